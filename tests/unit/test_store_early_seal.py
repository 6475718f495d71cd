"""Page images sealed while they are written (EarlySealer) and the publish that uses it."""

from __future__ import annotations

import errno
import os
import threading
import time
import zlib
from pathlib import Path
from typing import Any

import pytest
from cedana_shim import errors
from cedana_shim.checkpoint.store import early_seal, fsutil
from cedana_shim.checkpoint.store.early_seal import EarlySealer, Prefix
from cedana_shim.checkpoint.store.layout import MEDIA_TYPE_CRIU
from store_support import make_store

PIECE = 256 << 10


def _append_slowly(path: Path, pieces: list[bytes], gap: float = 0.01) -> threading.Thread:
    """A writer that appends like CRIU does, a piece at a time."""

    def run() -> None:
        with open(path, "ab", buffering=0) as f:
            for piece in pieces:
                f.write(piece)
                time.sleep(gap)

    thread = threading.Thread(target=run)
    thread.start()
    return thread


def _wait_until_read(sealer: EarlySealer, at_least: int) -> None:
    deadline = time.monotonic() + 10
    while sealer.bytes_read < at_least:
        assert time.monotonic() < deadline, f"never read {at_least} bytes"
        time.sleep(0.01)


def _stopped(sealer: EarlySealer) -> dict[str, Prefix]:
    kept: list[tuple[dict[str, Prefix], OSError | None]] = []
    sealer._keep = lambda read, error: kept.append((read, error))
    sealer.stop()
    ((prefixes, error),) = kept
    assert error is None
    return prefixes


def test_it_reads_what_a_growing_page_image_holds_and_leaves_other_files(tmp_path: Path) -> None:
    pieces = [os.urandom(PIECE) for _ in range(20)]
    (tmp_path / "core-1.img").write_bytes(b"core")
    sealer = EarlySealer(str(tmp_path))
    _append_slowly(tmp_path / "pages-1.img", pieces).join()
    _wait_until_read(sealer, len(pieces) * PIECE)
    prefixes = _stopped(sealer)

    data = b"".join(pieces)
    st = (tmp_path / "pages-1.img").stat()
    assert prefixes == {"pages-1.img": Prefix(st.st_dev, st.st_ino, len(data), zlib.crc32(data))}
    assert sealer.bytes_read == 0  # its fds are closed


def test_stop_returns_after_at_most_one_pass(tmp_path: Path) -> None:
    (tmp_path / "pages-1.img").write_bytes(os.urandom(8 << 20))
    sealer = EarlySealer(str(tmp_path))
    started = time.monotonic()
    sealer.stop()
    assert time.monotonic() - started < 2.0


def _publish_followed(tmp_path: Path, change: str) -> Prefix:
    """A dump's page image read early, then changed by ``change``, then published:
    the listed CRC is the file's as it is; the prefix read is returned."""
    store = make_store(tmp_path)
    ing = store.writer.begin(scope="ns", label="app", metadata={"container": "c1"})
    images = Path(ing.dir("criu"))
    (images / "inventory.img").write_bytes(b"inv")
    sealer = ing.seal_early(str(images))
    pieces = [os.urandom(PIECE) for _ in range(8)]
    _append_slowly(images / "pages-1.img", pieces).join()
    _wait_until_read(sealer, 8 * PIECE)
    sealer.stop()
    (prefix,) = ing.prefixes(str(images)).values()
    data = b"".join(pieces)
    if change == "appended":
        extra = os.urandom(1000)
        with open(images / "pages-1.img", "ab") as f:
            f.write(extra)
        data += extra
    elif change == "replaced":
        data = os.urandom(len(data))
        (images / "new").write_bytes(data)
        os.replace(images / "new", images / "pages-1.img")
    elif change == "truncated":
        data = data[:PIECE]
        os.truncate(images / "pages-1.img", PIECE)
    ing.add_dir_layer("criu", str(images), MEDIA_TYPE_CRIU)
    entry = store.writer.publish(ing)
    store.reader.verify(entry)  # every CRC as listed matches the files as they are
    files = store.catalog.file_list(entry, "criu")
    assert files is not None
    (listed,) = [f for f in files.files if f.path == "pages-1.img"]
    assert (listed.size, listed.crc32) == (len(data), zlib.crc32(data))
    return prefix


def test_publish_goes_on_from_the_prefix_of_a_file_that_grew_after(tmp_path: Path) -> None:
    assert _publish_followed(tmp_path, "appended").size == 8 * PIECE


def test_a_prefix_of_another_inode_or_a_longer_one_is_not_used(tmp_path: Path) -> None:
    for change in ("replaced", "truncated"):
        assert _publish_followed(tmp_path / change, change).size == 8 * PIECE


