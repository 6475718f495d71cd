"""A pulled checkpoint's raw-image cache: built while its chunks are staged, placed with
the checkpoint only when its files rebuild the dumping node's file list, never half."""

from __future__ import annotations

import os
import random
import zlib
from collections.abc import Callable
from pathlib import Path
from typing import IO

import pytest
from cedana_shim.checkpoint.remote.pull import download_order
from cedana_shim.checkpoint.store import Entry, Store
from cedana_shim.checkpoint.store.adopt import Adoption, manifest_blobs
from cedana_shim.checkpoint.store.layout import (
    ANN_CREATED,
    ANN_ID,
    ANN_LABEL,
    ANN_SCOPE,
    MEDIA_TYPE_MANIFEST,
    CheckpointRef,
    Descriptor,
    Manifest,
    parse_checkpoint_ref,
    parse_config,
    parse_manifest,
)
from cedana_shim.checkpoint.store.rawcache import CacheBuilder, crc32_combine
from cedana_shim.errors import DataLoss
from store_support import make_store, read_blob, stage

PAGE = 4096
CHUNK = 4 * PAGE


def _pages() -> bytes:
    """Page images with repeated chunks (the same digest at several offsets), an odd tail."""
    rng = random.Random(7)
    same = rng.randbytes(CHUNK)
    parts = [rng.randbytes(CHUNK), same, rng.randbytes(CHUNK), same, same, rng.randbytes(1000)]
    return b"".join(parts)


FILES = {
    "pages-1.img": _pages(),
    "pages-2.img": os.urandom(3 * CHUNK + 17),
    "core-1.img": b"core" * 100,
    "inventory.img": b"inv",
    "zz-after.img": b"sorted after the page images",
}


@pytest.fixture
def source(tmp_path: Path) -> tuple[Store, Entry]:
    store = make_store(tmp_path / "a", chunk_size=CHUNK)
    return store, store.commit(stage(store, "trainer", files=FILES))


def _documents(store: Store, entry: Entry) -> tuple[bytes, Manifest]:
    data = store.adopter.checkpoint_manifest(entry)
    return data, parse_manifest(data, "manifest")


def _begin(adoption: Adoption, store: Store, manifest: Manifest) -> None:
    desc = manifest.config
    config = parse_config(read_blob(store, desc.digest), "config", _ref(manifest))
    adoption.write_blob(desc.digest, desc.size, _writer(read_blob(store, desc.digest)))
    assert adoption.begin_cache(manifest, config)


def _ref(manifest: Manifest) -> CheckpointRef:
    keys = (ANN_ID, ANN_SCOPE, ANN_LABEL, ANN_CREATED)
    annotations = {k: manifest.annotations[k] for k in keys}
    desc = Descriptor(MEDIA_TYPE_MANIFEST, "sha256:" + "0" * 64, 1, annotations)
    return parse_checkpoint_ref(desc, 0, "test")


def _writer(data: bytes, *, fail_after: int | None = None) -> Callable[[IO[bytes]], None]:
    def fill(out: IO[bytes]) -> None:
        step = 5000  # in pieces, as a download streams
        for i in range(0, len(data), step):
            if fail_after is not None and i >= fail_after:
                raise DataLoss("the bytes hash to something else")
            out.write(data[i : i + step])

    return fill


def test_crc32_combine_is_zlibs() -> None:
    for a, b in ((b"", b"x"), (b"abc", b""), (os.urandom(999), os.urandom(70_001))):
        assert crc32_combine(zlib.crc32(a), zlib.crc32(b), len(b)) == zlib.crc32(a + b)


def test_a_pulled_checkpoint_comes_with_its_raw_images(
    source: tuple[Store, Entry], tmp_path: Path
) -> None:
    store, entry = source
    data, manifest = _documents(store, entry)
    target = make_store(tmp_path / "b", chunk_size=CHUNK)
    with target.adopter.begin_adoption(entry.id) as adoption:
        _begin(adoption, store, manifest)
        for digest, size in manifest_blobs(manifest).items():
            if digest != manifest.config.digest:
                adoption.write_blob(digest, size, _writer(read_blob(store, digest)))
        adopted = target.adopter.adopt(adoption, data)
    raw = target.raw.raw_images(adopted, "criu")
    assert raw is not None and raw == os.path.join(target.root, "raw", entry.id, "criu")
    for name, content in FILES.items():
        assert Path(raw, name).read_bytes() == content
        assert Path(raw, name).stat().st_mode & 0o777 == 0o600
    target.raw.verify_raw(adopted, "criu")  # every CRC-32 as the dumping node recorded it
    assert adopted.raw_bytes == sum(len(c) for c in FILES.values())
    assert sorted(os.listdir(Path(target.root, "ingest"))) == []
    # Checked as it was written: the first restore may skip the second read, once.
    assert target.adopter.take_fresh_cache(entry.id)
    assert not target.adopter.take_fresh_cache(entry.id)


def test_chunks_the_store_had_are_written_into_the_cache_too(
    source: tuple[Store, Entry], tmp_path: Path
) -> None:
    store, entry = source
    data, manifest = _documents(store, entry)
    target = make_store(tmp_path / "b", chunk_size=CHUNK)
    target.commit(stage(target, "other", files={"pages-1.img": FILES["pages-1.img"]}))
    with target.adopter.begin_adoption(entry.id) as adoption:
        _begin(adoption, store, manifest)
        linked = set()
        for digest, size in manifest_blobs(manifest).items():
            if adoption.link_existing(digest, size):
                linked.add(digest)
                adoption.fill_cache(digest)
            elif digest != manifest.config.digest:
                adoption.write_blob(digest, size, _writer(read_blob(store, digest)))
        assert linked  # the shared page image's chunks
        adopted = target.adopter.adopt(adoption, data)
    raw = target.raw.raw_images(adopted, "criu")
    assert raw is not None
    assert Path(raw, "pages-1.img").read_bytes() == FILES["pages-1.img"]
    target.raw.verify_raw(adopted, "criu")


