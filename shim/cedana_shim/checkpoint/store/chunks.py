"""A criu layer's page images as chunks: fixed-size pieces, each its own zstd blob.

Compaction splits every top-level ``pages-<n>.img`` of a criu layer (process
memory: nearly all of a checkpoint's bytes) into ``chunk_size`` raw pieces, the
last one shorter, and compresses each on its own into one complete zstd frame;
the layer's other files go into its tar blob as before. Chunks are content
addressed, so a chunk an earlier checkpoint already stored (the same memory) is
the same blob: it is not written again but hard-linked into the compaction's
work dir, which pins it against gc until the new index entry references it.

That needs the same bytes out for the same bytes in. zstd's multi-threaded mode
frames its output differently from its single-threaded one, and streaming
differs from one-shot compression (measured), so each chunk is compressed
single-threaded in one shot, and chunks are compressed in parallel across a
small pool instead. The files are read (and checked against their CRC-32s) in
order by the caller's thread; a pool of reused buffers bounds the memory.

Reading checks each chunk's size, sha256 and zstd frame before its bytes are
used: extraction writes them at their offsets (os.pwrite, chunks in parallel),
a layer stream re-emits them as tar members after the tar blob's own.
"""

from __future__ import annotations

import dataclasses
import hashlib
import io
import os
import queue
import tarfile
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import IO, TYPE_CHECKING, Final, TypeAlias

import zstandard

from cedana_shim import errors

from . import fsutil
from .compress import CHUNK, RawBound, ZstdReader
from .filelist import FileList, RawFile
from .layout import Chunk, SplitFile, check_split_file_name
from .rawfiles import CheckingReader, TellingWriter, open_listed

if TYPE_CHECKING:
    from .model import LayerInfo

__all__ = [
    "ChunkBuffers",
    "ChunkWriter",
    "chunk_temp_name",
    "extract_split_files",
    "pool_width",
    "read_chunk",
    "split_file_list",
    "split_files_of",
    "unpack_chunk",
    "write_split_tar",
]

# Each worker holds a raw chunk and its compressed copy (2 x chunk_size) at once.
_MAX_WORKERS: Final = 4
_NEW_FILE: Final = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC

# Opens a chunk's blob (DataLoss when it is missing), given what to call it.
OpenChunk: TypeAlias = Callable[[Chunk, str], int]
DescribeChunk: TypeAlias = Callable[[Chunk], str]


def pool_width(threads: int) -> int:
    """Chunks compressed or decompressed at once (StoreConfig.threads: 0 = all cores)."""
    return max(1, min(_MAX_WORKERS, threads or os.cpu_count() or 1))


def split_file_list(files: FileList) -> tuple[FileList, tuple[RawFile, ...]]:
    """(the list of what stays in the layer's tar, the page images split into chunks)."""
    split = tuple(
        f for f in files.files if f.kind == "file" and check_split_file_name(f.path) is None
    )
    names = {f.path for f in split}
    rest = tuple(f for f in files.files if f.path not in names)
    return dataclasses.replace(files, files=rest), split


def chunk_temp_name(digest: str) -> str:
    return "chunk-" + digest.removeprefix("sha256:")


def _fsync_and_close(fd: int) -> None:
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _same_bytes(fd: int, data: bytes) -> bool:
    """Whether the file holds ``data`` (read a piece at a time: a chunk is MiBs, and a
    second checkpoint compares most of its chunks with the store's)."""
    buf = bytearray(CHUNK)
    view, want = memoryview(buf), memoryview(data)
    offset = 0
    while offset < len(data):
        n = os.preadv(fd, [view[: min(CHUNK, len(data) - offset)]], offset)
        if n == 0 or view[:n] != want[offset : offset + n]:
            return False
        offset += n
    return os.preadv(fd, [view[:1]], offset) == 0


