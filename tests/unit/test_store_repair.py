"""A damaged, truncated or missing index.json is rebuilt from the blobs and raw dirs."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path

import pytest
from cedana_shim import errors
from cedana_shim.checkpoint.store import Entry, Store, StoreConfig
from store_support import blob_names, make_store, publish, referenced_blobs


def populate(store: Store) -> list[Entry]:
    """Oldest first: a compacted checkpoint, then a raw one of the same label, then another."""
    compacted = store.compactor.compact(publish(store).id)
    assert compacted is not None
    other = {"pages-1.img": os.urandom(1000), "inventory.img": b"other"}
    return [compacted, publish(store), publish(store, "other", files=other)]


DAMAGE: dict[str, Callable[[bytes], bytes]] = {
    "not json": lambda data: b"{not json",
    "truncated": lambda data: data[: len(data) // 2],
    "empty": lambda data: b"",
}


@pytest.mark.parametrize("damage", sorted(DAMAGE))
def test_repair_rebuilds_a_damaged_index_with_raw_and_compacted_checkpoints(
    tmp_path: Path, damage: str
) -> None:
    store = make_store(tmp_path, retain=0)
    entries = populate(store)
    before = store.catalog.list()
    index = Path(store.root, "index.json")
    damaged = DAMAGE[damage](index.read_bytes())
    index.write_bytes(damaged)
    with pytest.raises(errors.DataLoss, match="damaged"):
        store.catalog.list()

    report = store.maintenance.repair()
    assert report.rebuilt and report.damaged_copy is not None
    assert Path(report.damaged_copy).read_bytes() == damaged
    assert Path(report.damaged_copy).name.startswith("index.json.damaged-")
    assert report.recovered == tuple((e.id, e.state) for e in entries)
    assert report.dropped == ()
    assert str(index) in report.reason
    assert store.catalog.list() == before
    for e in store.catalog.list():
        store.reader.verify(e)
    assert store.maintenance.repair().rebuilt is False, "an intact index is left alone"


def test_a_missing_index_is_rebuilt_when_the_store_opens(tmp_path: Path) -> None:
    store = make_store(tmp_path, retain=0)
    entries = populate(store)
    before = store.catalog.list()
    os.unlink(Path(store.root, "index.json"))
    reopened = Store(StoreConfig(root=store.root))
    report = reopened.catalog.last_repair
    assert report is not None and report.damaged_copy is None
    assert "index.json is missing" in report.reason
    assert [cid for cid, _ in report.recovered] == [e.id for e in entries]
    assert reopened.catalog.list() == before


def test_repair_drops_what_does_not_check_out_and_says_why(tmp_path: Path) -> None:
    store = make_store(tmp_path, retain=0)
    good, raw, other = populate(store)
    broken = store.compactor.compact(other.id)
    assert broken is not None
    os.unlink(Path(store.root, "blobs", "sha256", broken.layers[0].digest.removeprefix("sha256:")))
    os.truncate(Path(store.root, "raw", raw.id, "criu", "pages-1.img"), 10)
    Path(store.root, "index.json").write_bytes(b"[]")

    report = store.maintenance.repair()
    assert report.recovered == ((good.id, "compacted"),)
    why = dict(report.dropped)
    assert len(why) == 2
    (missing,) = [w for what, w in report.dropped if broken.id in what]
    assert "is missing" in missing
    (truncated,) = [w for what, w in report.dropped if raw.id in what]
    assert "pages-1.img is 10 bytes" in truncated
    assert [e.id for e in store.catalog.list()] == [good.id]


def test_a_checkpoint_found_raw_and_compacted_is_recovered_compacted(tmp_path: Path) -> None:
    store = make_store(tmp_path)
    entry = publish(store)

    def crash(step: str) -> None:
        if step == "compact-committed":  # swapped, nothing swept yet
            raise KeyboardInterrupt

    with pytest.raises(KeyboardInterrupt):
        Store(StoreConfig(root=store.root), step_hook=crash).compactor.compact(entry.id)
    assert entry.manifest_digest.removeprefix("sha256:") in blob_names(store)
    Path(store.root, "index.json").write_bytes(b"")

    report = store.maintenance.repair()
    assert report.recovered == ((entry.id, "compacted"),)
    assert report.dropped == ((f"checkpoint {entry.id} (raw)", "superseded by its compacted form"),)
    store.maintenance.gc()
    assert blob_names(store) == referenced_blobs(store)


def test_foreign_entries_cannot_be_recovered_but_ours_are(tmp_path: Path) -> None:
    store = make_store(tmp_path)
    entry = publish(store)
    index = Path(store.root, "index.json")
    doc = json.loads(index.read_text())
    doc["manifests"].append({"mediaType": "a/b", "digest": "sha256:" + "0" * 64, "size": 1})
    index.write_text(json.dumps(doc)[:-5])
    report = store.maintenance.repair()
    assert report.recovered == ((entry.id, "raw"),)
    assert [e.id for e in store.catalog.list()] == [entry.id]
