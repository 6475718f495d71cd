"""The lazy restore's page server (checkpoint/remote/page_protocol.py, page_map.py,
page_server.py): CRIU 4.2's page_server_iov codec round-trips and is laid out as
CRIU's C struct; a request maps to the right bytes of the right pages image and to
the chunks holding them; the server answers GETs with the checkpoint's own bytes,
fetching a chunk only when needed, and a chunk that does not verify (or cannot be
fetched) is never served: the server stops answering and reports it. A fetch that
fails as a network does is tried again a few times first (one that fetched a blob
that does not verify is not), and never once the filler is stopped."""

from __future__ import annotations

import hashlib
import itertools
import logging
import os
import socket
import struct
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import zstandard
from cedana_shim.checkpoint.pagemap_image import (
    PAGE_SIZE,
    PE_LAZY,
    PE_PARENT,
    PE_PRESENT,
    Pagemap,
    PagemapEntry,
)
from cedana_shim.checkpoint.remote import page_protocol as proto
from cedana_shim.checkpoint.remote.page_map import PageMap, PageRun
from cedana_shim.checkpoint.remote.page_server import ChunkFiller, PageServer
from cedana_shim.checkpoint.store.chunks import unpack_chunk
from cedana_shim.checkpoint.store.layout import Chunk
from cedana_shim.errors import DataLoss, DeadlineExceeded, Unavailable
from hypothesis import given
from hypothesis import strategies as st

PS = PAGE_SIZE
BASE = 0x7F00_0000_0000
U64 = st.integers(0, (1 << 64) - 1)
U16 = st.integers(0, (1 << 16) - 1)
LAZY = PE_PRESENT | PE_LAZY

# -- the codec -------------------------------------------------------------------------


@given(U16, U16, U64, U64, U64)
def test_header_round_trips(command: int, flags: int, nr: int, vaddr: int, dst: int) -> None:
    iov = proto.PageIov(command, flags, nr, vaddr, dst)
    data = proto.encode(iov)
    assert len(data) == proto.HEADER.size == 32
    assert proto.decode(data) == iov


@given(U16, U16, U64, U64, U64)
def test_header_is_criu_struct_layout(
    command: int, flags: int, nr: int, vaddr: int, dst: int
) -> None:
    """struct page_server_iov {u32 cmd; u64 nr_pages; u64 vaddr; u64 dst_id;}: the
    host's byte order and alignment, cmd = flags << 16 | command."""
    data = proto.encode(proto.PageIov(command, flags, nr, vaddr, dst))
    assert struct.unpack("@IQQQ", data) == (flags << 16 | command, nr, vaddr, dst)


@given(st.binary().filter(lambda b: len(b) != 32))
def test_decode_refuses_other_sizes(data: bytes) -> None:
    with pytest.raises(ValueError):
        proto.decode(data)


@given(U64.filter(lambda n: n > 0), U64, U64, st.data())
def test_pages_reply_echoes_the_request(nr: int, vaddr: int, dst: int, data: st.DataObject) -> None:
    request = proto.PageIov(proto.PS_IOV_GET, 0, nr, vaddr, dst)
    served = data.draw(st.integers(1, nr))
    reply = proto.decode(proto.pages_reply(request, served))
    assert (reply.command, reply.flags) == (proto.PS_IOV_ADD_F, PE_PRESENT)
    assert (reply.nr_pages, reply.vaddr, reply.dst_id) == (served, vaddr, dst)


def test_pages_reply_never_more_than_asked_nor_none() -> None:
    request = proto.PageIov(proto.PS_IOV_GET, 0, 4, BASE, 1)
    for bad in (0, 5):
        with pytest.raises(ValueError):
            proto.pages_reply(request, bad)


def test_values_out_of_range_are_refused() -> None:
    with pytest.raises(ValueError):
        proto.PageIov(1 << 16, 0, 0, 0, 0)
    with pytest.raises(ValueError):
        proto.PageIov(proto.PS_IOV_GET, 0, 1 << 64, 0, 0)


# -- pages to chunks --------------------------------------------------------------------


