"""A page server for CRIU's lazy-pages daemon, fed from a checkpoint's chunks.

``criu lazy-pages --page-server --ps-socket FD`` (runtime/lazy_pages.py)
answers its tasks' page faults, and then copies the rest of their memory, with
pages it asks a page server for (page_protocol.py) rather than reading them from
``pages-<n>.img``. This is that server, for a checkpoint still in the registry: each
request maps to the chunks holding its pages (page_map.py); a chunk is fetched when
first needed (``fetch``: its blob, e.g. from the registry), checked (size, sha256,
one zstd frame decompressing to exactly its recorded raw size) before any byte of it
is used, and written at its place in the pages image in ``image_dir``, which then
serves it and every later request for it. Behind the faults a prefetcher fills the
rest in address order, so the images end up whole.

Failure is never an answer: a chunk that cannot be fetched, or does not verify, or a
request for pages no pagemap has, stops the server from answering anything more
(the daemon and its faulting tasks wait) and reports the error through
``on_failure``. The owner then freezes the daemon and kills the tasks
(PagesDaemon.abandon) before it closes the server, so that no task ever reads a
page nobody filled. "Cannot be fetched" means after a few tries: a fetch that fails
as a network or a busy registry does (Unavailable, DeadlineExceeded, OSError) is tried
again after a short pause (``FETCH_RETRY_DELAYS``, no try later than
``FETCH_RETRY_WITHIN`` after the first), the faulting task waiting meanwhile; a blob
that arrives but does not verify (DataLoss) is never fetched again.

Threads, not asyncio: the work is blocking reads, hashing and decompression, and the
daemon's one connection is served in order.
"""

from __future__ import annotations

import contextlib
import logging
import os
import socket
import threading
import time
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Final

from cedana_shim import errors

from ..store.chunks import unpack_chunk
from ..store.fsutil import pwrite_all
from ..store.layout import Chunk
from . import page_protocol as proto
from .page_map import PageMap, PageRun

__all__ = ["ChunkFiller", "Fetch", "PageServer"]

logger = logging.getLogger(__name__)

Fetch = Callable[[Chunk], bytes | bytearray]  # a chunk's blob, as stored (zstd)
OnFailure = Callable[[BaseException], None]

URGENT_WORKERS: Final = 4  # faults: each waits for its chunk alone
PREFETCH_WORKERS: Final = 3  # behind them; fewer, so that faults find the link free
_FILE_FLAGS: Final = os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
# A failed fetch ends a restore whose tasks already run (they are killed, and it falls
# back to a full pull): a registry that resets a connection or answers 503 for a
# moment is worth a few short waits, which a faulting task sits through.
FETCH_RETRY_DELAYS: Final = (0.2, 0.5, 1.0)  # seconds before the 2nd, 3rd, 4th try
# No try starts later than this after the first began: with registry_timeout's 30 s
# default a fetch that timed out is tried once more, not three times.
FETCH_RETRY_WITHIN: Final = 60.0
# What a network or a busy registry does (the registry client maps connection errors
# and 408/429/5xx to Unavailable, timeouts to DeadlineExceeded). Not DataLoss: a blob
# that arrived but does not verify is forged or damaged, and would be again.
_TRANSIENT: Final = (errors.Unavailable, errors.DeadlineExceeded, OSError)


