"""The store's side of restore by hand: finding a checkpoint by id or prefix in one
scope, and the restore records (`restores/<id>.jsonl`) with their bounds; the CLI
that shows both (`cedana checkpoints list` / `inspect`)."""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path

import pytest
from cedana_shim import errors
from cedana_shim.checkpoint.store import Store
from cedana_shim.checkpoint.store.restores import RECORD_FILE_MAX
from cedana_shim.cli import admin
from store_support import make_store, publish


def record(n: int = 0) -> dict[str, object]:
    return {
        "restoredAt": f"2026-12-01T08:00:{n % 60:02d}Z",
        "containerId": f"task-{n}",
        "namespace": "ns",
        "pod": "pod-1",
        "container": "app",
        "label": "app",
        "node": "node-a",
        "byHand": True,
    }


def records_dir(store: Store) -> Path:
    return Path(store.root, "restores")


def test_matching_finds_by_id_or_prefix_in_its_scope_only(tmp_path: Path) -> None:
    store = make_store(tmp_path)
    here = publish(store, "app", scope="ns")
    there = publish(store, "app", scope="other")
    assert [e.id for e in store.reader.matching("ns", here.id)] == [here.id]
    assert [e.id for e in store.reader.matching("ns", here.id[:20])] == [here.id]
    assert store.reader.matching("ns", there.id) == []  # another scope's id: not there at all
    assert store.reader.matching("ns", "") == []
    publish(store, "b", scope="ns")
    assert len(store.reader.matching("ns", here.id[:4])) == 2  # the year: both


def test_records_round_trip_private_and_oldest_first(tmp_path: Path) -> None:
    store = make_store(tmp_path)
    entry = publish(store)
    assert store.restore_records.restores(entry.id) == []
    store.restore_records.record_restore(entry.id, record(1))
    store.restore_records.record_restore(entry.id, record(2))
    assert [r["containerId"] for r in store.restore_records.restores(entry.id)] == [
        "task-1",
        "task-2",
    ]
    assert stat.S_IMODE(records_dir(store).stat().st_mode) == 0o700
    assert stat.S_IMODE((records_dir(store) / f"{entry.id}.jsonl").stat().st_mode) == 0o600


def test_records_stay_bounded_and_keep_the_newest(tmp_path: Path) -> None:
    store = make_store(tmp_path)
    entry = publish(store)
    line = len(json.dumps(record(0), sort_keys=True)) + 1
    written = 3 * RECORD_FILE_MAX // line
    for n in range(written):
        store.restore_records.record_restore(entry.id, record(n))
    files = list(records_dir(store).iterdir())
    assert sorted(f.name for f in files) == [f"{entry.id}.jsonl", f"{entry.id}.jsonl.old"]
    assert all(f.stat().st_size <= RECORD_FILE_MAX for f in files)
    kept = store.restore_records.restores(entry.id)
    assert RECORD_FILE_MAX // line <= len(kept) < written
    assert kept[-1]["containerId"] == f"task-{written - 1}"


def test_hostile_record_values_are_cut_and_a_torn_line_is_skipped(tmp_path: Path) -> None:
    store = make_store(tmp_path)
    entry = publish(store)
    store.restore_records.record_restore(
        entry.id, {**record(1), "pod": "p" * 10_000, "node": ["x"]}
    )
    with open(records_dir(store) / f"{entry.id}.jsonl", "ab") as f:
        f.write(b'{"containerId": "torn')  # a crash mid-write
    store.restore_records.record_restore(entry.id, record(2))
    first, second = store.restore_records.restores(entry.id)
    assert (len(first["pod"]), first["node"]) == (256, "['x']")
    assert second["containerId"] == "task-2"


def test_a_planted_symlink_is_refused_and_its_target_untouched(tmp_path: Path) -> None:
    store = make_store(tmp_path)
    entry = publish(store)
    target = tmp_path / "elsewhere"
    target.write_text("keep\n")
    records_dir(store).mkdir(mode=0o700)
    (records_dir(store) / f"{entry.id}.jsonl").symlink_to(target)
    with pytest.raises(errors.DataLoss, match="symbolic link"):
        store.restore_records.record_restore(entry.id, record(1))
    assert target.read_text() == "keep\n"


def test_a_bad_id_is_refused(tmp_path: Path) -> None:
    store = make_store(tmp_path)
    for bad in ("../index.json", "x", ""):
        with pytest.raises(errors.InvalidArgument):
            store.restore_records.record_restore(bad, record(1))
        with pytest.raises(errors.InvalidArgument):
            store.restore_records.restores(bad)


def test_records_go_with_their_checkpoint(tmp_path: Path) -> None:
    store = make_store(tmp_path)
    gone, kept = publish(store, "a"), publish(store, "b")
    store.restore_records.record_restore(gone.id, record(1))
    store.restore_records.record_restore(kept.id, record(2))
    store.maintenance.remove(gone.id)
    assert sorted(os.listdir(records_dir(store))) == [f"{kept.id}.jsonl"]


def test_list_and_inspect_show_how_to_restore_and_what_was_restored(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store = make_store(tmp_path)
    entry = publish(store)
    store.restore_records.record_restore(entry.id, record(7))
    root = store.root

    assert admin.main(["checkpoints", "list", "--store", root, "--json"]) == 0
    (item,) = json.loads(capsys.readouterr().out)
    assert item["restoreWith"] == {
        "env": f"CEDANA_RESTORE={entry.id}",
        "podSpec": f'- {{name: CEDANA_RESTORE, value: "{entry.id}"}}',
        "annotation": f'cedana.ai/restore: "{entry.id}"',
    }
    assert admin.main(["checkpoints", "list", "--store", root]) == 0
    assert f"CEDANA_RESTORE={entry.id}" in capsys.readouterr().out

    assert admin.main(["checkpoints", "inspect", "--store", root, entry.id]) == 0
    out = capsys.readouterr().out
    assert f'- {{name: CEDANA_RESTORE, value: "{entry.id}"}}' in out
    assert "Restored:   1 time(s)" in out
    (row,) = [x for x in out.splitlines() if "task-7" in x]
    assert "pod-1" in row and "node-a" in row and row.endswith("by hand")
    assert admin.main(["checkpoints", "inspect", "--store", root, "--json", entry.id]) == 0
    (restored,) = json.loads(capsys.readouterr().out)["restores"]
    assert (restored["containerId"], restored["restoredAt"]) == ("task-7", "2026-12-01T08:00:07Z")


def test_inspect_of_a_never_restored_checkpoint_says_so(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    store = make_store(tmp_path)
    entry = publish(store)
    assert admin.main(["checkpoints", "inspect", "--store", store.root, entry.id]) == 0
    assert "Restored:   never (on this node)" in capsys.readouterr().out