def _chunks(file: str, data: bytes, size: int) -> tuple[list[Chunk], dict[str, bytes]]:
    chunks, blobs = [], {}
    for off in range(0, len(data), size):
        raw = data[off : off + size]
        packed = zstandard.ZstdCompressor(write_content_size=True).compress(raw)
        digest = "sha256:" + hashlib.sha256(packed).hexdigest()
        blobs[digest] = packed
        chunks.append(Chunk(file, off, len(raw), digest, len(packed)))
    return chunks, blobs


def _pagemap(*entries: tuple[int, int, int], pages_id: int = 1) -> Pagemap:
    return Pagemap(pages_id, tuple(PagemapEntry(BASE + v * PS, n, f) for v, n, f in entries))


# Task 7: 2 present lazy pages at +0, a parent run at +2 (not in the image), 5 present
# lazy pages at +10, 3 present non-lazy pages at +20: 10 pages in pages-1.img.
TASK = _pagemap((0, 2, LAZY), (2, 3, PE_PARENT), (10, 5, LAZY), (20, 3, PE_PRESENT))


def test_a_request_maps_to_its_runs_bytes() -> None:
    chunks, _ = _chunks("pages-1.img", bytes(10 * PS), 3 * PS)
    pages = PageMap({7: TASK}, chunks)
    assert pages.locate(7, BASE, 2) == PageRun("pages-1.img", 0, 2)
    assert pages.locate(7, BASE + 11 * PS, 2) == PageRun("pages-1.img", 3 * PS, 2)
    # Never past the end of the run it starts in: CRIU takes fewer pages than it asked.
    assert pages.locate(7, BASE + 12 * PS, 100) == PageRun("pages-1.img", 4 * PS, 3)
    assert pages.locate(7, BASE + 21 * PS, 1) == PageRun("pages-1.img", 8 * PS, 1)


@pytest.mark.parametrize(
    ("pid", "vaddr", "nr"),
    [(8, BASE, 1), (7, BASE - PS, 1), (7, BASE + 2 * PS, 1), (7, BASE + 15 * PS, 1),
     (7, BASE + 23 * PS, 1), (7, BASE + 1, 1), (7, BASE, 0)],
)  # fmt: skip
def test_pages_no_present_run_holds_map_to_nothing(pid: int, vaddr: int, nr: int) -> None:
    chunks, _ = _chunks("pages-1.img", bytes(10 * PS), 3 * PS)
    assert PageMap({7: TASK}, chunks).locate(pid, vaddr, nr) is None


def test_covering_chunks_and_what_the_restore_reads_itself() -> None:
    task_chunks, _ = _chunks("pages-1.img", bytes(10 * PS), 3 * PS)  # 0-3, 3-6, 6-9, 9-10
    shm_chunks, _ = _chunks("pages-2.img", bytes(2 * PS), PS)
    pages = PageMap({7: TASK}, [*task_chunks, *shm_chunks])
    assert pages.covering(PageRun("pages-1.img", 2 * PS, 5)) == task_chunks[0:3]
    # The non-lazy run (pages 7..9 of the image) and the image no task names.
    assert pages.eager_chunks() == [task_chunks[2], task_chunks[3], *shm_chunks]
    assert list(pages.in_order()) == [*task_chunks, *shm_chunks]


@given(st.lists(st.integers(1, 9), min_size=1, max_size=12), st.integers(1, 7), st.data())
def test_covering_chunks_hold_exactly_the_run(
    runs: list[int], chunk_pages: int, data: st.DataObject
) -> None:
    entries, vaddr = [], 0
    for n in runs:
        entries.append((vaddr, n, LAZY))
        vaddr += n + 1
    pagemap = _pagemap(*entries)
    total = sum(runs) * PS
    chunks, _ = _chunks("pages-1.img", os.urandom(total), chunk_pages * PS)
    pages = PageMap({1: pagemap}, chunks)
    v, n, _ = data.draw(st.sampled_from(entries))
    skip = data.draw(st.integers(0, n - 1))
    run = pages.locate(1, BASE + (v + skip) * PS, data.draw(st.integers(1, 20)))
    assert run is not None and run.nr_pages <= n - skip
    covering = pages.covering(run)
    assert covering[0].offset <= run.offset < covering[0].offset + covering[0].raw_size
    assert covering[-1].offset < run.end <= covering[-1].offset + covering[-1].raw_size
    assert all(a.offset + a.raw_size == b.offset for a, b in itertools.pairwise(covering))


