"""The execs of one container: added by Exec, started by Start, gone after Delete."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass

from ..errors import AlreadyExists, InvalidArgument, NotFound
from ..lifecycle.process import Process, State
from ..runtime.reaper import Child
from .requests import ExecConfig
from .stdio import ProcessIO

IO_DRAIN_TIMEOUT = 2.0  # how long Delete waits for output still in flight


@dataclass(eq=False)
class ExecProcess:
    config: ExecConfig
    process: Process
    io: ProcessIO | None = None
    logger: Child | None = None

    def process_json(self) -> bytes:
        """The exec's process spec, its ``terminal`` the request's (as containerd does)."""
        spec = json.loads(self.config.process_json)
        spec["terminal"] = self.config.stdio.terminal
        return json.dumps(spec).encode()


class Execs:
    def __init__(self, container_id: str) -> None:
        self.container_id = container_id
        self._by_id: dict[str, ExecProcess] = {}

    def __iter__(self) -> Iterator[ExecProcess]:
        return iter(list(self._by_id.values()))

    def add(self, config: ExecConfig) -> ExecProcess:
        if config.exec_id in self._by_id:
            raise AlreadyExists(
                f"exec {config.exec_id} already exists in container {self.container_id}"
            )
        try:
            json.loads(config.process_json)
        except ValueError as err:
            raise InvalidArgument(f"exec {config.exec_id}: process spec is not JSON") from err
        ex = ExecProcess(config, Process(self.container_id, config.exec_id))
        self._by_id[config.exec_id] = ex
        return ex

    def get(self, exec_id: str) -> ExecProcess:
        try:
            return self._by_id[exec_id]
        except KeyError:
            raise NotFound(f"exec {exec_id} not found in container {self.container_id}") from None

    def running(self) -> list[ExecProcess]:
        return [e for e in self._by_id.values() if e.process.state is State.RUNNING]

    def delete(self, exec_id: str) -> ExecProcess:
        ex = self.get(exec_id)
        ex.process.check("delete")
        if ex.io is not None:
            ex.io.wait(IO_DRAIN_TIMEOUT)
            ex.io.close()
        ex.process.commit("delete")
        del self._by_id[exec_id]
        return ex

    def close_io(self) -> None:
        for ex in self._by_id.values():
            if ex.io is not None:
                ex.io.close()