class ChunkWriter:
    """Splits files into chunk blobs in a compaction's work dir (see the module doc).

    ``temps`` maps each distinct chunk digest to its file in the work dir:
    written there, or a hard link to the store's existing blob of that digest.
    """

    def __init__(
        self,
        work_fd: int,
        blobs_fd: int,
        *,
        level: int,
        chunk_size: int,
        workers: int,
        on_chunk: Callable[[str, int], None] | None = None,
    ) -> None:
        self._work_fd = work_fd
        self._on_chunk = on_chunk
        self._blobs_fd = blobs_fd
        self._level = level
        self._chunk_size = chunk_size
        self._workers = workers
        self._local = threading.local()
        self._lock = threading.Lock()
        self._failed = False
        self._syncer: ThreadPoolExecutor | None = None
        self._synced: list[Future[None]] = []
        self.temps: dict[str, str] = {}
        self.written = 0  # stored bytes of new chunk blobs
        self.reused = 0  # stored bytes of chunks the store already held

    def write(
        self, layer_fd: int, split: Sequence[RawFile], *, path: str, describe: str
    ) -> list[Chunk]:
        """The chunks of ``split`` (files of the raw layer at ``layer_fd``), in order."""
        buffers: queue.SimpleQueue[bytearray] = queue.SimpleQueue()
        for _ in range(self._workers + 1):
            buffers.put(bytearray(self._chunk_size))
        futures: list[Future[Chunk]] = []
        # New blobs are fsynced by a thread of their own: writeback overlaps compression.
        with (
            ThreadPoolExecutor(1, thread_name_prefix="cedana-chunk-sync") as self._syncer,
            ThreadPoolExecutor(self._workers, thread_name_prefix="cedana-chunk") as pool,
        ):
            try:
                for raw in split:
                    self._split(layer_fd, raw, path, describe, buffers, pool, futures)
            except BaseException:
                for future in futures:
                    future.cancel()
                raise
            chunks = [future.result() for future in futures]
        for synced in self._synced:
            synced.result()
        return chunks

    def _split(
        self,
        layer_fd: int,
        raw: RawFile,
        path: str,
        describe: str,
        buffers: queue.SimpleQueue[bytearray],
        pool: ThreadPoolExecutor,
        futures: list[Future[Chunk]],
    ) -> None:
        fd = open_listed(layer_fd, raw, path=path, describe=describe)
        try:
            reader = CheckingReader(fd, raw, describe)
            offset = 0
            while offset < raw.size and not self._failed:
                buf = buffers.get()
                n = reader.readinto(memoryview(buf)[: min(self._chunk_size, raw.size - offset)])
                if n == 0:
                    buffers.put(buf)
                    break  # shorter than listed: check() says so
                futures.append(pool.submit(self._store, raw.path, offset, buf, n, buffers))
                offset += n
            if not self._failed:
                reader.drain()
        finally:
            os.close(fd)

    def _compressor(self) -> zstandard.ZstdCompressor:
        # Not thread-safe: one per worker. threads=0: single-threaded (see the module doc).
        compressor: zstandard.ZstdCompressor | None = getattr(self._local, "compressor", None)
        if compressor is None:
            compressor = zstandard.ZstdCompressor(level=self._level, write_checksum=True)
            self._local.compressor = compressor
        return compressor

    def _store(
        self, file: str, offset: int, buf: bytearray, n: int, buffers: queue.SimpleQueue[bytearray]
    ) -> Chunk:
        try:
            try:
                data = self._compressor().compress(memoryview(buf)[:n])
            finally:
                buffers.put(buf)
            digest = fsutil.sha256_bytes(data)
            self._keep(digest, data)
            if self._on_chunk is not None:
                self._on_chunk(digest, len(data))  # must not raise: see Compactor.compact
            return Chunk(file, offset, n, digest, len(data))
        except BaseException:
            self._failed = True  # the reading thread stops early
            raise

    def _keep(self, digest: str, data: bytes) -> None:
        """Put the chunk's blob in the work dir once, linked from the store if it has it."""
        with self._lock:
            if digest in self.temps:
                return  # the same bytes twice in this layer
            tmp = self.temps[digest] = chunk_temp_name(digest)
        if self._link_existing(digest, tmp, data):
            with self._lock:
                self.reused += len(data)
            return
        fd = os.open(tmp, _NEW_FILE, 0o600, dir_fd=self._work_fd)
        try:
            fsutil.write_all(fd, data)
        except BaseException:
            os.close(fd)
            raise
        assert self._syncer is not None
        synced = self._syncer.submit(_fsync_and_close, fd)
        with self._lock:
            self._synced.append(synced)
            self.written += len(data)

    def _link_existing(self, digest: str, tmp: str, data: bytes) -> bool:
        """Pin the store's blob of ``digest`` as ``tmp``, if it holds exactly ``data``.

        A blob found damaged is not linked: the new copy replaces it when placed.
        """
        try:
            os.link(
                digest.removeprefix("sha256:"),
                tmp,
                src_dir_fd=self._blobs_fd,
                dst_dir_fd=self._work_fd,
                follow_symlinks=False,
            )
        except OSError:  # not there (or not linkable): write a copy of our own
            return False
        try:
            fd = fsutil.open_file(self._work_fd, tmp, path=tmp)
        except errors.DataLoss:
            same = False  # not a regular file: never the store's
        else:
            try:
                same = os.fstat(fd).st_size == len(data) and _same_bytes(fd, data)
            finally:
                os.close(fd)
        if not same:
            os.unlink(tmp, dir_fd=self._work_fd)
        return same


