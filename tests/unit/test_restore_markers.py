"""A start waits for the label's newest checkpoint only while another node is really
pushing it: not for a marker dated in the future, nor for one its pusher stopped
refreshing (a failed push, a dead pusher); for a live one, still. On the fake runc,
the remote store's real code over a shared directory."""

from __future__ import annotations

import asyncio
import logging
import threading
from dataclasses import replace
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from cedana_shim.checkpoint.remote.shared_dir import SharedDirectory
from task_support import NAMESPACE, TaskEnv, TaskWorld
from test_remote_markers import put_marker
from test_restore_by_hand import LABEL, counter_reaches, create, outcome_of, three_checkpoints

WAIT = 30.0  # label_wait_timeout here: what a start would have waited before
WAITING = "waiting for a checkpoint of the label being written"


def _registry(env: TaskEnv, tmp_path: Path) -> SharedDirectory:
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o700)
    env.reconfigure(registry=str(shared), label_wait_timeout=WAIT)
    return SharedDirectory(str(shared))


def _world(tmp_path: Path) -> TaskWorld:
    world = TaskWorld(tmp_path)
    # checkpoint_timeout as shipped: what bounded the age of a marker a start waited for.
    world.node_config = replace(world.node_config, checkpoint_timeout=600, restore_timeout=60)
    return world


@pytest.mark.parametrize("marker", ["future", "stale"])
def test_a_start_does_not_wait_for_a_marker_of_no_live_push(
    tmp_path: Path, marker: str, caplog: pytest.LogCaptureFixture
) -> None:
    async def body(env: TaskEnv) -> None:
        ids = await three_checkpoints(env)
        client = _registry(env, tmp_path)
        now = datetime.now(UTC)
        if marker == "future":  # a day ahead: its checkpoint, its start, its heartbeat
            day = now + timedelta(days=1)
            put_marker(client, day, started=day, heartbeat=day, scope=NAMESPACE, label=LABEL)
        else:  # a push that failed five minutes ago and left it (under checkpoint_timeout)
            ago = now - timedelta(minutes=5)
            put_marker(client, now, started=ago, heartbeat=ago, scope=NAMESPACE, label=LABEL)
        with caplog.at_level(logging.INFO, logger="cedana_shim.checkpoint.restore"):
            await create(env, "c1")
        await env.start("c1")
        await counter_reaches(env, "c1", "31")
        outcome = outcome_of(env, "c1")
        # Before: the Create waited the whole label_wait_timeout, then said so here.
        assert (outcome.outcome, outcome.checkpoint_id, outcome.detail) == (
            "restored", ids[-1], "",
        ), outcome  # fmt: skip
        assert WAITING not in caplog.text

    _world(tmp_path).run(body, timeout=WAIT + 60)


def test_a_start_waits_for_a_push_whose_pusher_keeps_its_marker_fresh(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async def body(env: TaskEnv) -> None:
        ids = await three_checkpoints(env)
        client = _registry(env, tmp_path)
        created = started = datetime.now(UTC)
        ended = threading.Event()

        def beat() -> None:
            put_marker(client, created, started=started, heartbeat=datetime.now(UTC),
                       scope=NAMESPACE, label=LABEL)  # fmt: skip

        def pusher() -> None:  # another node's push, beating as RemoteStore.push does
            while not ended.wait(0.2):
                beat()

        beat()  # the push has begun before the container starts

        beating = threading.Thread(target=pusher, daemon=True)
        beating.start()
        try:
            with caplog.at_level(logging.INFO, logger="cedana_shim.checkpoint.restore"):
                creating = asyncio.ensure_future(create(env, "c1"))
                await env.until(lambda: WAITING in caplog.text, "the Create to wait", timeout=30)
                assert not creating.done()
        finally:
            ended.set()  # the push ends without its tag (it failed): its marker goes
            beating.join()
        repo = client.repository_for(NAMESPACE)
        for tag in [t for t in client.list_tags(repo) if t.endswith(".pending")]:
            client.delete_manifest(repo, client.get_manifest(repo, tag)[2])
        await creating
        await env.start("c1")
        await counter_reaches(env, "c1", "31")
        outcome = outcome_of(env, "c1")
        assert (outcome.outcome, outcome.checkpoint_id) == ("restored", ids[-1]), outcome

    _world(tmp_path).run(body, timeout=WAIT + 60)
