"""Checkpoint/restore under faults: a SIGKILL racing the checkpoint-on-stop, the shim or
CRIU killed mid-dump, a full store disk (in the dump, in the compression), damaged
blobs, a rootfs diff crafted to escape the rootfs. In every case the store lists only
complete, verifiable checkpoints, and the next start restores the previous good one or
starts cold, saying why in the shim's log.

Versions: these tests run on containerd 1.6 and 2.1 only (FAULT_VERSIONS). What they
exercise is the shim's own machinery (its abort, fallback and commit paths, the store,
the restore planner); what containerd adds is how it reports an exit and cleans up after
a dead shim, which changed between the 1.x task manager (1.6 and 1.7 share it) and 2.x.
Each test starts a containerd of its own (`fresh_containerd`): they kill shims, mount a
tmpfs over the store, or damage it. The shared happy paths run on all three versions in
test_checkpoint_restore.py.

Also here: a checkpoint that verifies but whose CRIU images do not restore (Start falls
back), a SIGKILL during a slow restore, damage to one copy (blob or raw cache) of the
newest checkpoint, and the daemon surviving many checkpoints in a row.

Timing: a CRIU dump here lasts ~0.2-0.4 s and a commit of ~100 MiB ~0.2 s, too short
to hit by watching for it on a busy machine. The faults in the dump land while CRIU is
held at its post-dump step (all images written, CRIU not yet done) by an action script
added through the node config (`criu_hold`); the faults in the commit watch for its
staging dir. Afterwards the tests check from the shim's log and events that the fault
did land in the intended phase.
"""

from __future__ import annotations

import contextlib
import errno
import io
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import tarfile
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

import pytest
from cedana_shim.checkpoint.store import Entry
from cedana_shim.checkpoint.store.layout import RESERVED_METADATA_KEYS
from support.capabilities import OTHER_UID, prlimit_of_another_user_works

from .harness import procs
from .harness.config import CTR_NAMESPACE, SHIM_BIN_DIR
from .harness.containerd import Containerd
from .harness.cr_events import (
    TOPIC_COMMITTED,
    TOPIC_EXIT,
    TOPIC_FAILED,
    TOPIC_RESTORE,
    Event,
    EventStream,
)
from .harness.cr_support import (
    CRIU_LAYER,
    MEDIA_TYPES,
    ROOTFS_LAYER,
    Box,
    Counter,
    ShimLog,
    Workloads,
    assert_continues,
    blob_path,
    counter_script,
    criu_hold,
    criu_pids,
    entries,
    ingest_dirs,
    kill_all,
    open_store,
    restored_from,
    shim_pid,
    started_cold,
    stopped,
    store_is_sound,
    tmpfs_store,
    tree_bytes,
    unique_label,
    wait_compacted,
    wait_ticks,
)
from .harness.cr_tasks import TaskKiller
from .harness.fixtures import build_static
from .harness.util import wait_for

NewId = Callable[[str], str]
FAULT_VERSIONS = ("1.6", "2.1")
pytestmark = pytest.mark.ctrd_versions(*FAULT_VERSIONS)
COMMIT_TIMEOUT = 60
# Tens of MiB of memory so that a dump has real work; 40 idle children so that CRIU
# has a process tree to seize and walk (each adds parasite work): together they keep
# the dump running for a few hundred ms, long enough to hit on purpose.
MEM_KIB = 48 * 1024
CHILDREN = "for n in $(seq 40); do sleep 2147483647 & done\n"


def _stop_with_checkpoint(
    w: Workloads, box: Box, events: EventStream, *, ticks: int = 3
) -> tuple[Event, Counter]:
    """SIGTERM through ctr; the shim checkpoints; returns the commit and the final count."""
    wait_ticks(box.lines, count=ticks)
    w.ctr("task", "kill", "-s", "SIGTERM", box.cid)
    exited = events.wait_topic(TOPIC_EXIT, box.cid, timeout=30)
    assert exited.field("exit_status") == 143, exited
    committed = events.wait_commit(box.cid, timeout=COMMIT_TIMEOUT)
    w.delete(box)
    counted = box.ticks()
    assert counted is not None and "got-TERM" not in box.lines()
    return committed, counted


def _ids(containerd: Containerd, label: str) -> list[str]:
    return [e.id for e in entries(containerd.store, scope=CTR_NAMESPACE, label=label)]


def _wait_gone(pid: int, what: str, timeout: float = 30) -> None:
    wait_for(lambda: not procs.pid_alive(pid), timeout=timeout, what=what)


# -- SIGKILL during the checkpoint-on-stop --------------------------------------------------


def _wait_compression_over(store: Path, checkpoint_id: str) -> None:
    """Until the background compression of ``checkpoint_id`` is over: compacted, and its
    work dir removed (just after). The shim that took it does it, and under load is
    still at it when a later dump fails; that work dir is not the dump's."""
    wait_compacted(store, checkpoint_id)
    wait_for(
        lambda: (
            not [d for d in ingest_dirs(store) if d.name.startswith(f"compact-{checkpoint_id}-")]
        ),
        timeout=30,
        what=f"the compression of {checkpoint_id} to remove its work dir",
    )


def _second_incarnation(
    c: Containerd, w: Workloads, events: EventStream, ticks: int = 4
) -> tuple[Event, Counter, Box, int]:
    """Container "a" checkpointed on stop, then "b" restored from it and counting:
    (a's checkpoint, a's last count, b, b's shim pid): the stage every fault below
    interrupts."""
    good, counted = _stop_with_checkpoint(w, w.start("a"), events)
    b = w.start("b")
    restored_from(events, b, good.checkpoint_id)
    wait_ticks(b.lines, count=ticks)
    return good, counted, b, shim_pid(c, b)


