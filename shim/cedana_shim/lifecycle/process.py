"""Process states and the one table of legal moves between them.

Every rule lives in :data:`INIT_TRANSITIONS` / :data:`EXEC_TRANSITIONS` (h11's
``_state.py`` habit): an operation not in the table for the current state is
refused with FailedPrecondition naming the operation, the process and the
state, and the state is left unchanged. Callers do the side effect first and
commit the transition after it succeeded (containerd's ``init_state.go``); long
operations have their own states with a written way back:

* CREATED -plan-restore-> RESTORE_PENDING (a Create that will restore at Start);
  RESTORE_PENDING -restore-> RESTORING -restored-> RUNNING; a Start that could
  neither restore nor start cold goes back to CREATED (``restore-failed``), a
  Kill during the restore ends it (the exit is 128+signal).
* RUNNING -checkpoint-> CHECKPOINTING -checkpointed-> RUNNING (PAUSED has its
  own CHECKPOINTING_PAUSED, so the container comes back paused).
* RUNNING -stop-> STOPPING: a stop signal checkpoints first. Once the
  checkpoint is durable the processes are killed and the exit reads
  128+signal, as if the signal had killed them (``exit_status``); if the
  checkpoint cannot be made durable, ``stop-failed`` goes back to RUNNING and
  the application gets its signal.

Only :meth:`Process.commit` writes a state, under the process's one lock
(:attr:`Process.lock`), which is held for the changes of state and released for the
long calls between them (runwasi's habit). An exit that cannot be recorded is a
broken invariant, not a user error.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from enum import Enum

from ..errors import FailedPrecondition, NotFound


class State(Enum):
    CREATED = "created"
    RESTORE_PENDING = "created (restore pending)"
    RESTORING = "restoring"
    RUNNING = "running"
    PAUSED = "paused"
    CHECKPOINTING = "checkpointing"
    CHECKPOINTING_PAUSED = "checkpointing (paused)"
    STOPPING = "stopping (checkpoint on stop)"
    STOPPED = "stopped"
    DELETED = "deleted"


LIVE = (
    State.RUNNING,
    State.PAUSED,
    State.CHECKPOINTING,
    State.CHECKPOINTING_PAUSED,
    State.STOPPING,
)

# (state, operation) -> next state. Operations that keep the state map to it.
INIT_TRANSITIONS: dict[tuple[State, str], State] = {
    (State.CREATED, "start"): State.RUNNING,
    (State.CREATED, "kill"): State.CREATED,
    (State.CREATED, "update"): State.CREATED,
    (State.CREATED, "resize"): State.CREATED,
    (State.CREATED, "delete"): State.DELETED,
    (State.CREATED, "exited"): State.STOPPED,
    (State.CREATED, "plan-restore"): State.RESTORE_PENDING,
    (State.RESTORE_PENDING, "restore"): State.RESTORING,
    (State.RESTORE_PENDING, "kill"): State.RESTORE_PENDING,
    (State.RESTORE_PENDING, "delete"): State.DELETED,
    (State.RESTORE_PENDING, "exited"): State.STOPPED,
    (State.RESTORING, "restored"): State.RUNNING,
    (State.RESTORING, "restore-failed"): State.CREATED,
    (State.RESTORING, "kill"): State.RESTORING,
    (State.RESTORING, "resize"): State.RESTORING,
    (State.RESTORING, "exited"): State.STOPPED,
    (State.RUNNING, "pause"): State.PAUSED,
    (State.RUNNING, "kill"): State.RUNNING,
    (State.RUNNING, "update"): State.RUNNING,
    (State.RUNNING, "resize"): State.RUNNING,
    (State.RUNNING, "checkpoint"): State.CHECKPOINTING,
    (State.RUNNING, "stop"): State.STOPPING,
    (State.RUNNING, "exec"): State.RUNNING,
    (State.RUNNING, "exited"): State.STOPPED,
    (State.PAUSED, "resume"): State.RUNNING,
    (State.PAUSED, "kill"): State.PAUSED,
    (State.PAUSED, "update"): State.PAUSED,
    (State.PAUSED, "resize"): State.PAUSED,
    (State.PAUSED, "checkpoint"): State.CHECKPOINTING_PAUSED,
    (State.PAUSED, "exited"): State.STOPPED,
    (State.CHECKPOINTING, "checkpointed"): State.RUNNING,
    (State.CHECKPOINTING, "kill"): State.CHECKPOINTING,
    (State.CHECKPOINTING, "update"): State.CHECKPOINTING,
    (State.CHECKPOINTING, "resize"): State.CHECKPOINTING,
    (State.CHECKPOINTING, "exec"): State.CHECKPOINTING,
    (State.CHECKPOINTING, "exited"): State.STOPPED,
    (State.CHECKPOINTING_PAUSED, "checkpointed"): State.PAUSED,
    (State.CHECKPOINTING_PAUSED, "kill"): State.CHECKPOINTING_PAUSED,
    (State.CHECKPOINTING_PAUSED, "update"): State.CHECKPOINTING_PAUSED,
    (State.CHECKPOINTING_PAUSED, "resize"): State.CHECKPOINTING_PAUSED,
    (State.CHECKPOINTING_PAUSED, "exited"): State.STOPPED,
    (State.STOPPING, "stop-failed"): State.RUNNING,
    (State.STOPPING, "kill"): State.STOPPING,
    (State.STOPPING, "update"): State.STOPPING,
    (State.STOPPING, "resize"): State.STOPPING,
    (State.STOPPING, "exited"): State.STOPPED,
    (State.STOPPED, "delete"): State.DELETED,
    (State.STOPPED, "resize"): State.STOPPED,
}

EXEC_TRANSITIONS: dict[tuple[State, str], State] = {
    (State.CREATED, "start"): State.RUNNING,
    (State.CREATED, "delete"): State.DELETED,
    (State.CREATED, "resize"): State.CREATED,
    (State.CREATED, "exited"): State.STOPPED,
    (State.RUNNING, "kill"): State.RUNNING,
    (State.RUNNING, "resize"): State.RUNNING,
    (State.RUNNING, "exited"): State.STOPPED,
    (State.STOPPED, "delete"): State.DELETED,
    (State.STOPPED, "resize"): State.STOPPED,
}

# Go's zero time, which containerd reads as "has not exited".
NOT_EXITED = -62135596800.0


@dataclass(frozen=True, slots=True)
class ExitInfo:
    status: int
    timestamp: float


@dataclass(frozen=True, slots=True)
class StopIntent:
    """What STOPPING carries: the signal being turned into a checkpoint, and
    whether that checkpoint is durable yet (from then on the exit is the signal's)."""

    signal: int
    durable: bool = False


@dataclass(eq=False)
class Process:
    """One process of a container: the init (``exec_id == ""``) or an exec."""

    container_id: str
    exec_id: str
    state: State = State.CREATED
    pid: int = 0
    exit: ExitInfo | None = None
    stop: StopIntent | None = None  # set in STOPPING only
    lock: asyncio.Lock = field(default_factory=asyncio.Lock)
    exited: asyncio.Future[ExitInfo] = field(
        default_factory=lambda: asyncio.get_running_loop().create_future()
    )

    @property
    def is_init(self) -> bool:
        return self.exec_id == ""

    @property
    def table(self) -> dict[tuple[State, str], State]:
        return INIT_TRANSITIONS if self.is_init else EXEC_TRANSITIONS

    def describe(self) -> str:
        if self.is_init:
            return f"container {self.container_id}"
        return f"exec {self.exec_id} of container {self.container_id}"

    def check(self, op: str) -> State:
        """The state ``op`` would lead to; raises if ``op`` is illegal now."""
        try:
            return self.table[(self.state, op)]
        except KeyError:
            if self.state is State.DELETED:
                raise NotFound(f"{self.describe()} has been deleted") from None
            if op == "kill" and self.state is State.STOPPED:
                raise NotFound(f"{self.describe()}: process already finished") from None
            raise FailedPrecondition(
                f"cannot {op} {self.describe()} in {self.state.value} state"
            ) from None

    def commit(self, op: str) -> None:
        self.state = self.check(op)
        if self.state is not State.STOPPING:
            self.stop = None

    def begin_stop(self, signal: int) -> None:
        """RUNNING -> STOPPING for ``signal``."""
        self.commit("stop")
        self.stop = StopIntent(signal)

    def stop_durable(self) -> None:
        """The checkpoint of this stop is durable: the exit now reads 128+signal."""
        if self.state is not State.STOPPING or self.stop is None:
            raise AssertionError(f"{self.describe()} is not stopping ({self.state.value})")
        self.stop = StopIntent(self.stop.signal, durable=True)

    def exit_status(self, status: int) -> int:
        """The status to report for an exit with ``status``, decided by the state."""
        if self.state is State.STOPPING and self.stop is not None and self.stop.durable:
            return 128 + self.stop.signal  # killed after its checkpoint: a polite stop
        return status

    def set_exited(self, status: int, timestamp: float | None = None) -> bool:
        """Record the exit once; False if it was already recorded."""
        if self.exit is not None or self.state is State.DELETED:
            return False  # a force-deleted process dies after the fact
        if (self.state, "exited") not in self.table:
            raise AssertionError(f"exit of {self.describe()} in {self.state.value} state")
        status = self.exit_status(status)
        self.commit("exited")
        self.exit = ExitInfo(status, time.time() if timestamp is None else timestamp)
        if not self.exited.done():
            self.exited.set_result(self.exit)
        return True
