"""Dirty-page tracking on a kernel that tracks (CONFIG_MEM_SOFT_DIRTY), with periodic
checkpoints: the second dump of a container writes only the pages written since the
first, takes the rest from its parent, and the checkpoint it stores stands alone.

The workload is fixtures/dirtier.c: 128 MiB written at start, then on request 10 % of
its pages (SIGUSR1) or a check of every page (SIGUSR2). The figures (pages, CRIU's and
the shim's frozen times, their ratios) are printed at the end of the run.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest
from integration.harness.config import CTR_NAMESPACE
from integration.harness.containerd import Containerd
from integration.harness.cr_events import TOPIC_EXIT, EventStream
from integration.harness.cr_support import ShimLog, Workloads, restored_from, wait_compacted
from integration.harness.ctr import Ctr
from integration.harness.fixtures import build_static
from integration.harness.util import wait_for

from .nodes import TIMEOUT, Figures

NewId = Callable[[str], str]
MIB = 128
PERCENT = 10
# Seconds between a periodic checkpoint's end and the next one's start: the first
# one's compaction (~36 s here for 128 MiB), then the writes, must fit in it.
INTERVAL = 60
# The frozen time of the tracked dump's memory against the full one's, 10 % dirty.
TARGET_RATIO = 0.3


@pytest.fixture(scope="module")
def dirtier(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_static("dirtier", tmp_path_factory.mktemp("dirtier"))


def _frozen(record: dict[str, object]) -> float:
    """How long the shim kept the container frozen: the freeze, CRIU's dump and the
    capture of its files (it thaws right after)."""
    phases = record["phases"]
    assert isinstance(phases, dict), record
    return float(sum(phases.get(p, 0.0) for p in ("gpu", "freeze", "dump", "rootfs")))


def test_the_second_periodic_dump_takes_unchanged_pages_from_its_parent(
    containerd: Containerd, ctr: Ctr, new_id: NewId, dirtier: Path, figures: Figures
) -> None:
    label = f"dirty-{uuid.uuid4().hex[:8]}"
    mount = f"type=bind,src={dirtier},dst=/dirtier,options=rbind:ro"
    log = ShimLog(containerd)
    with (
        EventStream(containerd.socket) as events,
        Workloads(
            containerd, new_id, label=label, script=f"exec /dirtier {MIB} {PERCENT}",
            namespace=CTR_NAMESPACE,
        ) as w,
    ):  # fmt: skip
        env = ("--env", f"CEDANA_CHECKPOINT_INTERVAL={INTERVAL}s", "--mount", mount)
        box = w.start("tracked", extra=env)
        wait_for(lambda: any(line.startswith("ready") for line in box.lines()), timeout=TIMEOUT)
        first = events.wait_commit(box.cid, timeout=INTERVAL + TIMEOUT)
        assert first.field("reason") == "periodic", first
        # As a periodic interval does: the parent is compacted before the next dump.
        wait_compacted(containerd.store, first.checkpoint_id, timeout=TIMEOUT)
        mark = events.mark()
        ctr("task", "kill", "-s", "SIGUSR1", box.cid)
        wait_for(lambda: "dirtied round=1" in " ".join(box.lines()), timeout=TIMEOUT)
        late = time.monotonic() - first.received
        assert late < INTERVAL, (
            f"the pages were written {late:.0f}s after the first checkpoint, later than the "
            f"next one may have begun ({INTERVAL}s): the guest is too slow for this test"
        )
        second = events.wait_commit(box.cid, timeout=INTERVAL + TIMEOUT, since=mark)
        assert second.field("reason") == "periodic", second

        full = log.wait("checkpoint committed", checkpoint=first.checkpoint_id)
        tracked = log.wait("checkpoint committed", checkpoint=second.checkpoint_id)
        full_criu, tracked_criu = full["criu"], tracked["criu"]
        assert full_criu["pages_skipped_parent"] == 0, full_criu
        pages = MIB * 256
        assert full_criu["pages_written"] >= pages, full_criu
        # The kernel tracks a transparent huge page as one: a little more than the
        # pages written is dirty.
        dirtied = pages * PERCENT // 100
        assert dirtied <= tracked_criu["pages_written"] < 2 * dirtied, tracked_criu
        assert tracked_criu["pages_skipped_parent"] >= pages - 2 * dirtied, tracked_criu
        memory_ratio = tracked_criu["memdump_s"] / full_criu["memdump_s"]
        criu_ratio = tracked_criu["frozen_s"] / full_criu["frozen_s"]
        shim_ratio = _frozen(tracked) / _frozen(full)
        figures.add(
            f"dirty tracking, {MIB} MiB, {PERCENT} % dirty: pages written "
            f"{full_criu['pages_written']} -> {tracked_criu['pages_written']} "
            f"({tracked_criu['pages_skipped_parent']} from the parent); CRIU's memory dump "
            f"{full_criu['memdump_s']:.2f} s -> {tracked_criu['memdump_s']:.2f} s (ratio "
            f"{memory_ratio:.2f}); CRIU frozen {full_criu['frozen_s']:.2f} s -> "
            f"{tracked_criu['frozen_s']:.2f} s (ratio {criu_ratio:.2f}); container frozen "
            f"{_frozen(full):.2f} s -> {_frozen(tracked):.2f} s (ratio {shim_ratio:.2f})"
        )
        # The part of the freeze that dirty tracking shortens. The whole freeze also
        # holds CRIU's work on everything else of the container (namespaces, mounts,
        # files), which the guest's emulated CPU makes ~15x longer than CRIU's on the
        # process alone, as long as this dump's memory: the figures above show it.
        assert memory_ratio <= TARGET_RATIO, (memory_ratio, full_criu, tracked_criu)
        assert criu_ratio < 1 and shim_ratio < 1, (criu_ratio, shim_ratio)

        # The tracked checkpoint, as stored, restores on its own (its parent's pages
        # copied in): a new container from exactly that one has every page right.
        ctr("task", "kill", "-s", "SIGKILL", box.cid)
        events.wait_topic(TOPIC_EXIT, box.cid, id=box.cid, timeout=60)
        w.delete(box)
        again = w.start(
            "restored", extra=("--env", f"CEDANA_RESTORE={second.checkpoint_id}", "--mount", mount)
        )
        restored_from(events, again, second.checkpoint_id)
        ctr("task", "kill", "-s", "SIGUSR2", again.cid)
        wait_for(
            lambda: [line for line in again.lines() if line.startswith("verified")],
            timeout=TIMEOUT,
            what="the restored dirtier's check of its pages",
        )
        assert "verified ok round=1" in again.lines(), again.lines()
        # The check ran in the restored process: a cold start would have said "ready".
        assert not [line for line in again.lines() if line.startswith("ready")], again.lines()