def test_pagemap_larger_than_its_chunks_is_data_loss() -> None:
    chunks, _ = _chunks("pages-1.img", bytes(4 * PS), PS)
    with pytest.raises(DataLoss, match=r"pagemap-7\.img"):
        PageMap({7: TASK}, chunks)


def _unpack(packed: bytes, chunk: Chunk) -> memoryview:
    return unpack_chunk(packed, chunk, "c", memoryview(bytearray(chunk.raw_size)))


def test_unpack_chunk_checks_digest_size_and_frame() -> None:
    chunks, blobs = _chunks("pages-1.img", os.urandom(2 * PS), 2 * PS)
    chunk = chunks[0]
    packed = blobs[chunk.digest]
    assert len(_unpack(packed, chunk)) == 2 * PS
    flipped = bytearray(packed)
    flipped[-1] ^= 1
    with pytest.raises(DataLoss, match="sha256"):
        _unpack(bytes(flipped), chunk)
    with pytest.raises(DataLoss, match="bytes"):
        _unpack(packed[:-1], chunk)
    # A blob whose digest is right but whose frame says another size: refused.
    other = zstandard.ZstdCompressor(write_content_size=True).compress(bytes(PS))
    lying = Chunk("pages-1.img", 0, 2 * PS, "sha256:" + hashlib.sha256(other).hexdigest(),
                  len(other))  # fmt: skip
    with pytest.raises(DataLoss, match="zstd frame"):
        _unpack(other, lying)


# -- the server, over a real socket ------------------------------------------------------


PAGES_FILE = "pages-1.img"
QUICK = (0.01, 0.02, 0.03)  # the retries' pauses, shortened: the tries are what counts


class Served:
    def __init__(
        self,
        tmp: Path,
        blobs: dict[str, bytes],
        pages: PageMap,
        retry_delays: tuple[float, ...] = QUICK,
        retry_within: float = 60.0,
    ) -> None:
        self.blobs = blobs
        self.fetched: list[int] = []
        self.failures: list[BaseException] = []
        self.failed = threading.Event()
        self.gate = threading.Event()
        self.gate.set()
        self.filler = ChunkFiller(
            str(tmp), pages, self.fetch, self.fail, checkpoint="cp-1",
            retry_delays=retry_delays, retry_within=retry_within,
        )  # fmt: skip
        self.server = PageServer(pages, self.filler, self.fail)
        self.server.start()
        self.sock = self.server.daemon_end  # what the daemon inherits
        self.sock.settimeout(30)

    def fetch(self, chunk: Chunk) -> bytes:
        self.gate.wait(30)
        self.fetched.append(chunk.offset)
        return self.blobs[chunk.digest]

    def fail(self, err: BaseException) -> None:
        self.failures.append(err)
        self.failed.set()

    def get(self, pid: int, vaddr: int, nr: int) -> tuple[proto.PageIov, bytes]:
        self.sock.sendall(proto.encode(proto.PageIov(proto.PS_IOV_GET, 0, nr, vaddr, pid)))
        reply = proto.decode(_recv(self.sock, proto.HEADER.size))
        return reply, _recv(self.sock, reply.nr_pages * PS)

    def close(self) -> None:
        self.sock.close()
        self.server.close()
        self.filler.close()
        self.server.join()


def _recv(sock: socket.socket, n: int) -> bytes:
    buf = b""
    while len(buf) < n:
        block = sock.recv(n - len(buf))
        assert block, f"connection closed after {len(buf)} of {n} bytes"
        buf += block
    return buf


@pytest.fixture
def image() -> bytes:
    return os.urandom(10 * PS)


