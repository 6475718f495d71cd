"""Running a checkpoint stage's hooks as processes.

For each stage: re-read hooks.d (an edit takes effect at the next checkpoint,
as podman's directory monitor gives), pick the files whose ``when`` matches the
container, and run them one at a time in file-name order, each with the OCI
state JSON on stdin and under its own timeout.

Failure semantics follow the runtime spec's split between prestart (a failure
tears the container down) and poststop (a failure is logged, the rest still
run): a failing ``precheckpoint``/``prerestore`` hook raises
:class:`~.base.HookFailed` and later hooks of the stage do not run; failing
``post*`` hooks are logged and returned in the report. An unusable hooks.d file
fails pre stages closed (it may have been the guard meant for this
container) and is reported for post stages.
"""

from __future__ import annotations

import asyncio
import contextlib
import fcntl
import json
import logging
import os
import signal
import time
from collections.abc import Mapping, Sequence
from typing import Any

from .. import errors
from .base import HookFailed, HookReport, HookResult, HookState
from .config import CHECKPOINT_STAGES, DEFAULT_DIRS, PRE_STAGES, HookConfig, Stage, load
from .match import select
from .spawn import Command, Running, Spawn, pidfd_spawn

log = logging.getLogger(__name__)

# runc waits forever for a hook without a timeout; a checkpoint must not, and
# the stop path has the pipeline's own deadline on top of this.
DEFAULT_TIMEOUT = 30.0
OUTPUT_LIMIT = 64 * 1024
_READ_CHUNK = 64 * 1024
_DRAIN_READS = 16


class ProcessHookRunner:
    """The :class:`~.base.HookRunner` that runs hooks.d executables.

    In the shim daemon pass ``spawn=reaper_spawn(reaper)``; the default reaps
    its own children and suits processes without a :class:`Reaper`.
    """

    def __init__(
        self,
        dirs: Sequence[str] = DEFAULT_DIRS,
        *,
        spawn: Spawn = pidfd_spawn,
        default_timeout: float = DEFAULT_TIMEOUT,
        output_limit: int = OUTPUT_LIMIT,
    ) -> None:
        if default_timeout <= 0 or output_limit <= 0:
            raise ValueError("default_timeout and output_limit must be positive")
        self.dirs = tuple(dirs)
        self._spawn = spawn
        self._default_timeout = default_timeout
        self._output_limit = output_limit

    async def run(self, stage: Stage, state: HookState) -> HookReport:
        if stage not in CHECKPOINT_STAGES:
            raise errors.InvalidArgument(
                f"{stage.value} hooks are run by runc from config.json, not by the shim"
            )
        catalog = await asyncio.to_thread(load, self.dirs)
        fatal = stage in PRE_STAGES
        for problem in catalog.errors:
            log.error(
                "unusable hooks file",
                extra={**_fields(stage, state), "hook_file": problem.source, "error": str(problem)},
            )
        if fatal and catalog.errors:
            raise catalog.errors[0]
        payload = json.dumps(state.oci_state(stage)).encode()
        results: list[HookResult] = []
        for config in select(catalog.hooks, stage, state.spec):
            result = await self._run_one(config, stage, payload)
            results.append(result)
            _log(result, state, fatal)
            if fatal and not result.ok:
                raise HookFailed(result, HookReport(stage, tuple(results)))
        return HookReport(stage, tuple(results), tuple(str(e) for e in catalog.errors))

    async def _run_one(self, config: HookConfig, stage: Stage, payload: bytes) -> HookResult:
        hook = config.hook
        timeout = float(hook.timeout) if hook.timeout is not None else self._default_timeout
        env: Mapping[str, str] = (
            os.environ if hook.env is None else dict(e.split("=", 1) for e in hook.env)
        )
        started = time.monotonic()

        def result(status: int | None, timed_out: bool, error: str, tail: _Tail) -> HookResult:
            return HookResult(
                name=config.name,
                source=config.source,
                path=hook.path,
                stage=stage,
                status=status,
                timed_out=timed_out,
                timeout=timeout,
                error=error,
                output=tail.text(),
                dropped=tail.dropped,
                duration=round(time.monotonic() - started, 6),
            )

        read_end, write_end = (_above_stdio(fd) for fd in os.pipe())
        tail = _Tail(read_end, self._output_limit)
        try:
            try:
                stdin = _state_fd(payload)
                try:
                    running = self._spawn(
                        Command(hook.path, hook.argv, env), stdin=stdin, output=write_end
                    )
                finally:
                    os.close(stdin)
            except OSError as err:
                return result(None, False, f"{hook.path}: {err.strerror or err}", tail)
            finally:
                os.close(write_end)  # ours, or the pipe never reports EOF
            status, timed_out = await _wait(running, timeout)
            tail.drain()
            return result(status, timed_out, "", tail)
        finally:
            tail.close()


