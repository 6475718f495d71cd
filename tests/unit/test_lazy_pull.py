"""A lazy restore's pull (checkpoint/remote/lazy_pull.py, checkpoint/lazy_remote.py),
against a shared directory standing for the registry and real stores: the small blobs
and the pages CRIU's restore reads itself come first, every other chunk only when
asked for (once), and the checkpoint reaches the store only when all of it is staged,
exactly as a full pull leaves it; given up, it leaves nothing. A fetch broken off
leaves nothing staged; a filesystem without room for the raw pages is refused before
any is written."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import pytest
from cedana_shim import errors
from cedana_shim.checkpoint.lazy_remote import NoRoomForPages, ServedCheckpoint
from cedana_shim.checkpoint.pagemap_image import (
    PAGE_SIZE,
    PE_LAZY,
    PE_PRESENT,
    Pagemap,
    PagemapEntry,
    encode,
)
from cedana_shim.checkpoint.remote import RemoteStore
from cedana_shim.checkpoint.remote.shared_dir import SharedDirectory
from cedana_shim.checkpoint.store import Entry
from support.checkpoints import NODE, SCOPE, MiB, commit_checkpoint, open_store, staging_dirs

CHUNK = 256 << 10
PAGES = 4 * MiB
EAGER = 1 * MiB  # the last MiB: a run CRIU's restore reads itself (not PE_LAZY)
BASE = 0x7F00_0000_0000


class CountingDirectory(SharedDirectory):
    def __init__(self, path: str) -> None:
        super().__init__(path)
        self.pulled: list[str] = []
        self.cut: set[str] = set()  # blobs whose next pull breaks off halfway

    def pull_blob(
        self, repo: str, digest: str, size: int, dest: Any, *args: Any, **kw: Any
    ) -> None:
        self.pulled.append(digest)
        if digest in self.cut:
            self.cut.discard(digest)
            dest.write(b"x" * (size // 2))
            raise errors.Unavailable(f"registry: download of blob {digest}: connection reset")
        super().pull_blob(repo, digest, size, dest, *args, **kw)


def _files(pages: bytes) -> dict[str, bytes]:
    lazy, eager = (PAGES - EAGER) // PAGE_SIZE, EAGER // PAGE_SIZE
    pagemap = Pagemap(
        1,
        (
            PagemapEntry(BASE, lazy, PE_PRESENT | PE_LAZY),
            PagemapEntry(BASE + (lazy + 16) * PAGE_SIZE, eager, PE_PRESENT),
        ),
    )
    return {
        "pages-1.img": pages,
        "pagemap-1.img": encode(pagemap),
        "core-1.img": b"core" * 1000,
        "inventory.img": b"inv",
    }


class Moved:
    """A checkpoint pushed from store A, and node B's view of it."""

    def __init__(self, tmp_path: Path) -> None:
        shared = tmp_path / "shared"
        shared.mkdir(mode=0o700)
        self.a = open_store(tmp_path / "store-a", chunk_size=CHUNK)
        self.pages = os.urandom(PAGES)
        self.entry = commit_checkpoint(self.a, _files(self.pages))
        RemoteStore(self.a, SharedDirectory(str(shared)), NODE).push(self.entry.id)
        self.b = open_store(tmp_path / "store-b", chunk_size=CHUNK)
        self.directory = CountingDirectory(str(shared))
        self.remote_b = RemoteStore(self.b, self.directory, "node-b")
        (self.found,) = self.remote_b.candidates(SCOPE, "trainer")

    def chunks(self) -> list[Any]:
        return list(self.entry.layer("criu").chunks)


@pytest.fixture
def moved(tmp_path: Path) -> Moved:
    return Moved(tmp_path)


def _small(entry: Entry) -> set[str]:
    return {layer.digest for layer in entry.layers}


def test_begin_stages_the_small_blobs_and_chunks_come_once_when_asked(moved: Moved) -> None:
    pull = moved.remote_b.lazy_pull(moved.found)
    pull.begin()
    try:
        chunks = moved.chunks()
        assert not set(moved.directory.pulled) & {c.digest for c in chunks}
        assert _small(moved.entry) <= set(moved.directory.pulled)
        one = chunks[3]
        blob = pull.fetch_chunk(one)
        assert len(blob) == one.size
        assert pull.fetch_chunk(one) == blob  # staged: read back, not pulled again
        assert moved.directory.pulled.count(one.digest) == 1
        committed = pull.commit()
    finally:
        pull.close()
    assert committed.id == moved.entry.id
    moved.b.reader.verify(committed, deep=True)
    assert staging_dirs(moved.b) == []