def test_a_pass_starts_the_writeback_of_what_the_file_holds_and_never_waits_for_it(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    started: list[tuple[int, int]] = []
    real = early_seal.start_writeback

    def spy(fd: int, offset: int, length: int) -> None:
        started.append((offset, length))
        real(fd, offset, length)

    def never(fd: int) -> None:
        raise AssertionError("an fdatasync per pass stalls CRIU's appends (journal commits)")

    monkeypatch.setattr(early_seal, "start_writeback", spy)
    monkeypatch.setattr(early_seal.os, "fdatasync", never)
    (tmp_path / "pages-2.img").write_bytes(os.urandom(PIECE))
    sealer = EarlySealer(str(tmp_path))
    _wait_until_read(sealer, PIECE)
    with (tmp_path / "pages-2.img").open("ab") as f:
        f.write(os.urandom(PIECE))
    _wait_until_read(sealer, 2 * PIECE)
    sealer.stop()
    assert started[:2] == [(0, PIECE), (PIECE, PIECE)]


def test_the_writeback_of_all_a_file_holds_starts_before_any_of_it_is_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The disk keeps pace with CRIU, not with the CRC reads: the first pass starts the
    writeback of the whole file, though it reads only _PASS_BYTES of it."""
    events: list[tuple[str, int, int]] = []
    read = EarlySealer._read

    def spy_writeback(fd: int, offset: int, length: int) -> None:
        events.append(("writeback", offset, length))

    def spy_read(self: EarlySealer, f: Any, size: int) -> int:
        events.append(("read", f.size, size))
        return read(self, f, size)

    monkeypatch.setattr(early_seal, "start_writeback", spy_writeback)
    monkeypatch.setattr(EarlySealer, "_read", spy_read)
    monkeypatch.setattr(early_seal, "_PASS_BYTES", PIECE)
    (tmp_path / "pages-1.img").write_bytes(os.urandom(4 * PIECE))
    sealer = EarlySealer(str(tmp_path))
    _wait_until_read(sealer, 4 * PIECE)
    sealer.stop()
    assert events[0] == ("writeback", 0, 4 * PIECE)
    # Then only reads, a piece a pass, never the same bytes' writeback again.
    reads = [(offset, size) for what, offset, size in events[1:] if what == "read"]
    assert len(reads) == len(events) - 1
    assert reads[:4] == [(0, 4 * PIECE), (PIECE, 4 * PIECE), (2 * PIECE, 4 * PIECE),
                         (3 * PIECE, 4 * PIECE)]  # fmt: skip


def test_passes_follow_each_other_without_a_pause_while_there_is_more_to_read(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(early_seal, "_PASS_BYTES", PIECE)
    monkeypatch.setattr(early_seal, "_BUSY_BYTES", PIECE)
    monkeypatch.setattr(early_seal, "_PASS_INTERVAL_S", 30.0)
    (tmp_path / "pages-1.img").write_bytes(os.urandom(16 * PIECE))
    started = time.monotonic()
    sealer = EarlySealer(str(tmp_path))
    _wait_until_read(sealer, 16 * PIECE)  # 16 passes, far less than one pause
    assert time.monotonic() - started < 10
    sealer.stop()


def test_a_pass_that_found_little_new_pauses(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A slow dump, where every pass finds a few pages new, must not make the follower
    a busy loop beside CRIU."""
    passes: list[float] = []

    def a_few_pages_each_time(self: EarlySealer, dir_fd: int) -> int:
        passes.append(time.monotonic())
        return 4096

    monkeypatch.setattr(EarlySealer, "_pass", a_few_pages_each_time)
    monkeypatch.setattr(early_seal, "_PASS_INTERVAL_S", 0.05)
    sealer = EarlySealer(str(tmp_path))
    time.sleep(0.5)
    sealer.stop()
    assert 2 <= len(passes) <= 12  # one per pause, not thousands


def test_the_writeback_starts_with_sync_file_range(tmp_path: Path) -> None:
    """The real call: the range given back to the kernel, no error."""
    assert fsutil._sync_file_range() is not None  # Linux's libc has it
    path = tmp_path / "pages-1.img"
    path.write_bytes(os.urandom(PIECE))
    fd = os.open(path, os.O_RDONLY)
    try:
        fsutil.start_writeback(fd, 0, PIECE)
    finally:
        os.close(fd)


def test_a_writeback_that_cannot_start_fails_the_publish(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Delayed allocation finds a full disk when the writeback starts: the publish
    fails with it (the seal's own fsync may not be told)."""

    def full(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(early_seal, "start_writeback", full)
    store = make_store(tmp_path)
    ing = store.writer.begin(scope="ns", label="app", metadata={"container": "c1"})
    images = Path(ing.dir("criu"))
    (images / "pages-1.img").write_bytes(os.urandom(PIECE))
    sealer = ing.seal_early(str(images))
    deadline = time.monotonic() + 10
    while sealer._error is None:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    sealer.stop()
    ing.add_dir_layer("criu", str(images), MEDIA_TYPE_CRIU)
    with pytest.raises(errors.ResourceExhausted, match="No space left"):
        store.writer.publish(ing)
    assert store.catalog.list() == []
