"""Checkpoints of opted-in containers on the fake runc, into a real store in tmp_path:
on stop (SIGTERM) and what happens when that checkpoint cannot be made durable,
periodic, on demand (the cedana Checkpoint RPC, the Task API), their interplay with
signals, execs and Delete, and a restore that waits for a checkpoint of its label
still being written."""

from __future__ import annotations

import asyncio
import os
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path

import pytest
from cedana_shim.api.cedana.v1 import cedana_pb2 as cedana_pb
from cedana_shim.api.containerd.events import task_pb2 as ev
from cedana_shim.api.containerd.task.v2 import shim_pb2 as pb
from cedana_shim.api.containerd.types import task_pb2 as types
from cedana_shim.bundle_state import BundleState, read_stopping
from cedana_shim.checkpoint.store import Entry, Ingest, Store, StoreConfig, Writer
from cedana_shim.errors import Aborted, Code, FailedPrecondition, ResourceExhausted, ShimError
from cedana_shim.hooks import Stage
from cedana_shim.lifecycle.process import Process, State
from cedana_shim.runtime.reaper import Exit
from fakes.fake_runc import PAGES_IMAGE
from google.protobuf.message import Message
from task_support import COUNTER, NAMESPACE, SLEEP, TaskEnv, TaskWorld, ctx, trap_term

STOP_STAGES = [Stage.PRECHECKPOINT, Stage.POSTCHECKPOINT]


def store_with(writer: type[Writer]) -> Callable[[StoreConfig], Store]:
    """A store whose checkpoints ``writer`` publishes."""

    def build(config: StoreConfig) -> Store:
        store = Store(config)
        store.writer = writer(store.core, store.catalog, store.failure_records)
        return store

    return build


class FullWriter(Writer):
    """The writer of a store whose disk is full when a checkpoint is published."""

    def publish(self, ingest: Ingest) -> Entry:
        raise ResourceExhausted(f"checkpoint store {self._core.root} is full (the test says so)")


def _record_init_states(env: TaskEnv, container_id: str) -> list[tuple[Stage, State]]:
    """(stage, the init's state) at every hook stage from now on."""
    init = env.container(container_id).init
    seen: list[tuple[Stage, State]] = []
    env.hooks.probes.append(lambda stage, _: seen.append((stage, init.state)))
    return seen


def _states_at_exit(env: TaskEnv, container_id: str) -> list[State]:
    """The init's state at the moment its exit is reaped (before it is recorded)."""
    init = env.container(container_id).init
    seen: list[State] = []

    def on_exit(ex: Exit) -> None:
        if ex.pid == init.pid:
            seen.append(init.state)

    env.reaper.subscribe(on_exit)
    return seen


def test_sigterm_publishes_the_checkpoint_before_the_exit(tmp_path: Path) -> None:
    async def body(env: TaskEnv) -> None:
        pid = await env.run("c1", SLEEP, label="web")
        stages = _record_init_states(env, "c1")
        published_at_exit: list[list[str]] = []

        def at_send(event: Message) -> None:
            if isinstance(event, ev.TaskExit):
                published_at_exit.append(env.checkpoints_of("web"))

        env.events.probe(at_send)
        await env.kill("c1", signal.SIGTERM)
        assert (await env.wait("c1")).exit_status == 143

        (committed,) = env.events.of(cedana_pb.CheckpointCommitted)
        assert (committed.container_id, committed.label, committed.scope, committed.reason) == (
            "c1", "web", NAMESPACE, "stop",
        )  # fmt: skip
        assert published_at_exit == [[committed.checkpoint_id]]
        exit_event = await env.exit_event("c1")
        assert (exit_event.pid, exit_event.exit_status) == (pid, 143)
        assert stages == [(stage, State.STOPPING) for stage in STOP_STAGES]
        assert env.container("c1").init.state is State.STOPPED
        # Frozen for the dump, and killed (not thawed) once it was durable.
        verbs = [verb for verb in env.fake.verbs() if verb in ("pause", "resume", "kill")]
        assert verbs == ["pause", "kill"]
        assert env.fake.calls("kill")[-1][-3:] == ["--all", "c1", "9"]
        assert "--leave-running" in env.fake.calls("checkpoint")[0]
        assert env.fake.live_pids() == []

    TaskWorld(tmp_path).run(body)


