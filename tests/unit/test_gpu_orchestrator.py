"""freeze/thaw against the fake driver: parallel, barriered, and never leaving a
process locked, whichever step of whichever process fails."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Mapping

import pytest
from cedana_shim import errors
from cedana_shim.gpu.driver import (
    TRANSITIONS,
    GpuDeadlineExceeded,
    GpuError,
    GpuFailedPrecondition,
    GpuInternal,
    GpuProcessExited,
    GpuRecoveryFailed,
    ProcessState,
    Step,
)
from cedana_shim.gpu.inventory import GpuProcess
from cedana_shim.gpu.orchestrator import Frozen, freeze, thaw
from fakes.fake_gpu_driver import Failure, FakeDriver, running
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.examples import examples

PIDS = [101, 102, 103, 104, 105, 106]
GIB = 1 << 30


def states(driver: FakeDriver) -> dict[int, ProcessState]:
    return dict(driver.states)


def all_running(driver: FakeDriver) -> bool:
    return all(s is ProcessState.RUNNING for s in driver.states.values())


def calls(driver: FakeDriver, step: Step) -> list[tuple[float, float]]:
    return [(c.start, c.end) for c in driver.calls if c.step is step and c.error is None]


def test_freeze_locks_then_checkpoints_every_process_in_parallel() -> None:
    driver = running(PIDS, GIB, delay_s=0.05)
    procs = [GpuProcess(pid, ("GPU-a",), GIB) for pid in PIDS]

    frozen = asyncio.run(freeze(driver, procs, lock_timeout_ms=1000, container_id="ctr1"))

    assert all(s is ProcessState.CHECKPOINTED for s in driver.states.values())
    assert frozen.pids == tuple(PIDS)
    assert driver.max_overlap(Step.LOCK) == len(PIDS)
    assert driver.max_overlap(Step.CHECKPOINT) == len(PIDS)
    # Barrier: every process is locked before the first checkpoint starts.
    assert max(end for _, end in calls(driver, Step.LOCK)) <= min(
        start for start, _ in calls(driver, Step.CHECKPOINT)
    )
    assert frozen.total_bytes == len(PIDS) * GIB
    assert frozen.checkpoint_s >= 0.05
    assert frozen.checkpoint_gbps is not None and frozen.checkpoint_gbps > 0
    meta = json.loads(json.dumps(frozen.to_dict()))
    assert meta["backend"] == "fake"
    assert meta["bytes"] == len(PIDS) * GIB
    assert meta["processes"][0] == {"pid": 101, "memoryBytes": GIB, "gpuUuids": ["GPU-a"]}


def test_thaw_restores_then_unlocks_every_process_in_parallel() -> None:
    driver = running(PIDS, GIB, delay_s=0.05)
    frozen = asyncio.run(freeze(driver, PIDS, lock_timeout_ms=1000))
    driver.calls.clear()

    thawed = asyncio.run(thaw(driver, frozen))

    assert all_running(driver)
    assert thawed.restored == tuple(PIDS)
    assert driver.max_overlap(Step.RESTORE) == len(PIDS)
    assert driver.max_overlap(Step.UNLOCK) == len(PIDS)
    assert max(end for _, end in calls(driver, Step.RESTORE)) <= min(
        start for start, _ in calls(driver, Step.UNLOCK)
    )
    json.dumps(thawed.to_dict())


def test_parallelism_bounds_the_calls_in_flight() -> None:
    driver = running(PIDS, delay_s=0.03)
    frozen = asyncio.run(freeze(driver, PIDS, lock_timeout_ms=1000, parallelism=2))
    asyncio.run(thaw(driver, frozen, parallelism=2))
    for step in (Step.LOCK, Step.CHECKPOINT, Step.RESTORE, Step.UNLOCK):
        assert driver.max_overlap(step) == 2
    assert all_running(driver)


def test_thaw_after_restore_passes_the_device_map_to_every_restore() -> None:
    # After a CRIU restore the processes are new host pids, all CHECKPOINTED.
    driver = FakeDriver()
    for pid in (201, 202):
        driver.add(pid, GIB, ProcessState.CHECKPOINTED)
    device_map = {"GPU-old0": "GPU-new1", "GPU-old1": "GPU-new0"}

    thawed = asyncio.run(thaw(driver, [201, 202], device_map, total_bytes=2 * GIB))

    assert all_running(driver)
    assert driver.device_maps == {201: device_map, 202: device_map}
    assert thawed.device_map == device_map
    assert thawed.to_dict()["deviceMap"] == device_map
    assert thawed.total_bytes == 2 * GIB


def test_thaw_takes_each_process_from_where_it_is() -> None:
    driver = FakeDriver()
    driver.add(1, state=ProcessState.CHECKPOINTED)
    driver.add(2, state=ProcessState.LOCKED)
    driver.add(3, state=ProcessState.RUNNING)  # CRIU's CUDA plugin got there first
    thawed = asyncio.run(thaw(driver, [1, 2, 3, 4]))  # 4 is not a CUDA process
    assert all_running(driver)
    assert (thawed.restored, thawed.unlocked, thawed.already_running) == ((1,), (2,), (3,))
    assert set(thawed.skipped) == {4}
    assert driver.steps_of(2) == [Step.STATE, Step.UNLOCK]
    assert driver.steps_of(3) == [Step.STATE]


def test_freeze_skips_pids_that_are_not_cuda_processes_or_exit() -> None:
    driver = running([1, 2, 3])
    driver.fail(2, Step.LOCK, Failure(GpuProcessExited, message="no such process"))
    frozen = asyncio.run(freeze(driver, [1, 2, 3, 99], lock_timeout_ms=100))
    assert frozen.pids == (1, 3)
    assert set(frozen.skipped) == {2, 99}
    assert driver.steps_of(2) == [Step.STATE, Step.LOCK]  # never checkpointed


def test_freeze_refuses_a_process_someone_else_locked_and_touches_nothing() -> None:
    driver = running([1, 2])
    driver.states[2] = ProcessState.LOCKED
    with pytest.raises(GpuFailedPrecondition) as info:
        asyncio.run(freeze(driver, [1, 2], lock_timeout_ms=100, container_id="ctr9"))
    assert "container ctr9" in str(info.value) and "pid 2" in str(info.value)
    assert "is locked, not running" in str(info.value)
    assert "refused" in str(info.value) and "no process was touched" in str(info.value)
    assert states(driver) == {1: ProcessState.RUNNING, 2: ProcessState.LOCKED}
    assert all(c.step is Step.STATE for c in driver.calls)


def test_a_lock_timeout_unlocks_the_others_and_says_which_pid() -> None:
    driver = running(PIDS)
    driver.pending_work_ms[104] = 500
    with pytest.raises(GpuDeadlineExceeded) as info:
        asyncio.run(freeze(driver, PIDS, lock_timeout_ms=20, container_id="ctr1"))
    err = info.value
    assert isinstance(err, errors.DeadlineExceeded)
    assert all_running(driver)
    assert (err.pid, err.step) == (104, Step.LOCK)
    text = str(err)
    assert "GPU freeze of container ctr1 failed" in text
    assert "GPU lock of pid 104" in text and "every process was returned to running" in text
    assert set(err.reports) == set(PIDS)
    assert "lock FAILED" in err.reports[104]
    assert "recovery unlock ok" in err.reports[101]
    assert not any(c.step is Step.CHECKPOINT for c in driver.calls)


def test_a_process_the_driver_marks_failed_is_reported_as_stuck() -> None:
    driver = running([1, 2, 3])
    driver.fail(2, Step.CHECKPOINT, Failure(GpuInternal, leaves=ProcessState.FAILED))
    with pytest.raises(GpuRecoveryFailed) as info:
        asyncio.run(freeze(driver, [1, 2, 3], lock_timeout_ms=100, container_id="c"))
    assert states(driver) == {
        1: ProcessState.RUNNING,
        2: ProcessState.FAILED,
        3: ProcessState.RUNNING,
    }
    text = str(info.value)
    assert "pid 2 is failed" in text and "kill the container" in text
    assert isinstance(info.value, errors.Internal)
    assert (info.value.pid, info.value.step) == (2, Step.CHECKPOINT)


def test_a_restore_that_keeps_failing_during_undo_is_stuck_checkpointed() -> None:
    driver = running([1, 2])
    driver.fail(1, Step.CHECKPOINT)
    driver.fail(2, Step.RESTORE, Failure(times=-1))
    with pytest.raises(GpuRecoveryFailed) as info:
        asyncio.run(freeze(driver, [1, 2], lock_timeout_ms=100))
    assert states(driver) == {1: ProcessState.RUNNING, 2: ProcessState.CHECKPOINTED}
    assert "pid 2 is checkpointed" in str(info.value)
    assert driver.steps_of(2).count(Step.RESTORE) == 2  # tried, then retried once


def test_thaw_retries_a_failed_restore_once_and_notes_it() -> None:
    driver = running([1, 2])
    frozen = asyncio.run(freeze(driver, [1, 2], lock_timeout_ms=100))
    driver.fail(2, Step.RESTORE)
    thawed = asyncio.run(thaw(driver, frozen))
    assert all_running(driver)
    assert thawed.restored == (1,)
    assert any("pid 2" in n and "recovery restore ok" in n for n in thawed.notes)


def test_thaw_that_cannot_restore_one_process_still_runs_the_others() -> None:
    driver = running([1, 2, 3])
    frozen = asyncio.run(freeze(driver, [1, 2, 3], lock_timeout_ms=100, container_id="c"))
    driver.fail(3, Step.RESTORE, Failure(times=-1, message="out of memory"))
    with pytest.raises(GpuRecoveryFailed) as info:
        asyncio.run(thaw(driver, frozen, {"GPU-a": "GPU-b"}))
    assert states(driver) == {
        1: ProcessState.RUNNING,
        2: ProcessState.RUNNING,
        3: ProcessState.CHECKPOINTED,
    }
    assert "GPU thaw of container c" in str(info.value)
    assert "GPU restore of pid 3: out of memory" in str(info.value)


def test_a_backend_bug_is_wrapped_and_the_others_are_recovered() -> None:
    class Buggy(FakeDriver):
        def checkpoint(self, pid: int) -> None:
            if pid == 2:
                raise KeyError("oops")
            super().checkpoint(pid)

    driver = Buggy({1: 0, 2: 0})
    with pytest.raises(GpuInternal) as info:
        asyncio.run(freeze(driver, [1, 2], lock_timeout_ms=100))
    assert "KeyError" in str(info.value)
    assert all_running(driver)


def test_a_cancelled_freeze_waits_for_its_threads_and_undoes_everything() -> None:
    driver = running(PIDS, delay_s=0.1)

    async def body() -> None:
        task = asyncio.create_task(freeze(driver, PIDS, lock_timeout_ms=1000))
        while not any(step is Step.CHECKPOINT for _, step in driver.started):
            await asyncio.sleep(0.005)  # until the checkpoint phase has begun
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(body())
    assert all_running(driver)
    assert any(c.step is Step.CHECKPOINT for c in driver.calls)


def test_a_cancelled_thaw_finishes_first() -> None:
    driver = running(PIDS, delay_s=0.05)
    frozen = asyncio.run(freeze(driver, PIDS, lock_timeout_ms=1000))

    async def body() -> None:
        task = asyncio.create_task(thaw(driver, frozen))
        while not any(step is Step.RESTORE for _, step in driver.started):
            await asyncio.sleep(0.005)  # until the thaw has begun
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    asyncio.run(body())
    assert all_running(driver)


def test_nothing_to_do() -> None:
    driver = FakeDriver()
    frozen = asyncio.run(freeze(driver, [], lock_timeout_ms=10))
    assert frozen == Frozen("", "fake", (), {}, {}, {}, frozen.lock_s, frozen.checkpoint_s)
    assert frozen.checkpoint_gbps is None
    thawed = asyncio.run(thaw(driver, frozen))
    assert thawed.restored == ()


# -- property: one failure anywhere, plus one during recovery, leaves all RUNNING -----

RECOVERABLE_AFTER: Mapping[Step, list[ProcessState | None]] = {
    # The state a failed step may leave: unchanged, or done but reported as failed.
    Step.STATE: [None],
    Step.LOCK: [None, ProcessState.LOCKED],
    Step.CHECKPOINT: [None, ProcessState.CHECKPOINTED],
    Step.RESTORE: [None, ProcessState.LOCKED],
    Step.UNLOCK: [None, ProcessState.RUNNING],
}
ERROR_CLASSES = [GpuInternal, GpuDeadlineExceeded, GpuFailedPrecondition]


@st.composite
def failure_at(draw: st.DrawFn, n: int, steps: list[Step]) -> tuple[int, Step, Failure]:
    pid = PIDS[draw(st.integers(0, n - 1))]
    step = draw(st.sampled_from(steps))
    leaves = draw(st.sampled_from(RECOVERABLE_AFTER[step]))
    error = draw(st.sampled_from(ERROR_CLASSES))
    return pid, step, Failure(error, times=1, leaves=leaves)


@st.composite
def freeze_case(draw: st.DrawFn) -> tuple[int, tuple[int, Step, Failure], list[tuple]]:
    n = draw(st.integers(1, 5))
    primary = draw(failure_at(n, [Step.STATE, Step.LOCK, Step.CHECKPOINT]))
    extra = draw(st.lists(failure_at(n, [Step.RESTORE, Step.UNLOCK, Step.STATE]), max_size=1))
    return n, primary, extra


@settings(max_examples=examples(150), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(freeze_case())
def test_any_failure_during_freeze_leaves_every_process_running(
    case: tuple[int, tuple[int, Step, Failure], list[tuple[int, Step, Failure]]],
) -> None:
    n, (pid, step, failure), extra = case
    driver = running(PIDS[:n])
    driver.fail(pid, step, failure)
    for other_pid, other_step, other in extra:
        if (other_pid, other_step) != (pid, step):
            driver.fail(other_pid, other_step, other)

    with pytest.raises(GpuError) as info:
        asyncio.run(freeze(driver, PIDS[:n], lock_timeout_ms=100, container_id="prop"))

    assert all_running(driver), (driver.states, str(info.value))
    err = info.value
    assert err.pid is not None and err.step is not None
    assert f"of pid {err.pid}" in str(err) and f"GPU {err.step} " in str(err)
    assert f"pid {pid}" in str(err)
    assert "container prop" in str(err)
    for s in driver.states:
        if (s, Step.LOCK) in {(c.pid, c.step) for c in driver.calls}:
            assert s in err.reports


@st.composite
def thaw_case(draw: st.DrawFn) -> tuple[int, tuple[int, Step, Failure]]:
    n = draw(st.integers(1, 5))
    return n, draw(failure_at(n, [Step.STATE, Step.RESTORE, Step.UNLOCK]))


@settings(max_examples=examples(100), deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(thaw_case(), st.booleans())
def test_one_failure_during_thaw_is_retried_and_every_process_runs(
    case: tuple[int, tuple[int, Step, Failure]], with_map: bool
) -> None:
    n, (pid, step, failure) = case
    driver = running(PIDS[:n])
    frozen = asyncio.run(freeze(driver, PIDS[:n], lock_timeout_ms=100))
    driver.fail(pid, step, failure)
    device_map = {"GPU-x": "GPU-y"} if with_map else None

    thawed = asyncio.run(thaw(driver, frozen, device_map))

    assert all_running(driver)
    assert set(thawed.restored) | {pid} == set(PIDS[:n])
    if step is not Step.STATE or failure.leaves is not None:
        assert any(f"pid {pid}" in note for note in thawed.notes)
    for p in PIDS[:n]:
        # A restore that failed but did its work left no record in the fake.
        assert driver.device_maps.get(p, device_map) == device_map
        if p != pid:
            assert p in driver.device_maps


def test_transition_table_is_a_cycle() -> None:
    # The orchestrator's recovery relies on every non-final state having one way back.
    assert TRANSITIONS[(ProcessState.CHECKPOINTED, Step.RESTORE)] is ProcessState.LOCKED
    assert TRANSITIONS[(ProcessState.LOCKED, Step.UNLOCK)] is ProcessState.RUNNING