# -- reading -------------------------------------------------------------------------------


class ChunkBuffers(threading.local):
    """A thread's buffers for reading chunks, reused chunk after chunk.

    Fresh multi-MiB buffers cost a page fault per 4 KiB each time (see
    compress.CHUNK); one instance per extraction, so they go with it.
    """

    def __init__(self) -> None:
        self._buffers: dict[str, bytearray] = {}

    def get(self, name: str, size: int) -> memoryview:
        buf = self._buffers.get(name)
        if buf is None or len(buf) < size:
            buf = self._buffers[name] = bytearray(size)
        return memoryview(buf)[:size]


def read_chunk(fd: int, chunk: Chunk, describe: str, buffers: ChunkBuffers) -> memoryview:
    """The raw bytes of ``chunk`` from its blob ``fd``; DataLoss unless they are intact.

    The view is into ``buffers``: valid until the thread's next read_chunk.
    """
    have = os.fstat(fd).st_size
    if have != chunk.size:
        raise errors.DataLoss(
            f"{describe}: blob is {have} bytes, expected {chunk.size} (truncated?)"
        )
    packed = buffers.get("packed", chunk.size)
    got = 0
    while got < chunk.size and (n := os.preadv(fd, [packed[got:]], got)):
        got += n
    return unpack_chunk(packed[:got], chunk, describe, buffers.get("raw", chunk.raw_size))


def unpack_chunk(packed: fsutil.Bytes, chunk: Chunk, describe: str, raw: memoryview) -> memoryview:
    """The raw bytes of ``chunk`` from its whole blob ``packed``, decompressed into
    ``raw`` (``chunk.raw_size`` bytes); DataLoss unless the blob is exactly the one the
    manifest names and one zstd frame of exactly its recorded raw size."""
    if len(packed) != chunk.size:
        raise errors.DataLoss(
            f"{describe}: blob is {len(packed)} bytes, expected {chunk.size} (truncated?)"
        )
    digest = f"sha256:{hashlib.sha256(packed).hexdigest()}"
    if digest != chunk.digest:
        raise errors.DataLoss(
            f"{describe}: blob is corrupt (sha256 is {digest}, expected {chunk.digest})"
        )
    try:
        # Checked first: the frame header says how much it holds.
        content_size = zstandard.get_frame_parameters(packed).content_size
    except zstandard.ZstdError as err:
        raise errors.DataLoss(f"{describe}: corrupt zstd data ({err})") from None
    if content_size != chunk.raw_size:
        raise errors.DataLoss(
            f"{describe}: its zstd frame holds {content_size} bytes, the manifest says "
            f"{chunk.raw_size}"
        )
    with ZstdReader(packed, RawBound(chunk.raw_size, describe), describe) as reader:
        filled = 0
        while filled < chunk.raw_size and (n := reader.readinto(raw[filled:])):
            filled += n
        reader.drain()  # nothing more, and the frame's checksum
    return raw


def _load(
    chunk: Chunk, open_chunk: OpenChunk, describe: DescribeChunk, buffers: ChunkBuffers
) -> memoryview:
    what = describe(chunk)
    fd = open_chunk(chunk, what)
    try:
        return read_chunk(fd, chunk, what, buffers)
    finally:
        os.close(fd)