class ChunkFiller:
    """The pages images in ``image_dir``, filled chunk by chunk as they are needed.

    Thread-safe. A chunk blob that several places share is fetched once and written
    to each. ``failure`` holds the first error; after it nothing more is filled.
    ``checkpoint`` names the checkpoint in the log.
    """

    def __init__(
        self,
        image_dir: str,
        pages: PageMap,
        fetch: Fetch,
        on_failure: OnFailure,
        *,
        checkpoint: str = "",
        retry_delays: Sequence[float] = FETCH_RETRY_DELAYS,
        retry_within: float = FETCH_RETRY_WITHIN,
    ) -> None:
        self._pages = pages
        self._fetch = fetch
        self._on_failure = on_failure
        self._checkpoint = checkpoint
        self._retry_delays = tuple(retry_delays)
        self._retry_within = retry_within
        self._lock = threading.Lock()
        self._places: dict[str, list[Chunk]] = {}
        for chunk in pages.in_order():
            self._places.setdefault(chunk.digest, []).append(chunk)
        self._futures: dict[str, Future[None]] = {}
        self.failure: BaseException | None = None
        self._stopped = threading.Event()
        self._urgent = ThreadPoolExecutor(URGENT_WORKERS, thread_name_prefix="cedana-pages")
        self._prefetcher: threading.Thread | None = None
        self._all_in = threading.Event()
        self.fds: dict[str, int] = {}
        try:
            for file, size in pages.files().items():
                fd = os.open(os.path.join(image_dir, file), _FILE_FLAGS, 0o600)
                self.fds[file] = fd
                os.ftruncate(fd, size)
        except BaseException:
            self.close()
            raise

    def ensure(self, chunk: Chunk) -> Future[None]:
        """The fill of ``chunk``'s blob, started now on the urgent pool if not yet."""
        return self._claim(chunk.digest, self._urgent.submit)[0]

    def fill(self, chunks: list[Chunk]) -> None:
        """Fill ``chunks`` now (in parallel), raising the first failure."""
        for future in [self.ensure(c) for c in chunks]:
            future.result()

    def start_prefetch(self) -> None:
        """Fill every chunk not filled yet, in address order, behind the faults."""
        self._prefetcher = threading.Thread(
            target=self._prefetch, name="cedana-pages-prefetch", daemon=True
        )
        self._prefetcher.start()

    def wait_all(self, timeout: float | None = None) -> bool:
        """Until every chunk is in (True), or the timeout."""
        return self._all_in.wait(timeout)

    def _claim(
        self, digest: str, submit: Callable[[Callable[[str], None], str], Future[None]] | None
    ) -> tuple[Future[None], bool]:
        with self._lock:
            future = self._futures.get(digest)
            if future is not None:
                return future, False
            if submit is None:
                future = Future()
                future.set_running_or_notify_cancel()
            else:
                future = submit(self._fill_blob, digest)
            self._futures[digest] = future
            return future, True

    def _fill_blob(self, digest: str) -> None:
        if self._stopped.is_set():
            raise errors.Cancelled("the page server was stopped")
        places = self._places[digest]
        first = places[0]
        describe = f"chunk {digest} ({first.file} at {first.offset})"
        try:
            packed = self._fetch_retrying(first, describe)
            raw = unpack_chunk(packed, first, describe, memoryview(bytearray(first.raw_size)))
            for chunk in places:
                pwrite_all(self.fds[chunk.file], raw, chunk.offset)
        except BaseException as err:
            self._fail(err)
            raise

    def _fetch_retrying(self, chunk: Chunk, describe: str) -> bytes | bytearray:
        """``fetch(chunk)``, tried again after a transient failure (see the module doc)."""
        started = time.monotonic()
        for attempt, delay in enumerate((*self._retry_delays, None), 1):
            try:
                return self._fetch(chunk)
            except _TRANSIENT as err:
                elapsed = time.monotonic() - started
                if delay is None or elapsed + delay > self._retry_within:
                    if attempt == 1:
                        raise
                    raise _gave_up(err)(
                        f"{describe}: {attempt} tries in {elapsed:.1f}s failed, the last: {err}"
                    ) from err
                if self._stopped.is_set():
                    raise
                logger.warning(
                    "fetching a chunk of the pages failed; trying again",
                    extra={
                        "checkpoint": self._checkpoint,
                        "chunk": chunk.digest,
                        "file": chunk.file,
                        "offset": chunk.offset,
                        "attempt": attempt,
                        "retry_in_s": delay,
                        "error": str(err),
                    },
                )
                if self._stopped.wait(delay):
                    raise errors.Cancelled("the page server was stopped") from err
        raise AssertionError("unreachable: the last try returns or raises")

    def _prefetch(self) -> None:
        with ThreadPoolExecutor(PREFETCH_WORKERS, thread_name_prefix="cedana-pages-ahead") as pool:
            waits: list[Future[None]] = []
            for chunk in self._pages.in_order():
                if self._stopped.is_set():
                    return
                future, mine = self._claim(chunk.digest, None)
                if mine:
                    waits.append(pool.submit(self._prefetch_one, chunk.digest, future))
                else:
                    waits.append(future)
            for future in waits:
                try:
                    future.result()
                except BaseException:  # reported through on_failure by whoever filled it
                    return
        self._all_in.set()

    def _prefetch_one(self, digest: str, future: Future[None]) -> None:
        try:
            self._fill_blob(digest)
        except BaseException as err:
            future.set_exception(err)
            raise
        future.set_result(None)

    def _fail(self, err: BaseException) -> None:
        with self._lock:
            first = self.failure is None
            if first:
                self.failure = err
        self._stopped.set()
        if first:
            self._on_failure(err)

    def close(self) -> None:
        self._stopped.set()
        self._urgent.shutdown(wait=True, cancel_futures=True)
        if self._prefetcher is not None:
            self._prefetcher.join()
        for fd in self.fds.values():
            os.close(fd)
        self.fds = {}


