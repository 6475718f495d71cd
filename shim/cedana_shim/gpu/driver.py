"""The GPU checkpoint interface: one small Protocol, the state rules, typed errors.

The CUDA driver moves a process's GPU state in four steps, each a separate call
(``cuCheckpointProcess{Lock,Checkpoint,Restore,Unlock}``, or ``cuda-checkpoint
--action ...``)::

    RUNNING --lock--> LOCKED --checkpoint--> CHECKPOINTED --restore--> LOCKED --unlock--> RUNNING

Every backend (:mod:`.driver_api`, :mod:`.driver_cli`) and the test fake
(tests/unit/fakes/fake_gpu_driver.py) implements :class:`CudaCheckpointDriver`; the
orchestrator only ever talks to that. The rules live here, in one table, so the fake
and the orchestrator's recovery read the same ones.

The driver does not roll back a step that fails midway: a failed checkpoint can
leave the process LOCKED, CHECKPOINTED or FAILED. Recovering is the caller's job
(:mod:`.orchestrator`).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from typing import ClassVar, Final, Protocol

from .. import errors


class _Text(str, Enum):  # noqa: UP042 - see below
    # Prints as its value, like 3.11's StrEnum; spelled out so that the GPU check
    # also runs under the older Pythons that GPU images ship.
    def __str__(self) -> str:
        return str(self.value)

    def __format__(self, spec: str) -> str:
        return format(str(self.value), spec)


class ProcessState(_Text):
    """A process's CUDA checkpoint state, as ``cuda-checkpoint --get-state`` prints it."""

    RUNNING = "running"
    LOCKED = "locked"
    CHECKPOINTED = "checkpointed"
    # The driver gave up on the process: it cannot use the GPU again.
    FAILED = "failed"


class Step(_Text):
    STATE = "get-state"
    LOCK = "lock"
    CHECKPOINT = "checkpoint"
    RESTORE = "restore"
    UNLOCK = "unlock"


# (state before, step) -> state after. Any other pair is a wrong transition.
TRANSITIONS: Final[Mapping[tuple[ProcessState, Step], ProcessState]] = {
    (ProcessState.RUNNING, Step.LOCK): ProcessState.LOCKED,
    (ProcessState.LOCKED, Step.CHECKPOINT): ProcessState.CHECKPOINTED,
    (ProcessState.CHECKPOINTED, Step.RESTORE): ProcessState.LOCKED,
    (ProcessState.LOCKED, Step.UNLOCK): ProcessState.RUNNING,
}

# The step that takes a process one hop back towards RUNNING.
TOWARDS_RUNNING: Final[Mapping[ProcessState, Step]] = {
    ProcessState.LOCKED: Step.UNLOCK,
    ProcessState.CHECKPOINTED: Step.RESTORE,
}


class GpuError(errors.ShimError):
    """A GPU checkpoint step failed. Raised only as one of the subclasses below, whose
    errors.py base decides the status code.

    ``pid`` and ``step`` say where; ``detail`` is the message without that prefix
    (``message`` replaces the whole text); ``reports`` (set by the orchestrator on a
    failure that spans processes) maps each pid to what happened to it.
    """

    def __init__(
        self,
        detail: str,
        *,
        pid: int | None = None,
        step: Step | None = None,
        message: str | None = None,
    ) -> None:
        where = "GPU"
        if step is not None:
            where += f" {step}"
        if pid is not None:
            where += f" of pid {pid}"
        super().__init__(message if message is not None else f"{where}: {detail}")
        self.detail = detail
        self.pid = pid
        self.step = step
        self.reports: dict[int, str] = {}


class GpuUnavailable(GpuError, errors.Unavailable):
    """No backend, no driver, or a driver too old for the checkpoint API."""


class GpuFailedPrecondition(GpuError, errors.FailedPrecondition):
    """A step asked of a process in the wrong state (say, checkpoint while RUNNING)."""


class GpuDeadlineExceeded(GpuError, errors.DeadlineExceeded):
    """Lock did not finish in time (submitted work still running), or a tool hung."""


class GpuNotFound(GpuError, errors.NotFound):
    """The pid is not a CUDA process."""


class GpuProcessExited(GpuNotFound):
    """The pid no longer exists: there is nothing left to lock or to recover."""


class GpuUnimplemented(GpuError, errors.Unimplemented):
    """The driver cannot do this (UVM/IPC memory, MIG, MPS; device map before 580)."""


class GpuInvalidArgument(GpuError, errors.InvalidArgument):
    """A bad argument: a malformed device map, a zero lock timeout."""


class GpuInternal(GpuError, errors.Internal):
    """The driver failed a step for a reason it did not classify."""


class GpuRecoveryFailed(GpuError, errors.Internal):
    """A step failed and at least one process could not be brought back to RUNNING."""


@dataclass(frozen=True, slots=True)
class Availability:
    """Whether a backend can be used here, and if not, why (for errors and doctor)."""

    ok: bool
    detail: str

    def __bool__(self) -> bool:
        return self.ok


class CudaCheckpointDriver(Protocol):
    """One backend for the driver's per-process checkpoint steps.

    Every method blocks (a checkpoint copies the process's GPU memory) and may be
    called from several worker threads at once for different pids. Each raises a
    :class:`GpuError` subclass naming the pid and the step; a step refused because
    of the process's state raises :class:`GpuFailedPrecondition`.
    """

    name: ClassVar[str]

    @classmethod
    def available(cls) -> Availability: ...

    def state(self, pid: int) -> ProcessState: ...

    def lock(self, pid: int, timeout_ms: int) -> None:
        """RUNNING -> LOCKED once submitted work is done; after ``timeout_ms`` raises
        :class:`GpuDeadlineExceeded` and leaves the process RUNNING."""
        ...

    def checkpoint(self, pid: int) -> None:
        """LOCKED -> CHECKPOINTED: GPU memory copied into the process's host memory."""
        ...

    def restore(self, pid: int, device_map: Mapping[str, str] | None = None) -> None:
        """CHECKPOINTED -> LOCKED; ``device_map`` maps old GPU UUIDs to new ones and
        must name every GPU the process used (driver >= 580)."""
        ...

    def unlock(self, pid: int) -> None: ...


def check_lock_timeout(pid: int, timeout_ms: int) -> None:
    """The driver reads 0 as "wait forever"; the shim never asks for that."""
    if timeout_ms <= 0:
        raise GpuInvalidArgument(
            f"lock timeout must be positive, got {timeout_ms} ms", pid=pid, step=Step.LOCK
        )


def format_device_map(device_map: Mapping[str, str]) -> str:
    """``old=new,old=new``: cuda-checkpoint's --device-map syntax (and CRIU's)."""
    return ",".join(f"{old}={new}" for old, new in device_map.items())
