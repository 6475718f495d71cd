"""Adopter.adopt: a compacted checkpoint staged blob by blob enters the store all at once,
or not at all."""

from __future__ import annotations

import filecmp
import os
from collections.abc import Callable
from pathlib import Path
from typing import IO

import pytest
from cedana_shim.checkpoint.store import Entry, Store
from cedana_shim.checkpoint.store.adopt import manifest_blobs
from cedana_shim.checkpoint.store.layout import parse_manifest
from cedana_shim.errors import DataLoss, InvalidArgument
from store_support import CRIU_FILES, blob_names, make_store, publish, read_blob, stage


@pytest.fixture
def source(tmp_path: Path) -> tuple[Store, Entry]:
    store = make_store(tmp_path / "a", chunk_size=4096)
    return store, store.commit(stage(store, "trainer"))


def _writer(data: bytes) -> Callable[[IO[bytes]], None]:
    def fill(out: IO[bytes]) -> None:
        out.write(data)

    return fill


def test_a_checkpoint_staged_blob_by_blob_is_adopted_whole(
    source: tuple[Store, Entry], tmp_path: Path
) -> None:
    store, entry = source
    manifest = store.adopter.checkpoint_manifest(entry)
    target = make_store(tmp_path / "b")
    with target.adopter.begin_adoption(entry.id) as adoption:
        assert os.path.isdir(adoption.path)
        for digest, size in manifest_blobs(parse_manifest(manifest, "m")).items():
            adoption.write_blob(digest, size, _writer(read_blob(store, digest)))
        adopted = target.adopter.adopt(adoption, manifest)
        assert target.adopter.adopt(adoption, manifest) == adopted  # idempotent
    assert not os.path.exists(adoption.path)
    assert (adopted.id, adopted.created, adopted.label) == (entry.id, entry.created, entry.label)
    assert adopted.manifest_digest == entry.manifest_digest
    target.reader.verify(adopted, deep=True)
    target.reader.extract_layer(adopted, "criu", str(tmp_path / "out"))
    store.reader.extract_layer(entry, "criu", str(tmp_path / "want"))
    _, mismatch, errors = filecmp.cmpfiles(
        tmp_path / "out", tmp_path / "want", sorted(CRIU_FILES), shallow=False
    )
    assert (mismatch, errors) == ([], [])
    assert [e.id for e in target.catalog.list()] == [entry.id]


def test_a_missing_blob_fails_the_adoption_and_leaves_the_store_as_it_was(
    source: tuple[Store, Entry], tmp_path: Path
) -> None:
    store, entry = source
    manifest = store.adopter.checkpoint_manifest(entry)
    target = make_store(tmp_path / "b")
    blobs = manifest_blobs(parse_manifest(manifest, "m"))
    last = list(blobs)[-1]
    with target.adopter.begin_adoption(entry.id) as adoption:
        for digest, size in blobs.items():
            if digest != last:
                adoption.write_blob(digest, size, _writer(read_blob(store, digest)))
        with pytest.raises(DataLoss, match="is missing"):
            target.adopter.adopt(adoption, manifest)
    assert target.catalog.list() == [] and blob_names(target) == set()
    assert os.listdir(os.path.join(target.root, "ingest")) == []


def test_a_blob_of_the_wrong_size_is_not_staged(
    source: tuple[Store, Entry], tmp_path: Path
) -> None:
    store, entry = source
    target = make_store(tmp_path / "b")
    config = parse_manifest(store.adopter.checkpoint_manifest(entry), "m").config
    with target.adopter.begin_adoption(entry.id) as adoption:
        with pytest.raises(DataLoss, match="expected"):
            adoption.write_blob(config.digest, config.size + 1, _writer(b"x"))
        assert adoption.staged == {} and os.listdir(adoption.path) == ["lock"]


def test_chunks_the_store_holds_are_pinned_not_copied_and_damaged_ones_refused(
    source: tuple[Store, Entry], tmp_path: Path
) -> None:
    _, entry = source
    target = make_store(tmp_path / "b", chunk_size=4096)
    target.commit(stage(target, "trainer"))  # the same pages: the same chunks
    chunk = entry.layer("criu").chunks[0]
    with target.adopter.begin_adoption(entry.id) as adoption:
        assert adoption.link_existing(chunk.digest, chunk.size)
        assert adoption.staged == {chunk.digest: chunk.size}
        assert not adoption.link_existing("sha256:" + "0" * 64, 10)
    blob = Path(target.root, "blobs", "sha256", entry.layer("criu").chunks[1].digest[7:])
    blob.write_bytes(b"\0" + blob.read_bytes()[1:])
    with target.adopter.begin_adoption(entry.id) as adoption:
        second = entry.layer("criu").chunks[1]
        assert not adoption.link_existing(second.digest, second.size)


def test_only_compacted_checkpoints_are_adopted(tmp_path: Path) -> None:
    store = make_store(tmp_path / "a")
    raw = publish(store)
    target = make_store(tmp_path / "b")
    with target.adopter.begin_adoption(raw.id) as adoption, pytest.raises(InvalidArgument):
        target.adopter.adopt(adoption, store.adopter.checkpoint_manifest(raw))
    with pytest.raises(InvalidArgument):
        target.adopter.begin_adoption("../etc")


def test_gc_leaves_an_adoption_in_progress_alone(
    source: tuple[Store, Entry], tmp_path: Path
) -> None:
    _, entry = source
    target = make_store(tmp_path / "b")
    with target.adopter.begin_adoption(entry.id) as adoption:
        target.maintenance.gc()
        assert os.path.isdir(adoption.path)