class PageServer:
    """Answers one lazy-pages daemon from a :class:`ChunkFiller`, over a connection
    nobody else holds: :attr:`daemon_end` is handed to the daemon (``--ps-socket``).

    A listening port would let any local process read the checkpoint's memory, or take
    the daemon's place; so the server connects to itself on loopback, keeps the
    connection whose peer is its own other end, and stops listening (TCP rather than a
    socketpair: CRIU sets TCP options on the socket at every request).
    """

    def __init__(self, pages: PageMap, filler: ChunkFiller, on_failure: OnFailure) -> None:
        self._pages = pages
        self._filler = filler
        self._on_failure = on_failure
        self._conn, self.daemon_end = _private_connection()
        self._thread: threading.Thread | None = None
        self.closed_by_daemon = threading.Event()  # it said CLOSE: all its pages are in
        self.requests = 0

    def start(self) -> None:
        self._thread = threading.Thread(target=self._run, name="cedana-page-server", daemon=True)
        self._thread.start()

    def fileno(self) -> int:
        """Our end of the connection."""
        return self._conn.fileno()

    def handed_over(self) -> None:
        """The daemon holds its end now: ours goes, so that its exit reads as EOF."""
        with contextlib.suppress(OSError):
            self.daemon_end.close()

    def _run(self) -> None:
        conn = self._conn
        try:
            self._serve(conn)
        except BaseException as err:
            # The filler reported its own failure (which a request waiting for its chunk
            # raises here too); the socket's errors after it are its consequence.
            failed = self._filler.failure
            if failed is None or not (err is failed or isinstance(err, OSError)):
                self._on_failure(err)

    def _serve(self, conn: socket.socket) -> None:
        while True:
            header = _recv_exactly(conn, proto.HEADER.size)
            if header is None:
                if self.closed_by_daemon.is_set():
                    return
                raise errors.Unavailable("the lazy-pages daemon hung up before it said CLOSE")
            request = proto.decode(header)
            if request.command in (proto.PS_IOV_CLOSE, proto.PS_IOV_FORCE_CLOSE):
                conn.sendall(proto.close_reply())
                self.closed_by_daemon.set()
                continue
            if request.command != proto.PS_IOV_GET:
                raise errors.DataLoss(f"the lazy-pages daemon sent command {request.command}")
            run = self._pages.locate(request.dst_id, request.vaddr, request.nr_pages)
            if run is None:
                raise errors.DataLoss(
                    f"the lazy-pages daemon asked for {request.nr_pages} pages at "
                    f"{request.vaddr:#x} of task {request.dst_id}, which no pagemap holds"
                )
            data = self._read(run)
            conn.sendall(proto.pages_reply(request, run.nr_pages))
            conn.sendall(data)
            self.requests += 1

    def _read(self, run: PageRun) -> bytes:
        for future in [self._filler.ensure(c) for c in self._pages.covering(run)]:
            future.result()  # a failure was reported by the filler; nothing is answered
        fd = self._filler.fds[run.file]
        want = run.end - run.offset
        data = os.pread(fd, want, run.offset)
        if len(data) != want:
            raise errors.DataLoss(f"{run.file}: short read at {run.offset}")
        return data

    def close(self) -> None:
        """Hang up: only once the daemon is frozen or gone (see the module doc). The
        thread may still wait for a chunk: close the filler, then :meth:`join`."""
        self.handed_over()
        with contextlib.suppress(OSError):
            self._conn.shutdown(socket.SHUT_RDWR)
        with contextlib.suppress(OSError):
            self._conn.close()

    def join(self) -> None:
        if self._thread is not None:
            self._thread.join()


def _private_connection() -> tuple[socket.socket, socket.socket]:
    """(our end, the daemon's end) of a loopback TCP connection only we made."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        listener.bind(("127.0.0.1", 0))
        listener.listen(8)
        theirs = socket.create_connection(listener.getsockname()[:2])
        try:
            while True:  # another process may connect first: refused
                ours, peer = listener.accept()
                if peer == theirs.getsockname():
                    break
                ours.close()
        except BaseException:
            theirs.close()
            raise
    finally:
        listener.close()
    for end in (ours, theirs):
        end.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return ours, theirs


def _recv_exactly(conn: socket.socket, n: int) -> bytes | None:
    """``n`` bytes, or None at EOF before the first; DataLoss at EOF midway."""
    buf = bytearray()
    while len(buf) < n:
        block = conn.recv(n - len(buf))
        if not block:
            if not buf:
                return None
            raise errors.DataLoss(f"the lazy-pages daemon sent {len(buf)} of {n} header bytes")
        buf += block
    return bytes(buf)


def _gave_up(err: BaseException) -> type[errors.ShimError]:
    """The class of the error that ends a chunk's tries, from the last one's: a plain
    OSError (the transport's own) reads as the registry being unavailable."""
    return (
        errors.DeadlineExceeded if isinstance(err, errors.DeadlineExceeded) else errors.Unavailable
    )
