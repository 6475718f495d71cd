"""Dirty-page tracking (checkpoint/dirty_tracking.py) on the fake runc: which dump names
which checkpoint as its parent, and what a failure on that path does. The kernel here
has no soft-dirty tracking, so these tests say the kernel has it; the flattening of a
real CRIU parent chain is tests/privileged/test_pagemap_flatten_real.py."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import pytest
from cedana_shim.checkpoint import pagemap
from cedana_shim.checkpoint.criu_config import config_path
from cedana_shim.checkpoint.dirty_tracking import DirtyTracking
from cedana_shim.checkpoint.layers import CRIU_LAYER
from cedana_shim.errors import DataLoss, ShimError
from cedana_shim.runtime.runc import Runc
from task_support import SLEEP, TaskEnv, TaskWorld


def _tracking(env: TaskEnv) -> None:
    env.pipeline.tracking = DirtyTracking("auto", available=True)


def _parent_of_dump(env: TaskEnv, n: int) -> str | None:
    """The raw images dir the ``n``th checkpoint call named as parent, resolved."""
    argv = env.fake.calls("checkpoint")[n]
    if "--parent-path" not in argv:
        return None
    relative = argv[argv.index("--parent-path") + 1]
    image = argv[argv.index("--image-path") + 1]
    return os.path.realpath(os.path.join(image, relative))


def _raw_dir(env: TaskEnv, checkpoint_id: str) -> str:
    """Where the store keeps the checkpoint's raw CRIU images (raw, or as the label's
    cache once compacted; a background compaction may already have dropped an older
    checkpoint's cache)."""
    return os.path.realpath(os.path.join(env.store.root, "raw", checkpoint_id, CRIU_LAYER))


async def _compacted(env: TaskEnv, checkpoint_id: str) -> str:
    """Once the background compaction of the checkpoint is done, as it is long before
    the next periodic checkpoint: a dump racing it may find the parent's raw images
    in flux and fall back to a full dump (what the fallback tests below cover)."""
    await env.until(lambda: env.store.catalog.get(checkpoint_id).state == "compacted", "compacted")
    return checkpoint_id


async def _tracked_with_a_checkpoint(env: TaskEnv) -> str:
    """Container c1 (label web) on a kernel said to track dirty pages, with one
    committed and compacted checkpoint; its id."""
    _tracking(env)
    await env.run("c1", SLEEP, label="web")
    return await _compacted(
        env, (await env.cedana_checkpoint("c1", leave_running=True)).checkpoint_id
    )


async def _kill(env: TaskEnv) -> None:
    await env.kill("c1", signal.SIGKILL)
    await env.wait("c1")


def _criu_config(env: TaskEnv, container_id: str) -> list[str]:
    bundle = env.container(container_id).bundle
    return Path(config_path(bundle)).read_text().splitlines()


def test_each_dump_names_the_previous_committed_one_as_its_parent(tmp_path: Path) -> None:
    async def body(env: TaskEnv) -> None:
        _tracking(env)
        await env.run("c1", SLEEP, label="web")
        first = (await env.cedana_checkpoint("c1", leave_running=True)).checkpoint_id
        assert "track-mem" in _criu_config(env, "c1")  # the soft-dirty bits cleared
        assert _parent_of_dump(env, 0) is None
        await _compacted(env, first)
        second = (await env.cedana_checkpoint("c1", leave_running=True)).checkpoint_id
        assert _parent_of_dump(env, 1) == _raw_dir(env, first)
        # The stored checkpoint stands alone: CRIU's link to its parent is gone.
        assert os.path.isdir(_raw_dir(env, second))
        assert not os.path.lexists(os.path.join(_raw_dir(env, second), "parent"))
        await _compacted(env, second)
        await env.kill("c1", signal.SIGTERM)  # the stop's dump too
        assert (await env.wait("c1")).exit_status == 143
        assert _parent_of_dump(env, 2) == _raw_dir(env, second)
        assert len(env.fake.calls("checkpoint")) == 3  # none of them done again in full
        assert len(env.checkpoints_of("web")) == 3

    TaskWorld(tmp_path).run(body)


def test_without_the_kernel_feature_every_dump_is_full(tmp_path: Path) -> None:
    async def body(env: TaskEnv) -> None:
        await env.run("c1", SLEEP, label="web")
        await env.cedana_checkpoint("c1", leave_running=True)
        await env.cedana_checkpoint("c1", leave_running=True)
        assert [_parent_of_dump(env, n) for n in range(2)] == [None, None]
        assert "track-mem" not in _criu_config(env, "c1")  # CRIU would refuse it
        await _kill(env)

    TaskWorld(tmp_path).run(body)


