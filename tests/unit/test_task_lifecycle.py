"""The Task API's lifecycle on the fake runc: create, start, exec, kill, wait, delete."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import pytest
from cedana_shim.api.containerd.events import task_pb2 as ev
from cedana_shim.api.containerd.types import task_pb2 as types
from cedana_shim.errors import FailedPrecondition, NotFound, Unknown
from cedana_shim.lifecycle.process import State
from task_support import PYTHON, SLEEP, TaskEnv, TaskWorld


def test_create_start_kill_wait_delete(tmp_path: Path) -> None:
    async def body(env: TaskEnv) -> None:
        pid = await env.create("c1")
        state = await env.state("c1")
        assert (state.status, state.pid) == (types.CREATED, pid)
        assert env.fake.status("c1") == "created"

        assert await env.start("c1") == pid
        state = await env.state("c1")
        assert (state.status, state.pid) == (types.RUNNING, pid)
        assert env.fake.live_pids("c1") == [pid]

        await env.kill("c1", signal.SIGTERM)
        waited = await env.wait("c1")
        assert waited.exit_status == 128 + signal.SIGTERM
        state = await env.state("c1")
        assert (state.status, state.exit_status) == (types.STOPPED, 143)
        assert state.exited_at.ToNanoseconds() == waited.exited_at.ToNanoseconds() > 0

        deleted = await env.delete("c1")
        assert (deleted.pid, deleted.exit_status) == (pid, 143)
        with pytest.raises(NotFound):
            await env.state("c1")
        assert env.fake.state("c1") is None

        exit_event = await env.exit_event("c1")
        assert (exit_event.pid, exit_event.exit_status) == (pid, 143)
        assert env.events.topics() == ["/tasks/create", "/tasks/start", "/tasks/exit",
                                       "/tasks/delete"]  # fmt: skip
        assert env.events.of(ev.TaskStart)[0].pid == pid
        assert env.events.of(ev.TaskDelete)[0].exit_status == 143

    TaskWorld(tmp_path).run(body)


def test_exec_runs_and_reports_its_own_exit(tmp_path: Path) -> None:
    async def body(env: TaskEnv) -> None:
        await env.run("c1")
        await env.exec("c1", "e1", ["sh", "-c", "exit 3"])
        assert (await env.state("c1", "e1")).status == types.CREATED
        pid = await env.start("c1", "e1")
        assert pid > 0

        waited = await env.wait("c1", "e1")
        assert waited.exit_status == 3
        state = await env.state("c1", "e1")
        assert (state.status, state.exit_status, state.pid) == (types.STOPPED, 3, pid)
        exit_event = await env.exit_event("c1", "e1")
        assert (exit_event.pid, exit_event.exit_status) == (pid, 3)
        assert env.events.of(ev.TaskExecStarted)[0].pid == pid

        deleted = await env.delete("c1", "e1")
        assert deleted.exit_status == 3
        with pytest.raises(NotFound):
            await env.state("c1", "e1")
        # The container itself goes on.
        assert (await env.state("c1")).status == types.RUNNING
        assert env.events.topics()[2:] == ["/tasks/exec-added", "/tasks/exec-started",
                                           "/tasks/exit"]  # fmt: skip

    TaskWorld(tmp_path).run(body)


def test_the_init_writes_to_the_stdio_it_was_created_with(tmp_path: Path) -> None:
    async def body(env: TaskEnv) -> None:
        out = tmp_path / "out.log"
        await env.run("c1", ["sh", "-c", "echo hello; echo oops >&2"], stdout=f"file://{out}")
        assert (await env.wait("c1")).exit_status == 0
        await env.delete("c1")  # drains the copiers
        assert sorted(out.read_text().split()) == ["hello", "oops"]

    TaskWorld(tmp_path).run(body)


def test_init_exit_is_published_after_every_exec_exit(tmp_path: Path) -> None:
    async def body(env: TaskEnv) -> None:
        init = await env.run("c1")
        await env.exec("c1", "e1", SLEEP)
        exec_pid = await env.start("c1", "e1")

        os.kill(init, signal.SIGKILL)
        await env.until(lambda: env.fake.process_state(init) == "gone", "the init to be reaped")
        await asyncio.sleep(0.05)
        # The init is gone, but its exit waits for the exec's (containerd handleInitExit).
        assert not [e for e in env.events.of(ev.TaskExit) if e.id == "c1"]
        assert env.container("c1").init.exit is None

        await env.kill("c1", signal.SIGKILL, exec_id="e1")
        assert (await env.wait("c1")).exit_status == 137
        exits = [(e.id, e.pid, e.exit_status) for e in env.events.of(ev.TaskExit)]
        assert exits == [("e1", exec_pid, 137), ("c1", init, 137)]

    TaskWorld(tmp_path).run(body)


def test_without_a_pid_namespace_the_init_exit_kills_the_execs(tmp_path: Path) -> None:
    async def body(env: TaskEnv) -> None:
        init = await env.run("c1", pid_namespace=False)
        await env.exec("c1", "e1", SLEEP)
        exec_pid = await env.start("c1", "e1")

        await env.kill("c1", signal.SIGKILL)
        assert (await env.wait("c1")).exit_status == 137
        assert env.fake.calls("kill")[-1][-3:] == ["--all", "c1", "9"]
        exits = [(e.id, e.pid, e.exit_status) for e in env.events.of(ev.TaskExit)]
        assert exits == [("e1", exec_pid, 137), ("c1", init, 137)]
        assert env.fake.live_pids() == []

    TaskWorld(tmp_path).run(body)


def test_a_program_that_exits_at_once_is_started_then_exits(tmp_path: Path) -> None:
    async def body(env: TaskEnv) -> None:
        pid = await env.run("c1", ["sh", "-c", "exit 3"])
        assert (await env.wait("c1")).exit_status == 3
        assert env.events.topics() == ["/tasks/create", "/tasks/start", "/tasks/exit"]
        assert env.events.of(ev.TaskExit)[0].pid == pid

    TaskWorld(tmp_path).run(body)


def test_exit_before_start(tmp_path: Path) -> None:
    async def body(env: TaskEnv) -> None:
        pid = await env.create("c1")
        os.kill(pid, signal.SIGKILL)  # e.g. the OOM killer, before Start
        assert (await env.wait("c1")).exit_status == 137
        with pytest.raises(FailedPrecondition, match="c1 exited before it was started"):
            await env.start("c1")
        assert not env.events.of(ev.TaskStart)
        assert (await env.delete("c1")).exit_status == 137
        assert env.events.topics() == ["/tasks/create", "/tasks/exit", "/tasks/delete"]

    TaskWorld(tmp_path).run(body)


def test_delete_of_a_created_container_kills_its_init(tmp_path: Path) -> None:
    async def body(env: TaskEnv) -> None:
        pid = await env.create("c1")
        assert env.fake.live_pids("c1") == [pid]
        deleted = await env.delete("c1")
        assert (deleted.pid, deleted.exit_status) == (pid, 0)
        assert env.fake.live_pids() == []
        assert env.fake.state("c1") is None
        assert "c1" not in env.service.containers
        assert env.events.topics() == ["/tasks/create", "/tasks/delete"]

    TaskWorld(tmp_path).run(body)


def test_pause_and_resume(tmp_path: Path) -> None:
    async def body(env: TaskEnv) -> None:
        pid = await env.run("c1")
        await env.pause("c1")
        assert (await env.state("c1")).status == types.PAUSED
        assert env.fake.process_state(pid) == "T"  # stopped
        with pytest.raises(FailedPrecondition, match="paused"):
            await env.exec("c1", "e1", SLEEP)
        with pytest.raises(FailedPrecondition, match="cannot pause container c1 in paused"):
            await env.pause("c1")

        await env.resume("c1")
        assert (await env.state("c1")).status == types.RUNNING
        assert env.fake.process_state(pid) == "S"  # sleeping again
        assert env.events.topics()[2:] == ["/tasks/paused", "/tasks/resumed"]

    TaskWorld(tmp_path).run(body)


def test_second_start_is_refused_and_changes_nothing(tmp_path: Path) -> None:
    async def body(env: TaskEnv) -> None:
        pid = await env.run("c1")
        with pytest.raises(FailedPrecondition, match="cannot start container c1 in running"):
            await env.start("c1")
        assert env.container("c1").init.state is State.RUNNING
        assert env.fake.live_pids("c1") == [pid]
        assert len(env.fake.calls("start")) == 1
        assert len(env.events.of(ev.TaskStart)) == 1

    TaskWorld(tmp_path).run(body)


def test_kill_of_a_stopped_init_is_not_found(tmp_path: Path) -> None:
    async def body(env: TaskEnv) -> None:
        await env.run("c1")
        await env.kill("c1", signal.SIGKILL)
        assert (await env.wait("c1")).exit_status == 137
        with pytest.raises(NotFound, match="c1: process already finished"):
            await env.kill("c1", signal.SIGTERM)
        assert len(env.fake.calls("kill")) == 1

    TaskWorld(tmp_path).run(body)


def test_create_of_a_missing_program_fails_and_leaves_nothing(tmp_path: Path) -> None:
    async def body(env: TaskEnv) -> None:
        with pytest.raises(Unknown, match=r"no-such-program.*not found"):
            await env.create("c1", ["no-such-program"])
        assert "c1" not in env.service.containers
        assert env.fake.state("c1") is None
        assert not env.events.events
        # The id is free again.
        await env.run("c1", [*PYTHON, "pass"])
        assert (await env.wait("c1")).exit_status == 0

    TaskWorld(tmp_path).run(body)