def _no_checkpoint_then_the_signal(world: TaskWorld, expected_error: str) -> None:
    """A stop whose checkpoint cannot be made durable: the application gets SIGTERM."""

    async def body(env: TaskEnv) -> None:
        ready = str(world.tmp / "ready")
        pid = await env.run("c1", trap_term(7, ready), label="web")
        await env.file_exists(ready)
        at_exit = _states_at_exit(env, "c1")

        await env.kill("c1", signal.SIGTERM)
        assert (await env.wait("c1")).exit_status == 7
        assert at_exit == [State.RUNNING]  # back from STOPPING before the signal landed
        assert env.checkpoints_of("web") == []
        assert not env.events.of(cedana_pb.CheckpointCommitted)
        (failed,) = env.events.of(cedana_pb.CheckpointFailed)
        assert (failed.container_id, failed.label, failed.reason) == ("c1", "web", "stop")
        assert expected_error in failed.error
        exit_event = await env.exit_event("c1")
        assert (exit_event.pid, exit_event.exit_status) == (pid, 7)
        assert env.fake.calls("kill")[-1][-2:] == ["c1", "15"]

    world.run(body)


def test_failing_dump_delivers_the_signal(tmp_path: Path) -> None:
    world = TaskWorld(tmp_path)
    world.fake.control(checkpoint={"error": "cannot dump pages"})
    # CRIU's own reason, not runc's "criu failed: type NOTIFY errno 0".
    _no_checkpoint_then_the_signal(world, "criu: Error (criu/fake.c:1): cannot dump pages")


def test_failing_publish_thaws_and_delivers_the_signal(tmp_path: Path) -> None:
    world = TaskWorld(tmp_path)
    world.store_type = store_with(FullWriter)
    _no_checkpoint_then_the_signal(world, "is full")


def test_sigkill_abandons_a_dump_in_progress(tmp_path: Path) -> None:
    world = TaskWorld(tmp_path)
    world.fake.control(checkpoint={"sleep": 30})

    async def body(env: TaskEnv) -> None:
        pid = await env.run("c1", SLEEP, label="web")
        await env.kill("c1", signal.SIGTERM)
        await env.fake_called("checkpoint")
        started = time.monotonic()
        await env.kill("c1", signal.SIGKILL)
        assert (await env.wait("c1")).exit_status == 137
        assert time.monotonic() - started < 3.0  # not the dump's 30 s
        assert env.checkpoints_of("web") == []
        assert not env.events.of(cedana_pb.CheckpointCommitted)
        (failed,) = env.events.of(cedana_pb.CheckpointFailed)
        assert "abandoned" in failed.error and "c1" in failed.error, failed.error
        assert (await env.exit_event("c1")).pid == pid
        assert env.fake.live_pids() == []
        assert env.store.reader.in_flight(NAMESPACE, "web") == []  # its staging is gone too

    world.run(body)


@pytest.mark.parametrize("pid_namespace", [True, False], ids=["own-pid-ns", "host-pid-ns"])
def test_delete_waits_for_a_stop_in_flight(tmp_path: Path, pid_namespace: bool) -> None:
    world = TaskWorld(tmp_path)
    world.fake.control(checkpoint={"sleep": 0.3})

    async def body(env: TaskEnv) -> None:
        await env.run("c1", SLEEP, label="web", pid_namespace=pid_namespace)
        await env.kill("c1", signal.SIGTERM)
        await env.fake_called("checkpoint")
        deleted = await env.delete("c1")
        assert deleted.exit_status == 143
        (committed,) = env.events.of(cedana_pb.CheckpointCommitted)
        assert env.checkpoints_of("web") == [committed.checkpoint_id]
        topics = env.events.topics()
        assert topics.index("/cedana/checkpoint/committed") < topics.index("/tasks/exit")
        assert topics[-1] == "/tasks/delete"
        assert env.fake.live_pids() == []

    world.run(body)


