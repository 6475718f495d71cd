"""Every (state, operation) pair either moves as the table says or is refused cleanly;
the exit status of a stop follows the STOPPING rule."""

import asyncio
import itertools

import pytest
from cedana_shim.errors import FailedPrecondition, NotFound
from cedana_shim.lifecycle.process import (
    EXEC_TRANSITIONS,
    INIT_TRANSITIONS,
    LIVE,
    Process,
    State,
    StopIntent,
)

# Every operation either table knows, plus ones neither does.
OPERATIONS = sorted({op for _, op in (*INIT_TRANSITIONS, *EXEC_TRANSITIONS)} | {"bogus"})


def make(exec_id: str, state: State) -> Process:
    async def build() -> Process:
        return Process("c1", exec_id, state=state)

    return asyncio.run(build())


def test_operations_cover_the_lifecycle() -> None:
    # A rename in the table must not silently shrink what test_every_pair covers.
    assert {
        "start", "kill", "update", "resize", "delete", "pause", "resume", "checkpoint",
        "checkpointed", "exec", "restore", "restored", "restore-failed", "stop",
        "stop-failed", "exited", "plan-restore",
    } <= set(OPERATIONS)  # fmt: skip


@pytest.mark.parametrize(
    "exec_id, state, op",
    [
        (exec_id, state, op)
        for exec_id, state, op in itertools.product(["", "e1"], State, OPERATIONS)
    ],
)
def test_every_pair(exec_id: str, state: State, op: str) -> None:
    process = make(exec_id, state)
    table = INIT_TRANSITIONS if not exec_id else EXEC_TRANSITIONS
    if (state, op) in table:
        process.commit(op)
        assert process.state is table[(state, op)]
        return
    expected = (
        NotFound
        if state is State.DELETED or (op == "kill" and state is State.STOPPED)
        else FailedPrecondition
    )
    with pytest.raises(expected) as info:
        process.commit(op)
    assert process.state is state, "a refused operation must not change the state"
    if expected is FailedPrecondition:
        assert op in str(info.value) and state.value in str(info.value) and "c1" in str(info.value)
        assert (exec_id or "container c1") in str(info.value)


@pytest.mark.parametrize(
    ("start", "ops", "end"),
    [
        (State.RESTORE_PENDING, ["restore", "restored"], State.RUNNING),
        (State.RESTORE_PENDING, ["restore", "restore-failed"], State.CREATED),
        (State.RESTORE_PENDING, ["restore", "kill", "exited"], State.STOPPED),
        (State.RUNNING, ["checkpoint", "checkpointed"], State.RUNNING),
        (State.PAUSED, ["checkpoint", "checkpointed"], State.PAUSED),
        (State.RUNNING, ["stop", "stop-failed"], State.RUNNING),
        (State.RUNNING, ["stop", "kill", "exited", "delete"], State.DELETED),
    ],
)
def test_long_operations_have_a_way_back(start: State, ops: list[str], end: State) -> None:
    process = make("", start)
    for op in ops:
        process.commit(op)
    assert process.state is end


def test_stop_exit_before_durable_is_the_process_own() -> None:
    async def run() -> None:
        process = Process("c1", "", state=State.RUNNING)
        process.begin_stop(15)
        assert (process.state, process.stop) == (State.STOPPING, StopIntent(15))
        assert process.set_exited(7, 10.0)
        assert process.state is State.STOPPED
        assert process.exit is not None and process.exit.status == 7
        assert process.stop is None

    asyncio.run(run())


def test_stop_exit_after_durable_reads_128_plus_signal() -> None:
    async def run() -> None:
        process = Process("c1", "", state=State.RUNNING)
        process.begin_stop(15)
        process.stop_durable()
        assert process.stop == StopIntent(15, durable=True)
        assert process.exit_status(137) == 143
        assert process.set_exited(137, 10.0)  # the SIGKILL after the checkpoint
        assert (await process.exited).status == 143
        assert process.state is State.STOPPED
        assert process.stop is None

    asyncio.run(run())


def test_stop_failed_forgets_the_intent() -> None:
    async def run() -> None:
        process = Process("c1", "", state=State.RUNNING)
        process.begin_stop(2)
        process.commit("stop-failed")
        assert (process.state, process.stop) == (State.RUNNING, None)
        assert process.exit_status(130) == 130
        with pytest.raises(AssertionError, match="not stopping"):
            process.stop_durable()

    asyncio.run(run())


@pytest.mark.parametrize("state", [s for s in State if s is not State.RUNNING])
def test_begin_stop_only_from_running(state: State) -> None:
    process = make("", state)
    with pytest.raises((FailedPrecondition, NotFound)):
        process.begin_stop(15)
    assert (process.state, process.stop) == (state, None)


def test_exec_cannot_stop() -> None:
    process = make("e1", State.RUNNING)
    with pytest.raises(FailedPrecondition, match="cannot stop exec e1 of container c1"):
        process.begin_stop(15)
    assert process.state is State.RUNNING


@pytest.mark.parametrize("state", [s for s in State if s is not State.STOPPING])
def test_exit_status_is_the_process_own_outside_stopping(state: State) -> None:
    assert make("", state).exit_status(9) == 9


def test_every_live_state_can_exit() -> None:
    for state in (*LIVE, State.CREATED, State.RESTORE_PENDING, State.RESTORING):
        assert (state, "exited") in INIT_TRANSITIONS, state


def test_exit_is_recorded_once_and_resolves_waiters() -> None:
    async def run() -> None:
        process = Process("c1", "", state=State.RUNNING)
        assert process.set_exited(143, 10.0)
        assert not process.set_exited(0, 11.0)
        info = await process.exited
        assert (info.status, info.timestamp, process.state) == (143, 10.0, State.STOPPED)

    asyncio.run(run())


def test_exit_after_force_delete_is_ignored() -> None:
    process = make("", State.DELETED)
    assert not process.set_exited(137)


def test_exit_in_a_state_that_cannot_exit_is_a_broken_invariant() -> None:
    process = make("", State.STOPPED)
    with pytest.raises(AssertionError, match="exit of container c1 in stopped state"):
        process.set_exited(0)
