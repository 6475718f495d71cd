"""A zstd bomb in a checkpoint (a small blob that expands far past the raw size its
config records) is refused at that size by every decompression of the store: the
pull's raw-image cache, the restore's extraction of a layer, a layer streamed into a
rootfs, a chunk. Nothing past the recorded size is written."""

from __future__ import annotations

import io
import os
import subprocess
import sys
import textwrap
from collections.abc import Callable, Iterator
from datetime import datetime, timedelta
from pathlib import Path
from typing import IO

import pytest
import zstandard
from cedana_shim.checkpoint.remote import RemoteCheckpoint, RemoteStore
from cedana_shim.checkpoint.remote.shared_dir import SharedDirectory
from cedana_shim.checkpoint.store import Entry, Store
from cedana_shim.checkpoint.store.compress import RawBound, ZstdReader
from cedana_shim.checkpoint.store.layout import (
    ANN_CREATED,
    ANN_ID,
    ANN_LABEL,
    ANN_SCOPE,
    MEDIA_TYPE_MANIFEST,
    CheckpointRef,
    Descriptor,
    parse_checkpoint_ref,
    parse_config,
    parse_manifest,
)
from cedana_shim.errors import DataLoss
from store_support import make_store, stage, tar_bytes
from support.checkpoints import NODE, SCOPE, MiB, commit_checkpoint, open_store, staging_dirs
from support.forged import RECORDED_TAR_BYTES, adopt_forged, forge, push_forged, zstd_bomb

EXPANDS_TO = 64 * MiB
FILES = {"pages-1.img": os.urandom(100_000), "core-1.img": b"core" * 100, "inventory.img": b"i"}


@pytest.fixture(scope="module")
def bomb() -> bytes:
    data = zstd_bomb(EXPANDS_TO)
    assert len(data) < EXPANDS_TO // 1000  # a bomb: KiBs for MiBs
    return data


@pytest.fixture
def source(tmp_path: Path) -> tuple[Store, Entry]:
    store = open_store(tmp_path / "a", chunk_size=16 << 10)
    return store, commit_checkpoint(store, FILES)


def _later(entry: Entry, minutes: int = 5) -> datetime:
    return datetime.fromisoformat(entry.created) + timedelta(minutes=minutes)


def _ref(entry: Entry) -> CheckpointRef:
    values = (entry.id, entry.scope, entry.label, entry.created)
    annotations = dict(zip((ANN_ID, ANN_SCOPE, ANN_LABEL, ANN_CREATED), values, strict=True))
    return parse_checkpoint_ref(
        Descriptor(MEDIA_TYPE_MANIFEST, entry.manifest_digest, 1, annotations), 0, "test"
    )


def test_the_bounded_reader_hands_out_nothing_past_the_recorded_size(bomb: bytes) -> None:
    reader = ZstdReader(io.BytesIO(bomb), RawBound(4096, "layer x"), "layer x")
    received = 0
    with pytest.raises(DataLoss, match=r"more than the 4096 bytes recorded for it; refused at"):
        while data := reader.read(1000):
            received += len(data)
    assert received <= 4096
    short = zstandard.ZstdCompressor().compress(b"x" * 100)
    with pytest.raises(DataLoss, match="decompresses to 100 bytes, 200 recorded"):
        ZstdReader(short, RawBound(200, "layer y"), "layer y").drain()
    exact = ZstdReader(short, RawBound(100, "layer z"), "layer z")
    assert exact.read() == b"x" * 100


_EXTRACT_UNDER_A_FILE_SIZE_LIMIT = """
import resource, signal, sys
from cedana_shim import errors
from cedana_shim.checkpoint.store import Store, StoreConfig

root, checkpoint_id, layer, dest = sys.argv[1:]
store = Store(StoreConfig(root=root, cache_raw=False))
entry = store.catalog.get(checkpoint_id)
store.reader.verify(entry)  # the digests are the forger's own: they check out
# Writing more than 1 MiB into any file fails (EFBIG) from here on.
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
try:
    store.reader.extract_layer(entry, layer, dest)
except errors.ShimError as err:
    print(type(err).__name__, err)
"""


