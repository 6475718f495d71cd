"""The raw-image cache of a checkpoint being adopted, written while its blobs arrive.

A pull (remote/pull.py) streams each chunk blob of the CRIU layer through a
:class:`CacheBuilder` on its way into the adoption's staging dir: the bytes are
decompressed as they come and written at the chunk's offset of its page image in
``<staging>/cache-<layer>/`` (several downloads at once, each into its own range).
Chunks the store already had, and a chunk whose bytes appear twice, are filled
from their staged blob afterwards. :meth:`CacheBuilder.finish` then unpacks the
layer's tar (the small CRIU images) beside them and rebuilds the layer's file
list, entry by entry in the order publish wrote it, with the CRC-32 of every file
as written here (a split file's from its chunks' CRC-32s, combined). The cache is
kept only if that list hashes to the digest the checkpoint's config records
(``rawFiles``): then these files are exactly the ones the dumping node published,
and a restore can run CRIU from them at once, as it does from a local checkpoint's
cache (the first restore after the pull reads them once, every byte having been
checked here as it was written; later ones check their CRC-32s again while CRIU
reads them, see adopt.py). Otherwise the cache
is dropped, and the restore unpacks the blobs as before.

Nothing here is visible: the staging dir is the adoption's, and the store's adopt
moves the cache into ``raw/<id>/`` in the same hold of ``index.lock`` as the index
write that adds the checkpoint (adopt.py). The page images are made durable while
the pull goes on (a thread of its own fdatasyncs a file whenever chunks were written
into it), and ``finish`` waits for the last: the cache is as durable as a published
checkpoint when it becomes visible. That also keeps the restore fast: CRIU reads page
images still dirty in the page cache several times slower than written-back ones.
"""

from __future__ import annotations

import contextlib
import functools
import logging
import os
import tarfile
import threading
import zlib
from collections.abc import Callable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from typing import IO, Final, cast

import zstandard

from cedana_shim import errors

from .compress import CHUNK, RawBound, member_path
from .filelist import FileList, RawFile, dump_file_list
from .fsutil import pwrite_all, sha256_bytes, write_all
from .layout import Chunk, ConfigLayer

__all__ = ["CACHE_DIR_PREFIX", "CacheBuilder", "ChunkSink", "crc32_combine"]

log = logging.getLogger(__name__)

_NEW_FILE: Final = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_DIR_FLAGS: Final = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# Chunks of other sizes than the compactor's fixed one (and each file's last) cost a
# CRC-32 shift operator each (~2 ms): a manifest with more gets no cache.
_MAX_CHUNK_SIZES: Final = 64
CACHE_DIR_PREFIX: Final = "cache-"

# -- CRC-32 of concatenated pieces (zlib's crc32_combine, which Python lacks) --------------

_POLY: Final = 0xEDB88320
_Matrix = tuple[int, ...]  # 32 columns over GF(2): the image of each bit of a CRC


def _times(matrix: _Matrix, vector: int) -> int:
    out, i = 0, 0
    while vector:
        if vector & 1:
            out ^= matrix[i]
        vector >>= 1
        i += 1
    return out


def _compose(a: _Matrix, b: _Matrix) -> _Matrix:
    """The operator ``a`` after ``b``."""
    return tuple(_times(a, column) for column in b)


@functools.lru_cache(maxsize=_MAX_CHUNK_SIZES)
def _shift(nbytes: int) -> _Matrix:
    """The operator that moves a CRC-32 past ``nbytes`` zero bytes."""
    op: _Matrix = (_POLY, *(1 << (n - 1) for n in range(1, 32)))  # one zero bit
    for _ in range(3):
        op = _compose(op, op)  # one zero byte
    result: _Matrix | None = None
    while nbytes:
        if nbytes & 1:
            result = op if result is None else _compose(op, result)
        nbytes >>= 1
        if nbytes:
            op = _compose(op, op)
    assert result is not None
    return result