class KillingWriter(Writer):
    """Publishing takes long enough for the application to be killed from outside
    (the OOM killer, say) and its exit recorded before the checkpoint is durable."""

    victim: Process | None = None

    def publish(self, ingest: Ingest) -> Entry:
        assert self.victim is not None
        os.kill(self.victim.pid, signal.SIGKILL)
        deadline = time.monotonic() + 5.0
        while self.victim.exit is None and time.monotonic() < deadline:
            time.sleep(0.005)
        return super().publish(ingest)


def test_exit_from_outside_while_a_stop_publishes(tmp_path: Path) -> None:
    world = TaskWorld(tmp_path)
    world.store_type = store_with(KillingWriter)

    async def body(env: TaskEnv) -> None:
        pid = await env.run("c1", SLEEP, label="web")
        assert isinstance(env.store.writer, KillingWriter)
        env.store.writer.victim = env.container("c1").init
        await env.kill("c1", signal.SIGTERM)
        # Killed before its checkpoint was durable: the exit is its own.
        assert (await env.wait("c1")).exit_status == 137
        (committed,) = await env.event(cedana_pb.CheckpointCommitted)
        assert env.checkpoints_of("web") == [committed.checkpoint_id]
        assert (await env.exit_event("c1")).pid == pid
        assert (await env.delete("c1")).exit_status == 137

    world.run(body)


def test_periodic_checkpoint_leaves_the_container_running(tmp_path: Path) -> None:
    async def body(env: TaskEnv) -> None:
        pid = await env.create("c1", SLEEP, env=["CEDANA_ENABLE=1"])
        cr = env.container("c1").cr
        assert cr is not None
        cr.policy = replace(cr.policy, interval=0.05)  # the policy's minimum is 10 s
        stages = _record_init_states(env, "c1")
        init = env.container("c1").init
        at_commit: list[State] = []

        def at_send(event: Message) -> None:
            if isinstance(event, cedana_pb.CheckpointCommitted):
                at_commit.append(init.state)

        env.events.probe(at_send)

        await env.start("c1")
        (committed,) = await env.event(cedana_pb.CheckpointCommitted)
        cr.stop_periodic()
        assert (committed.reason, committed.label) == ("periodic", "c1")
        assert stages[:2] == [(stage, State.CHECKPOINTING) for stage in STOP_STAGES]
        assert at_commit[0] is State.RUNNING
        assert init.state is State.RUNNING
        assert env.fake.live_pids("c1") == [pid]
        assert committed.checkpoint_id in env.checkpoints_of("c1")

    TaskWorld(tmp_path).run(body)


def test_manual_checkpoint_leave_running(tmp_path: Path) -> None:
    async def body(env: TaskEnv) -> None:
        pid = await env.run("c1", SLEEP, label="web")
        resp = await env.cedana_checkpoint("c1", leave_running=True)
        assert (resp.label, resp.scope) == ("web", NAMESPACE)
        assert resp.size > 0
        assert env.checkpoints_of("web") == [resp.checkpoint_id]
        (committed,) = env.events.of(cedana_pb.CheckpointCommitted)
        assert (committed.checkpoint_id, committed.reason) == (resp.checkpoint_id, "manual")
        assert env.container("c1").init.state is State.RUNNING
        assert env.fake.live_pids("c1") == [pid]
        assert env.fake.status("c1") == "running"  # thawed after the dump
        assert not env.events.of(ev.TaskExit)

    TaskWorld(tmp_path).run(body)