@pytest.fixture
def served(tmp_path: Path, image: bytes) -> Iterator[Served]:
    chunks, blobs = _chunks("pages-1.img", image, 3 * PS)
    s = Served(tmp_path, blobs, PageMap({7: TASK}, chunks))
    yield s
    s.close()


def test_get_answers_with_the_checkpoints_bytes(served: Served, image: bytes) -> None:
    reply, data = served.get(7, BASE + 11 * PS, 100)
    assert (reply.command, reply.nr_pages, reply.vaddr, reply.dst_id) == (
        proto.PS_IOV_ADD_F, 4, BASE + 11 * PS, 7,
    )  # fmt: skip
    assert data == image[3 * PS : 7 * PS]
    assert sorted(served.fetched) == [3 * PS, 6 * PS]  # only the chunks it needed
    _, again = served.get(7, BASE + 12 * PS, 1)
    assert again == image[4 * PS : 5 * PS]
    assert sorted(served.fetched) == [3 * PS, 6 * PS]  # filled once, served from the image


def test_close_is_answered_and_the_prefetch_fills_everything(
    served: Served, image: bytes, tmp_path: Path
) -> None:
    served.filler.start_prefetch()
    assert served.filler.wait_all(30)
    served.sock.sendall(proto.encode(proto.PageIov(proto.PS_IOV_CLOSE, 0, 0, 0, 0)))
    assert struct.unpack("=i", _recv(served.sock, 4)) == (0,)
    assert served.server.closed_by_daemon.wait(30)
    assert (tmp_path / "pages-1.img").read_bytes() == image
    assert sorted(served.fetched) == [0, 3 * PS, 6 * PS, 9 * PS]
    assert not served.failures


def test_a_corrupt_chunk_is_never_served(served: Served) -> None:
    digest = next(d for d in served.blobs)
    served.blobs[digest] = served.blobs[digest][:-1] + bytes([served.blobs[digest][-1] ^ 1])
    served.sock.sendall(proto.encode(proto.PageIov(proto.PS_IOV_GET, 0, 1, BASE, 7)))
    assert served.failed.wait(30)
    assert isinstance(served.failures[0], DataLoss)
    # No answer at all: the daemon and its faulting task wait until they are killed.
    served.sock.settimeout(0.2)
    with pytest.raises(TimeoutError):
        served.sock.recv(1)


class Flaky:
    """A fetch that raises ``errors`` in turn, then fetches; each try's offset in ``tries``."""

    def __init__(self, served: Served, errors: list[BaseException]) -> None:
        self.blobs = served.blobs
        self.errors = errors
        self.tries: list[int] = []
        served.filler._fetch = self

    def __call__(self, chunk: Chunk) -> bytes:
        self.tries.append(chunk.offset)
        if len(self.tries) <= len(self.errors):
            raise self.errors[len(self.tries) - 1]
        return self.blobs[chunk.digest]


def test_a_fetch_that_fails_stops_every_answer(served: Served) -> None:
    fetch = Flaky(served, [ConnectionError("registry gone")] * 4)
    served.sock.sendall(proto.encode(proto.PageIov(proto.PS_IOV_GET, 0, 1, BASE + 21 * PS, 7)))
    assert served.failed.wait(30)
    (failure,) = served.failures  # the first failure only
    assert isinstance(failure, Unavailable)
    assert fetch.tries == [6 * PS] * 4
    assert "4 tries in" in str(failure) and "registry gone" in str(failure)
    assert f"({PAGES_FILE} at {6 * PS})" in str(failure)
    assert isinstance(failure.__cause__, ConnectionError)
    served.sock.settimeout(0.2)
    with pytest.raises(TimeoutError):
        served.sock.recv(1)


