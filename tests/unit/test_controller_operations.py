"""Operations outlive the controller: every change of a step is written to the
store (a ConfigMap in the cluster), a restarted controller reads them back, and
one that was running when the controller stopped is marked interrupted."""

from __future__ import annotations

import json
import threading
from typing import Any

from cedana_shim.controller.op_store import NAME, ConfigMapOperations
from cedana_shim.controller.operations import INTERRUPTED, Operation, Operations, StepFailed


class ConfigMaps:
    """The two ConfigMap calls of the cluster API, over a dict (the API server's)."""

    def __init__(self) -> None:
        self.maps: dict[tuple[str, str], dict[str, Any]] = {}
        self.writes = 0

    def get_config_map(self, namespace: str, name: str) -> dict[str, Any] | None:
        found = self.maps.get((namespace, name))
        return None if found is None else json.loads(json.dumps(found))

    def save_config_map(self, namespace: str, config_map: dict[str, Any]) -> None:
        self.writes += 1
        self.maps[(namespace, config_map["metadata"]["name"])] = json.loads(json.dumps(config_map))


def test_operations_are_read_back_and_a_running_one_is_interrupted() -> None:
    api = ConfigMaps()
    store = ConfigMapOperations(api, "cedana-system")  # type: ignore[arg-type]
    first = Operations(store)
    ended = threading.Event()

    def fails(op: Operation) -> None:
        with op.step("checkpoint") as step:
            step.detail = "20261204T200000Z-3f9a1c2b on node-a"
        with op.step("push"):
            raise StepFailed("the registry is away")

    done = first.start("migrate", "alice", "team-a", "team-a/web-0",
                       ["checkpoint", "push", "evict"], fails, lambda _: ended.set())  # fmt: skip
    assert ended.wait(30)
    release, entered = threading.Event(), threading.Event()

    def hangs(op: Operation) -> None:
        with op.step("checkpoint"):
            entered.set()
            release.wait(30)

    running = first.start("migrate", "alice", "team-a", "team-a/web-1",
                          ["checkpoint", "push"], hangs, lambda _: None)  # fmt: skip
    assert entered.wait(30)
    saved = api.maps[("cedana-system", NAME)]["data"]
    assert json.loads(saved[running.id])["steps"][0]["state"] == "running"

    # The controller restarts (the thread driving `running` is gone with it).
    second = Operations(ConfigMapOperations(api, "cedana-system"))  # type: ignore[arg-type]
    again = second.get(done.id)
    assert again is not None and again.to_json() == done.to_json()
    assert [(s.name, s.state) for s in again.steps] == [
        ("checkpoint", "done"), ("push", "failed"), ("evict", "skipped")
    ]  # fmt: skip
    cut = second.get(running.id)
    assert cut is not None and (cut.state, cut.error) == ("failed", INTERRUPTED)
    assert [(s.name, s.state) for s in cut.steps] == [("checkpoint", "failed"), ("push", "skipped")]
    assert json.loads(api.maps[("cedana-system", NAME)]["data"][running.id])["state"] == "failed"
    assert [o.id for o in second.recent()] == [running.id, done.id], "newest first"
    release.set()


def test_a_store_that_cannot_be_written_does_not_stop_an_operation() -> None:
    class Refusing(ConfigMaps):
        def save_config_map(self, namespace: str, config_map: dict[str, Any]) -> None:
            raise RuntimeError("configmaps is forbidden")

    ended = threading.Event()
    ops = Operations(ConfigMapOperations(Refusing(), "ns"))  # type: ignore[arg-type]

    def work(op: Operation) -> None:
        with op.step("checkpoint"):
            pass

    op = ops.start("migrate", "u", "ns", "ns/p", ["checkpoint"], work, lambda _: ended.set())
    assert ended.wait(30) and op.state == "done"
