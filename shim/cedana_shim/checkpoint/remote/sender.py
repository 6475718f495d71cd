"""The blobs of one push, sent by a few threads as they become ready.

A push of a raw checkpoint compacts it first; the compaction hands over each chunk
blob as soon as it is written (store Compactor.compact's ``on_blob``), and
:class:`BlobSender` starts sending it at once, while the next chunks are still being
compressed: the upload and the compression overlap instead of adding up. Offering
never blocks nor fails (a compaction must not wait on a slow registry): offers queue
up, ``UPLOAD_WORKERS`` threads take them in order. The rest (the layers' tar blobs,
the config) follows once the compaction is done (:meth:`BlobSender.finish`).

Every blob waits for the push's first step (its in-flight marker, see remote.py): the
marker is in the registry before any blob is. The first failure stops the sending
(what is still queued is skipped) and is raised by ``finish``; the blobs sent are
kept by the registry, so a later push sends only the rest.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from typing import IO, Final, TypeVar

from cedana_shim import errors
from cedana_shim.registry import ProgressCallback, PushResult, Registry

__all__ = ["UPLOAD_WORKERS", "BlobSender", "OpenSource", "Progress", "PushLayer"]

UPLOAD_WORKERS: Final = 4
OpenSource = Callable[[int], IO[bytes]]  # offset -> the blob, positioned there
Progress = Callable[[int, int], None]  # (bytes the registry holds, bytes in all)
# How a layer goes up instead of as it is (encrypted: encryption.PushCipher.push):
# (client, repo, plain digest, size, source, progress) -> what the push did.
PushLayer = Callable[[Registry, str, str, int, OpenSource, ProgressCallback | None], PushResult]
T = TypeVar("T")


class BlobSender:
    """Blobs of one push to ``repo`` (see the module doc); a context manager."""

    def __init__(
        self,
        client: Registry,
        repo: str,
        what: str,
        progress: Progress | None,
        push_layer: PushLayer | None = None,
    ) -> None:
        self._client = client
        # Run on the sending thread (never the compaction's): it encrypts as it sends.
        self._push_layer = push_layer
        self._repo = repo
        self._what = what
        self._progress = progress
        self._pool = ThreadPoolExecutor(UPLOAD_WORKERS, thread_name_prefix="cedana-push")
        self._lock = threading.Lock()
        self._sizes: dict[str, int] = {}
        self._held: dict[str, int] = {}
        self._futures: list[Future[None]] = []
        self._error: BaseException | None = None
        self._first: Future[object] | None = None
        self._total: int | None = None  # known once finish() has every blob

    def __enter__(self) -> BlobSender:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def first(self, step: Callable[[], T]) -> Future[T]:
        """Run ``step`` before any blob is sent; its result (or error) in the future."""
        future: Future[T] = self._pool.submit(step)
        self._first = future  # type: ignore[assignment]
        return future

    def offer(self, digest: str, size: int, open_at: OpenSource, *, plain: bool = False) -> None:
        """Send blob ``digest`` when a thread is free (once per digest); never raises.
        ``plain``: as it is, never through ``push_layer`` (a config)."""
        with self._lock:
            if digest in self._sizes or self._error is not None:
                return
            self._sizes[digest] = size
            self._futures.append(self._pool.submit(self._send, digest, size, open_at, plain))

    def finish(
        self,
        blobs: Mapping[str, int],
        source: Callable[[str], OpenSource],
        plain: frozenset[str] = frozenset(),
    ) -> None:
        """Send what of ``blobs`` was not offered (largest first; those in ``plain``
        as they are), wait for every blob, and raise the first failure."""
        with self._lock:
            self._total = sum(blobs.values())
        for digest in sorted(blobs, key=lambda d: -blobs[d]):
            self.offer(digest, blobs[digest], source(digest), plain=digest in plain)
        for future in list(self._futures):
            future.result()  # _send keeps its errors: this only waits
        if self._first is not None:
            self._first.result()
        with self._lock:
            error = self._error
        if error is not None:
            raise error
        self._report()

    def close(self) -> None:
        """Skip what is still queued; wait for the uploads in flight."""
        with self._lock:
            if self._error is None:
                self._error = errors.Aborted(f"{self._what}: the push was abandoned")
        self._pool.shutdown(wait=True, cancel_futures=True)

    # -- helpers ----------------------------------------------------------------------

    def _send(self, digest: str, size: int, open_at: OpenSource, plain: bool) -> None:
        try:
            if self._first is not None:
                self._first.result()  # the marker first; its error stops every blob
            with self._lock:
                if self._error is not None:
                    return

            def progress(held: int) -> None:
                self._update(digest, held)

            if self._push_layer is not None and not plain:
                result = self._push_layer(self._client, self._repo, digest, size, open_at, progress)
            else:
                result = self._client.push_blob(self._repo, digest, size, open_at, progress)
            if result.existed:
                self._update(digest, size)
        except (errors.ShimError, OSError) as err:
            with self._lock:
                if self._error is None:
                    self._error = err

    def _update(self, digest: str, held: int) -> None:
        with self._lock:
            self._held[digest] = held
        self._report()

    def _report(self) -> None:
        if self._progress is None:
            return
        with self._lock:
            total, done = self._total, sum(self._held.values())
        if total is not None:
            self._progress(min(done, total), total)
