"""Every (state, operation) pair either moves as the table says or is refused cleanly."""

import asyncio
import itertools

import pytest
from cedana_shim.errors import FailedPrecondition, NotFound
from cedana_shim.task.process import EXEC_TRANSITIONS, INIT_TRANSITIONS, Process, State

OPERATIONS = [
    "start",
    "kill",
    "update",
    "resize",
    "delete",
    "pause",
    "resume",
    "checkpoint",
    "exec",
]


def make(exec_id: str, state: State) -> Process:
    async def build() -> Process:
        return Process("c1", exec_id, state=state)

    return asyncio.run(build())


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