def test_manual_checkpoint_and_stop(tmp_path: Path) -> None:
    async def body(env: TaskEnv) -> None:
        pid = await env.run("c1", SLEEP, label="web")
        resp = await env.cedana_checkpoint("c1", leave_running=False)
        assert env.checkpoints_of("web") == [resp.checkpoint_id]
        assert (await env.wait("c1")).exit_status == 143
        exit_event = await env.exit_event("c1")
        assert (exit_event.pid, exit_event.exit_status) == (pid, 143)
        (committed,) = env.events.of(cedana_pb.CheckpointCommitted)
        assert committed.reason == "manual"
        assert env.fake.live_pids() == []

    TaskWorld(tmp_path).run(body)


def test_manual_checkpoint_of_a_paused_container_leaves_it_paused(tmp_path: Path) -> None:
    async def body(env: TaskEnv) -> None:
        pid = await env.run("c1", SLEEP, label="web")
        await env.pause("c1")
        resp = await env.cedana_checkpoint("c1", leave_running=True)
        assert env.checkpoints_of("web") == [resp.checkpoint_id]
        assert env.container("c1").init.state is State.PAUSED
        assert env.fake.status("c1") == "paused"
        assert env.fake.live_pids("c1") == [pid]

    TaskWorld(tmp_path).run(body)


def test_a_checkpoint_asked_during_a_pause_waits_for_it(tmp_path: Path) -> None:
    # One lock per process: the checkpoint's change of state waits for the Pause's (it
    # once went RUNNING -> CHECKPOINTING between the Pause's check and its commit, and
    # the Pause failed with runc having paused the container).
    world = TaskWorld(tmp_path)
    world.fake.control(pause={"sleep": 1.0})

    async def body(env: TaskEnv) -> None:
        pid = await env.run("c1", SLEEP, label="web")
        pausing = asyncio.ensure_future(env.pause("c1"))
        await env.fake_called("pause")
        manual = asyncio.ensure_future(env.cedana_checkpoint("c1", leave_running=True))
        await pausing
        resp = await manual
        assert env.checkpoints_of("web") == [resp.checkpoint_id]
        assert env.container("c1").init.state is State.PAUSED
        assert env.fake.status("c1") == "paused"
        await env.resume("c1")
        assert env.container("c1").init.state is State.RUNNING
        assert env.fake.live_pids("c1") == [pid]

    world.run(body)


def test_a_pause_during_a_dump_is_refused_before_runc_pauses(tmp_path: Path) -> None:
    world = TaskWorld(tmp_path)
    world.fake.control(checkpoint={"sleep": 0.5})

    async def body(env: TaskEnv) -> None:
        await env.run("c1", SLEEP, label="web")
        manual = asyncio.ensure_future(env.cedana_checkpoint("c1", leave_running=True))
        await env.fake_called("checkpoint")
        with pytest.raises(FailedPrecondition, match="cannot pause container c1 in checkpointing"):
            await env.pause("c1")
        await manual
        assert env.container("c1").init.state is State.RUNNING
        assert env.fake.status("c1") == "running"

    world.run(body)


def test_sigkill_abandons_a_manual_checkpoint_with_a_clear_error(tmp_path: Path) -> None:
    world = TaskWorld(tmp_path)
    world.fake.control(checkpoint={"sleep": 30})

    async def body(env: TaskEnv) -> None:
        await env.run("c1", SLEEP, label="web")
        checkpointing = asyncio.ensure_future(env.cedana_checkpoint("c1", leave_running=True))
        await env.fake_called("checkpoint")
        assert env.container("c1").init.state is State.CHECKPOINTING
        await env.kill("c1", signal.SIGKILL)
        assert (await env.wait("c1")).exit_status == 137
        with pytest.raises(Aborted, match="c1"):
            await checkpointing
        assert env.checkpoints_of("web") == []
        assert env.store.reader.in_flight(NAMESPACE, "web") == []

    world.run(body)