def test_a_corrupt_chunk_mid_stream_leaves_nothing_behind(
    source: tuple[Store, Entry], tmp_path: Path
) -> None:
    store, entry = source
    _, manifest = _documents(store, entry)
    target = make_store(tmp_path / "b", chunk_size=CHUNK)
    chunk = manifest.chunks["criu"][2]
    with target.adopter.begin_adoption(entry.id) as adoption:
        _begin(adoption, store, manifest)
        assert os.listdir(adoption.path) != []
        with pytest.raises(DataLoss):
            adoption.write_blob(
                chunk.digest, chunk.size, _writer(read_blob(store, chunk.digest), fail_after=5000)
            )
        staging = adoption.path
    assert not os.path.exists(staging)
    assert target.catalog.list() == []
    assert not os.path.exists(os.path.join(target.root, "raw", entry.id))


def test_bytes_that_do_not_decompress_to_the_chunk_fail_the_pull(
    source: tuple[Store, Entry], tmp_path: Path
) -> None:
    store, entry = source
    _, manifest = _documents(store, entry)
    target = make_store(tmp_path / "b", chunk_size=CHUNK)
    chunk = manifest.chunks["criu"][0]
    other = manifest.chunks["criu"][-1]  # a valid zstd frame of another size
    with target.adopter.begin_adoption(entry.id) as adoption:
        _begin(adoption, store, manifest)
        with pytest.raises(DataLoss, match="decompresses to"):
            adoption.write_blob(chunk.digest, other.size, _writer(read_blob(store, other.digest)))
    assert target.catalog.list() == []


def test_files_that_do_not_rebuild_the_file_list_are_not_kept_as_a_cache(
    source: tuple[Store, Entry], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    store, entry = source
    data, manifest = _documents(store, entry)
    target = make_store(tmp_path / "b", chunk_size=CHUNK)
    # A list in another order hashes to another digest: as if this node's files differed.
    monkeypatch.setattr(CacheBuilder, "_ordered", lambda self, e: tuple(reversed(e)))
    with target.adopter.begin_adoption(entry.id) as adoption:
        _begin(adoption, store, manifest)
        for digest, size in manifest_blobs(manifest).items():
            if digest != manifest.config.digest:
                adoption.write_blob(digest, size, _writer(read_blob(store, digest)))
        adopted = target.adopter.adopt(adoption, data)
    assert target.raw.raw_images(adopted, "criu") is None
    assert not os.path.exists(os.path.join(target.root, "raw", entry.id))
    assert not target.adopter.take_fresh_cache(entry.id)
    target.reader.verify(adopted, deep=True)  # the checkpoint itself is whole


def test_no_cache_for_a_checkpoint_older_than_the_labels_newest(
    source: tuple[Store, Entry], tmp_path: Path
) -> None:
    store, entry = source
    data, manifest = _documents(store, entry)
    target = make_store(tmp_path / "b", chunk_size=CHUNK)
    newer = target.commit(stage(target, "trainer", files=FILES))
    assert newer.created > entry.created
    with target.adopter.begin_adoption(entry.id) as adoption:
        _begin(adoption, store, manifest)
        for digest, size in manifest_blobs(manifest).items():
            if digest != manifest.config.digest:
                adoption.write_blob(digest, size, _writer(read_blob(store, digest)))
        adopted = target.adopter.adopt(adoption, data)
    assert target.raw.raw_images(adopted, "criu") is None
    assert target.raw.raw_images(target.catalog.get(newer.id), "criu") is not None
    assert not target.adopter.take_fresh_cache(entry.id)


def test_no_cache_when_the_store_keeps_none(source: tuple[Store, Entry], tmp_path: Path) -> None:
    store, entry = source
    _, manifest = _documents(store, entry)
    target = make_store(tmp_path / "b", chunk_size=CHUNK, cache_raw=False)
    config = parse_config(read_blob(store, manifest.config.digest), "config", _ref(manifest))
    with target.adopter.begin_adoption(entry.id) as adoption:
        assert adoption.cache_layer(manifest, config) is None
        assert not adoption.begin_cache(manifest, config)


def test_a_pull_asks_for_the_small_blobs_first_then_the_chunks_as_their_files_hold_them(
    source: tuple[Store, Entry],
) -> None:
    store, entry = source
    _, manifest = _documents(store, entry)
    blobs = manifest_blobs(manifest)
    order = download_order(manifest, blobs)
    layers = [d.digest for d in manifest.layers]
    assert manifest.config.digest not in order
    assert set(order) == set(blobs) - {manifest.config.digest}
    assert sorted(order[: len(layers)], key=lambda d: blobs[d]) == order[: len(layers)]
    assert set(order[: len(layers)]) == set(layers)
    placed = [(c.file, c.offset, c.digest) for c in manifest.chunks["criu"]]
    first_places = list(dict.fromkeys(d for _, _, d in sorted(placed)))
    assert order[len(layers) :] == first_places  # a repeated chunk at its first place
    # Blobs the store had are not asked for.
    had = next(iter(manifest.chunks["criu"])).digest
    assert had not in download_order(manifest, {d: s for d, s in blobs.items() if d != had})
