"""Backend: NVIDIA's ``cuda-checkpoint`` executable (github.com/NVIDIA/cuda-checkpoint).

    cuda-checkpoint --get-state --pid N     (prints running|locked|checkpointed|failed)
    cuda-checkpoint --action lock --pid N --timeout MS
    cuda-checkpoint --action checkpoint|unlock --pid N
    cuda-checkpoint --action restore --pid N [--device-map old=new,...]   (map: 580+)

A failed action exits non-zero and prints ``Could not <action> on process ID N:
"<CUDA error string>"``; the error strings are turned into classes in one place,
:func:`classify`.

Commands run through an injectable :class:`Runner`. The shim daemon owns SIGCHLD
(one reaper), so it must pass :func:`reaper_runner`; :func:`subprocess_runner`
is for processes without a reaper (the CLI, doctor, tests).
"""

from __future__ import annotations

import asyncio
import os
import re
import shutil
import subprocess
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, ClassVar, Final, Protocol

from .driver import (
    Availability,
    GpuDeadlineExceeded,
    GpuError,
    GpuFailedPrecondition,
    GpuInternal,
    GpuInvalidArgument,
    GpuNotFound,
    GpuProcessExited,
    GpuUnavailable,
    GpuUnimplemented,
    ProcessState,
    Step,
    check_lock_timeout,
    format_device_map,
)

if TYPE_CHECKING:
    from ..runtime.reaper import Reaper

BINARY: Final = "cuda-checkpoint"
STATE_TIMEOUT_S: Final = 30.0
# Checkpoint and restore copy all of a process's GPU memory (141 GB on an H200,
# ~20 s at PCIe 5 speed, far longer into swap-starved hosts): bounded, generously.
ACTION_TIMEOUT_S: Final = 900.0
# Lock waits in the driver for its own --timeout; the process gets this on top.
LOCK_GRACE_S: Final = 30.0

_VERSION = re.compile(r"Version\s+(\d+(?:\.\d+)*)")
_ILLEGAL_STATE = re.compile(r"present state|illegal state|invalid state", re.IGNORECASE)
_TIMED_OUT = re.compile(r"timed out|timeout|not ready", re.IGNORECASE)
_UNSUPPORTED = re.compile(r"not supported", re.IGNORECASE)
_INVALID = re.compile(r"invalid argument|invalid value|invalid device map", re.IGNORECASE)
_NO_DRIVER = re.compile(r"initialization error|no cuda-capable device|driver", re.IGNORECASE)


class Runner(Protocol):
    """Run ``argv`` to completion: ``(exit status, stdout, stderr)``. Raises
    :class:`TimeoutError` (after killing it) when it outlasts ``timeout`` seconds and
    :class:`OSError` when it cannot be started."""

    def __call__(self, argv: Sequence[str], *, timeout: float) -> tuple[int, str, str]: ...


def subprocess_runner(argv: Sequence[str], *, timeout: float) -> tuple[int, str, str]:
    try:
        done = subprocess.run(
            list(argv),
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            errors="replace",
            timeout=timeout,
            check=False,
        )
    except subprocess.TimeoutExpired as err:
        raise TimeoutError(f"{argv[0]} did not finish within {timeout:g} s") from err
    return done.returncode, done.stdout, done.stderr


def reaper_runner(reaper: Reaper, loop: asyncio.AbstractEventLoop) -> Runner:
    """A Runner for worker threads of the shim daemon: each command is spawned on
    ``loop`` through ``reaper``, so its exit is collected by the daemon's one reaper."""

    def run(argv: Sequence[str], *, timeout: float) -> tuple[int, str, str]:
        try:
            running = asyncio.get_running_loop()
        except RuntimeError:
            running = None
        if running is loop:
            raise RuntimeError("reaper_runner blocks: call it from a worker thread")
        future = asyncio.run_coroutine_threadsafe(_run_reaped(reaper, argv, timeout), loop)
        # _run_reaped enforces the timeout itself; this one only guards a stopped loop.
        return future.result(timeout + 60)

    return run


async def _run_reaped(reaper: Reaper, argv: Sequence[str], timeout: float) -> tuple[int, str, str]:
    out = os.memfd_create("cuda-checkpoint-out", os.MFD_CLOEXEC)
    err = os.memfd_create("cuda-checkpoint-err", os.MFD_CLOEXEC)
    try:
        child = reaper.spawn(argv, stdout=out, stderr=err)
        try:
            exited = await asyncio.wait_for(child.wait(), timeout)
        except TimeoutError:
            await asyncio.shield(child.terminate())
            raise TimeoutError(f"{argv[0]} did not finish within {timeout:g} s") from None
        return exited.status, _read_memfd(out), _read_memfd(err)
    finally:
        os.close(out)
        os.close(err)


def _read_memfd(fd: int) -> str:
    return os.pread(fd, 1 << 16, 0).decode(errors="replace")


@dataclass(frozen=True, slots=True)
class CliInfo:
    path: str
    version: str  # the tool's own version line; it tracks the driver it shipped with
    device_map: bool  # --device-map (580+)