def test_sigterm_during_a_checkpoint_stops_after_it(tmp_path: Path) -> None:
    world = TaskWorld(tmp_path)
    world.fake.control(checkpoint={"sleep": 0.2})

    async def body(env: TaskEnv) -> None:
        await env.run("c1", SLEEP, label="web")
        manual = asyncio.ensure_future(env.cedana_checkpoint("c1", leave_running=True))
        await env.fake_called("checkpoint")
        await env.kill("c1", signal.SIGTERM)  # dumps run one at a time: this one waits
        first = (await manual).checkpoint_id
        assert (await env.wait("c1")).exit_status == 143
        reasons = [c.reason for c in env.events.of(cedana_pb.CheckpointCommitted)]
        assert reasons == ["manual", "stop"]
        assert env.checkpoints_of("web")[1] == first

    world.run(body)


def test_exec_during_a_checkpoint_runs_after_the_freeze(tmp_path: Path) -> None:
    world = TaskWorld(tmp_path)
    world.fake.control(checkpoint={"sleep": 0.2})

    async def body(env: TaskEnv) -> None:
        await env.run("c1", SLEEP, env=["CEDANA_ENABLE=1"])
        manual = asyncio.ensure_future(env.cedana_checkpoint("c1", leave_running=True))
        await env.fake_called("checkpoint")
        # The container reads as running (an exec liveness probe, say) while it is
        # frozen for the dump.
        assert (await env.state("c1")).status == types.RUNNING
        await env.exec("c1", "probe", ["sh", "-c", "exit 0"])
        await env.start("c1", "probe")
        assert (await env.wait("c1", "probe")).exit_status == 0
        await manual

    world.run(body)


def test_sigterm_without_a_label_is_just_a_signal(tmp_path: Path) -> None:
    async def body(env: TaskEnv) -> None:
        await env.run("c1", SLEEP, env=["CEDANA_ENABLE=1"])
        await env.kill("c1", signal.SIGTERM)
        assert (await env.wait("c1")).exit_status == 143
        assert env.fake.calls("checkpoint") == []
        assert env.checkpoints_of("c1") == []

    TaskWorld(tmp_path).run(body)


def test_checkpoint_timeout_says_so(tmp_path: Path) -> None:
    world = TaskWorld(tmp_path)
    world.node_config = replace(world.node_config, checkpoint_timeout=0.2)
    world.fake.control(checkpoint={"sleep": 30})

    async def body(env: TaskEnv) -> None:
        pid = await env.run("c1", SLEEP, label="web")
        with pytest.raises(ShimError, match=r"c1.*0\.2") as info:
            await env.cedana_checkpoint("c1", leave_running=True)
        assert info.value.code is Code.DEADLINE_EXCEEDED
        (failed,) = env.events.of(cedana_pb.CheckpointFailed)
        assert "0.2" in failed.error
        assert env.container("c1").init.state is State.RUNNING
        assert env.fake.status("c1") == "running"  # thawed
        assert env.fake.live_pids("c1") == [pid]

    world.run(body)


def test_task_api_checkpoint_lands_in_the_store_and_the_image_path(tmp_path: Path) -> None:
    async def body(env: TaskEnv) -> None:
        pid = await env.run("c1", SLEEP, label="web")
        images = tmp_path / "ctr-images"
        req = pb.CheckpointTaskRequest(id="c1", path=str(images))
        await env.service.checkpoint(req, ctx("Checkpoint"))
        (committed,) = env.events.of(cedana_pb.CheckpointCommitted)
        assert committed.reason == "task-api"
        assert env.checkpoints_of("web") == [committed.checkpoint_id]
        assert (images / PAGES_IMAGE).exists()
        assert env.container("c1").init.state is State.RUNNING
        assert env.fake.live_pids("c1") == [pid]

    TaskWorld(tmp_path).run(body)