def test_sigkill_while_the_stop_checkpoint_dumps(
    fresh_containerd: Containerd, new_id: NewId
) -> None:
    """`ctr task kill -s SIGKILL` (sent through the same Tasks API) while CRIU dumps the
    stopping container: the container dies with 137, the dump is abandoned, nothing is
    committed, and the next start restores the previous good checkpoint."""
    c = fresh_containerd
    log = ShimLog(c)
    script = counter_script(mem_kib=MEM_KIB, extra=CHILDREN)
    with (
        criu_hold(c, "post-dump") as hold,
        EventStream(c.socket) as events,
        Workloads(
            c, new_id, label=unique_label("kill"), script=script, namespace=CTR_NAMESPACE
        ) as w,
        TaskKiller(c.socket, CTR_NAMESPACE) as tasks,
    ):
        good, counted, b, shim = _second_incarnation(c, w, events)
        init = w.pid(b)

        hold.arm()
        tasks.kill(b.cid, signal.SIGTERM)
        hold.wait_held()
        dumping = criu_pids(shim)
        tasks.kill(b.cid, signal.SIGKILL)

        exited = events.wait_topic(TOPIC_EXIT, b.cid, timeout=30)
        assert exited.field("exit_status") == 137, exited
        failed = events.wait_topic(TOPIC_FAILED, b.cid, timeout=30)
        # What an abort reports: the SIGKILL landed while the dump ran.
        abandoned = (
            f"checkpoint of container {b.cid} abandoned: the container was killed while it "
            "was being dumped"
        )
        assert failed.field("error") == abandoned, failed
        assert failed.field("reason") == "stop"
        log.wait("checkpoint failed", container=b.cid, error=abandoned)
        assert not procs.pid_alive(init)
        wait_for(lambda: not criu_pids(shim), timeout=10, what=f"CRIU {dumping} to be gone")
        w.delete(b)
        _wait_gone(shim, "b's shim to exit")  # after this no commit can still be pending
        assert not events.of(TOPIC_COMMITTED, b.cid)
        assert _ids(c, w.label) == [good.checkpoint_id]
        _wait_compression_over(c.store, good.checkpoint_id)
        store_is_sound(c.store)
        assert not ingest_dirs(c.store), "the abandoned dump's staging dir was left behind"

        c3 = w.start("c")
        restored_from(events, c3, good.checkpoint_id)
        assert_continues(counted, wait_ticks(c3.lines, count=3), "restore after the SIGKILL")


# -- the shim itself killed -------------------------------------------------------------------


def test_shim_killed_during_the_dump(fresh_containerd: Containerd, new_id: NewId) -> None:
    """SIGKILL to the shim daemon while CRIU dumps: containerd cleans up the dead shim,
    the container is gone, the half-written dump is never listed (and is garbage for
    `Maintenance.gc`), and the next start restores the previous good checkpoint."""
    c = fresh_containerd
    log = ShimLog(c)
    script = counter_script(mem_kib=MEM_KIB, extra=CHILDREN)
    with (
        criu_hold(c, "post-dump") as hold,
        EventStream(c.socket) as events,
        Workloads(
            c, new_id, label=unique_label("shimdump"), script=script, namespace=CTR_NAMESPACE
        ) as w,
        TaskKiller(c.socket, CTR_NAMESPACE) as tasks,
    ):
        good, counted, b, shim = _second_incarnation(c, w, events)
        init = w.pid(b)

        hold.arm()
        tasks.kill(b.cid, signal.SIGTERM)
        hold.wait_held()
        dumping = criu_pids(shim)
        os.kill(shim, signal.SIGKILL)

        exited = events.wait_topic(TOPIC_EXIT, b.cid, timeout=30)
        assert exited.field("exit_status") in (137, 143), exited
        _wait_gone(init, "the container's init")
        wait_for(lambda: not any(procs.pid_alive(p) for p in dumping), timeout=30, what="CRIU")
        assert not events.of(TOPIC_COMMITTED, b.cid)
        assert not log.find("checkpoint committed", container=b.cid)
        w.ctr.remove(b.cid)
        assert _ids(c, w.label) == [good.checkpoint_id]
        _wait_compression_over(c.store, good.checkpoint_id)
        store_is_sound(c.store)
        # The dead shim's staging dir is unlocked garbage: gc reclaims it.
        leftovers = ingest_dirs(c.store)
        open_store(c.store).maintenance.gc()
        assert not ingest_dirs(c.store), f"gc left {ingest_dirs(c.store)} (was {leftovers})"

        c3 = w.start("c")
        restored_from(events, c3, good.checkpoint_id)
        assert_continues(counted, wait_ticks(c3.lines, count=3), "restore after the shim died")


# -- CRIU killed ------------------------------------------------------------------------------


def test_criu_killed_during_the_dump(fresh_containerd: Containerd, new_id: NewId) -> None:
    """SIGKILL to CRIU mid-dump: runc's checkpoint fails, the shim says why and falls
    back to delivering the SIGTERM (the workload's own handler runs: it was not left
    frozen), nothing is committed or left staged, and the previous checkpoint stays the
    one the next start restores."""
    c = fresh_containerd
    log = ShimLog(c)
    script = counter_script(mem_kib=MEM_KIB, extra=CHILDREN)
    with (
        criu_hold(c, "post-dump") as hold,
        EventStream(c.socket) as events,
        Workloads(
            c, new_id, label=unique_label("criu"), script=script, namespace=CTR_NAMESPACE
        ) as w,
        TaskKiller(c.socket, CTR_NAMESPACE) as tasks,
    ):
        good, counted, b, shim = _second_incarnation(c, w, events)

        hold.arm()
        tasks.kill(b.cid, signal.SIGTERM)
        held = hold.wait_held()
        # CRIU and the held script together: the script (CRIU's child) would keep
        # CRIU's socket to runc open, and runc waiting, as long as it runs.
        kill_all(criu_pids(shim) | {held})

        failed = events.wait_topic(TOPIC_FAILED, b.cid, timeout=30)
        assert "runc checkpoint failed" in str(failed.field("error")), failed
        why = log.wait("checkpoint on stop failed; stopping without it", container=b.cid)
        assert why["error"] == failed.field("error")
        exited = events.wait_topic(TOPIC_EXIT, b.cid, timeout=30)
        assert exited.field("exit_status") == 143, exited
        wait_for(lambda: "got-TERM" in b.lines(), timeout=10, what="the workload's TERM trap")
        assert not events.of(TOPIC_COMMITTED, b.cid)
        w.delete(b)
        assert _ids(c, w.label) == [good.checkpoint_id]
        _wait_compression_over(c.store, good.checkpoint_id)
        store_is_sound(c.store)
        assert not ingest_dirs(c.store), "the failed dump's staging dir was left behind"

        c3 = w.start("c")
        restored_from(events, c3, good.checkpoint_id)
        assert_continues(counted, wait_ticks(c3.lines, count=3), "restore after CRIU died")


