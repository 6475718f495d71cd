"""Lazy restores (node config lazy_restore) on the fake runc and its fake `criu
lazy-pages`, from a real store: restored lazily, the lazy path failing (the daemon does
not start, or dies once the tasks run) falls back to an eager restore of the same
checkpoint, raw memory pages that fail their check while they are served give the task
up for the blob, and a Kill while the pages still arrive leaves nothing behind. From
the registry (the remote store's real code over a shared directory): a bundle without
room for the raw pages gets the checkpoint pulled whole instead, and a Delete before
the Start drops what the Create staged. Real CRIU:
tests/integration/test_lazy_restore.py, test_lazy_across_nodes.py."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from dataclasses import replace
from pathlib import Path

import pytest
from cedana_shim.api.cedana.v1 import cedana_pb2 as cedana_pb
from cedana_shim.bundle_state import CRIU_GROUP_MARK
from cedana_shim.checkpoint.layers import CRIU_LAYER
from cedana_shim.errors import Aborted
from cedana_shim.lifecycle.process import State
from fakes.fake_runc import PAGES_IMAGE
from support.checkpoints import staging_dirs
from task_support import COUNTER, TaskEnv, TaskWorld
from test_lazy_pull import _little_room
from test_task_restore import LABEL, counter_reaches, two_checkpoints

LAZY = "--lazy-pages"


def lazy_world(tmp_path: Path) -> TaskWorld:
    world = TaskWorld(tmp_path)
    world.node_config = replace(world.node_config, lazy_restore=True)
    return world


def outcome_of(env: TaskEnv, container_id: str) -> cedana_pb.RestoreOutcome:
    (outcome,) = [o for o in env.events.of(cedana_pb.RestoreOutcome)
                  if o.container_id == container_id]  # fmt: skip
    return outcome


def restores(env: TaskEnv) -> list[bool]:
    """For each runc restore so far: was it lazy?"""
    return [LAZY in argv for argv in env.fake.calls("restore")]


def daemon_pids(env: TaskEnv) -> list[int]:
    return [int(p) for p in os.listdir("/proc") if p.isdigit() and _is_daemon(env, int(p))]


def _is_daemon(env: TaskEnv, pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            argv = f.read().split(b"\0")
        with open(f"/proc/{pid}/stat") as f:
            state = f.read().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return env.fake.criu.encode() in argv and b"lazy-pages" in argv and state not in "ZX"


def test_restores_lazily_and_waits_for_every_page(tmp_path: Path) -> None:
    async def body(env: TaskEnv) -> None:
        _, newer = await two_checkpoints(env)
        env.fake.control(**{"lazy-pages": {"sleep": 0.5}})  # pages still arriving
        await env.create("c1", COUNTER, label=LABEL)
        started = time.monotonic()
        pid = await env.start("c1")
        assert time.monotonic() - started >= 0.5  # Start returned once all were in
        await counter_reaches(env, "c1", "21")
        outcome = outcome_of(env, "c1")
        assert (outcome.outcome, outcome.checkpoint_id, outcome.detail) == (
            "restored", newer, "",
        )  # fmt: skip
        assert restores(env) == [True]
        (daemon,) = env.fake.calls("lazy-pages")
        work = daemon[daemon.index("--work-dir") + 1]
        (restore,) = env.fake.calls("restore")
        assert restore[restore.index("--work-path") + 1] == work  # its socket's dir
        assert env.fake.live_pids() == [pid] and daemon_pids(env) == []

    lazy_world(tmp_path).run(body)


def test_a_daemon_that_cannot_start_falls_back_to_an_eager_restore(tmp_path: Path) -> None:
    async def body(env: TaskEnv) -> None:
        _, newer = await two_checkpoints(env)
        env.fake.control(**{"lazy-pages": {"error": "uffd: not supported"}})
        await env.create("c1", COUNTER, label=LABEL)
        pid = await env.start("c1")
        await counter_reaches(env, "c1", "21")  # the same checkpoint
        outcome = outcome_of(env, "c1")
        assert (outcome.outcome, outcome.checkpoint_id) == ("restored", newer)
        assert f"{newer}: lazy restore failed, restoring eagerly: " in outcome.detail
        assert "uffd: not supported" in outcome.detail
        assert restores(env) == [False]  # runc never ran lazily
        assert env.fake.live_pids() == [pid] and daemon_pids(env) == []

    lazy_world(tmp_path).run(body)


def test_a_daemon_dying_once_the_tasks_run_kills_them_and_restores_eagerly(
    tmp_path: Path,
) -> None:
    async def body(env: TaskEnv) -> None:
        _, newer = await two_checkpoints(env)
        env.fake.control(**{"lazy-pages": {"sleep": 0.3, "die": "uffd: copy failed"}})
        await env.create("c1", COUNTER, label=LABEL)
        pid = await env.start("c1")
        await counter_reaches(env, "c1", "21")
        outcome = outcome_of(env, "c1")
        assert (outcome.outcome, outcome.checkpoint_id) == ("restored", newer)
        assert "before all memory was in" in outcome.detail
        assert "uffd: copy failed" in outcome.detail
        assert restores(env) == [True, False]
        # The lazily restored task was killed; only the eager one runs.
        assert env.fake.live_pids() == [pid] and daemon_pids(env) == []
        assert env.container("c1").init.state is State.RUNNING

    lazy_world(tmp_path).run(body)


def test_raw_pages_failing_their_check_while_served_give_the_task_up_for_the_blob(
    tmp_path: Path,
) -> None:
    async def body(env: TaskEnv) -> None:
        _, newer = await two_checkpoints(env)
        raw = env.store.raw.raw_images(env.store.catalog.get(newer), CRIU_LAYER)
        assert raw is not None
        with open(os.path.join(raw, PAGES_IMAGE), "r+") as f:
            f.write("66")  # same size, other bytes: only the checksum can tell
        env.fake.control(**{"lazy-pages": {"sleep": 2.0}})
        await env.create("c1", COUNTER, label=LABEL)
        started = time.monotonic()
        pid = await env.start("c1")
        # The pages check failed before the attempt was done (here, before runc even
        # ran: the file is tiny): it was given up at once, without waiting for the
        # daemon's last pages, and the blob of the same checkpoint restored lazily.
        assert time.monotonic() - started < 2 * 2.0
        await counter_reaches(env, "c1", "21")
        outcome = outcome_of(env, "c1")
        assert (outcome.outcome, outcome.checkpoint_id) == ("restored", newer)
        assert f"{newer}: raw images discarded" in outcome.detail
        last = env.fake.calls("restore")[-1]
        assert LAZY in last
        assert not last[last.index("--image-path") + 1].startswith(raw)  # the blob's
        assert env.fake.live_pids() == [pid] and daemon_pids(env) == []

    lazy_world(tmp_path).run(body)


def test_kill_while_the_pages_arrive_leaves_nothing_behind(tmp_path: Path) -> None:
    async def body(env: TaskEnv) -> None:
        await two_checkpoints(env)
        env.fake.control(**{"lazy-pages": {"sleep": 30}})
        await env.create("c1", COUNTER, label=LABEL)
        starting = asyncio.ensure_future(env.start("c1"))
        await counter_reaches(env, "c1", "21")  # running, its pages still arriving
        assert env.container("c1").init.state is State.RESTORING
        assert len(daemon_pids(env)) == 1

        started = time.monotonic()
        await env.kill("c1", signal.SIGKILL)
        with pytest.raises(Aborted, match="restore of container c1 abandoned"):
            await starting
        assert time.monotonic() - started < 5.0  # not the daemon's 30 s
        assert (await env.wait("c1")).exit_status == 137
        assert env.fake.live_pids() == [] and daemon_pids(env) == []
        assert not os.path.exists(os.path.join(env.container("c1").bundle, CRIU_GROUP_MARK))
        assert (await env.delete("c1")).exit_status == 137

    lazy_world(tmp_path).run(body)


# -- from the registry (lazy_remote.py): the remote store's real code over a shared dir --


async def only_in_the_registry(env: TaskEnv, tmp_path: Path) -> str:
    """The newer of two checkpoints, pushed to a registry and gone from the store: the
    next start of the label serves it from the registry."""
    _, newer = await two_checkpoints(env)
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o700)
    env.reconfigure(registry=str(shared))
    env.pipeline.delivery.remote().push(newer)
    env.store.maintenance.remove(newer)
    return newer


def test_a_delete_before_the_start_drops_the_served_checkpoints_staging(tmp_path: Path) -> None:
    async def body(env: TaskEnv) -> None:
        newer = await only_in_the_registry(env, tmp_path)
        await env.create("c1", COUNTER, label=LABEL)
        plan = env.container("c1").restore.plan  # type: ignore[union-attr]
        assert plan is not None and plan.served is not None and plan.entry.id == newer
        assert staging_dirs(env.store)  # its small blobs and eager pages, staged
        work = os.path.dirname(plan.work_dir)
        assert os.path.isdir(work)
        await env.delete("c1")  # never started
        # Before: the staging dir stayed until the shim exited.
        assert staging_dirs(env.store) == []
        assert not os.path.exists(work)
        assert restores(env) == [] and daemon_pids(env) == []

    lazy_world(tmp_path).run(body)


def test_no_room_for_the_raw_pages_pulls_the_checkpoint_whole(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    async def body(env: TaskEnv) -> None:
        newer = await only_in_the_registry(env, tmp_path)
        bundles = env.world.tmp / "bundles"
        _little_room(monkeypatch, bundles / "c1" / "work", 1 << 20)
        await env.create("c1", COUNTER, label=LABEL)
        plan = env.container("c1").restore.plan  # type: ignore[union-attr]
        assert plan is not None and plan.served is None  # pulled, then unpacked
        monkeypatch.undo()
        pid = await env.start("c1")
        await counter_reaches(env, "c1", "21")
        outcome = outcome_of(env, "c1")
        assert (outcome.outcome, outcome.checkpoint_id) == ("restored", newer)
        assert "lazy restore impossible, pulling it whole: " in outcome.detail
        assert f"restoring lazily checkpoint {newer} " in outcome.detail
        assert "from a full pull instead" in outcome.detail
        assert newer in env.checkpoints_of(LABEL)  # the full pull's
        assert env.fake.live_pids() == [pid] and staging_dirs(env.store) == []

    lazy_world(tmp_path).run(body)
