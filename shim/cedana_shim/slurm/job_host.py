"""One Slurm job step's container, as the restore session and the pipeline drive it.

:class:`JobHost` is the :class:`~cedana_shim.checkpoint.restore.RestoreHost` of a
job: it creates the container cold or restores it from CRIU images through the
shim's runc driver, and hands the pipeline its :class:`Target`. The job's stdio
reaches the container through pipes this process copies into the job's own
stdout/stderr (:class:`JobStdio`): a restore re-attaches new pipes (runc hands
CRIU inherited pipes for the container's fds 0-2), so a restored job writes where
the current step's output goes, never at an offset of the old file.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
from collections.abc import Mapping, Sequence
from typing import Any, Final

from ..checkpoint.pipeline import Target
from ..checkpoint.policy import Policy
from ..checkpoint.restore import RestoreRequest
from ..runtime.runc import CreateOpts, RestoreOpts, Runc, Stdio, read_pid_file
from .batch_script import BatchScript

log = logging.getLogger(__name__)

DRAIN_TIMEOUT: Final = 5.0  # seconds the output of a finished job may take to arrive
_CHUNK: Final = 1 << 16


class JobStdio:
    """The pipes of one attempt at starting the container: stdin is empty (the batch
    step's stdin is /dev/null under Slurm), stdout and stderr are copied to ``out``
    and ``err`` until every writer is gone."""

    def __init__(self, out: int, err: int) -> None:
        stdin_r, stdin_w = os.pipe()
        os.close(stdin_w)
        self._stdout_r, self._stdout_w = os.pipe()
        self._stderr_r, self._stderr_w = os.pipe()
        self._child: list[int] = [stdin_r, self._stdout_w, self._stderr_w]
        self.stdio = Stdio(stdin_r, self._stdout_w, self._stderr_w)
        loop = asyncio.get_running_loop()
        self._copies = [
            loop.create_task(asyncio.to_thread(_copy, self._stdout_r, out)),
            loop.create_task(asyncio.to_thread(_copy, self._stderr_r, err)),
        ]

    def handed_over(self) -> None:
        """runc has given the container its ends: close ours, so that EOF means the
        container's processes are gone."""
        for fd in self._child:
            with contextlib.suppress(OSError):
                os.close(fd)
        self._child = []

    async def drain(self, timeout: float = DRAIN_TIMEOUT) -> None:
        self.handed_over()
        _, pending = await asyncio.wait(self._copies, timeout=timeout)
        if pending:
            log.warning("job output still open after its exit; not waiting for more")


def _copy(src: int, dest: int) -> None:
    """Copy until EOF; a destination that went away ends the copy, not the job."""
    try:
        while data := os.read(src, _CHUNK):
            view = memoryview(data)
            while view:
                view = view[os.write(dest, view) :]
    except OSError as err:
        log.warning("job output copy stopped", extra={"error": str(err)})
    finally:
        os.close(src)


class JobHost:
    """The container of one job step (a RestoreHost)."""

    def __init__(
        self,
        *,
        container_id: str,
        bundle: str,
        rootfs: str,
        spec: dict[str, Any],
        runc: Runc,
        policy: Policy,
        script: BatchScript | None = None,
        out: int = 1,
        err: int = 2,
    ) -> None:
        self._container_id = container_id
        self._bundle = bundle
        self._rootfs = rootfs
        self._spec = spec
        self.runc = runc
        self.policy = policy
        self.script = script
        self._out, self._err = out, err
        self.io: JobStdio | None = None
        self.pid = 0

    # -- RestoreHost ------------------------------------------------------------------

    @property
    def container_id(self) -> str:
        return self._container_id

    @property
    def bundle(self) -> str:
        return self._bundle

    @property
    def rootfs(self) -> str:
        return self._rootfs

    @property
    def spec(self) -> Mapping[str, Any]:
        return checkpoint_view(self._spec)

    async def network_facts(self) -> Any:
        # The host's network: a restored job's connections are closed (tcp-close).
        return {}

    async def restore_images(self, request: RestoreRequest) -> int:
        if self.script is not None:
            await asyncio.to_thread(self.script.stage_for, request.checkpointed_container)
        io = self._fresh_io()
        try:
            pages = await self.runc.restore(
                self.container_id,
                RestoreOpts(
                    bundle=self.bundle,
                    image_path=request.image_dir,
                    work_path=request.work_dir,
                    pid_file=self._pid_file(),
                    tcp_established=request.tcp_established,
                    ext_unix_sk=request.ext_unix_sk,
                    file_locks=request.file_locks,
                    lazy_pages=request.lazy_pages,
                    lazy_page_server=request.page_server,
                    stdio=io.stdio,
                ),
            )
        finally:
            io.handed_over()
        try:
            self.pid = read_pid_file(self._pid_file())
            if pages is not None:
                request.resumed()
                await pages.wait()  # every page in (cancelled: the tasks are killed first)
        except BaseException:
            if pages is not None:
                await asyncio.shield(pages.abandon())
            raise
        return self.pid

    async def pids(self) -> Sequence[int]:
        return await self.runc.ps(self.container_id)

    async def discard_attempt(self) -> None:
        await self.runc.discard(self.container_id)

    async def reset_rootfs(self) -> None:
        """Nothing to reset: the root is the host's, and no checkpoint of a job has a
        rootfs layer (the pipeline is given no rootfs mounts)."""

    async def create_cold(self) -> int:
        io = self._fresh_io()
        try:
            await self.runc.run(
                self.container_id,
                CreateOpts(bundle=self.bundle, pid_file=self._pid_file(), stdio=io.stdio),
            )
        finally:
            io.handed_over()
        self.pid = read_pid_file(self._pid_file())
        return self.pid

    # -- the pipeline's view -------------------------------------------------------------

    def target(self) -> Target:
        return Target(
            container_id=self.container_id,
            bundle=self.bundle,
            namespace="slurm",
            policy=self.policy,
            spec=self.spec,
            rootfs=(),
            pid=self.pid,
            terminal=False,
            runc=self.runc,
        )

    async def drain_output(self) -> None:
        if self.io is not None:
            await self.io.drain()

    def _fresh_io(self) -> JobStdio:
        """New pipes for each attempt; a failed attempt's copies end at their EOF."""
        self.io = JobStdio(self._out, self._err)
        return self.io

    def _pid_file(self) -> str:
        return os.path.join(self.bundle, "init.pid")


def checkpoint_view(spec: Mapping[str, Any]) -> dict[str, Any]:
    """The spec as the pipeline and the restore session see it.

    * Without the host's /dev/shm: it is the node's, shared with every other job; a
      bind mount of it at /dev/shm would otherwise be saved into each checkpoint and
      written back over the host's at restore (layers.shm_source).
    * With the job's GPUs said the way the shim's GPU steps read them: Slurm names
      the node's GPUs it gave the job in SLURM_JOB_GPUS (node indices), where a
      container runtime sets NVIDIA_VISIBLE_DEVICES.
    """
    view = dict(spec)
    view["mounts"] = [m for m in spec.get("mounts") or [] if m.get("destination") != "/dev/shm"]
    process = dict(spec.get("process") or {})
    env = [str(item) for item in process.get("env") or []]
    names = {item.partition("=")[0]: item.partition("=")[2] for item in env}
    gpus = names.get("SLURM_STEP_GPUS") or names.get("SLURM_JOB_GPUS")
    if gpus and "NVIDIA_VISIBLE_DEVICES" not in names:
        process["env"] = [*env, f"NVIDIA_VISIBLE_DEVICES={gpus}"]
        view["process"] = process
    return view


__all__ = ["JobHost", "JobStdio", "checkpoint_view"]