async def _wait(running: Running, timeout: float) -> tuple[int, bool]:
    try:
        async with asyncio.timeout(timeout):
            return await running.wait(), False
    except TimeoutError:
        _kill_group(running.pid)
        return await asyncio.shield(running.wait()), True
    except BaseException:
        # Cancelled (the checkpoint was aborted): leave no hook behind.
        _kill_group(running.pid)
        with contextlib.suppress(Exception):
            await asyncio.shield(running.wait())
        raise


def _kill_group(pid: int) -> None:
    # The hook leads its own session, so its pid is its process group: this
    # takes whatever it forked along, which SIGKILL of the pid alone (runc's
    # way) would leave running.
    with contextlib.suppress(ProcessLookupError):
        os.killpg(pid, signal.SIGKILL)


def _above_stdio(fd: int) -> int:
    # posix_spawn dup2s onto 0-2 in order; a source fd among them (the daemon
    # may run with stdio closed) would be overwritten before it is used.
    if fd > 2:
        return fd
    high = fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 3)
    os.close(fd)
    return high


def _state_fd(payload: bytes) -> int:
    # A memfd, not a pipe: a hook that never reads stdin cannot block us on a
    # full pipe, and one that reads it gets it all at once.
    fd = _above_stdio(os.memfd_create("hook-state", os.MFD_CLOEXEC))
    view = memoryview(payload)
    while view:
        view = view[os.write(fd, view) :]
    os.lseek(fd, 0, os.SEEK_SET)
    return fd


class _Tail:
    """The last ``limit`` bytes a hook writes, read as they arrive so a chatty
    hook never stalls on a full pipe."""

    def __init__(self, fd: int, limit: int) -> None:
        self._fd = fd
        self._limit = limit
        self._buf = bytearray()
        self.dropped = 0
        os.set_blocking(fd, False)
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(fd, self._read)
        self._watching = True

    def _read(self) -> bool:
        try:
            data = os.read(self._fd, _READ_CHUNK)
        except BlockingIOError:
            return False
        except OSError:
            data = b""
        if not data:
            self._unwatch()
            return False
        self._buf += data
        excess = len(self._buf) - self._limit
        if excess > 0:
            del self._buf[:excess]
            self.dropped += excess
        return True

    def drain(self) -> None:
        # What the hook wrote just before exiting may still sit in the pipe. A
        # child it left behind can hold the pipe open and keep writing, so
        # take what is there now, a bounded number of reads, not up to EOF.
        for _ in range(_DRAIN_READS):
            if not self._read():
                return

    def text(self) -> str:
        return self._buf.decode(errors="replace")

    def _unwatch(self) -> None:
        if self._watching:
            self._loop.remove_reader(self._fd)
            self._watching = False

    def close(self) -> None:
        self._unwatch()
        os.close(self._fd)


def _fields(stage: Stage, state: HookState) -> dict[str, Any]:
    return {
        "stage": stage.value,
        "container": state.container_id,
        "checkpoint": state.checkpoint_id,
    }


def _log(result: HookResult, state: HookState, fatal: bool) -> None:
    extra = {
        **_fields(result.stage, state),
        "hook": result.name,
        "hook_file": result.source,
        "hook_path": result.path,
        "status": result.status,
        "timed_out": result.timed_out,
        "duration": result.duration,
    }
    if result.ok:
        if result.output:  # a hook may warn and still succeed
            extra.update(output=result.output, output_dropped=result.dropped)
        log.info("hook ran", extra=extra)
        return
    extra.update(error=result.describe(), output=result.output, output_dropped=result.dropped)
    if fatal:
        log.error("hook failed: the operation is aborted", extra=extra)
    else:
        log.warning("hook failed", extra=extra)
