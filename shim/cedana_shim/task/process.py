"""Process states and the one table of legal moves between them.

Every rule lives in :data:`INIT_TRANSITIONS` / :data:`EXEC_TRANSITIONS` (h11's
``_state.py`` habit): an operation not in the table for the current state is
refused with FailedPrecondition naming the operation, the process and the
state, and the state is left unchanged. Callers do the side effect first and
commit the transition after it succeeded (containerd's ``init_state.go``).
An exit that cannot be recorded is a broken invariant, not a user error.
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
    RUNNING = "running"
    PAUSED = "paused"
    STOPPED = "stopped"
    DELETED = "deleted"


# (state, operation) -> next state. Operations that keep the state map to it.
INIT_TRANSITIONS: dict[tuple[State, str], State] = {
    (State.CREATED, "start"): State.RUNNING,
    (State.CREATED, "kill"): State.CREATED,
    (State.CREATED, "update"): State.CREATED,
    (State.CREATED, "resize"): State.CREATED,
    (State.CREATED, "delete"): State.DELETED,
    (State.CREATED, "exited"): State.STOPPED,
    (State.RESTORE_PENDING, "start"): State.RUNNING,
    (State.RESTORE_PENDING, "kill"): State.RESTORE_PENDING,
    (State.RESTORE_PENDING, "delete"): State.DELETED,
    (State.RESTORE_PENDING, "exited"): State.STOPPED,
    (State.RUNNING, "pause"): State.PAUSED,
    (State.RUNNING, "kill"): State.RUNNING,
    (State.RUNNING, "update"): State.RUNNING,
    (State.RUNNING, "resize"): State.RUNNING,
    (State.RUNNING, "checkpoint"): State.RUNNING,
    (State.RUNNING, "exec"): State.RUNNING,
    (State.RUNNING, "exited"): State.STOPPED,
    (State.PAUSED, "resume"): State.RUNNING,
    (State.PAUSED, "kill"): State.PAUSED,
    (State.PAUSED, "update"): State.PAUSED,
    (State.PAUSED, "resize"): State.PAUSED,
    (State.PAUSED, "checkpoint"): State.PAUSED,
    (State.PAUSED, "exited"): State.STOPPED,
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


@dataclass(eq=False)
class Process:
    """One process of a container: the init (``exec_id == ""``) or an exec."""

    container_id: str
    exec_id: str
    state: State = State.CREATED
    pid: int = 0
    exit: ExitInfo | None = None
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

    def set_exited(self, status: int, timestamp: float | None = None) -> bool:
        """Record the exit once; False if it was already recorded."""
        if self.exit is not None or self.state is State.DELETED:
            return False  # a force-deleted process dies after the fact
        if (self.state, "exited") not in self.table:
            raise AssertionError(f"exit of {self.describe()} in {self.state.value} state")
        self.state = State.STOPPED
        self.exit = ExitInfo(status, time.time() if timestamp is None else timestamp)
        if not self.exited.done():
            self.exited.set_result(self.exit)
        return True