# -- a full store disk ------------------------------------------------------------------------


def _fill(path: Path) -> None:
    """Write zeros until the filesystem is full."""
    chunk = bytes(1 << 20)
    with open(path, "wb", buffering=0) as f:
        while True:
            try:
                f.write(chunk)
            except OSError as exc:
                if exc.errno != errno.ENOSPC:
                    raise
                break
        while True:
            try:
                f.write(b"\0" * 4096)
            except OSError:
                break


@pytest.mark.parametrize("phase", ["dump", "compact"])
def test_full_store(fresh_containerd: Containerd, new_id: NewId, phase: str) -> None:
    """The store's disk fills up during a checkpoint-on-stop.

    - In the dump (CRIU's images do not fit: 8 MiB of tmpfs for ~43 MB of images): the
      container is thawed and gets its SIGTERM (its trap runs), the failure says the
      store is full, nothing is listed or left behind, the next start is cold.
    - In the compression that follows a durable stop (the disk is filled by the test
      the moment the compaction starts): nothing is lost. The checkpoint stays listed,
      uncompressed, the shim says why it could not compress it, and the next start
      resumes from it.
    (Filling up between the dump and the durable point: test_stop_durability.py.)"""
    c = fresh_containerd
    size_mib, mem_kib = (8, 32 * 1024) if phase == "dump" else (64, 16 * 1024)
    log = ShimLog(c)
    with (
        tmpfs_store(c, size_mib) as store,
        EventStream(c.socket) as events,
        Workloads(
            c, new_id, label=unique_label(f"full{phase}"), script=counter_script(mem_kib=mem_kib),
            namespace=CTR_NAMESPACE,
        ) as w,
    ):  # fmt: skip
        a = w.start("a")
        started_cold(events, a)
        wait_ticks(a.lines, count=3)
        shim = shim_pid(c, a)
        w.ctr("task", "kill", "-s", "SIGTERM", a.cid)
        if phase == "compact":
            compacting = wait_for(
                lambda: next(
                    (d for d in ingest_dirs(store) if d.name.startswith("compact-")), None
                ),
                timeout=20,
                interval=0.001,
                what="the compression to begin",
            )
            with stopped(shim):
                _fill(compacting / "filler")  # inside its work dir: the failure frees it
            committed = events.wait_commit(a.cid, timeout=COMMIT_TIMEOUT)
            exited = events.wait_topic(TOPIC_EXIT, a.cid, timeout=30)
            assert exited.field("exit_status") == 143, exited
            assert "got-TERM" not in a.lines()
            why = log.wait(
                "checkpoint compaction failed; it stays uncompressed",
                checkpoint=committed.checkpoint_id,
            )
            assert "No space left on device" in why["error"] or "is full" in why["error"], why
            counted = a.ticks()
            assert counted is not None
            w.delete(a)
            (entry,) = entries(store)
            assert (entry.id, entry.state) == (committed.checkpoint_id, "raw")
            store_is_sound(store)
            assert not ingest_dirs(store), "the failed compression's work dir fills the disk"
            b = w.start("b")
            restored_from(events, b, committed.checkpoint_id)
            assert_continues(counted, wait_ticks(b.lines, count=3), "resume from the raw one")
            return
        failed = events.wait_topic(TOPIC_FAILED, a.cid, timeout=COMMIT_TIMEOUT)
        exited = events.wait_topic(TOPIC_EXIT, a.cid, timeout=30)
        # The workload's own trap ran and exited 143: the shim delivered the SIGTERM.
        assert exited.field("exit_status") == 143, exited
        wait_for(lambda: "got-TERM" in a.lines(), timeout=10, what="the TERM trap")
        # The failure must say the disk is full, not only that something failed: in the
        # error the shim reports (the /cedana/checkpoint/failed event and its "checkpoint
        # failed" line). CRIU's own log excerpt does not count: CRIU writes that log into
        # the full store, so the line naming ENOSPC may itself be cut off.
        errors = [str(failed.field("error"))] + [
            str(r.get("error", "")) for r in log.find("checkpoint failed", container=a.cid)
        ]
        tails = [
            line
            for r in log.find("criu failed")
            for line in r.get("criu_log_tail") or []
            if "No space" in line
        ]
        assert any("No space left on device" in e or "is full" in e for e in errors), (
            f"the reported error does not say the store is full: {errors}; "
            f"CRIU's log excerpt says {tails or 'nothing about space either'}"
        )
        assert not events.of(TOPIC_COMMITTED, a.cid)
        w.delete(a)
        assert entries(store) == []
        assert not ingest_dirs(store), "the failed checkpoint's staging data fills the disk"
        assert tree_bytes(store) < 1 << 20, f"{tree_bytes(store)} bytes left in the store"

        b = w.start("b")
        outcome = started_cold(events, b)
        assert outcome.field("detail") == "no checkpoint for this label", outcome
        fresh = wait_ticks(b.lines, count=2)
        assert fresh.first == 1


# -- damaged blobs ---------------------------------------------------------------------------
#
# Once compressed, a checkpoint's CRIU images are kept uncompressed too for the newest
# checkpoint of each label (<store>/raw/<id>/criu, with a file list of sizes and CRC-32s);
# a restore runs CRIU from there and checks them in parallel, falling back to the
# verified blob of the same checkpoint. So "what a restore reads" is the blob, or for
# the newest checkpoint its raw copy. The tests wait for the compression first.


