"""The fake CUDA checkpoint driver keeps the real state rules (it is what the
orchestrator tests, and the lead's integration tests, stand on), and the GPU error
classes map to the right status codes."""

from __future__ import annotations

import itertools

import pytest
from cedana_shim import errors
from cedana_shim.errors import Code
from cedana_shim.gpu.driver import (
    TRANSITIONS,
    CudaCheckpointDriver,
    GpuDeadlineExceeded,
    GpuError,
    GpuFailedPrecondition,
    GpuInternal,
    GpuInvalidArgument,
    GpuNotFound,
    GpuProcessExited,
    GpuRecoveryFailed,
    GpuUnavailable,
    GpuUnimplemented,
    ProcessState,
    Step,
    format_device_map,
)
from cedana_shim.ttrpc.status import status_from_exception
from fakes.fake_gpu_driver import Failure, FakeDriver, running

PID = 4242


def call(driver: FakeDriver, pid: int, step: Step) -> None:
    if step is Step.STATE:
        driver.state(pid)
    elif step is Step.LOCK:
        driver.lock(pid, 1000)
    elif step is Step.CHECKPOINT:
        driver.checkpoint(pid)
    elif step is Step.RESTORE:
        driver.restore(pid)
    else:
        driver.unlock(pid)


@pytest.mark.parametrize(
    ("state", "step"),
    list(itertools.product(ProcessState, [s for s in Step if s is not Step.STATE])),
    ids=lambda v: str(v),
)
def test_every_state_and_step_moves_by_the_table_or_fails_unchanged(
    state: ProcessState, step: Step
) -> None:
    driver = FakeDriver({PID: 1})
    driver.states[PID] = state
    expected = TRANSITIONS.get((state, step))
    if expected is None:
        with pytest.raises(GpuFailedPrecondition) as info:
            call(driver, PID, step)
        assert driver.states[PID] is state
        assert f"pid {PID}" in str(info.value) and str(step) in str(info.value)
        assert isinstance(info.value, errors.FailedPrecondition)
    else:
        call(driver, PID, step)
        assert driver.states[PID] is expected


def test_the_full_cycle_returns_to_running() -> None:
    driver = running([PID])
    driver.lock(PID, 500)
    driver.checkpoint(PID)
    assert driver.state(PID) is ProcessState.CHECKPOINTED
    driver.restore(PID, {"GPU-a": "GPU-b"})
    assert driver.state(PID) is ProcessState.LOCKED
    driver.unlock(PID)
    assert driver.state(PID) is ProcessState.RUNNING
    assert driver.device_maps[PID] == {"GPU-a": "GPU-b"}
    assert driver.steps_of(PID) == [
        Step.LOCK,
        Step.CHECKPOINT,
        Step.STATE,
        Step.RESTORE,
        Step.STATE,
        Step.UNLOCK,
        Step.STATE,
    ]


def test_lock_times_out_while_submitted_work_runs_and_leaves_it_running() -> None:
    driver = running([PID])
    driver.pending_work_ms[PID] = 200
    with pytest.raises(GpuDeadlineExceeded) as info:
        driver.lock(PID, 20)
    assert driver.states[PID] is ProcessState.RUNNING
    assert "pid 4242" in str(info.value) and "lock" in str(info.value)
    driver.pending_work_ms[PID] = 10
    driver.lock(PID, 500)
    assert driver.states[PID] is ProcessState.LOCKED


def test_a_zero_lock_timeout_is_refused() -> None:
    driver = running([PID])
    with pytest.raises(GpuInvalidArgument):
        driver.lock(PID, 0)
    assert driver.states[PID] is ProcessState.RUNNING


@pytest.mark.parametrize("step", list(Step), ids=str)
def test_injected_failures_fail_the_step_and_leave_the_chosen_state(step: Step) -> None:
    driver = running([PID])
    driver.fail(PID, step, Failure(GpuInternal, times=2, leaves=ProcessState.FAILED))
    for _ in range(2):
        driver.states[PID] = ProcessState.RUNNING
        with pytest.raises(GpuInternal) as info:
            call(driver, PID, step)
        assert f"GPU {step} of pid {PID}: injected failure" == str(info.value)
        assert driver.states[PID] is ProcessState.FAILED
    driver.states[PID] = ProcessState.RUNNING
    if step in (Step.STATE, Step.LOCK):
        call(driver, PID, step)  # the third call goes through


def test_an_exited_process_raises_process_exited() -> None:
    driver = running([PID])
    driver.exit(PID)
    with pytest.raises(GpuProcessExited) as info:
        driver.state(PID)
    assert isinstance(info.value, GpuNotFound)
    with pytest.raises(GpuProcessExited):
        driver.lock(PID, 10)


def test_the_fake_is_a_driver() -> None:
    driver: CudaCheckpointDriver = running([PID])
    assert driver.name == "fake"
    assert FakeDriver.available()


@pytest.mark.parametrize(
    ("cls", "base", "code"),
    [
        (GpuUnavailable, errors.Unavailable, Code.UNAVAILABLE),
        (GpuFailedPrecondition, errors.FailedPrecondition, Code.FAILED_PRECONDITION),
        (GpuDeadlineExceeded, errors.DeadlineExceeded, Code.DEADLINE_EXCEEDED),
        (GpuNotFound, errors.NotFound, Code.NOT_FOUND),
        (GpuProcessExited, errors.NotFound, Code.NOT_FOUND),
        (GpuUnimplemented, errors.Unimplemented, Code.UNIMPLEMENTED),
        (GpuInvalidArgument, errors.InvalidArgument, Code.INVALID_ARGUMENT),
        (GpuInternal, errors.Internal, Code.INTERNAL),
        (GpuRecoveryFailed, errors.Internal, Code.INTERNAL),
    ],
    ids=lambda v: getattr(v, "__name__", str(v)),
)
def test_gpu_errors_carry_their_errors_py_class_and_code(
    cls: type[GpuError], base: type[errors.ShimError], code: Code
) -> None:
    err = cls("it broke", pid=7, step=Step.CHECKPOINT)
    assert isinstance(err, base)
    assert status_from_exception(err).code == code
    assert str(err) == "GPU checkpoint of pid 7: it broke"
    assert (err.pid, err.step, err.detail) == (7, Step.CHECKPOINT, "it broke")
    assert str(cls("plain")) == "GPU: plain"
    assert str(cls("x", message="whole text")) == "whole text"


def test_device_map_format_is_cuda_checkpoints() -> None:
    assert format_device_map({"GPU-a": "GPU-b", "GPU-c": "GPU-d"}) == "GPU-a=GPU-b,GPU-c=GPU-d"