def test_manual_checkpoint_of_a_container_that_did_not_opt_in(tmp_path: Path) -> None:
    async def body(env: TaskEnv) -> None:
        await env.run("c1", SLEEP)
        with pytest.raises(FailedPrecondition, match=r"c1 has not opted in.*CEDANA_ENABLE=1"):
            await env.cedana_checkpoint("c1", leave_running=True)
        assert env.fake.calls("checkpoint") == []

    TaskWorld(tmp_path).run(body)


def test_restore_waits_for_a_checkpoint_of_its_label_being_written(tmp_path: Path) -> None:
    world = TaskWorld(tmp_path)
    world.fake.control(checkpoint={"sleep": 0.3})

    async def body(env: TaskEnv) -> None:
        await env.run("old", COUNTER, label="web")
        await env.until(lambda: env.fake.memory("old") == "1", "the counter to start")
        env.fake.set_memory("old", "7")
        await env.kill("old", signal.SIGTERM)
        await env.fake_called("checkpoint")
        assert env.checkpoints.writing(NAMESPACE, "web")

        await env.create("new", COUNTER, label="web")  # waits for the stop's checkpoint
        (committed,) = env.events.of(cedana_pb.CheckpointCommitted)
        assert env.container("new").init.state is State.RESTORE_PENDING
        pid = await env.start("new")
        outcomes = env.events.of(cedana_pb.RestoreOutcome)
        assert [(o.container_id, o.outcome) for o in outcomes] == [
            ("old", "cold"),  # nothing to restore when it was created
            ("new", "restored"),
        ]
        assert outcomes[1].checkpoint_id == committed.checkpoint_id
        await env.until(lambda: env.fake.memory("new") == "8", "the counter to go on")
        assert env.fake.live_pids("new") == [pid]
        assert (await env.wait("old")).exit_status == 143

    world.run(body)


def test_delete_after_the_daemon_died_mid_stop_delivers_the_signal(tmp_path: Path) -> None:
    """The daemon dies while a stop checkpoint is still being dumped: the container is
    frozen and nothing is durable. containerd's `delete` command (a fresh process, run
    here on the bundle as containerd would) thaws it and delivers the stop signal, so
    the application shuts down as it would have without us."""
    world = TaskWorld(tmp_path)
    world.fake.control(checkpoint={"sleep": 30})

    async def body(env: TaskEnv) -> None:
        ready = str(world.tmp / "ready")
        await env.run("c1", trap_term(7, ready), label="web")
        await env.file_exists(ready)
        bundle = env.container("c1").bundle
        await env.kill("c1", signal.SIGTERM)
        await env.fake_called("checkpoint")  # frozen, dumping
        assert read_stopping(bundle) == signal.SIGTERM
        assert env.fake.status("c1") == "paused"

        # What containerd runs, as a process of its own, once the daemon's socket is gone;
        # it finds runc through the bundle, as the production runc factory records it.
        BundleState(str(env.fake.binary), str(env.fake.root)).save(bundle)
        delete = env.reaper.spawn(
            [sys.executable, "-c", "import sys; from cedana_shim.cli.shim_main import main; "
             "sys.exit(main())", "-namespace", NAMESPACE, "-id", "c1", "-bundle", bundle,
             "delete"],
            cwd=bundle,
        )  # fmt: skip
        assert (await delete.wait()).status == 0
        assert (await env.wait("c1")).exit_status == 7  # its own SIGTERM handler ran
        assert read_stopping(bundle) is None
        sent = [call for call in env.fake.calls("kill") if call[-1] == "15"]
        assert sent and sent[0][-2:] == ["c1", "15"]
        assert "resume" in env.fake.verbs()
        # This "dead" daemon is the test: its dump, of a process gone by now, is given up.
        container = env.container("c1")
        assert container.cr is not None
        await container.cr.abort(container.init)

    world.run(body)