def test_a_fetch_that_fails_twice_then_succeeds_is_served(
    served: Served, image: bytes, caplog: pytest.LogCaptureFixture
) -> None:
    down = Unavailable("registry r: connection failed: reset by peer; retry later")
    fetch = Flaky(served, [down, down])
    with caplog.at_level(logging.WARNING, "cedana_shim.checkpoint.remote.page_server"):
        _, data = served.get(7, BASE + 21 * PS, 1)
    assert data == image[8 * PS : 9 * PS]
    assert fetch.tries == [6 * PS] * 3
    assert not served.failures and served.filler.failure is None
    retries = [r for r in caplog.records if "trying again" in r.getMessage()]
    logged = [(r.attempt, r.retry_in_s) for r in retries]  # type: ignore[attr-defined]
    assert logged == [(1, QUICK[0]), (2, QUICK[1])]
    assert all(r.levelno == logging.WARNING for r in retries)
    assert retries[0].chunk == served.filler._pages.in_order()[2].digest
    assert retries[0].checkpoint == "cp-1" and "reset by peer" in retries[0].error


@pytest.mark.parametrize(
    "error", [DataLoss("the bytes hash to sha256:0: the registry's copy is damaged"), None]
)
def test_a_blob_that_does_not_verify_is_not_fetched_again(
    served: Served, error: DataLoss | None
) -> None:
    """The registry client's own check (DataLoss from the fetch), or the chunk's."""
    first = served.filler._pages.in_order()[2]
    if error is None:
        packed = served.blobs[first.digest]
        served.blobs[first.digest] = packed[:-1] + bytes([packed[-1] ^ 1])
        fetch = Flaky(served, [])
    else:
        fetch = Flaky(served, [error])
    served.sock.sendall(proto.encode(proto.PageIov(proto.PS_IOV_GET, 0, 1, BASE + 21 * PS, 7)))
    assert served.failed.wait(30)
    assert isinstance(served.failures[0], DataLoss)
    assert fetch.tries == [6 * PS]


def test_no_try_starts_past_the_bound(tmp_path: Path, image: bytes) -> None:
    """A try that took longer than the bound (a timeout) is the last: reported as is."""
    chunks, blobs = _chunks(PAGES_FILE, image, 3 * PS)
    served = Served(tmp_path, blobs, PageMap({7: TASK}, chunks), retry_within=0.05)
    tries: list[int] = []

    def slow(chunk: Chunk) -> bytes:
        tries.append(chunk.offset)
        time.sleep(0.1)
        raise DeadlineExceeded("registry r: no answer within 0.1s")

    served.filler._fetch = slow
    try:
        with pytest.raises(DeadlineExceeded, match="no answer within"):
            served.filler.fill([chunks[0]])
        assert tries == [0]
    finally:
        served.close()


def test_no_try_after_the_filler_is_stopped(tmp_path: Path, image: bytes) -> None:
    chunks, blobs = _chunks(PAGES_FILE, image, 3 * PS)
    served = Served(tmp_path, blobs, PageMap({7: TASK}, chunks), retry_delays=(30.0,))
    tried = threading.Event()

    def down(chunk: Chunk) -> bytes:
        tried.set()
        raise Unavailable("registry r: HTTP 503: busy; retry later")

    served.filler._fetch = down
    filling = served.filler.ensure(chunks[0])
    assert tried.wait(30)
    started = time.monotonic()
    served.close()  # in the 30 s pause: it ends it, and no other try is made
    assert time.monotonic() - started < 10
    with pytest.raises(Exception, match="stopped"):
        filling.result(0)


def test_the_daemons_end_is_connected_to_the_server_alone(served: Served) -> None:
    ours = served.server._conn
    assert served.sock.getpeername() == ours.getsockname()
    assert ours.getpeername() == served.sock.getsockname()
    with pytest.raises(ConnectionRefusedError):  # nothing listens any more
        socket.create_connection(served.sock.getpeername(), timeout=5)


def test_a_request_no_pagemap_holds_is_refused_unanswered(served: Served) -> None:
    served.sock.sendall(proto.encode(proto.PageIov(proto.PS_IOV_GET, 0, 1, BASE + 2 * PS, 7)))
    assert served.failed.wait(30)
    assert "no pagemap holds" in str(served.failures[0])
    served.sock.settimeout(0.2)
    with pytest.raises(TimeoutError):
        served.sock.recv(1)