def crc32_combine(crc1: int, crc2: int, len2: int) -> int:
    """zlib.crc32(a + b) from zlib.crc32(a), zlib.crc32(b) and len(b)."""
    if len2 <= 0:
        return crc1
    return _times(_shift(len2), crc1) ^ crc2


# -- writing a chunk into its place ----------------------------------------------------


class _Placer:
    """Where zstd puts a chunk's bytes: at its offset, counted and CRC'd, never past its end."""

    def __init__(self, fd: int, chunk: Chunk, describe: str) -> None:
        self._fd = fd
        self._chunk = chunk
        self.bound = RawBound(chunk.raw_size, describe)
        self.crc = 0

    def write(self, data: bytes) -> int:
        offset = self._chunk.offset + self.bound.count
        self.bound.add(len(data))  # before a byte past the chunk's end is written
        pwrite_all(self._fd, data, offset)
        self.crc = zlib.crc32(data, self.crc)
        return len(data)


class ChunkSink:
    """A chunk's compressed bytes in (``write``), its raw bytes in place (``finish``).

    What is wrong with the bytes is said by ``finish``, once the whole blob was read:
    a download whose digest is off fails first, with the better message.
    """

    def __init__(self, builder: CacheBuilder, fd: int, chunk: Chunk, describe: str) -> None:
        self._builder = builder
        self._chunk = chunk
        self._describe = describe
        self._placer = _Placer(fd, chunk, describe)
        self._zstd = zstandard.ZstdDecompressor().stream_writer(
            cast("IO[bytes]", self._placer), write_size=CHUNK, closefd=False
        )
        self._error: errors.DataLoss | None = None

    def write(self, data: bytes) -> int:
        if self._error is None:
            try:
                self._zstd.write(data)
            except zstandard.ZstdError as err:
                self._error = errors.DataLoss(f"{self._describe}: corrupt zstd data ({err})")
            except errors.DataLoss as err:
                self._error = err
        return len(data)

    def finish(self) -> None:
        """DataLoss unless the chunk came out whole; then it counts as filled."""
        if self._error is not None:
            raise self._error
        self._placer.bound.end()
        self._builder._filled(self._chunk, self._placer.crc)