def _flip(path: Path) -> None:
    size = path.stat().st_size
    with open(path, "r+b") as f:
        f.seek(size // 2)
        byte = f.read(1)
        f.seek(size // 2)
        f.write(bytes([byte[0] ^ 0x01]))


def _cached_images(root: Path, entry: Entry) -> list[Path]:
    """The raw-cache copy of the checkpoint's CRIU images, biggest file first."""
    cached = root / "raw" / entry.id / CRIU_LAYER
    files = [p for p in cached.rglob("*") if p.is_file()] if cached.is_dir() else []
    return sorted(files, key=lambda p: p.stat().st_size, reverse=True)


def _damage(root: Path, entry: Entry, how: str) -> None:
    if how == "flip":
        # A bit flip in the CRIU layer blob, and no raw cache to read instead (the cache
        # "only ever saves time"; a damaged cache is the next test's subject).
        _flip(blob_path(root, entry.layer(CRIU_LAYER).digest))
        shutil.rmtree(root / "raw" / entry.id, ignore_errors=True)
    else:  # a rootfs-diff blob cut in half (not cached: always read from the blob)
        path = blob_path(root, entry.layer(ROOTFS_LAYER).digest)
        os.truncate(path, path.stat().st_size // 2)


@pytest.mark.parametrize(("how", "layer"), [("flip", CRIU_LAYER), ("truncate", ROOTFS_LAYER)])
def test_damaged_checkpoint_falls_back(
    fresh_containerd: Containerd, new_id: NewId, how: str, layer: str
) -> None:
    """With an older good checkpoint, a damaged newest one is skipped ("skipping
    checkpoint" names it) and the older one restored; once every one is damaged, the
    start is cold and says why."""
    c = fresh_containerd
    log = ShimLog(c)
    with (
        EventStream(c.socket) as events,
        Workloads(
            c, new_id, label=unique_label(how), script=counter_script(), namespace=CTR_NAMESPACE
        ) as w,
    ):
        older, at_older = _stop_with_checkpoint(w, w.start("a"), events)
        b = w.start("b")
        restored_from(events, b, older.checkpoint_id)
        newer, at_newer = _stop_with_checkpoint(w, b, events, ticks=5)
        assert at_newer.last > at_older.last + 3
        for done in (older, newer):  # the blobs to damage exist once compressed
            wait_compacted(c.store, done.checkpoint_id)
        listed = entries(c.store, label=w.label)
        assert [e.id for e in listed] == [newer.checkpoint_id, older.checkpoint_id]
        _damage(c.store, listed[0], how)

        c3 = w.start("c")
        outcome = restored_from(events, c3, older.checkpoint_id)
        assert newer.checkpoint_id in str(outcome.field("detail")), outcome
        skipped = log.wait("skipping checkpoint", checkpoint=newer.checkpoint_id)
        expected = "corrupt" if how == "flip" else "truncated"
        assert expected in skipped["error"] and layer in skipped["error"], skipped
        assert_continues(at_older, wait_ticks(c3.lines, count=3), "fallback to the older one")
        w.ctr("task", "kill", "-s", "SIGKILL", c3.cid)  # no checkpoint on SIGKILL
        events.wait_topic(TOPIC_EXIT, c3.cid, timeout=30)
        w.delete(c3)

        _damage(c.store, listed[1], how)
        d = w.start("d")
        outcome = started_cold(events, d)
        for ckpt in (newer, older):
            assert ckpt.checkpoint_id in str(outcome.field("detail")), outcome
        log.wait("skipping checkpoint", checkpoint=older.checkpoint_id)
        cold = log.wait("starting cold", container=d.cid)
        assert newer.checkpoint_id in cold["why"] and older.checkpoint_id in cold["why"]
        fresh = wait_ticks(d.lines, count=2)
        assert fresh.first == 1 and fresh.token != at_older.token


@pytest.mark.parametrize("where", ["cache", "blob"])
def test_damage_to_one_copy_of_the_newest_checkpoint(
    fresh_containerd: Containerd, new_id: NewId, where: str
) -> None:
    """One bit flipped in one of the two copies of the newest checkpoint's CRIU images:
    - in the raw cache: the digest check catches it, nothing restored from the damaged
      images may run (not even briefly: no output, no side effect), and the same
      checkpoint is restored from its verified blob;
    - in the blob: the restore reads the intact, digest-checked cache and succeeds.
    Either way the container resumes once, from the NEWEST checkpoint. The ticker prints
    every 5 ms: a process that ran from the damaged images, even for the few ms until
    the shim killed it, shows up in the container's log as a second incarnation."""
    c = fresh_containerd
    log = ShimLog(c)
    script = counter_script(mem_kib=16 * 1024, tick=0.005)
    with (
        EventStream(c.socket) as events,
        Workloads(
            c, new_id, label=unique_label(where), script=script, namespace=CTR_NAMESPACE
        ) as w,
    ):
        newest, counted = _stop_with_checkpoint(w, w.start("a"), events, ticks=40)
        wait_compacted(c.store, newest.checkpoint_id)
        entry = entries(c.store, label=w.label)[0]
        cached = _cached_images(c.store, entry)
        assert cached, f"no raw cache for the newest checkpoint under {c.store / 'raw'}"
        _flip(cached[0] if where == "cache" else blob_path(c.store, entry.layer(CRIU_LAYER).digest))

        b = w.start("b")
        outcome = restored_from(events, b, newest.checkpoint_id)
        after = wait_ticks(b.lines, count=40)
        if where == "cache":
            assert "raw images discarded" in str(outcome.field("detail")), outcome
            skipped = log.wait("skipping checkpoint", container=b.cid, checkpoint=entry.id)
            assert skipped["error"].startswith("raw images discarded"), skipped
            assert not _cached_images(c.store, entry), "the bad cache was kept"
            assert after.values[0] == after.values[-1] - len(after.values) + 1, (
                "the process restored from the damaged cached images ran before their "
                f"digests were checked: the log shows two incarnations, ticks {after.values}"
            )
        else:
            assert outcome.field("detail") == "", outcome
        assert_continues(counted, after, f"newest checkpoint, damaged {where} copy")


# -- a crafted rootfs diff --------------------------------------------------------------------


def _tar(path: Path, members: list[tuple[tarfile.TarInfo, bytes | None]]) -> Path:
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tar:
        for info, data in members:
            if data is not None:
                info.size = len(data)
                tar.addfile(info, fileobj=io.BytesIO(data))
            else:
                tar.addfile(info)
    return path


def _members_of(stream: BinaryIO) -> list[tuple[tarfile.TarInfo, bytes | None]]:
    """A diff's members in order, regular files with their contents."""
    members: list[tuple[tarfile.TarInfo, bytes | None]] = []
    with tarfile.open(fileobj=stream, mode="r|") as tar:
        for info in tar:
            data = tar.extractfile(info) if info.isreg() else None
            members.append((info, data.read() if data is not None else None))
    return members


def _member(name: str, kind: bytes = tarfile.REGTYPE, **attrs: object) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.mode = 0o644 if kind == tarfile.REGTYPE else 0o755
    info.mtime = int(time.time())
    for k, v in attrs.items():
        setattr(info, k, v)
    return info


def _commit_crafted(root: Path, source: Entry, criu_dir: Path, label: str, diff: Path) -> Entry:
    """A checkpoint like the shim's own (same CRIU images, same metadata) but with the
    given rootfs-diff tar, committed through the Store API."""
    store = open_store(root)
    metadata = {k: v for k, v in source.metadata.items() if k not in RESERVED_METADATA_KEYS}
    ingest = store.writer.begin(scope=source.scope, label=label, metadata=metadata)
    ingest.add_dir_layer(CRIU_LAYER, str(criu_dir), MEDIA_TYPES[CRIU_LAYER])
    ingest.add_file_layer(ROOTFS_LAYER, str(diff), MEDIA_TYPES[ROOTFS_LAYER])
    return store.commit(ingest)


def test_crafted_rootfs_diff_is_refused(
    fresh_containerd: Containerd, new_id: NewId, tmp_path: Path
) -> None:
    """Checkpoints whose rootfs-diff layer holds `../` paths, absolute paths, a device
    node or a path through a symlink are refused before anything is written: nothing
    lands outside (or inside) the new container's rootfs and it starts cold, with the
    checkpoint named in the log. Each crafted diff is the source checkpoint's own diff
    plus the crafted members, and a benign one built the same way restores, which
    proves the refusals are about those members and nothing else.

    The source's own diff has to be in there: CRIU's images name the files the
    processes had open, and those must be back in the rootfs. The counter holds
    /var/held open for ever, so this is so at every dump (under load the counter's
    /var/count.new, open for a moment each tick, made a diff of the crafted members
    alone fail to restore now and then); its capture is checked on the way."""
    c = fresh_containerd
    log = ShimLog(c)
    token = uuid.uuid4().hex[:12]
    host_targets = {
        "dotdot": Path(f"/tmp/cedana-dotdot-{token}"),
        "absolute": Path(f"/tmp/cedana-abs-{token}"),
        "symlink": Path(f"/tmp/cedana-sym-{token}"),
    }
    payload = f"escaped-{token}\n".encode()
    cases: dict[str, list[tuple[tarfile.TarInfo, bytes | None]]] = {
        "benign": [(_member(f"crafted-{token}"), payload)],
        "dotdot": [
            (_member(f"../cedana-dotdot-{token}"), payload),
            (_member("../" * 24 + f"tmp/cedana-dotdot-{token}"), payload),
        ],
        "absolute": [(_member(f"/tmp/cedana-abs-{token}"), payload)],
        "device": [(_member(f"dev-null-{token}", tarfile.CHRTYPE, devmajor=1, devminor=3), None)],
        "symlink": [
            (_member(f"esc-{token}", tarfile.SYMTYPE, linkname="/tmp"), None),
            (_member(f"esc-{token}/cedana-sym-{token}"), payload),
        ],
    }
    with (
        EventStream(c.socket) as events,
        Workloads(
            c,
            new_id,
            label=unique_label("src"),
            script=counter_script(extra="exec 3>/var/held; echo held >&3\n"),
            namespace=CTR_NAMESPACE,
        ) as w,
    ):
        src, at_src = _stop_with_checkpoint(w, w.start("src"), events)
        source = entries(c.store, label=w.label)[0]
        assert source.id == src.checkpoint_id
        criu_dir = tmp_path / "criu"
        open_store(c.store).reader.extract_layer(source, CRIU_LAYER, str(criu_dir))
        with open_store(c.store).reader.open_layer(source, ROOTFS_LAYER) as stream:
            own = _members_of(stream)
        held = [data for info, data in own if info.name == "var/held"]
        assert held == [b"held\n"], f"the file open at the dump is not in its diff: {own}"

        problems: list[str] = []
        for kind, members in cases.items():
            label = f"crafted-{kind}-{token[:6]}"
            diff = _tar(tmp_path / f"{kind}.tar", [*own, *members])
            crafted = _commit_crafted(c.store, source, criu_dir, label, diff)
            box = w.start(kind, label=label)
            outcome = events.wait_topic(TOPIC_RESTORE, box.cid, timeout=30)
            bundle = c.bundle(CTR_NAMESPACE, box.cid)
            if kind == "benign":
                if outcome.field("outcome") != "restored":
                    problems.append(f"benign crafted checkpoint not restored: {outcome.message}")
                else:
                    assert_continues(at_src, wait_ticks(box.lines, count=2), "crafted, benign")
                    got = w.ctr(
                        "task", "exec", "--exec-id", "probe", box.cid, "cat", f"/crafted-{token}"
                    )
                    if got.stdout.encode() != payload:
                        problems.append(f"benign file not applied: {got.stdout!r}")
            else:
                if outcome.field("outcome") != "cold" or crafted.id not in str(
                    outcome.field("detail")
                ):
                    problems.append(f"{kind}: not refused: {outcome.message}")
                skipped = log.find("skipping checkpoint", checkpoint=crafted.id)
                if not skipped:
                    problems.append(f"{kind}: no 'skipping checkpoint' naming {crafted.id}")
                if not log.find("starting cold", container=box.cid):
                    problems.append(f"{kind}: no 'starting cold' for {box.cid}")
                wait_ticks(box.lines, count=1)
                inside = w.ctr(
                    "task", "exec", "--exec-id", "probe", box.cid, "sh", "-c",
                    f"ls -a / /tmp | grep -e {token} || true",
                ).stdout  # fmt: skip
                if inside.strip():
                    problems.append(f"{kind}: crafted content inside the rootfs: {inside!r}")
                strays = [p.name for p in bundle.parent.rglob(f"*{token}*")]
                if strays:
                    problems.append(f"{kind}: crafted content next to the rootfs: {strays}")
            for target in host_targets.values():
                if target.exists() or target.is_symlink():
                    problems.append(f"{kind}: wrote {target} on the host")
                    with contextlib.suppress(OSError):
                        target.unlink()
            w.ctr.remove(box.cid)
        assert not problems, "\n".join(problems)
    assert not list(Path("/tmp").glob(f"*{token}*"))


# -- the daemon itself ------------------------------------------------------------------------


def test_shim_survives_many_checkpoints(fresh_containerd: Containerd, new_id: NewId) -> None:
    """Regression: every checkpoint (and every opted-in Create in a pod) reads the pod's
    network facts; pyroute2's netns helper was a fork of the shim that got a SIGTERM, and
    the child's copy of asyncio's signal wake-up fd made the daemon itself shut down
    (containers killed, checkpoint lost). Twelve on-demand leave-running checkpoints in
    a row (`cedana checkpoint`): the same daemon serves all of them, the workload keeps
    running and counting, and retention keeps the newest three."""
    c = fresh_containerd
    rounds = 12
    cedana = SHIM_BIN_DIR / "cedana"
    with (
        EventStream(c.socket) as events,
        Workloads(
            c, new_id, label=unique_label("many"), script=counter_script(), namespace=CTR_NAMESPACE
        ) as w,
    ):
        box = w.start("a")
        started_cold(events, box)
        wait_ticks(box.lines, count=2)
        shim = shim_pid(c, box)
        ids: list[str] = []
        for _ in range(rounds):
            out = subprocess.run(
                [
                    str(cedana), "checkpoint", box.cid, "--leave-running", "--namespace",
                    CTR_NAMESPACE, "--containerd-state", str(c.state), "--json",
                ],
                capture_output=True, text=True, timeout=60, check=False,
            )  # fmt: skip
            assert out.returncode == 0, (out.returncode, out.stdout, out.stderr)
            assert procs.pid_alive(shim), f"the shim died during checkpoint {len(ids) + 1}"
            doc = json.loads(out.stdout)
            assert (doc["label"], doc["namespace"], doc["leaveRunning"]) == (
                w.label,
                CTR_NAMESPACE,
                True,
            ), doc
            ids.append(doc["id"])
        committed = [e.checkpoint_id for e in events.of(TOPIC_COMMITTED, box.cid)]
        assert committed == ids
        assert all(e.field("reason") == "manual" for e in events.of(TOPIC_COMMITTED, box.cid))
        assert c.shim_pids(CTR_NAMESPACE, box.cid) == {shim}
        task = w.ctr.task(box.cid)
        assert task is not None and task.status == "RUNNING"
        before = box.ticks()
        assert before is not None
        wait_ticks(box.lines, count=len(before.values) + 3)
        assert _ids(c, w.label) == list(reversed(ids[-3:])), "retention keeps the newest 3"
        store_is_sound(c.store)


# -- what CRIU cannot dump, said before the freeze; why a dump failed, said after it ----------


@pytest.fixture(scope="module")
def fixture_bin(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("fixtures")
    build_static("io_uring_sleep", out)
    build_static("unix_ticker", out)
    return out


def _failed_record(c: Containerd, cid: str) -> dict[str, object]:
    """The failure record the shim left for the node agent (none runs here)."""
    records: list[dict[str, object]] = [
        json.loads(path.read_text()) for path in sorted((c.store / "ops").glob("*.json"))
    ]
    (record,) = [r for r in records if (r["container_id"], r["kind"]) == (cid, "checkpoint")]
    assert record["outcome"] == "failed", record
    return record


def _runc_calls(log: ShimLog, cid: str) -> list[str]:
    return [str(r.get("runc_verb")) for r in log.records() if r.get("container_id") == cid]


def _refused_stop(c: Containerd, w: Workloads, box: Box, log: ShimLog, events: EventStream) -> str:
    """SIGTERM to a container whose checkpoint the shim refuses before the freeze: the
    refusal is the error of the event, the log line and the failure record, nothing was
    paused or dumped, and the signal was delivered (exit 143 from the workload's own
    handler). The error."""
    w.ctr("task", "kill", "-s", "SIGTERM", box.cid)
    failed = events.wait_topic(TOPIC_FAILED, box.cid, timeout=30)
    error = str(failed.field("error"))
    assert failed.field("reason") == "stop"
    assert error.startswith(
        f"checkpoint of container {box.cid} refused, nothing was frozen: its process "
    ), error
    assert log.wait("checkpoint failed", container=box.cid)["error"] == error
    exited = events.wait_topic(TOPIC_EXIT, box.cid, timeout=30)
    assert exited.field("exit_status") == 143, exited
    wait_for(lambda: "got-TERM" in box.lines(), timeout=10, what="the workload's TERM handler")
    calls = _runc_calls(log, box.cid)
    assert "pause" not in calls and "checkpoint" not in calls, calls
    assert not log.find("criu failed", container=box.cid)
    assert _failed_record(c, box.cid)["detail"] == error
    assert not events.of(TOPIC_COMMITTED, box.cid)
    return error


def _status(pid: int, key: str) -> list[str]:
    """A field of /proc/<pid>/status; [] once the process is gone."""
    with contextlib.suppress(FileNotFoundError):
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith(f"{key}:"):
                return line.split()[1:]
    return []


def test_a_process_of_another_user_is_refused_at_once_without_cap_sys_resource(
    containerd: Containerd, new_id: NewId
) -> None:
    """A root init with a child running as uid 1000 (a database or web server dropping
    root). Where root may not read another user's resource limits (no CAP_SYS_RESOURCE
    in the bounding set, as on the machines this project is tested on) CRIU would fail
    with "Can't get rlimit 0: Operation not permitted" after the freeze: the stop fails
    at once instead, naming the process and the capability, and the SIGTERM is
    delivered. Where root may, the same container is checkpointed as any other."""
    c = containerd
    log = ShimLog(c)
    script = (
        "trap 'echo got-TERM; exit 143' TERM\n"
        f"echo 'app:x:{OTHER_UID}:{OTHER_UID}::/:/bin/sh' >> /etc/passwd\n"
        f"echo 'app:x:{OTHER_UID}:' >> /etc/group\n"
        "su app -c 'exec sleep 2147483647' &\n"
        "while :; do echo tick; sleep 0.2; done\n"
    )
    with (
        EventStream(c.socket) as events,
        Workloads(
            c, new_id, label=unique_label("otheruser"), script=script, namespace=CTR_NAMESPACE
        ) as w,
    ):
        box = w.start("a")
        wait_for(lambda: "tick" in box.lines(), timeout=20, what="the workload to run")
        init, uid = w.pid(box), str(OTHER_UID)
        (user,) = wait_for(
            lambda: [p for p in procs.descendants({init}) if _status(p, "Uid")[:1] == [uid]],
            timeout=10,
            what="the uid 1000 child",
        )
        if prlimit_of_another_user_works():
            w.ctr("task", "kill", "-s", "SIGTERM", box.cid)
            events.wait_commit(box.cid, timeout=COMMIT_TIMEOUT)
            assert events.wait_topic(TOPIC_EXIT, box.cid, timeout=30).field("exit_status") == 143
            assert "got-TERM" not in box.lines()
            return
        inside = _status(user, "NSpid")[-1]
        error = _refused_stop(c, w, box, log, events)
        assert error.startswith(
            f"checkpoint of container {box.cid} refused, nothing was frozen: its process "
            f"{user} (sleep, pid {inside} in the container) runs as uid 1000, gid 1000, "
        ), error
        assert "CAP_SYS_RESOURCE" in error and "bounding set" in error, error


def test_a_process_with_an_io_uring_is_refused_at_once(
    containerd: Containerd, new_id: NewId, fixture_bin: Path
) -> None:
    """CRIU cannot dump io_uring (it fails deep in the dump, after the freeze, with
    "send_fds failed"): a container whose init set up a ring fails its stop at once,
    naming the process, and gets its SIGTERM."""
    assert Path("/proc/sys/kernel/io_uring_disabled").read_text().strip() == "0", (
        "io_uring is disabled on this kernel (kernel.io_uring_disabled): this test needs it"
    )
    c = containerd
    log = ShimLog(c)
    mount = f"type=bind,src={fixture_bin / 'io_uring_sleep'},dst=/io_uring_sleep,options=rbind:ro"
    with (
        EventStream(c.socket) as events,
        Workloads(
            c, new_id, label=unique_label("uring"), script="exec /io_uring_sleep",
            namespace=CTR_NAMESPACE,
        ) as w,
    ):  # fmt: skip
        box = w.start("a", extra=("--mount", mount))
        ring = wait_for(
            lambda: next((line for line in box.lines() if line.startswith("ring ")), None),
            timeout=20,
            what="the ring",
        )
        init = w.pid(box)
        error = _refused_stop(c, w, box, log, events)
        assert error.startswith(
            f"checkpoint of container {box.cid} refused, nothing was frozen: its process "
            f"{init} (io_uring_sleep, pid 1 in the container) has an io_uring instance "
            f"(fd {ring.split()[1]}), and CRIU cannot checkpoint io_uring; "
        ), error


def test_a_failed_dump_says_criu_s_reason_and_keeps_its_log(
    containerd: Containerd, new_id: NewId, fixture_bin: Path, tmp_path: Path
) -> None:
    """A dump CRIU fails (one end of a unix stream connection whose other end is outside
    the container), asked for with `cedana checkpoint`: the CLI, the event, the
    "checkpoint failed" line and the failure record all carry CRIU's first error line
    (not runc's "criu failed: type NOTIFY errno 0", nor the error CRIU logs about its own
    fd limit without CAP_SYS_RESOURCE), and name a copy of CRIU's log in the store that
    is still there once the container is deleted."""
    c = containerd
    log = ShimLog(c)
    shared = tmp_path / "ext"
    shared.mkdir()
    mounts = (
        "--mount", f"type=bind,src={fixture_bin / 'unix_ticker'},dst=/ticker,options=rbind:ro",
        "--mount", f"type=bind,src={shared},dst={shared},options=rbind:rw",
    )  # fmt: skip
    script = counter_script(extra=f"/ticker stream {shared}/stream &\n")
    with (
        socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as server,
        EventStream(c.socket) as events,
        Workloads(
            c, new_id, label=unique_label("criureason"), script=script, namespace=CTR_NAMESPACE
        ) as w,
    ):
        server.bind(str(shared / "stream"))
        server.listen(1)
        box = w.start("a", extra=mounts)
        conn, _ = server.accept()
        with conn:
            wait_ticks(box.lines, count=2)
            out = subprocess.run(
                [
                    str(SHIM_BIN_DIR / "cedana"), "checkpoint", box.cid, "--namespace",
                    CTR_NAMESPACE, "--containerd-state", str(c.state),
                ],
                capture_output=True, text=True, timeout=120, check=False,
            )  # fmt: skip
            assert out.returncode != 0, (out.stdout, out.stderr)
            failed = events.wait_topic(TOPIC_FAILED, box.cid, timeout=30)
            error = str(failed.field("error"))
            reason = re.search(r"criu: (Error \(.*); criu log: (\S+)$", error)
            assert reason, error
            assert "Can't dump half of stream unix connection" in reason.group(1), error
            assert "NOTIFY" not in error and "RLIMIT_NOFILE" not in error, error
            assert error in out.stderr, out.stderr
            assert log.wait("checkpoint failed", container=box.cid)["error"] == error
            assert _failed_record(c, box.cid)["detail"] == error
            kept = Path(reason.group(2))
            assert kept.parent == c.store / "ops" / "criu-logs", kept
            assert 0 < kept.stat().st_size <= 64 << 10
            assert reason.group(1) in kept.read_text()
            # A stop asked for by the CLI that fails leaves the container running.
            task = w.ctr.task(box.cid)
            assert task is not None and task.status == "RUNNING", task
        w.ctr("task", "kill", "-s", "SIGKILL", box.cid)
        events.wait_topic(TOPIC_EXIT, box.cid, timeout=30)
        w.delete(box)
        assert not c.bundle(CTR_NAMESPACE, box.cid).exists()
        assert reason.group(1) in kept.read_text(), "the kept log went with the container"


# -- a checkpoint that verifies but does not restore -----------------------------------------


def test_failed_restore_falls_back_at_start(
    fresh_containerd: Containerd, new_id: NewId, tmp_path: Path
) -> None:
    """A checkpoint whose blobs all verify but whose CRIU images cannot be restored (no
    process tree image): `runc restore` fails at Start, the shim logs "skipping
    checkpoint" with "restore failed: ..." and falls back to the older checkpoint; with
    no other candidate it starts cold, and the cold container's stdout still reaches its
    log."""
    c = fresh_containerd
    log = ShimLog(c)
    with (
        EventStream(c.socket) as events,
        Workloads(
            c,
            new_id,
            label=unique_label("norestore"),
            script=counter_script(),
            namespace=CTR_NAMESPACE,
        ) as w,
    ):
        good, counted = _stop_with_checkpoint(w, w.start("a"), events)
        source = entries(c.store, label=w.label)[0]
        broken = tmp_path / "criu"
        open_store(c.store).reader.extract_layer(source, CRIU_LAYER, str(broken))
        # No process tree: CRIU gives up at once. (An emptied pages image instead makes
        # CRIU 4.1.1 spin forever: that is a CRIU bug, bounded only by restore_timeout.)
        (broken / "pstree.img").unlink()
        diff = tmp_path / "rootfs-diff.tar"
        with open_store(c.store).reader.open_layer(source, ROOTFS_LAYER) as stream:
            diff.write_bytes(stream.read())

        def commit_broken(label: str) -> Entry:
            store = open_store(c.store)
            meta = {k: v for k, v in source.metadata.items() if k not in RESERVED_METADATA_KEYS}
            ingest = store.writer.begin(scope=source.scope, label=label, metadata=meta)
            ingest.add_dir_layer(CRIU_LAYER, str(broken), MEDIA_TYPES[CRIU_LAYER])
            ingest.add_file_layer(ROOTFS_LAYER, str(diff), MEDIA_TYPES[ROOTFS_LAYER])
            return store.commit(ingest)

        bad = commit_broken(w.label)  # newer than `good`: tried first
        assert _ids(c, w.label) == [bad.id, good.checkpoint_id]
        b = w.start("b")
        outcome = restored_from(events, b, good.checkpoint_id)
        assert bad.id in str(outcome.field("detail")), outcome
        failed = log.wait("skipping checkpoint", container=b.cid, checkpoint=bad.id)
        assert failed["error"].startswith("restore failed: runc restore failed"), failed
        assert_continues(counted, wait_ticks(b.lines, count=3), "restore after a failed one")
        w.ctr("task", "kill", "-s", "SIGKILL", b.cid)
        events.wait_topic(TOPIC_EXIT, b.cid, timeout=30)
        w.delete(b)

        only_bad = f"{w.label}-only"
        bad_only = commit_broken(only_bad)
        d = w.start("d", label=only_bad)
        outcome = started_cold(events, d)
        assert bad_only.id in str(outcome.field("detail")), outcome
        skipped = log.wait("skipping checkpoint", container=d.cid, checkpoint=bad_only.id)
        assert skipped["error"].startswith("restore failed:"), skipped
        log.wait("starting cold", container=d.cid)
        task = w.ctr.task(d.cid)
        assert task is not None and task.status == "RUNNING", task

        def count() -> int:
            probe = w.ctr("task", "exec", "--exec-id", f"p{uuid.uuid4().hex[:6]}", d.cid,
                          "cat", "/var/count")  # fmt: skip
            return int(probe.stdout)

        first = count()
        wait_for(lambda: count() > first + 2, timeout=10, what="the cold container to count")
        token = w.ctr("task", "exec", "--exec-id", "tok", d.cid, "cat", "/var/token").stdout
        assert token.strip() != counted.token, "the cold start kept the checkpoint's rootfs"
        # ... and its stdout reaches its log like any container's.
        fresh = wait_ticks(d.lines, count=3, timeout=5)
        assert fresh.first == 1 and fresh.token == token.strip()


# -- SIGKILL during a restore ------------------------------------------------------------------


def _restore_of(cid: str) -> set[int]:
    """The `runc restore` of this container and everything below it (CRIU, its action
    scripts, the tasks restored so far)."""
    listing = procs.list_processes()
    runcs = {p.pid for p in listing if "restore" in p.argv and p.argv and p.argv[-1] == cid}
    return runcs | procs.descendants(runcs, listing)


def test_sigkill_wins_over_a_restore_in_progress(
    fresh_containerd: Containerd, new_id: NewId
) -> None:
    """A restore that takes long (a big checkpoint; here CRIU is held at pre-restore by an
    action script) must not make the container unkillable: `ctr task kill -s SIGKILL`
    (kubelet's StopPodSandbox does the same) returns promptly and the task ends, instead of
    waiting for the restore (up to restore_timeout, 10 minutes by default), and no cgroup
    of it is left behind.

    Held by a script, not by SIGSTOP on the first CRIU seen: runc runs CRIU twice (first to
    ask its version), and a stopped version query never lets the restore begin."""
    c = fresh_containerd
    hold = criu_hold(c, "pre-restore")
    with (
        hold,
        EventStream(c.socket) as events,
        Workloads(
            c,
            new_id,
            label=unique_label("slowrestore"),
            script=counter_script(),
            namespace=CTR_NAMESPACE,
        ) as w,
        TaskKiller(c.socket, CTR_NAMESPACE) as tasks,
    ):
        good, _ = _stop_with_checkpoint(w, w.start("a"), events)
        hold.arm()
        cid = new_id("b")
        w.started.append(Box(cid, w.logs / f"{cid}.log"))
        run = w.ctr.popen(
            *w.ctr.run_args(
                c.images.busybox, cid, "sh", "-c", w.script,
                flags=("-d", "--env", f"CEDANA_CHECKPOINT={w.label}"),
            )
        )  # fmt: skip
        restoring: set[int] = set()
        try:
            hold.wait_held()
            restoring = _restore_of(cid)
            spec = json.loads((c.bundle(CTR_NAMESPACE, cid) / "config.json").read_text())
            cgroups_path = spec["linux"]["cgroupsPath"]
            # runc made them before it sent CRIU the restore request.
            assert procs.container_cgroups(cgroups_path), "runc restore made no cgroups"
            started = time.monotonic()
            try:
                tasks.kill(cid, signal.SIGKILL, timeout=10)
                error = None
            except Exception as exc:  # a deadline: the Kill waited for the restore
                error = exc
            elapsed = time.monotonic() - started
        finally:
            kill_all(restoring | _restore_of(cid), signal.SIGKILL)
        assert error is None and elapsed < 5, (
            f"SIGKILL during a restore took {elapsed:.1f}s and returned {error!r}: "
            "Kill waits for the process lock that Start holds for the whole restore"
        )
        exited = events.wait_topic(TOPIC_EXIT, cid, timeout=30)
        assert exited.field("exit_status") == 137, exited
        # The abandoned restore's runc never wrote its state: `runc delete` knew nothing
        # of the cgroups it made, the shim removed them before it reported the exit.
        assert not procs.container_cgroups(cgroups_path), "the abandoned restore's cgroups"
        run.communicate(timeout=30)
        assert not events.of(TOPIC_COMMITTED, cid)
        assert _ids(c, w.label) == [good.checkpoint_id]
