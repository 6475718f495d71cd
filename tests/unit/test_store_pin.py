"""A pinned checkpoint (the dashboard's pin) is exempt from retention and prune, keeps
its pin through compaction, and can be unpinned; the manifest never changes."""

from __future__ import annotations

from pathlib import Path

import pytest
from cedana_shim import errors
from support.checkpoints import commit_checkpoint, open_store


def test_a_pinned_checkpoint_outlives_retention_and_prune(tmp_path: Path) -> None:
    store = open_store(tmp_path / "store", retain=2)
    first = commit_checkpoint(store, {"pages-1.img": b"a" * 100}, label="app")
    digest = store.catalog.get(first.id).manifest_digest
    store.maintenance.pin(first.id)
    later = [commit_checkpoint(store, {"pages-1.img": b"b" * 100}, label="app") for _ in range(3)]
    kept = {e.id for e in store.catalog.list(label="app")}
    # Retention keeps the two newest beside the pinned one, which it does not count.
    assert kept == {first.id, later[1].id, later[2].id}
    pinned = store.catalog.get(first.id)
    assert pinned.pinned and pinned.to_json()["pinned"] is True
    assert pinned.manifest_digest == digest, "a pin must not change the manifest"
    assert store.maintenance.prune(label="app", keep=0) == [later[2].id, later[1].id]
    assert {e.id for e in store.catalog.list(label="app")} == {first.id}
    store.reader.verify(store.catalog.get(first.id))

    store.maintenance.pin(first.id, pinned=False)
    assert not store.catalog.get(first.id).pinned
    assert store.maintenance.prune(label="app", keep=0) == [first.id]


def test_pinning_an_unknown_or_malformed_id_says_so(tmp_path: Path) -> None:
    store = open_store(tmp_path / "store")
    with pytest.raises(errors.NotFound, match="not found"):
        store.maintenance.pin("20261129T183000Z-3f9a1c2b")
    with pytest.raises(errors.InvalidArgument):
        store.maintenance.pin("../etc")


def test_a_pin_survives_a_repair_of_the_index(tmp_path: Path) -> None:
    store = open_store(tmp_path / "store")
    mine = commit_checkpoint(store, {"pages-1.img": b"a" * 100}, label="app")
    policys = commit_checkpoint(store, {"pages-1.img": b"b" * 100}, label="app")
    plain = commit_checkpoint(store, {"pages-1.img": b"c" * 100}, label="app")
    store.maintenance.pin(mine.id)
    store.maintenance.pin(policys.id, by_policy=True)
    (tmp_path / "store" / "index.json").write_text("{damaged")
    report = store.maintenance.repair()
    assert report.rebuilt and {i for i, _ in report.recovered} == {mine.id, policys.id, plain.id}
    pins = {e.id: e.pinned_by for e in store.catalog.list(label="app")}
    assert pins == {mine.id: "user", policys.id: "policy", plain.id: ""}
    # And the rebuilt index keeps them exempt from prune.
    assert store.maintenance.prune(label="app", keep=0) == [plain.id]


def test_a_damaged_pins_file_loses_no_checkpoint_on_repair(tmp_path: Path) -> None:
    store = open_store(tmp_path / "store")
    entry = commit_checkpoint(store, {"pages-1.img": b"a" * 100}, label="app")
    store.maintenance.pin(entry.id)
    (tmp_path / "store" / "pins.json").write_text("[not pins")
    (tmp_path / "store" / "index.json").unlink()
    assert store.maintenance.repair().rebuilt
    [found] = store.catalog.list(label="app")
    assert found.id == entry.id and not found.pinned