def extract_split_files(
    layer: LayerInfo,
    dest_fd: int,
    open_chunk: OpenChunk,
    describe: DescribeChunk,
    *,
    workers: int,
) -> None:
    """Write ``layer``'s split files into ``dest_fd`` (its tar already extracted there).

    Each chunk is checked, then written at its offset; with ``workers`` > 1,
    several chunks at once. On error the files may be partial: the caller owns
    ``dest_fd``'s removal.
    """
    fds: dict[str, int] = {}
    try:
        for split in layer.split_files:
            try:
                fd = os.open(split.path, _NEW_FILE, 0o600, dir_fd=dest_fd)
            except FileExistsError:
                raise errors.DataLoss(
                    f"{describe(layer.chunks[0]) if layer.chunks else layer.name}: "
                    f"{split.path} is both in the layer's tar and split into chunks"
                ) from None
            fds[split.path] = fd
            os.ftruncate(fd, split.size)

        buffers = ChunkBuffers()

        def put(chunk: Chunk) -> None:
            data = _load(chunk, open_chunk, describe, buffers)
            fsutil.pwrite_all(fds[chunk.file], data, chunk.offset)

        if workers > 1 and len(layer.chunks) > 1:
            with ThreadPoolExecutor(workers, thread_name_prefix="cedana-unchunk") as pool:
                for _ in pool.map(put, layer.chunks):
                    pass
        else:
            for chunk in layer.chunks:
                put(chunk)
        for split in layer.split_files:
            fd = fds[split.path]
            os.fchmod(fd, split.mode & 0o777)
            os.utime(fd, (split.mtime, split.mtime))
    finally:
        for fd in fds.values():
            os.close(fd)


class _SplitFileReader:
    """read(n) over one split file's chunks, loaded (and checked) one at a time."""

    def __init__(self, chunks: Iterator[Chunk], load: Callable[[Chunk], memoryview]) -> None:
        self._chunks = chunks
        self._load = load
        self._data = memoryview(b"")

    def read(self, n: int = -1) -> bytes:
        # tarfile wants exactly n bytes until the member's end, across chunk ends.
        out = io.BytesIO()
        while n < 0 or out.tell() < n:
            if not self._data:
                chunk = next(self._chunks, None)
                if chunk is None:
                    break
                self._data = self._load(chunk)  # the previous one is consumed
            take = len(self._data) if n < 0 else min(len(self._data), n - out.tell())
            out.write(self._data[:take])
            self._data = self._data[take:]
        return out.getvalue()


def write_split_tar(
    tar_stream: IO[bytes],
    layer: LayerInfo,
    open_chunk: OpenChunk,
    describe: DescribeChunk,
    out: IO[bytes],
    *,
    what: str,
) -> None:
    """The whole layer as one tar into ``out``: the tar blob's members, then the split files.

    ``tar_stream`` is the layer's decompressed tar blob (``what``); it is read
    to its end, where a checked stream verifies its digest.
    """
    with tarfile.open(
        fileobj=TellingWriter(out),  # type: ignore[call-overload]
        mode="w",
        format=tarfile.PAX_FORMAT,
        copybufsize=CHUNK,
    ) as tar_out:
        try:
            with tarfile.open(fileobj=tar_stream, mode="r|", bufsize=CHUNK) as tar_in:
                for member in tar_in:
                    tar_out.addfile(member, tar_in.extractfile(member) if member.isreg() else None)
        except tarfile.TarError as err:
            raise errors.DataLoss(f"{what}: broken tar stream ({err})") from None
        while tar_stream.read(CHUNK):
            pass
        buffers = ChunkBuffers()
        for split in layer.split_files:
            info = tarfile.TarInfo(split.path)
            info.type, info.size = tarfile.REGTYPE, split.size
            info.mode, info.mtime = split.mode, split.mtime
            chunks = (c for c in layer.chunks if c.file == split.path)
            reader = _SplitFileReader(chunks, lambda c: _load(c, open_chunk, describe, buffers))
            tar_out.addfile(info, reader)


def split_files_of(files: Sequence[RawFile]) -> tuple[SplitFile, ...]:
    """What the config records about the files split into chunks."""
    return tuple(SplitFile(f.path, f.size, f.mode, f.mtime) for f in files)
