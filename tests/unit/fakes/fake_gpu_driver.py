"""A fake CUDA checkpoint driver (a :class:`~cedana_shim.gpu.driver.CudaCheckpointDriver`)
that keeps the real rules, for tests of the GPU layer.

It enforces :data:`~cedana_shim.gpu.driver.TRANSITIONS` (a wrong transition raises
:class:`~cedana_shim.gpu.driver.GpuFailedPrecondition` and changes nothing), models lock
waiting for submitted work (``pending_work_ms`` longer than the lock timeout
raises :class:`~cedana_shim.gpu.driver.GpuDeadlineExceeded` and leaves the process RUNNING),
and fails any step of any pid on demand, leaving the process in whatever state
the test chooses: the real driver has no rollback either. Every call is recorded
with its start and end time, so tests can assert that calls overlapped.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import ClassVar

from cedana_shim.gpu.driver import (
    TRANSITIONS,
    Availability,
    GpuDeadlineExceeded,
    GpuError,
    GpuFailedPrecondition,
    GpuInternal,
    GpuProcessExited,
    ProcessState,
    Step,
    check_lock_timeout,
)


@dataclass
class Failure:
    """Make the next ``times`` calls of one step on one pid fail."""

    error: type[GpuError] = GpuInternal
    times: int = 1  # -1: every call
    leaves: ProcessState | None = None  # the state the failed call leaves (None: unchanged)
    message: str = "injected failure"


@dataclass(frozen=True, slots=True)
class Call:
    pid: int
    step: Step
    start: float
    end: float
    error: str | None


@dataclass
class FakeDriver:
    """``processes`` maps each CUDA pid to its GPU memory in bytes."""

    processes: Mapping[int, int] = field(default_factory=dict)
    delay_s: float = 0.0  # every lock/checkpoint/restore/unlock takes this long
    name: ClassVar[str] = "fake"

    def __post_init__(self) -> None:
        self.states: dict[int, ProcessState] = dict.fromkeys(self.processes, ProcessState.RUNNING)
        self.pending_work_ms: dict[int, int] = {}
        self.failures: dict[tuple[int, Step], Failure] = {}
        self.calls: list[Call] = []  # finished calls
        self.started: list[tuple[int, Step]] = []  # calls begun, in order
        self.device_maps: dict[int, Mapping[str, str] | None] = {}
        self._mu = threading.Lock()

    @classmethod
    def available(cls) -> Availability:
        return Availability(True, "fake driver for tests")

    # -- test controls -------------------------------------------------------------

    def fail(self, pid: int, step: Step, failure: Failure | None = None) -> None:
        self.failures[(pid, step)] = failure or Failure()

    def exit(self, pid: int) -> None:
        """The process dies: every later call on it raises GpuProcessExited."""
        with self._mu:
            self.states.pop(pid, None)

    def add(
        self, pid: int, memory_bytes: int = 0, state: ProcessState = ProcessState.RUNNING
    ) -> None:
        with self._mu:
            self.states[pid] = state
            self.processes = {**self.processes, pid: memory_bytes}

    def max_overlap(self, step: Step) -> int:
        """The largest number of ``step`` calls that were in flight at one instant."""
        events = sorted(
            [(c.start, 1) for c in self.calls if c.step is step]
            + [(c.end, -1) for c in self.calls if c.step is step],
            key=lambda e: (e[0], e[1]),
        )
        best = current = 0
        for _, delta in events:
            current += delta
            best = max(best, current)
        return best

    def steps_of(self, pid: int) -> list[Step]:
        return [c.step for c in self.calls if c.pid == pid]

    # -- the driver ------------------------------------------------------------------

    def state(self, pid: int) -> ProcessState:
        start = time.monotonic()
        try:
            with self._mu:
                self._inject(pid, Step.STATE)
                state = self._current(pid, Step.STATE)
        except GpuError as err:
            self._record(pid, Step.STATE, start, err)
            raise
        self._record(pid, Step.STATE, start, None)
        return state

    def lock(self, pid: int, timeout_ms: int) -> None:
        check_lock_timeout(pid, timeout_ms)
        self._step(pid, Step.LOCK, timeout_ms=timeout_ms)

    def checkpoint(self, pid: int) -> None:
        self._step(pid, Step.CHECKPOINT)

    def restore(self, pid: int, device_map: Mapping[str, str] | None = None) -> None:
        self._step(pid, Step.RESTORE, device_map=device_map)

    def unlock(self, pid: int) -> None:
        self._step(pid, Step.UNLOCK)

    def _step(
        self,
        pid: int,
        step: Step,
        *,
        timeout_ms: int = 0,
        device_map: Mapping[str, str] | None = None,
    ) -> None:
        start = time.monotonic()
        with self._mu:
            self.started.append((pid, step))
        try:
            self._do_step(pid, step, timeout_ms, device_map)
        except GpuError as err:
            self._record(pid, step, start, err)
            raise
        self._record(pid, step, start, None)

    def _do_step(
        self, pid: int, step: Step, timeout_ms: int, device_map: Mapping[str, str] | None
    ) -> None:
        # Checked before and after the (lock-free) delay: a concurrent call on the same
        # pid must not slip a second transition through.
        with self._mu:
            self._inject(pid, step)
            before = self._current(pid, step)
            after = self._target(pid, step, before)
        work_ms = self.pending_work_ms.get(pid, 0) if step is Step.LOCK else 0
        if work_ms > timeout_ms > 0:
            time.sleep(timeout_ms / 1000)
            raise GpuDeadlineExceeded(
                f"submitted CUDA work did not finish within {timeout_ms} ms", pid=pid, step=step
            )
        time.sleep(self.delay_s + work_ms / 1000)
        with self._mu:
            if self._current(pid, step) is not before:
                raise GpuFailedPrecondition("state changed during the call", pid=pid, step=step)
            self.states[pid] = after
            if step is Step.RESTORE:
                self.device_maps[pid] = dict(device_map) if device_map else None
            if step is Step.LOCK:
                self.pending_work_ms.pop(pid, None)

    def _inject(self, pid: int, step: Step) -> None:
        failure = self.failures.get((pid, step))
        if failure is None or failure.times == 0:
            return
        if failure.times > 0:
            failure.times -= 1
        if failure.leaves is not None and pid in self.states:
            self.states[pid] = failure.leaves
        raise failure.error(failure.message, pid=pid, step=step)

    def _current(self, pid: int, step: Step) -> ProcessState:
        state = self.states.get(pid)
        if state is None:
            raise GpuProcessExited("no such process", pid=pid, step=step)
        return state

    def _target(self, pid: int, step: Step, state: ProcessState) -> ProcessState:
        after = TRANSITIONS.get((state, step))
        if after is None:
            raise GpuFailedPrecondition(
                f"cannot {step} a process that is {state}", pid=pid, step=step
            )
        return after

    def _record(self, pid: int, step: Step, start: float, err: GpuError | None) -> None:
        call = Call(pid, step, start, time.monotonic(), None if err is None else str(err))
        with self._mu:
            self.calls.append(call)


def running(pids: Iterable[int], memory_bytes: int = 1 << 30, **kwargs: float) -> FakeDriver:
    """A fake with ``pids`` all RUNNING, each holding ``memory_bytes`` of GPU memory."""
    return FakeDriver(dict.fromkeys(pids, memory_bytes), **kwargs)