class CacheBuilder:
    """The raw-image cache of one split layer, built in the adoption's staging dir.

    Thread-safe: downloads stream different chunks at once. Close it when done (the
    staging dir itself goes with the adoption).
    """

    def __init__(
        self,
        staging_fd: int,
        layer: ConfigLayer,
        chunks: Sequence[Chunk],
        file_list_digest: str,
        where: str,
    ) -> None:
        self.layer = layer
        self.dir_name = CACHE_DIR_PREFIX + layer.name
        self._chunks = tuple(chunks)
        self._file_list_digest = file_list_digest
        self._where = f"{where}: raw-image cache of layer {layer.name!r}"
        self._lock = threading.Lock()
        self._first: dict[str, Chunk] = {}
        for chunk in self._chunks:
            self._first.setdefault(chunk.digest, chunk)
        self._claimed: set[str] = set()
        self._crcs: dict[tuple[str, int], int] = {}
        self._fds: dict[str, int] = {}
        self._syncer = ThreadPoolExecutor(1, thread_name_prefix="cedana-cache-sync")
        self._sync_queued: set[str] = set()  # files with an fdatasync queued, not started
        self._synced: list[Future[None]] = []
        os.mkdir(self.dir_name, 0o700, dir_fd=staging_fd)
        self._dir_fd = os.open(self.dir_name, _DIR_FLAGS, dir_fd=staging_fd)
        try:
            for split in layer.split_files:
                fd = os.open(split.path, _NEW_FILE, 0o600, dir_fd=self._dir_fd)
                self._fds[split.path] = fd
                os.ftruncate(fd, split.size)
        except BaseException:
            self.close()
            raise

    @staticmethod
    def worth_building(chunks: Sequence[Chunk]) -> bool:
        """Whether a layer's chunks are regular enough to combine their CRC-32s cheaply."""
        return bool(chunks) and len({c.raw_size for c in chunks}) <= _MAX_CHUNK_SIZES

    def wants(self, digest: str) -> bool:
        return digest in self._first

    def sink(self, digest: str) -> ChunkSink | None:
        """A sink for the download of blob ``digest``, or None (not a chunk of the layer,
        or claimed already: the rest of its places are filled from its staged blob)."""
        chunk = self._first.get(digest)
        with self._lock:
            if chunk is None or digest in self._claimed:
                return None
            self._claimed.add(digest)
        return ChunkSink(self, self._fds[chunk.file], chunk, self._describe(chunk))

    def fill_from(self, digest: str, open_staged: Callable[[str], int]) -> None:
        """Fill every place of chunk blob ``digest`` not filled yet, from its staged copy
        (its digest already checked)."""
        done = self._crcs_snapshot()
        todo = [c for c in self._chunks if c.digest == digest and (c.file, c.offset) not in done]
        if not todo:
            return
        fd = open_staged(digest)
        try:
            for chunk in todo:
                sink = ChunkSink(self, self._fds[chunk.file], chunk, self._describe(chunk))
                os.lseek(fd, 0, os.SEEK_SET)
                while data := os.read(fd, CHUNK * 8):
                    sink.write(data)
                sink.finish()
        finally:
            os.close(fd)

    def unfilled(self) -> list[str]:
        """Digests of chunk blobs with a place not filled yet."""
        done = self._crcs_snapshot()
        return sorted({c.digest for c in self._chunks if (c.file, c.offset) not in done})

    def finish(self, tar_stream: IO[bytes]) -> bytes | None:
        """Unpack the layer's tar (decompressed, from its checked blob) beside the page
        images and rebuild the file list; its bytes when they hash to the recorded
        digest, else None (logged: the cache is not kept)."""
        missing = self.unfilled()
        if missing:
            raise errors.Internal(f"{self._where}: {len(missing)} chunk blob(s) not written")
        entries = self._ordered(self._unpack_tar(tar_stream))
        self._sync_all()
        # Whether the dumping node kept its own raw images is in the list too.
        for kept in (True, False):
            data = dump_file_list(
                FileList(self.layer.name, "dir", self.layer.media_type, kept, entries)
            )
            if sha256_bytes(data) == self._file_list_digest:
                return data
        log.warning(
            "%s: the files do not rebuild the file list the config records; restores "
            "unpack the blobs instead",
            self._where,
        )
        return None

    def close(self) -> None:
        self._syncer.shutdown(wait=True, cancel_futures=True)  # before its fds go
        for fd in self._fds.values():
            with contextlib.suppress(OSError):
                os.close(fd)
        self._fds.clear()
        with contextlib.suppress(OSError, AttributeError):
            os.close(self._dir_fd)

    # -- helpers --------------------------------------------------------------------

    def _describe(self, chunk: Chunk) -> str:
        return f"{self._where}: chunk {chunk.digest} of {chunk.file} at {chunk.offset}"

    def _filled(self, chunk: Chunk, crc: int) -> None:
        with self._lock:
            self._crcs[(chunk.file, chunk.offset)] = crc
            if chunk.file in self._sync_queued:
                return  # the queued fdatasync will cover this chunk too
            self._sync_queued.add(chunk.file)
            self._synced.append(self._syncer.submit(self._sync, chunk.file))

    def _sync(self, path: str) -> None:
        with self._lock:
            self._sync_queued.discard(path)  # chunks written from now on queue another
        os.fdatasync(self._fds[path])

    def _sync_all(self) -> None:
        """Every page image and the tar's files on disk; re-raises a failed fdatasync."""
        with self._lock:
            pending = list(self._synced)
        for future in pending:
            future.result()
        for fd in self._fds.values():
            os.fdatasync(fd)  # what the last queued one started before (cheap)
        self._sync_tree(self._dir_fd)

    def _crcs_snapshot(self) -> dict[tuple[str, int], int]:
        with self._lock:
            return dict(self._crcs)

    def _split_entries(self) -> list[RawFile]:
        out: list[RawFile] = []
        for split in self.layer.split_files:
            crc, end = 0, 0
            for chunk in sorted(
                (c for c in self._chunks if c.file == split.path), key=lambda c: c.offset
            ):
                crc = crc32_combine(crc, self._crcs[(chunk.file, chunk.offset)], chunk.raw_size)
                end = chunk.offset + chunk.raw_size
            if end != split.size:
                raise errors.DataLoss(f"{self._where}: the chunks of {split.path} end at {end}")
            out.append(RawFile(split.path, "file", split.mode, split.mtime, split.size, crc))
        return out

    def _ordered(self, tar_entries: list[RawFile]) -> tuple[RawFile, ...]:
        """Publish's walk order: the top level sorted by name, then each subdirectory's
        entries (the tar holds those in that order already); page images are top-level."""
        top = [e for e in tar_entries if "/" not in e.path] + self._split_entries()
        nested = [e for e in tar_entries if "/" in e.path]
        return (*sorted(top, key=lambda e: e.path), *nested)

    def _unpack_tar(self, stream: IO[bytes]) -> list[RawFile]:
        entries: list[RawFile] = []
        try:
            with tarfile.open(fileobj=stream, mode="r|", bufsize=CHUNK) as tar:
                for member in tar:
                    try:
                        rel = member_path(member)
                    except ValueError as why:
                        raise errors.DataLoss(
                            f"{self._where}: unsafe tar member {member.name!r} ({why})"
                        ) from None
                    if rel is None:
                        continue
                    entries.append(self._unpack_member(tar, member, rel))
        except tarfile.TarError as err:
            raise errors.DataLoss(f"{self._where}: broken tar stream ({err})") from None
        return entries

    def _unpack_member(self, tar: tarfile.TarFile, member: tarfile.TarInfo, rel: str) -> RawFile:
        mode, mtime = member.mode & 0o7777, int(member.mtime)
        parent, _, name = rel.rpartition("/")
        parent_fd = self._open_parent(parent)
        try:
            if member.isdir():
                os.mkdir(name, 0o700, dir_fd=parent_fd)
                return RawFile(rel, "dir", mode, mtime)
            try:
                fd = os.open(name, _NEW_FILE, 0o600, dir_fd=parent_fd)
            except FileExistsError:
                raise errors.DataLoss(
                    f"{self._where}: {rel} is both in the layer's tar and split into chunks"
                ) from None
            try:
                src = tar.extractfile(member)
                assert src is not None  # a regular file has data
                crc = size = 0
                while data := src.read(CHUNK):
                    write_all(fd, data)
                    crc = zlib.crc32(data, crc)
                    size += len(data)
                os.fdatasync(fd)  # small files (the page images are synced apart)
            finally:
                os.close(fd)
            return RawFile(rel, "file", mode, mtime, size, crc)
        except FileExistsError:
            raise errors.DataLoss(f"{self._where}: {rel} is in the layer's tar twice") from None
        finally:
            if parent_fd != self._dir_fd:
                os.close(parent_fd)

    def _sync_tree(self, dir_fd: int) -> None:
        """fsync the cache's directories, deepest first (their entries are durable)."""
        for name in sorted(os.listdir(dir_fd)):
            try:
                child = os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
            except NotADirectoryError:
                continue
            try:
                self._sync_tree(child)
            finally:
                os.close(child)
        os.fsync(dir_fd)

    def _open_parent(self, parent: str) -> int:
        """The directory ``parent`` (made by an earlier member: tar order) under the cache."""
        if not parent:
            return self._dir_fd
        fd = os.dup(self._dir_fd)
        try:
            for part in parent.split("/"):
                child = os.open(part, _DIR_FLAGS, dir_fd=fd)
                os.close(fd)
                fd = child
        except FileNotFoundError:
            os.close(fd)
            raise errors.DataLoss(
                f"{self._where}: the tar holds {parent!r}'s files before the directory"
            ) from None
        except BaseException:
            os.close(fd)
            raise
        return fd
