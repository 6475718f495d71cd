"""A compacted criu layer holds its page images as chunks: one zstd blob per piece.

Small chunks (4 KiB) keep the data small; everything runs against a real store.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import random
import stat
import tarfile
from pathlib import Path

import pytest
import zstandard
from cedana_shim import errors
from cedana_shim.checkpoint.store import Entry, Store, StoreConfig
from cedana_shim.checkpoint.store.chunks import ChunkBuffers, read_chunk
from cedana_shim.checkpoint.store.layout import (
    ANN_CHUNK_FILE,
    ANN_CHUNK_OFFSET,
    ANN_CHUNK_RAW_SIZE,
    ANN_TITLE,
    MEDIA_TYPE_CRIU,
    MEDIA_TYPE_CRIU_CHUNK,
    Chunk,
)
from store_support import blob_names, make_store, read_blob, referenced_blobs

CHUNK = 4096


def pages(n_chunks: float, seed: int) -> bytes:
    """Mixed data, the same for the same seed: compressible runs and random bytes."""
    rng = random.Random(seed)
    out = bytearray()
    size = int(n_chunks * CHUNK)
    while len(out) < size:
        out += bytes([seed % 251]) * 512 + rng.randbytes(512)
    return bytes(out[:size])


def criu_files() -> dict[str, tuple[bytes, int]]:
    return {
        "pages-1.img": (pages(3.5, 1), 0o644),
        "pages-2.img": (b"", 0o600),  # no pages dumped: no chunk, still restored
        "pages-3.img": (pages(2, 3), 0o640),
        "core-1.img": (b"core" * 300, 0o600),
        "inventory.img": (b"inv", 0o644),
        "sub/pages-9.img": (b"not top-level: stays in the tar", 0o600),
    }


def commit(
    store: Store, files: dict[str, tuple[bytes, int]] | None = None, label: str = "app"
) -> Entry:
    ing = store.writer.begin(scope="ns", label=label, metadata={"container": "c1"})
    root = Path(ing.dir("criu"))
    for rel, (data, mode) in (files or criu_files()).items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        path.chmod(mode)
        os.utime(path, (1_700_000_000, 1_700_000_000))
    for sub in root.rglob("*"):  # and the directories: two commits a second apart match
        if sub.is_dir():
            os.utime(sub, (1_700_000_000, 1_700_000_000))
    ing.add_dir_layer("criu", str(root), MEDIA_TYPE_CRIU)
    ing.keep_raw("criu")
    return store.commit(ing)


def chunked_store(tmp_path: Path, **kw: object) -> Store:
    # No raw-image cache: every read below goes through the blobs.
    return make_store(tmp_path, chunk_size=CHUNK, cache_raw=False, retain=0, **kw)


def blob(store: Store, digest: str) -> Path:
    return Path(store.root, "blobs", "sha256", digest.removeprefix("sha256:"))


def assert_tree(dest: Path, files: dict[str, tuple[bytes, int]]) -> None:
    for rel, (data, mode) in files.items():
        assert (dest / rel).read_bytes() == data, rel
        assert stat.S_IMODE((dest / rel).stat().st_mode) == mode, rel
        assert (dest / rel).stat().st_mtime == 1_700_000_000, rel


# --------------------------------------------------------------------------- format


def test_page_images_become_chunks_and_extract_byte_for_byte(tmp_path: Path) -> None:
    store = chunked_store(tmp_path)
    entry = commit(store)
    (layer,) = entry.layers
    manifest = json.loads(read_blob(store, entry.manifest_digest))
    descs = manifest["layers"]
    assert descs[0]["mediaType"] == MEDIA_TYPE_CRIU
    assert [d["annotations"][ANN_TITLE] for d in descs] == ["criu"] * 7
    assert [
        (d["annotations"][ANN_CHUNK_FILE], d["annotations"][ANN_CHUNK_OFFSET],
         d["annotations"][ANN_CHUNK_RAW_SIZE], d["mediaType"])
        for d in descs[1:]
    ] == [
        ("pages-1.img", "0", "4096", MEDIA_TYPE_CRIU_CHUNK),
        ("pages-1.img", "4096", "4096", MEDIA_TYPE_CRIU_CHUNK),
        ("pages-1.img", "8192", "4096", MEDIA_TYPE_CRIU_CHUNK),
        ("pages-1.img", "12288", "2048", MEDIA_TYPE_CRIU_CHUNK),
        ("pages-3.img", "0", "4096", MEDIA_TYPE_CRIU_CHUNK),
        ("pages-3.img", "4096", "4096", MEDIA_TYPE_CRIU_CHUNK),
    ]  # fmt: skip
    assert [(c.file, c.offset, c.digest, c.size) for c in layer.chunks] == [
        (d["annotations"][ANN_CHUNK_FILE], int(d["annotations"][ANN_CHUNK_OFFSET]),
         d["digest"], d["size"])
        for d in descs[1:]
    ]  # fmt: skip
    assert [f.path for f in layer.split_files] == ["pages-1.img", "pages-2.img", "pages-3.img"]

    # Each chunk is a complete zstd frame of its piece of the file, nothing else.
    data = criu_files()["pages-1.img"][0]
    first = zstandard.ZstdDecompressor().decompress(read_blob(store, layer.chunks[1].digest))
    assert first == data[4096:8192]
    # The layer's tar holds everything else.
    tar_blob = read_blob(store, layer.digest)
    assert len(tar_blob) == layer.blob_size == layer.size - sum(c.size for c in layer.chunks)
    with tarfile.open(fileobj=zstandard.ZstdDecompressor().stream_reader(tar_blob), mode="r|") as t:
        names = sorted(m.name for m in t)
    assert names == ["core-1.img", "inventory.img", "sub", "sub/pages-9.img"]

    config = json.loads(read_blob(store, manifest["config"]["digest"]))
    split = config["layers"][0]["split_files"]
    assert split[0] == {"path": "pages-1.img", "size": 14336, "mode": 0o644, "mtime": 1_700_000_000}
    assert config["sizes"] == {"raw": layer.raw_size, "stored": layer.size}
    assert layer.raw_size > sum(len(d) for d, _ in criu_files().values())  # tar headers on top
    assert entry.to_json()["layers"][0]["chunks"] == 6
    assert entry.size > layer.size

    store.reader.verify(entry)
    dest = tmp_path / "out" / "images"
    store.reader.extract_layer(entry, "criu", str(dest))
    assert_tree(dest, criu_files())
    assert sorted(os.listdir(dest.parent)) == ["images"]


def test_open_layer_streams_the_whole_layer_as_one_tar(tmp_path: Path) -> None:
    store = chunked_store(tmp_path)
    entry = commit(store)
    with store.reader.open_layer(entry, "criu") as stream:
        data = stream.read()
    with tarfile.open(fileobj=io.BytesIO(data), mode="r:") as tar:
        got = {
            m.name: (tar.extractfile(m).read(), m.mode, m.mtime)  # type: ignore[union-attr]
            for m in tar
            if m.isreg()
        }
    assert got == {rel: (d, mode, 1_700_000_000) for rel, (d, mode) in criu_files().items()}


def test_chunk_size_zero_keeps_one_blob_per_layer(tmp_path: Path) -> None:
    store = make_store(tmp_path, chunk_size=0, cache_raw=False)
    entry = commit(store)
    (layer,) = entry.layers
    assert layer.chunks == () and layer.split_files == () and layer.blob_size == layer.size
    manifest = json.loads(read_blob(store, entry.manifest_digest))
    assert [d["mediaType"] for d in manifest["layers"]] == [MEDIA_TYPE_CRIU]
    config = json.loads(read_blob(store, manifest["config"]["digest"]))
    assert "split_files" not in config["layers"][0]


@pytest.mark.parametrize("size", [1, 4095, 257 << 20])
def test_chunk_size_out_of_range_is_refused(tmp_path: Path, size: int) -> None:
    with pytest.raises(errors.InvalidArgument, match="chunk_size"):
        Store(StoreConfig(root=str(tmp_path / "s"), chunk_size=size))


# --------------------------------------------------------------------------- sharing


def test_a_second_checkpoint_writes_only_the_chunks_that_changed(tmp_path: Path) -> None:
    store = chunked_store(tmp_path)
    first_files = criu_files()
    first = commit(store, first_files)
    inodes = {c.digest: blob(store, c.digest).stat().st_ino for c in first.layers[0].chunks}

    data = bytearray(first_files["pages-1.img"][0])
    data[5000:5100] = os.urandom(100)  # inside chunk 1 of pages-1.img only
    second_files = {**first_files, "pages-1.img": (bytes(data), 0o644)}
    before = blob_names(store)
    second = commit(store, second_files)

    old, new = first.layers[0].chunks, second.layers[0].chunks
    assert [c.digest for c in new] == [c.digest for c in old[:1]] + [new[1].digest] + [
        c.digest for c in old[2:]
    ]
    assert new[1].digest != old[1].digest
    added = blob_names(store) - before
    # Manifest, config, the new chunk; the tar of the rest is the same blob as before.
    assert len(added) == 3 and new[1].digest.removeprefix("sha256:") in added
    # The shared blobs were not rewritten: same files (inodes) as the first compaction made.
    for c in new:
        if c.digest in inodes:
            assert blob(store, c.digest).stat().st_ino == inodes[c.digest]
    store.reader.verify(first)
    store.reader.verify(second)
    dest = tmp_path / "second"
    store.reader.extract_layer(second, "criu", str(dest))
    assert (dest / "pages-1.img").read_bytes() == bytes(data)


def test_identical_chunks_in_one_layer_are_one_blob(tmp_path: Path) -> None:
    store = chunked_store(tmp_path)
    piece = os.urandom(CHUNK)
    files = {"pages-1.img": (piece * 3, 0o600), "pages-2.img": (piece, 0o600)}
    entry = commit(store, files)
    digests = {c.digest for c in entry.layers[0].chunks}
    assert len(entry.layers[0].chunks) == 4 and len(digests) == 1
    store.reader.verify(entry)
    dest = tmp_path / "out"
    store.reader.extract_layer(entry, "criu", str(dest))
    assert (dest / "pages-1.img").read_bytes() == piece * 3


def test_a_shared_chunk_is_removed_only_when_no_checkpoint_needs_it(tmp_path: Path) -> None:
    store = chunked_store(tmp_path)
    first = commit(store)
    second = commit(store)  # same files: every chunk shared
    shared = {c.digest for c in first.layers[0].chunks}
    assert shared == {c.digest for c in second.layers[0].chunks}
    store.maintenance.remove(first.id)
    store.maintenance.gc()
    assert blob_names(store) == referenced_blobs(store)
    assert all(blob(store, d).exists() for d in shared)
    store.reader.verify(second)
    store.maintenance.remove(second.id)
    store.maintenance.gc()
    assert blob_names(store) == set()


def test_a_shared_chunk_swept_during_compaction_is_still_committed(tmp_path: Path) -> None:
    """The compaction pins a chunk the store already has (a hard link in its work dir):
    a gc that removes the only checkpoint referencing it meanwhile cannot lose it."""
    root = tmp_path / "store"
    first = commit(chunked_store(tmp_path))
    shared = [c.digest for c in first.layers[0].chunks]
    other = Store(StoreConfig(root=str(root), chunk_size=CHUNK, cache_raw=False, retain=0))

    def on_step(step: str) -> None:
        if step == "layer-written":
            other.maintenance.remove(first.id)
            assert not any(blob(other, d).exists() for d in shared)

    store = Store(
        StoreConfig(root=str(root), chunk_size=CHUNK, cache_raw=False, retain=0), step_hook=on_step
    )
    second = commit(store)
    assert [e.id for e in store.catalog.list()] == [second.id]
    assert [c.digest for c in second.layers[0].chunks] == shared
    store.reader.verify(second)
    store.maintenance.gc()
    assert blob_names(store) == referenced_blobs(store)


def test_a_damaged_blob_of_the_same_digest_is_not_reused_but_healed(tmp_path: Path) -> None:
    store = chunked_store(tmp_path)
    first = commit(store)
    chunk = first.layers[0].chunks[0]
    path = blob(store, chunk.digest)
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(errors.DataLoss, match="corrupt"):
        store.reader.verify(first)

    second = commit(store)
    assert second.layers[0].chunks[0].digest == chunk.digest
    store.reader.verify(second)
    store.reader.verify(first)  # the new copy replaced the damaged one


# --------------------------------------------------------------------------- damage


def test_a_corrupt_chunk_is_data_loss_naming_checkpoint_and_chunk(tmp_path: Path) -> None:
    store = chunked_store(tmp_path)
    entry = commit(store)
    chunk = entry.layers[0].chunks[2]
    path = blob(store, chunk.digest)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))

    where = f"checkpoint {entry.id}: layer 'criu': chunk of pages-1.img at offset 8192 ({path})"
    store.reader.verify(entry, deep=False)  # same size: only the digest can tell
    with pytest.raises(errors.DataLoss) as info:
        store.reader.verify(entry)
    assert str(info.value).startswith(f"{where}: blob is corrupt (sha256 is ")
    dest = tmp_path / "out"
    with pytest.raises(errors.DataLoss) as info:
        store.reader.extract_layer(entry, "criu", str(dest))
    assert str(info.value).startswith(f"{where}: blob is corrupt")
    assert not dest.exists() and os.listdir(tmp_path) == ["store"]
    with pytest.raises(errors.DataLoss, match="corrupt"):
        store.reader.open_layer(entry, "criu")


def test_a_missing_or_truncated_chunk_is_data_loss(tmp_path: Path) -> None:
    store = chunked_store(tmp_path)
    entry = commit(store)
    chunks = entry.layers[0].chunks
    truncated = blob(store, chunks[0].digest)
    good = truncated.read_bytes()
    os.truncate(truncated, 3)
    with pytest.raises(errors.DataLoss) as info:
        store.reader.verify(entry, deep=False)
    assert str(info.value) == (
        f"checkpoint {entry.id}: layer 'criu': chunk of pages-1.img at offset 0 ({truncated}): "
        f"blob is 3 bytes, expected {chunks[0].size} (truncated?)"
    )
    truncated.write_bytes(good)

    missing = blob(store, chunks[-1].digest)
    missing.unlink()
    where = (
        f"checkpoint {entry.id}: layer 'criu': chunk of pages-3.img at offset 4096 ({missing}): "
        f"blob {missing} is missing"
    )
    with pytest.raises(errors.DataLoss) as info:
        store.reader.verify(entry, deep=False)
    assert str(info.value) == where
    with pytest.raises(errors.DataLoss) as info:
        store.reader.extract_layer(entry, "criu", str(tmp_path / "out"))
    assert str(info.value) == where
    assert os.listdir(tmp_path) == ["store"]


def test_read_chunk_checks_the_frame_against_the_manifest(tmp_path: Path) -> None:
    frame = zstandard.ZstdCompressor().compress(b"x" * 100)
    path = tmp_path / "blob"
    path.write_bytes(frame)
    digest = "sha256:" + hashlib.sha256(frame).hexdigest()
    fd = os.open(path, os.O_RDONLY)
    try:
        buffers = ChunkBuffers()
        chunk = Chunk("pages-1.img", 0, 100, digest, len(frame))
        assert read_chunk(fd, chunk, "c", buffers) == b"x" * 100
        with pytest.raises(errors.DataLoss, match="c: its zstd frame holds 100 bytes"):
            read_chunk(fd, Chunk("pages-1.img", 0, 99, digest, len(frame)), "c", buffers)
        with pytest.raises(errors.DataLoss, match="c: blob is corrupt"):
            bad = Chunk("pages-1.img", 0, 100, "sha256:" + "0" * 64, len(frame))
            read_chunk(fd, bad, "c", buffers)
    finally:
        os.close(fd)


# --------------------------------------------------------------------------- compatibility


def test_checkpoints_from_before_chunks_still_work_beside_chunked_ones(tmp_path: Path) -> None:
    old_store = make_store(tmp_path, chunk_size=0, cache_raw=False, retain=0)
    old = commit(old_store, label="old")
    store = chunked_store(tmp_path)
    new = commit(store, label="new")
    assert old.layers[0].chunks == () and len(new.layers[0].chunks) == 6

    assert {e.id for e in store.catalog.list()} == {old.id, new.id}
    for entry in (old, new):
        store.reader.verify(entry)
        dest = tmp_path / entry.id
        store.reader.extract_layer(entry, "criu", str(dest))
        assert_tree(dest, criu_files())
    store.maintenance.gc()
    assert blob_names(store) == referenced_blobs(store)

    Path(store.root, "index.json").unlink()
    report = make_store(tmp_path, chunk_size=CHUNK).catalog.last_repair
    assert report is not None and {cid for cid, _ in report.recovered} == {old.id, new.id}
    assert report.dropped == ()
    assert {e.id: e for e in store.catalog.list()} == {old.id: old, new.id: new}


def test_repair_drops_a_checkpoint_whose_chunk_is_gone(tmp_path: Path) -> None:
    store = chunked_store(tmp_path)
    good = commit(store, label="good")
    files = {**criu_files(), "pages-3.img": (pages(2, 77), 0o640)}
    bad = commit(store, files, label="bad")
    only_bad = {c.digest for c in bad.layers[0].chunks} - {c.digest for c in good.layers[0].chunks}
    blob(store, sorted(only_bad)[0]).unlink()
    Path(store.root, "index.json").write_bytes(b"{damaged")

    report = store.maintenance.repair()
    assert [cid for cid, _ in report.recovered] == [good.id]
    assert [what for what, _ in report.dropped] == [
        f"checkpoint {bad.id} (manifest {bad.manifest_digest})"
    ]
    assert "is missing" in report.dropped[0][1]
    store.reader.verify(store.catalog.get(good.id))