class CliDriver:
    name: ClassVar[str] = "cuda-checkpoint"

    def __init__(
        self,
        binary: str | None = None,
        *,
        run: Runner = subprocess_runner,
        action_timeout_s: float = ACTION_TIMEOUT_S,
    ) -> None:
        path = binary or shutil.which(BINARY)
        if path is None:
            raise GpuUnavailable(f"{BINARY} is not on PATH")
        self.path = path
        self._run = run
        self._action_timeout_s = action_timeout_s
        self._info: CliInfo | None = None

    @classmethod
    def available(cls) -> Availability:
        try:
            info = cls().probe()
        except GpuError as err:
            return Availability(False, err.detail)
        return Availability(True, f"{info.path} version {info.version or 'unknown'}")

    def probe(self) -> CliInfo:
        """Run ``--help`` once: the tool must know --action (driver 555+ tools)."""
        if self._info is None:
            try:
                rc, out, err = self._run([self.path, "--help"], timeout=STATE_TIMEOUT_S)
            except (OSError, TimeoutError) as exc:
                raise GpuUnavailable(f"cannot run {self.path} --help: {exc}") from exc
            text = out + err
            if "--action" not in text:
                raise GpuUnavailable(
                    f"{self.path} (exit status {rc}) does not offer --action: it predates "
                    "driver 555; use the cuda-checkpoint shipped with driver >= 570"
                )
            match = _VERSION.search(text)
            self._info = CliInfo(
                path=self.path,
                version=match.group(1) if match else "",
                device_map="--device-map" in text,
            )
        return self._info

    def state(self, pid: int) -> ProcessState:
        out = self._invoke(Step.STATE, pid, ["--get-state", "--pid", str(pid)], STATE_TIMEOUT_S)
        word = out.strip().split()[0].lower() if out.strip() else ""
        try:
            return ProcessState(word)
        except ValueError:
            raise GpuInternal(
                f"{self.path} printed an unknown state {out.strip()!r}", pid=pid, step=Step.STATE
            ) from None

    def lock(self, pid: int, timeout_ms: int) -> None:
        check_lock_timeout(pid, timeout_ms)
        self._invoke(
            Step.LOCK,
            pid,
            ["--action", "lock", "--pid", str(pid), "--timeout", str(timeout_ms)],
            timeout_ms / 1000 + LOCK_GRACE_S,
            timeout_ms=timeout_ms,
        )

    def checkpoint(self, pid: int) -> None:
        argv = ["--action", "checkpoint", "--pid", str(pid)]
        self._invoke(Step.CHECKPOINT, pid, argv, self._action_timeout_s)

    def restore(self, pid: int, device_map: Mapping[str, str] | None = None) -> None:
        argv = ["--action", "restore", "--pid", str(pid)]
        if device_map:
            info = self.probe()
            if not info.device_map:
                raise GpuUnimplemented(
                    f"{info.path} (version {info.version or 'unknown'}) has no --device-map: "
                    "restoring onto other GPUs needs driver >= 580 and its cuda-checkpoint",
                    pid=pid,
                    step=Step.RESTORE,
                )
            argv += ["--device-map", format_device_map(device_map)]
        self._invoke(Step.RESTORE, pid, argv, self._action_timeout_s, device_map=bool(device_map))

    def unlock(self, pid: int) -> None:
        self._invoke(Step.UNLOCK, pid, ["--action", "unlock", "--pid", str(pid)], STATE_TIMEOUT_S)

    def _invoke(
        self,
        step: Step,
        pid: int,
        args: list[str],
        timeout: float,
        *,
        timeout_ms: int = 0,
        device_map: bool = False,
    ) -> str:
        argv = [self.path, *args]
        try:
            rc, out, err = self._run(argv, timeout=timeout)
        except TimeoutError as exc:
            raise GpuDeadlineExceeded(
                f"{self.path} {' '.join(args)} did not finish within {timeout:g} s and was "
                "killed; the process may be left mid-step",
                pid=pid,
                step=step,
            ) from exc
        except OSError as exc:
            raise GpuUnavailable(f"cannot run {self.path}: {exc}", pid=pid, step=step) from exc
        if rc != 0:
            raise classify(
                step,
                pid,
                rc,
                (err.strip() or out.strip()),
                timeout_ms=timeout_ms,
                device_map=device_map,
            )
        return out


def classify(
    step: Step, pid: int, rc: int, message: str, *, timeout_ms: int = 0, device_map: bool = False
) -> GpuError:
    """The error for a failed cuda-checkpoint call that printed ``message``."""
    said = f"cuda-checkpoint exit status {rc}: {message or '(no output)'}"
    if not os.path.exists(f"/proc/{pid}"):
        return GpuProcessExited(f"the process has exited ({said})", pid=pid, step=step)
    if step is Step.STATE and not _NO_DRIVER.search(message):
        # The tool cannot tell "no CUDA in this process" apart from its other refusals.
        return GpuNotFound(f"not a CUDA process ({said})", pid=pid, step=step)
    if _ILLEGAL_STATE.search(message):
        return GpuFailedPrecondition(f"wrong state for {step} ({said})", pid=pid, step=step)
    if step is Step.LOCK and _TIMED_OUT.search(message):
        return GpuDeadlineExceeded(
            f"submitted CUDA work did not finish within {timeout_ms} ms ({said}); the process "
            "keeps running: retry later or raise the lock timeout",
            pid=pid,
            step=step,
        )
    if _UNSUPPORTED.search(message):
        return GpuUnimplemented(
            f"the driver cannot checkpoint this process ({said}): UVM or CUDA IPC memory, MIG "
            "and MPS are not supported",
            pid=pid,
            step=step,
        )
    if _INVALID.search(message) and device_map:
        return GpuInvalidArgument(
            f"the driver rejected the device map ({said}): every checkpointed GPU must map to "
            "a present GPU of the same model",
            pid=pid,
            step=step,
        )
    if _NO_DRIVER.search(message):
        return GpuUnavailable(said, pid=pid, step=step)
    return GpuInternal(said, pid=pid, step=step)