def test_a_dump_against_the_parent_that_fails_is_done_again_in_full(tmp_path: Path) -> None:
    async def body(env: TaskEnv) -> None:
        await _tracked_with_a_checkpoint(env)
        env.fake.control(checkpoint={"error_with_parent": "Hole not found in parent"})
        second = (await env.cedana_checkpoint("c1", leave_running=True)).checkpoint_id
        assert _parent_of_dump(env, 1) is not None
        assert _parent_of_dump(env, 2) is None  # the same checkpoint, in full
        assert env.checkpoints_of("web")[0] == second
        assert os.path.isdir(_raw_dir(env, second))
        assert not os.path.lexists(os.path.join(_raw_dir(env, second), "parent"))
        await _kill(env)

    TaskWorld(tmp_path).run(body)


def test_a_failed_checkpoint_leaves_no_parent_for_the_next(tmp_path: Path) -> None:
    async def body(env: TaskEnv) -> None:
        await _tracked_with_a_checkpoint(env)
        # This dump may have cleared the soft-dirty bits before it failed: what the
        # bits say is no longer relative to the first checkpoint.
        env.fake.control(checkpoint={"error": "no space for pages"})
        with pytest.raises(ShimError):
            await env.cedana_checkpoint("c1", leave_running=True)
        env.fake.control()
        await env.cedana_checkpoint("c1", leave_running=True)
        assert _parent_of_dump(env, 2) is None
        await _kill(env)

    TaskWorld(tmp_path).run(body)


def test_a_parent_whose_raw_images_are_gone_gives_a_full_dump(tmp_path: Path) -> None:
    async def body(env: TaskEnv) -> None:
        first = await _tracked_with_a_checkpoint(env)
        env.store.raw.discard_raw(env.store.catalog.get(first))
        await env.cedana_checkpoint("c1", leave_running=True)
        assert _parent_of_dump(env, 1) is None
        await _kill(env)

    TaskWorld(tmp_path).run(body)


def test_the_parent_belongs_to_the_same_processes() -> None:
    tracking = DirtyTracking("auto", available=True)
    tracking.remember("c1", 100, "ck1")
    assert tracking.take_parent("c1", 101) is None  # another init: not what CRIU tracked
    tracking.remember("c1", 100, "ck1")
    assert tracking.take_parent("c2", 100) is None
    assert tracking.take_parent("c1", 100) == "ck1"
    assert tracking.take_parent("c1", 100) is None  # taken: until the dump is committed


def test_off_never_asks_criu() -> None:
    runc = Runc(reaper=None, root="/nonexistent")  # type: ignore[arg-type]
    assert asyncio.run(DirtyTracking("off").available(runc)) is False


def _copy_fails(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuse(images_dir: str) -> None:
        raise DataLoss(f"{images_dir}/pagemap-1.img: page 0x1000 is in no run of parent")

    monkeypatch.setattr(pagemap, "flatten", refuse)


def test_a_copy_that_fails_fails_a_periodic_checkpoint_and_the_next_is_full(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def body(env: TaskEnv) -> None:
        await _tracked_with_a_checkpoint(env)
        with monkeypatch.context() as patch:
            _copy_fails(patch)
            # Thawed already: dumping again would pair later memory with earlier files.
            with pytest.raises(DataLoss, match="the next checkpoint is a full one"):
                await env.cedana_checkpoint("c1", leave_running=True)
        assert len(env.checkpoints_of("web")) == 1
        await env.cedana_checkpoint("c1", leave_running=True)
        assert [_parent_of_dump(env, n) is None for n in range(3)] == [True, False, True]
        await _kill(env)

    TaskWorld(tmp_path).run(body)


def test_a_copy_that_fails_on_a_stop_dumps_it_again_in_full(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def body(env: TaskEnv) -> None:
        await _tracked_with_a_checkpoint(env)
        _copy_fails(monkeypatch)
        await env.kill("c1", signal.SIGTERM)  # still frozen: the same instant, in full
        assert (await env.wait("c1")).exit_status == 143
        assert [_parent_of_dump(env, n) is None for n in range(3)] == [True, False, True]
        assert len(env.checkpoints_of("web")) == 2

    TaskWorld(tmp_path).run(body)