def test_a_fetch_broken_off_stages_nothing_and_the_next_try_starts_afresh(
    moved: Moved,
) -> None:
    pull = moved.remote_b.lazy_pull(moved.found)
    pull.begin()
    try:
        one = moved.chunks()[2]
        moved.directory.cut.add(one.digest)
        with pytest.raises(errors.Unavailable, match="connection reset"):
            pull.fetch_chunk(one)
        (staging,) = staging_dirs(moved.b)
        left = os.listdir(os.path.join(moved.b.root, "ingest", staging))
        assert not [n for n in left if one.digest.removeprefix("sha256:") in n]  # no part file
        blob = pull.fetch_chunk(one)  # pulled again, whole: not the half of before
        assert len(blob) == one.size and moved.directory.pulled.count(one.digest) == 2
        for chunk in moved.chunks():
            pull.fetch_chunk(chunk)
        committed = pull.commit()
    finally:
        pull.close()
    moved.b.reader.verify(committed, deep=True)


def test_given_up_it_leaves_nothing(moved: Moved) -> None:
    pull = moved.remote_b.lazy_pull(moved.found)
    pull.begin()
    pull.fetch_chunk(moved.chunks()[0])
    pull.close()
    assert moved.b.catalog.list() == []
    assert staging_dirs(moved.b) == []


def test_a_served_checkpoint_has_only_what_the_restore_reads_before_it_starts(
    moved: Moved, tmp_path: Path
) -> None:
    images = tmp_path / "work" / "images"
    served = ServedCheckpoint(moved.remote_b.lazy_pull(moved.found), str(images))
    try:
        served.prepare()
        assert served.chunked()
        eager = {c.digest for c in moved.chunks() if c.offset + c.raw_size > PAGES - EAGER}
        all_chunks = {c.digest for c in moved.chunks()}
        assert set(moved.directory.pulled) & all_chunks == eager
        written = (images / "pages-1.img").read_bytes()
        assert len(written) == PAGES
        assert written[PAGES - EAGER :] == moved.pages[PAGES - EAGER :]
        assert written[: CHUNK * 4] == bytes(CHUNK * 4)  # lazy pages: not there yet
        assert (images / "core-1.img").read_bytes() == b"core" * 1000
        assert served.entry().id == moved.entry.id
        served.resumed()  # the prefetch fills the rest; then the commit
        committed = served.commit()
        assert (images / "pages-1.img").read_bytes() == moved.pages
    finally:
        served.close()
    moved.b.reader.verify(committed, deep=True)
    assert staging_dirs(moved.b) == []


def _little_room(monkeypatch: pytest.MonkeyPatch, under: Path, free: int) -> None:
    """statvfs says the filesystem of ``under`` has ``free`` bytes left."""
    real = os.statvfs

    def statvfs(path: Any) -> os.statvfs_result:
        st = real(path)
        if not os.fspath(path).startswith(str(under)):
            return st
        fields = list(st)  # f_bsize, f_frsize, f_blocks, f_bfree, f_bavail, ...
        fields[3] = fields[4] = free // st.f_frsize
        return os.statvfs_result(fields)

    monkeypatch.setattr(os, "statvfs", statvfs)


def test_no_room_for_the_raw_pages_is_refused_before_one_is_written(
    moved: Moved, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    images = tmp_path / "work" / "images"
    free = PAGES // 2  # the chunks, compressed, would fit; the raw pages do not
    _little_room(monkeypatch, tmp_path / "work", free)
    served = ServedCheckpoint(moved.remote_b.lazy_pull(moved.found), str(images))
    try:
        with pytest.raises(NoRoomForPages) as info:
            served.prepare()
        assert isinstance(info.value, errors.ResourceExhausted)
        message = str(info.value)
        assert f"checkpoint {moved.entry.id} " in message and str(images) in message
        assert f"which has {free} free" in message
        assert f"its raw memory pages ({PAGES} bytes)" in message
        # The store is on this filesystem too: the chunks still to download count.
        chunks = sum(c.size for c in moved.chunks())
        assert f"needs {PAGES + chunks} bytes" in message
        assert "from a full pull instead" in message
        assert not (images / "pages-1.img").exists()  # nothing truncated, nothing fetched
        assert not set(moved.directory.pulled) & {c.digest for c in moved.chunks()}
    finally:
        served.close()
    assert staging_dirs(moved.b) == []
