"""A lazy restore straight from the registry: what restore.py runs for a registry
candidate when ``lazy_restore`` is on and the checkpoint's page images are chunked.

1. :meth:`ServedCheckpoint.prepare` (blocking, at Create): the pull begins
   (remote/lazy_pull.py: manifest checked, config and every layer's own blob
   staged), the CRIU layer's small images are unpacked into the attempt's images
   dir, the pages images created there empty at their sizes, and the pages CRIU's
   restore reads itself (not lazy; shared memory's) filled before it starts
   (remote/page_map.py). The images dir is in the bundle's work dir, often not the
   store's filesystem: unless it has room for the raw pages (and, on the store's
   filesystem, for the chunks still to download), :class:`NoRoomForPages` before
   any is written, and the session pulls the checkpoint whole instead.
2. :meth:`ServedCheckpoint.serve` (at Start): the page server (remote/page_server.py)
   makes one private loopback connection to itself (it listens only until then, and
   keeps no connection but its own), whose other end ``criu lazy-pages --page-server
   --ps-socket FD`` inherits (runtime/lazy_pages.py); once the tasks run
   (:meth:`ServedCheckpoint.resumed`) the prefetcher fills the rest in address order
   behind their faults. A failure of either (a registry that still fails after a
   few tries, a chunk that does not verify) sets :attr:`ServedCheckpoint.failed`:
   the session then abandons the restore, the tasks killed before the server closes.
3. :meth:`ServedCheckpoint.commit` once the daemon is done: the rest of the chunks
   are in (the prefetcher's), and the checkpoint is committed to the store as a pull
   would have. :meth:`close` in every case.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import re
from types import MappingProxyType
from typing import Final

from cedana_shim import errors

from .layers import CRIU_LAYER
from .pagemap_image import Pagemap, read_pagemap_at
from .remote.lazy_pull import LazyPull
from .remote.page_map import PageMap
from .remote.page_server import ChunkFiller, PageServer
from .remote.pull import check_space
from .store import Entry
from .store.compress import extract_tar
from .store.model import LayerInfo

__all__ = ["NoRoomForPages", "ServedCheckpoint", "task_pagemaps"]

_TASK_PAGEMAP: Final = re.compile(r"pagemap-([0-9]+)\.img")
# After the daemon is done the prefetcher has little left; this bounds the wait.
COMMIT_TIMEOUT: Final = 600.0


class NoRoomForPages(errors.ResourceExhausted):
    """The images dir's filesystem has no room for the raw pages: a lazy restore is
    impossible there, a full pull (its blobs in the store) may not be."""


def task_pagemaps(image_dir: str) -> dict[int, Pagemap]:
    """Every task's pagemap in ``image_dir`` (not shared memory's), by pid."""
    fd = os.open(image_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        out: dict[int, Pagemap] = {}
        for name in os.listdir(fd):
            if m := _TASK_PAGEMAP.fullmatch(name):
                out[int(m.group(1))] = read_pagemap_at(name, fd, f"{image_dir}/{name}")
        return out
    finally:
        os.close(fd)


class ServedCheckpoint:
    """One registry checkpoint restored lazily; see the module doc."""

    def __init__(self, pull: LazyPull, image_dir: str) -> None:
        self.pull = pull
        self.image_dir = image_dir
        self.failed: asyncio.Future[BaseException] | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._pages: PageMap | None = None
        self._filler: ChunkFiller | None = None
        self._server: PageServer | None = None

    @property
    def checkpoint_id(self) -> str:
        return self.pull.remote.checkpoint_id

    def chunked(self) -> bool:
        """Whether the CRIU layer's pages are chunks (else only a full pull restores it)."""
        return bool(self.pull.chunks(CRIU_LAYER))

    def prepare(self) -> None:
        """Steps 1 (see the module doc). Blocking."""
        self.pull.begin()
        if not self.chunked():
            return
        os.makedirs(self.image_dir, mode=0o700)
        with self.pull.open_layer(CRIU_LAYER) as tar:
            extract_tar(tar, self.image_dir, f"checkpoint {self.checkpoint_id}: CRIU images")
        self._pages = PageMap(task_pagemaps(self.image_dir), self.pull.chunks(CRIU_LAYER))
        self._check_space(sum(self._pages.files().values()))
        self._filler = ChunkFiller(
            self.image_dir,
            self._pages,
            self.pull.fetch_chunk,
            self._fail,
            checkpoint=self.checkpoint_id,
        )
        self._filler.fill(self._pages.eager_chunks())

    def _check_space(self, raw: int) -> None:
        """NoRoomForPages unless the images dir has room for ``raw`` bytes of pages (the
        chunks' sparse files fill as they come) and, when the store shares its
        filesystem, for the blobs still to download too."""
        need, also = raw, ""
        if os.stat(self.image_dir).st_dev == os.stat(self.pull.store_root).st_dev:
            pending = self.pull.pending_bytes()
            need += pending
            also = f" and its chunks still to download ({pending} bytes, the store is there too)"
        try:
            check_space(
                self.image_dir,
                need,
                self.pull.remote,
                doing="restoring lazily",
                then=(
                    f"that is its raw memory pages ({raw} bytes){also}; restoring it from "
                    "a full pull instead. Free space on that filesystem (the container's "
                    "bundle) for lazy restores"
                ),
            )
        except errors.ResourceExhausted as err:
            raise NoRoomForPages(str(err)) from None

    def entry(self) -> Entry:
        """The checkpoint as the store will hold it once committed (what the session
        checks and records meanwhile)."""
        manifest, config = self.pull.manifest, self.pull.config
        assert manifest is not None and config is not None
        layers = []
        for c in config.layers:
            chunks = manifest.chunks.get(c.name, ())
            size = c.size + sum(x.size for x in chunks)
            layers.append(LayerInfo(c.name, c.media_type, c.digest, size, c.raw_size, chunks,
                                    c.split_files))  # fmt: skip
        remote = self.pull.remote
        return Entry(
            remote.checkpoint_id, remote.scope, remote.label, remote.created,
            "", sum(x.size for x in layers), MappingProxyType(config.metadata), tuple(layers),
        )  # fmt: skip

    def serve(self) -> tuple[int, int]:
        """Step 2: the fds of the daemon's end of its connection to the page server
        (kept open here until :meth:`handed_over`) and of the server's end (which the
        daemon inherits too, see lazy_pages.PagesDaemon.start)."""
        if self._pages is None or self._filler is None:
            raise errors.FailedPrecondition("the served checkpoint was not prepared")
        self._loop = asyncio.get_running_loop()
        self.failed = self._loop.create_future()
        self._server = PageServer(self._pages, self._filler, self._fail)
        self._server.start()
        return self._server.daemon_end.fileno(), self._server.fileno()

    def handed_over(self) -> None:
        """The daemon runs with its end of the connection: ours closes."""
        if self._server is not None:
            self._server.handed_over()

    def resumed(self) -> None:
        """The tasks run: the rest of the pages stream in behind their faults. (Not
        before: until then nothing faults, and the link is the eager pages'.) The
        daemon was started long before: our copy of its socket closes."""
        self.handed_over()
        if self._filler is not None:
            self._filler.start_prefetch()

    def _fail(self, err: BaseException) -> None:
        """From the server's or the filler's threads: the first failure wins."""
        loop, failed = self._loop, self.failed
        if loop is None or failed is None:
            return  # before serve(): the caller of prepare() sees the exception itself

        def settle() -> None:
            if not failed.done():
                failed.set_result(err)

        with contextlib.suppress(RuntimeError):  # the loop is closed: nobody waits
            loop.call_soon_threadsafe(settle)

    def commit(self) -> Entry:
        """Step 3 (blocking): the rest of the chunks in, the checkpoint in the store."""
        filler = self._filler
        if filler is not None and not filler.wait_all(COMMIT_TIMEOUT):
            raise errors.DeadlineExceeded(
                f"checkpoint {self.checkpoint_id}: the page prefetch did not finish within "
                f"{COMMIT_TIMEOUT:g}s"
            )
        if filler is not None and filler.failure is not None:
            raise errors.Unavailable(f"fetching its pages: {filler.failure}")
        return self.pull.commit()

    def close(self) -> None:
        """Stop serving (after the daemon is frozen or gone) and drop what was staged."""
        if self._server is not None:
            self._server.close()  # hung up: nothing more is sent
        if self._filler is not None:
            self._filler.close()  # a chunk the server waits for fails now
        if self._server is not None:
            self._server.join()
        self.pull.close()
