"""Failure records: a checkpoint that failed its verification or its restore is tried
after the others and never kept by retention in place of a good one; a pulled one's
record outlives the checkpoint (bounded), a local one's goes with it."""

from __future__ import annotations

import os
from datetime import datetime, timedelta
from pathlib import Path

import pytest
from cedana_shim.checkpoint.store import Entry, Store
from cedana_shim.checkpoint.store.failures import (
    FAILURES_DIR,
    MAX_REMOTE_RECORDS,
    failed_last,
    has_failed,
)
from store_support import make_store, stage
from support.checkpoints import SCOPE, commit_checkpoint, open_store
from support.forged import adopt_forged, forge, zstd_bomb

FILES = {"pages-1.img": os.urandom(20_000), "core-1.img": b"core", "inventory.img": b"inv"}


def _ids(store: Store) -> list[str]:
    return [e.id for e in store.catalog.list(scope=SCOPE, label="trainer")]


@pytest.fixture
def three_good_and_a_forged_newer(tmp_path: Path) -> tuple[Store, list[Entry], str]:
    """retain = 3: three good checkpoints of the label, and a newer-dated one pulled
    in (adopted: retention does not apply) that then failed."""
    store = open_store(tmp_path / "store", retain=3, cache_raw=False)
    good = [commit_checkpoint(store, FILES) for _ in range(3)]
    newer = datetime.fromisoformat(good[-1].created) + timedelta(hours=1)
    forged = adopt_forged(store, store, forge(store, good[-1], newer, bomb=zstd_bomb(1 << 20)))
    store.failure_records.record_failure(forged.id, "restore failed: boom", tag="c.trainer.forged")
    return store, good, forged.id


def test_records_are_written_read_back_and_cleared(tmp_path: Path) -> None:
    store = make_store(tmp_path)
    entry = store.commit(stage(store))
    assert store.failure_records.failures() == {}
    store.failure_records.record_failure(entry.id, "x" * 5000, tag="c.app.tag")
    (record,) = store.failure_records.failures().values()
    assert (record.checkpoint_id, record.tag, len(record.why)) == (entry.id, "c.app.tag", 1024)
    assert record.failed_at.endswith("Z")
    assert os.stat(os.path.join(store.root, FAILURES_DIR)).st_mode & 0o777 == 0o700
    # A record torn by a crash, or not ours, is skipped.
    Path(store.root, FAILURES_DIR, "20250101T000000Z-0000aaaa.json").write_bytes(b'{"id": ')
    Path(store.root, FAILURES_DIR, "notes.txt").write_text("hi")
    assert list(store.failure_records.failures()) == [entry.id]
    store.failure_records.clear_failure(entry.id)
    store.failure_records.clear_failure(entry.id)  # idempotent
    assert store.failure_records.failures() == {}


def test_a_pulled_ones_record_names_only_its_tag_a_local_ones_any(tmp_path: Path) -> None:
    store = make_store(tmp_path)
    local, pulled = store.commit(stage(store)), store.commit(stage(store))
    store.failure_records.record_failure(local.id, "damaged")
    store.failure_records.record_failure(pulled.id, "damaged", tag="c.app.one")
    failures = store.failure_records.failures()
    assert has_failed(failures, local.id) and has_failed(failures, local.id, "c.app.any")
    assert has_failed(failures, pulled.id) and has_failed(failures, pulled.id, "c.app.one")
    assert not has_failed(failures, pulled.id, "c.app.other")  # the same id, another tag
    assert failed_last([1, 2, 3, 4], lambda n: n in (1, 3)) == [2, 4, 1, 3]


def test_retention_never_drops_a_good_checkpoint_for_one_that_failed(
    three_good_and_a_forged_newer: tuple[Store, list[Entry], str],
) -> None:
    store, good, forged = three_good_and_a_forged_newer
    assert _ids(store) == [forged, *reversed([g.id for g in good])]
    fourth = commit_checkpoint(store, FILES)  # publish applies retain = 3
    # Before: the forged one counted as the newest and two good ones went (2 of 3 left).
    assert _ids(store) == [fourth.id, good[2].id, good[1].id]
    assert (
        forged in store.failure_records.failures()
    )  # a pulled one's record outlives it: its tag stays last


def test_prune_keeps_the_good_ones_too(
    three_good_and_a_forged_newer: tuple[Store, list[Entry], str],
) -> None:
    store, good, forged = three_good_and_a_forged_newer
    assert store.maintenance.prune(scope=SCOPE, label="trainer", keep=3) == [forged]
    assert _ids(store) == [g.id for g in reversed(good)]


def test_records_of_checkpoints_gone_are_swept_but_a_bounded_number_of_pulled_ones(
    tmp_path: Path,
) -> None:
    store = make_store(tmp_path)
    kept, gone = store.commit(stage(store)), store.commit(stage(store))
    store.failure_records.record_failure(kept.id, "restore failed")
    store.failure_records.record_failure(gone.id, "restore failed")
    base = datetime(2025, 1, 1)
    pulled = [f"{base + timedelta(seconds=i):%Y%m%dT%H%M%S}Z-{i:08x}" for i in range(300)]
    for i, cid in enumerate(pulled):
        store.failure_records.record_failure(cid, "cannot pull it: bomb", tag=f"c.app.t{i}")
        os.utime(Path(store.root, FAILURES_DIR, f"{cid}.json"), (1e9 + i, 1e9 + i))
    store.maintenance.remove(gone.id)  # sweeps
    left = store.failure_records.failures()
    assert kept.id in left and gone.id not in left
    assert sorted(set(left) - {kept.id}) == pulled[-MAX_REMOTE_RECORDS:]
