"""Restores of a labelled container on the fake runc, from a real store in tmp_path:
the newest checkpoint, the fallback to older ones (a failing restore, raw images that
fail their check, a timeout, a prerestore hook's veto), a cold start, a damaged
store, and a Kill during a slow restore."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from dataclasses import replace
from pathlib import Path

import pytest
from cedana_shim.api.cedana.v1 import cedana_pb2 as cedana_pb
from cedana_shim.api.containerd.events import task_pb2 as ev
from cedana_shim.api.containerd.types import task_pb2 as types
from cedana_shim.checkpoint.layers import CRIU_LAYER
from cedana_shim.errors import Aborted
from cedana_shim.hooks import Stage
from cedana_shim.lifecycle.process import State
from fakes.fake_runc import PAGES_IMAGE
from task_support import COUNTER, TaskEnv, TaskWorld

LABEL = "web"


async def two_checkpoints(env: TaskEnv, *, newest_bad: bool = False) -> tuple[str, str]:
    """(older, newer) checkpoints of LABEL, taken with the counter at 10 and at 20,
    and compacted; the container they came from is gone."""
    await env.run("src", COUNTER, label=LABEL)
    await env.until(lambda: env.fake.memory("src") == "1", "the counter to start")
    env.fake.set_memory("src", "10")
    older = (await env.cedana_checkpoint("src", leave_running=True)).checkpoint_id
    env.fake.set_memory("src", "20")
    if newest_bad:
        env.fake.control(checkpoint={"bad_images": True})
    newer = (await env.cedana_checkpoint("src", leave_running=True)).checkpoint_id
    env.fake.control()
    await env.kill("src", signal.SIGKILL)
    await env.wait("src")
    await env.delete("src")
    await env.checkpoints.drain(5.0)
    assert env.checkpoints_of(LABEL) == [newer, older]
    env.events.events.clear()
    return older, newer


async def counter_reaches(env: TaskEnv, container_id: str, value: str) -> None:
    await env.until(lambda: env.fake.memory(container_id) == value, f"the counter at {value}")


def outcome_of(env: TaskEnv, container_id: str) -> cedana_pb.RestoreOutcome:
    (outcome,) = [o for o in env.events.of(cedana_pb.RestoreOutcome)
                  if o.container_id == container_id]  # fmt: skip
    return outcome


def test_restores_the_newest_checkpoint(tmp_path: Path) -> None:
    async def body(env: TaskEnv) -> None:
        _, newer = await two_checkpoints(env)
        assert await env.create("c1", COUNTER, label=LABEL) == 0  # nothing runs before Start
        assert (await env.state("c1")).status == types.CREATED
        assert len(env.fake.calls("create")) == 1  # src's only

        pid = await env.start("c1")
        await counter_reaches(env, "c1", "21")  # the checkpoint's 20, and on
        assert env.fake.live_pids("c1") == [pid]
        assert [e.pid for e in env.events.of(ev.TaskStart)] == [pid]
        state = await env.state("c1")
        assert (state.status, state.pid) == (types.RUNNING, pid)
        outcome = outcome_of(env, "c1")
        assert (outcome.outcome, outcome.checkpoint_id, outcome.label) == (
            "restored", newer, LABEL,
        )  # fmt: skip
        assert len(env.fake.calls("restore")) == 1

        await env.kill("c1", signal.SIGKILL)
        assert (await env.wait("c1")).exit_status == 137

    TaskWorld(tmp_path).run(body)


def test_newest_failing_falls_back_to_the_older(tmp_path: Path) -> None:
    async def body(env: TaskEnv) -> None:
        older, newer = await two_checkpoints(env, newest_bad=True)
        await env.create("c1", COUNTER, label=LABEL)
        pid = await env.start("c1")
        await counter_reaches(env, "c1", "11")
        assert env.fake.live_pids("c1") == [pid]
        assert [e.pid for e in env.events.of(ev.TaskStart)] == [pid]
        outcome = outcome_of(env, "c1")
        assert (outcome.outcome, outcome.checkpoint_id) == ("restored", older)
        assert f"{newer}: restore failed" in outcome.detail
        assert "criu: Error (criu/fake.c:1): the images are marked bad" in outcome.detail
        assert len(env.fake.calls("restore")) == 2
        # The failed attempt left nothing behind.
        assert env.fake.live_pids() == [pid]

    TaskWorld(tmp_path).run(body)


def test_damaged_raw_images_are_discarded_for_the_blob_of_the_same_checkpoint(
    tmp_path: Path,
) -> None:
    async def body(env: TaskEnv) -> None:
        _, newer = await two_checkpoints(env)
        raw = env.store.raw.raw_images(env.store.catalog.get(newer), CRIU_LAYER)
        assert raw is not None  # the newest keeps its raw images
        with open(os.path.join(raw, PAGES_IMAGE), "r+") as f:
            f.write("66")  # same size, other bytes: only the checksum can tell
        await env.create("c1", COUNTER, label=LABEL)
        pid = await env.start("c1")
        # The gate held the restored process; the check refused the raw images, and
        # the same checkpoint came back from its blob: 20, and on.
        await counter_reaches(env, "c1", "21")
        assert env.fake.live_pids() == [pid]
        outcome = outcome_of(env, "c1")
        assert (outcome.outcome, outcome.checkpoint_id) == ("restored", newer)
        assert f"{newer}: raw images discarded" in outcome.detail
        assert len(env.fake.calls("restore")) == 2
        assert env.store.raw.raw_images(env.store.catalog.get(newer), CRIU_LAYER) is None

    TaskWorld(tmp_path).run(body)


def test_restore_timeout_falls_back_and_says_why(tmp_path: Path) -> None:
    world = TaskWorld(tmp_path)
    world.node_config = replace(world.node_config, restore_timeout=0.15)

    async def body(env: TaskEnv) -> None:
        older, newer = await two_checkpoints(env)
        env.fake.control(restore={"sleep": 30})
        await env.create("c1", COUNTER, label=LABEL)
        pid = await env.start("c1")
        await counter_reaches(env, "c1", "1")  # both timed out: cold
        assert env.fake.live_pids() == [pid]
        outcome = outcome_of(env, "c1")
        assert outcome.outcome == "cold"
        for checkpoint_id in (newer, older):
            assert f"{checkpoint_id}: restore failed: " in outcome.detail
        assert outcome.detail.count("0.15") == 2  # how long it was given, for each

    world.run(body)


def test_every_checkpoint_failing_starts_cold(tmp_path: Path) -> None:
    async def body(env: TaskEnv) -> None:
        older, newer = await two_checkpoints(env)
        env.fake.control(restore={"error": "cannot restore pages"})
        await env.create("c1", COUNTER, label=LABEL)
        pid = await env.start("c1")
        await counter_reaches(env, "c1", "1")  # a fresh start: no memory
        assert env.fake.live_pids() == [pid]
        assert [e.pid for e in env.events.of(ev.TaskStart)] == [pid]
        outcome = outcome_of(env, "c1")
        assert (outcome.outcome, outcome.checkpoint_id) == ("cold", "")
        assert f"{newer}: restore failed" in outcome.detail
        assert f"{older}: restore failed" in outcome.detail
        assert outcome.detail.index(newer) < outcome.detail.index(older)
        assert len(env.fake.calls("restore")) == 2
        assert len(env.fake.calls("create")) == 2  # src's, and this cold one
        assert env.container("c1").init.state is State.RUNNING

    TaskWorld(tmp_path).run(body)


def test_damaged_store_starts_cold_and_says_why(tmp_path: Path) -> None:
    async def body(env: TaskEnv) -> None:
        await two_checkpoints(env)
        with open(os.path.join(env.config.store_path, "index.json"), "w") as f:
            f.write("{ this is not an index")
        pid = await env.create("c1", COUNTER, label=LABEL)
        assert pid > 0  # cold: created at Create, not at Start
        outcome = outcome_of(env, "c1")
        assert (outcome.outcome, outcome.checkpoint_id) == ("cold", "")
        assert "checkpoint store unusable" in outcome.detail
        assert await env.start("c1") == pid
        await counter_reaches(env, "c1", "1")
        assert env.fake.calls("restore") == []

    TaskWorld(tmp_path).run(body)


def test_kill_during_a_slow_restore_aborts_the_start(tmp_path: Path) -> None:
    async def body(env: TaskEnv) -> None:
        await two_checkpoints(env)
        env.fake.control(restore={"sleep": 30})
        await env.create("c1", COUNTER, label=LABEL)
        starting = asyncio.ensure_future(env.start("c1"))
        await env.fake_called("restore")
        assert env.container("c1").init.state is State.RESTORING

        started = time.monotonic()
        await env.kill("c1", signal.SIGTERM)
        with pytest.raises(Aborted, match="restore of container c1 abandoned"):
            await starting
        assert time.monotonic() - started < 3.0  # not the restore's 30 s
        assert (await env.wait("c1")).exit_status == 143
        exit_event = await env.exit_event("c1")
        assert exit_event.exit_status == 143
        assert not env.events.of(ev.TaskStart)
        assert env.fake.live_pids() == []
        assert env.fake.state("c1") is None
        assert (await env.delete("c1")).exit_status == 143

    TaskWorld(tmp_path).run(body)


def test_prerestore_veto_moves_to_the_next_candidate(tmp_path: Path) -> None:
    async def body(env: TaskEnv) -> None:
        older, newer = await two_checkpoints(env)
        env.hooks.vetoed.add(newer)
        env.hooks.calls.clear()
        await env.create("c1", COUNTER, label=LABEL)
        pid = await env.start("c1")
        await counter_reaches(env, "c1", "11")
        assert env.fake.live_pids("c1") == [pid]
        outcome = outcome_of(env, "c1")
        assert (outcome.outcome, outcome.checkpoint_id) == ("restored", older)
        assert f"{newer}: restore failed" in outcome.detail
        assert "vetoed by the test" in outcome.detail
        attempts = [(stage, state.checkpoint_id) for stage, state in env.hooks.calls]
        assert attempts == [
            (Stage.PRERESTORE, newer),  # vetoed: CRIU never ran for it
            (Stage.PRERESTORE, older),
            (Stage.POSTRESTORE, older),
        ]
        assert len(env.fake.calls("restore")) == 1
        assert env.hooks.calls[-1][1].pid == pid

    TaskWorld(tmp_path).run(body)


def test_prerestore_veto_of_every_candidate_starts_cold(tmp_path: Path) -> None:
    async def body(env: TaskEnv) -> None:
        await two_checkpoints(env)
        env.hooks.fail(Stage.PRERESTORE, "maintenance window")
        await env.create("c1", COUNTER, label=LABEL)
        pid = await env.start("c1")
        await counter_reaches(env, "c1", "1")
        outcome = outcome_of(env, "c1")
        assert (outcome.outcome, outcome.detail.count("maintenance window")) == ("cold", 2)
        assert env.fake.calls("restore") == []
        assert env.fake.live_pids() == [pid]

    TaskWorld(tmp_path).run(body)
