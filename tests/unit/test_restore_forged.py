"""A forged checkpoint in the registry, newer than the label's good ones (someone able
to push there made it), on the fake runc with the remote store's real code over a
shared directory: the start skips it and restores the newest good one; it is not left
in the store, the label's three good checkpoints stay, and the next start does not try
it first again."""

from __future__ import annotations

import os
from dataclasses import replace
from datetime import datetime, timedelta
from pathlib import Path

import pytest
import zstandard
from fakes.fake_runc import BAD_MARKER
from support.forged import Forged, forge, push_forged, with_member, zstd_bomb
from task_support import NAMESPACE, TaskEnv, TaskWorld
from test_restore_by_hand import LABEL, counter_reaches, create, outcome_of, three_checkpoints

MiB = 1 << 20


def _forged(env: TaskEnv, kind: str, checkpoint_id: str) -> Forged:
    """A copy of ``checkpoint_id`` an hour newer: its CRIU layer's tar a zstd bomb,
    refused at the pull (which unpacks that tar into the raw-image cache) or, with no
    cache to build, when the restore extracts it; or whole, with images CRIU refuses."""
    entry = env.store.catalog.get(checkpoint_id)
    assert entry.state == "compacted"
    newer = datetime.fromisoformat(entry.created) + timedelta(hours=1)
    if kind == "bad-images":
        tar = with_member(env.store, entry, BAD_MARKER, b"")
        blob = zstandard.ZstdCompressor().compress(tar)
        return forge(env.store, entry, newer, bomb=blob, tar_raw_size=len(tar))
    at_pull = kind == "bomb-at-pull"
    return forge(env.store, entry, newer, bomb=zstd_bomb(64 * MiB), raw_files=at_pull)


@pytest.mark.parametrize("kind", ["bomb-at-pull", "bomb-at-restore", "bad-images"])
def test_a_forged_newer_checkpoint_is_skipped_removed_and_tried_last_from_then_on(
    tmp_path: Path, kind: str
) -> None:
    async def body(env: TaskEnv) -> None:
        ids = await three_checkpoints(env)
        shared = tmp_path / "shared"
        shared.mkdir(mode=0o700)
        env.reconfigure(registry=str(shared))
        remote = env.pipeline.delivery.remote()
        forged = _forged(env, kind, ids[-1])
        tag = push_forged(remote.client, env.store, forged, "node-x", scope=NAMESPACE)
        assert [c.checkpoint_id for c in remote.candidates(NAMESPACE, LABEL)] == [forged.id]

        await create(env, "c1")
        await env.start("c1")
        await counter_reaches(env, "c1", "31")  # the newest good one, on from 30
        outcome = outcome_of(env, "c1")
        assert (outcome.outcome, outcome.checkpoint_id) == ("restored", ids[-1]), outcome
        assert f"{forged.id} (registry, from node node-x)" in outcome.detail or (
            f"{forged.id}: " in outcome.detail
        ), outcome.detail
        # Not left in the store (before: it stayed, the newest there); the good ones stay.
        assert env.checkpoints_of(LABEL) == list(reversed(ids))
        assert not os.path.exists(os.path.join(env.store.root, "raw", forged.id))
        record = env.store.failure_records.failures()[forged.id]
        assert record.tag == tag.tag and record.why, record

        await env.kill("c1", 9)
        await env.wait("c1")
        await env.delete("c1")
        env.events.events.clear()
        await create(env, "c2")
        await env.start("c2")
        await counter_reaches(env, "c2", "31")
        outcome = outcome_of(env, "c2")
        # The forged tag is still in the registry; it comes after the good ones now.
        assert (outcome.outcome, outcome.checkpoint_id, outcome.detail) == (
            "restored", ids[-1], "",
        ), outcome  # fmt: skip
        assert env.checkpoints_of(LABEL) == list(reversed(ids))

    world = TaskWorld(tmp_path)
    # Three checkpoints, a pull and two restores: room for a busy machine.
    world.node_config = replace(world.node_config, checkpoint_timeout=60, restore_timeout=60)
    world.run(body, timeout=180)