def test_extracting_a_bombed_layer_is_refused_at_its_recorded_size(
    source: tuple[Store, Entry], bomb: bytes, tmp_path: Path
) -> None:
    """The restore's extraction of a pulled checkpoint's CRIU layer (no raw-image cache):
    refused at the recorded size, nothing written past it (the child may not write 1 MiB
    into a file: before, the extraction got EFBIG there, 1 MiB into the 64 MiB member)."""
    store, entry = source
    target = open_store(tmp_path / "b", cache_raw=False)
    forged = adopt_forged(target, store, forge(store, entry, _later(entry), bomb=bomb))
    dest = tmp_path / "images"
    child = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(_EXTRACT_UNDER_A_FILE_SIZE_LIMIT),
         target.root, forged.id, "criu", str(dest)],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert child.returncode == 0, child.stderr
    assert child.stdout.startswith("DataLoss "), child.stdout
    assert f"more than the {RECORDED_TAR_BYTES} bytes recorded for it" in child.stdout
    assert not dest.exists() and os.listdir(tmp_path).count("images") == 0


def test_a_bombed_layer_stream_is_cut_at_its_recorded_size(bomb: bytes, tmp_path: Path) -> None:
    """A rootfs diff streamed from its blob (what a restore spools and applies)."""
    store = make_store(tmp_path / "a")
    entry = store.commit(stage(store, "trainer", diff=tar_bytes({"etc/motd": b"hi"})))
    target = make_store(tmp_path / "b", cache_raw=False)
    forged = forge(store, entry, _later(entry), bomb=bomb, layer="rootfs-diff")
    adopted = adopt_forged(target, store, forged)
    received = 0
    with (
        pytest.raises(DataLoss, match=f"more than the {RECORDED_TAR_BYTES} bytes recorded"),
        target.reader.open_layer(adopted, "rootfs-diff") as stream,
    ):
        while data := stream.read(64 << 10):
            received += len(data)
    assert received <= RECORDED_TAR_BYTES


@pytest.fixture
def shared(tmp_path: Path) -> Iterator[SharedDirectory]:
    path = tmp_path / "shared"
    path.mkdir(mode=0o700)
    yield SharedDirectory(str(path))


def test_a_bombed_checkpoint_fails_its_pull_and_leaves_nothing(
    source: tuple[Store, Entry], bomb: bytes, shared: SharedDirectory, tmp_path: Path
) -> None:
    """With the raw-image cache on (the default), the pull unpacks the CRIU layer's tar
    beside the page images as it adopts: refused there, nothing of the pull stays.
    Before, the tar came out whole (64 MiB in the staging dir), the cache was dropped
    and the forged checkpoint committed."""
    store, entry = source
    forged = forge(store, entry, _later(entry), bomb=bomb)
    tag = push_forged(shared, store, forged, NODE, scope=SCOPE)
    target = open_store(tmp_path / "b", chunk_size=16 << 10)
    puller = RemoteStore(target, shared, "node-b")
    (candidate,) = [c for c in puller.candidates(SCOPE, "trainer") if c.tag == tag.tag]
    assert isinstance(candidate, RemoteCheckpoint)
    with pytest.raises(DataLoss, match=f"more than the {RECORDED_TAR_BYTES} bytes recorded"):
        puller.pull(candidate)
    assert target.catalog.list() == [] and staging_dirs(target) == []
    assert not os.path.exists(os.path.join(target.root, "raw", forged.id))
    assert not os.listdir(os.path.join(target.root, "blobs", "sha256"))


def _pieces(data: bytes) -> Callable[[IO[bytes]], None]:
    def fill(out: IO[bytes]) -> None:
        for i in range(0, len(data), 5000):  # as a download streams
            out.write(data[i : i + 5000])

    return fill


def test_a_chunk_that_expands_past_its_raw_size_is_refused_while_it_streams(
    source: tuple[Store, Entry], bomb: bytes, tmp_path: Path
) -> None:
    """A page-image chunk decompressed into the raw-image cache as it downloads (bounded
    before too, by a check of its own: now by the same RawBound as every other path)."""
    store, entry = source
    chunk = entry.layer("criu").chunks[0]
    manifest = parse_manifest(store.adopter.checkpoint_manifest(entry), "manifest")
    with store.adopter.open_blob(manifest.config.digest, "config") as f:
        config = f.read()
    target = open_store(tmp_path / "b", chunk_size=16 << 10)
    with target.adopter.begin_adoption(entry.id) as adoption:
        adoption.write_blob(manifest.config.digest, len(config), _pieces(config))
        assert adoption.begin_cache(manifest, parse_config(config, "config", _ref(entry)))
        with pytest.raises(DataLoss, match=f"more than the {chunk.raw_size} bytes recorded"):
            adoption.write_blob(chunk.digest, len(bomb), _pieces(bomb))
    assert target.catalog.list() == []
