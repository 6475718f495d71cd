"""Streaming zstd + sha256 (and strict tar extraction), with bounded memory.

Writing: a layer's bytes (a tar the caller produces as it goes) -> zstd
(multi-threaded) -> sha256 + blob file, in one pass with no uncompressed temp
tar: CRIU page images are GiBs, and the store's disk holds their raw copy too.

Reading: blob -> sha256 -> zstd -> strict tar reader -> files. The digest is
checked at the end of the same pass, before the caller makes anything visible
(extraction happens in a private temp directory that is renamed into place
only on success), so a blob is read once, not twice.

Every decompression of the store (here, chunks.py, rawcache.py, adopt.py) is held
to the raw size the checkpoint recorded for its output, by :class:`RawBound`: a
checkpoint from a registry is untrusted, and a small blob can expand to gigabytes
(a zstd bomb). Output past that size is refused at its first byte, before anything
is written of it.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import io
import os
import queue
import tarfile
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import IO, TYPE_CHECKING, Final, Protocol, TypeAlias, cast

import zstandard

from cedana_shim import errors

from .fsutil import write_all

if TYPE_CHECKING:
    from typing_extensions import Buffer

__all__ = [
    "CHUNK",
    "LayerStream",
    "RawBound",
    "WrittenBlob",
    "ZstdReader",
    "compress_stream",
    "extract_tar",
    "extract_tar_zstd",
    "hash_fd",
    "member_path",
]

_Bytes: TypeAlias = bytes | bytearray | memoryview


class _Readable(Protocol):
    def read(self, n: int = -1, /) -> _Bytes: ...


# I/O unit everywhere. Measured here: 128 KiB beats 1 MiB by 2x, because glibc
# serves fresh allocations >= its mmap threshold (128 KiB to start with) with
# new mappings, so every 1 MiB bytes object the pipeline creates costs 256 page
# faults; below it, buffers are recycled from the heap. Buffers that can be
# reused are, which matters more than their size.
CHUNK: Final = 128 << 10
_SINK_DEPTH: Final = 32  # chunks in flight to the writer thread: 4 MiB

# Errors from creating a path named by a tar member: the member is at fault
# (names clash, too long), not the machine.
_MEMBER_ERRNOS: Final = frozenset(
    {errno.EEXIST, errno.ENOTDIR, errno.EISDIR, errno.ENAMETOOLONG, errno.ELOOP, errno.EINVAL}
)


@dataclass(frozen=True)
class WrittenBlob:
    digest: str  # "sha256:<hex>" of the stored (compressed) bytes
    size: int  # stored bytes
    raw_size: int  # bytes before compression (the tar stream)


def _zstd_threads(threads: int) -> int:
    # StoreConfig says 0 = all cores; zstandard says -1 = all cores, 0 = no workers.
    return -1 if threads == 0 else threads


class _HashingSink:
    """Where zstd puts compressed output: sha256 it and append it to the blob.

    A helper thread does the hashing and writing (both release the GIL), so
    they overlap with reading and compressing instead of adding to them:
    incompressible data (random page contents) is hash- and write-bound.
    """

    def __init__(self, fd: int, on_first_write: Callable[[], None] | None) -> None:
        self._fd = fd
        self._on_first_write = on_first_write
        self.hash = hashlib.sha256()
        self.size = 0
        self._queue: queue.Queue[bytes | None] = queue.Queue(maxsize=_SINK_DEPTH)
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="cedana-blob-writer", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while (data := self._queue.get()) is not None:
            if self._error is not None:
                continue  # keep draining so the producer never blocks on a dead writer
            try:
                self.hash.update(data)
                write_all(self._fd, data)
            except BaseException as err:  # handed to the producer, which re-raises it
                self._error = err

    def write(self, data: _Bytes) -> int:
        if self._error is not None:
            raise self._error
        # zstd hands over a fresh bytes object per call; anything else may be
        # a buffer its owner reuses, so it is copied.
        chunk = data if isinstance(data, bytes) else bytes(data)
        self._queue.put(chunk)
        self.size += len(chunk)
        if self._on_first_write is not None:
            hook, self._on_first_write = self._on_first_write, None
            hook()
        return len(chunk)

    def flush(self) -> None:
        pass

    def finish(self) -> None:
        """Wait for every byte to be hashed and written; re-raise a write error."""
        self._queue.put(None)
        self._thread.join()
        if self._error is not None:
            raise self._error


class _CountingWriter:
    """What tarfile writes into: counts raw bytes and passes them to zstd.

    tarfile's plain "w" mode (unlike the "w|" stream mode, which copies every
    block through an internal bytes buffer) only needs write() and tell().
    """

    def __init__(self, inner: zstandard.ZstdCompressionWriter) -> None:
        self._inner = inner
        self.count = 0

    def write(self, data: _Bytes) -> int:
        n = len(memoryview(data))
        self._inner.write(data)
        self.count += n
        return n

    def tell(self) -> int:
        return self.count

    def flush(self) -> None:
        pass


def _compressor(level: int, threads: int) -> zstandard.ZstdCompressor:
    return zstandard.ZstdCompressor(
        level=level, threads=_zstd_threads(threads), write_checksum=True
    )


def compress_stream(
    fd: int,
    feed: Callable[[IO[bytes]], None],
    *,
    level: int,
    threads: int,
    on_first_write: Callable[[], None] | None = None,
) -> WrittenBlob:
    """zstd whatever ``feed`` writes (into the file-like it is given) into ``fd``."""
    sink = _HashingSink(fd, on_first_write)
    try:
        with _compressor(level, threads).stream_writer(
            cast("IO[bytes]", sink), write_size=CHUNK, closefd=False
        ) as zwriter:
            counter = _CountingWriter(zwriter)
            feed(cast("IO[bytes]", counter))
    except BaseException:
        with contextlib.suppress(OSError):  # the error already raised says more
            sink.finish()
        raise
    sink.finish()
    return WrittenBlob(f"sha256:{sink.hash.hexdigest()}", sink.size, counter.count)


def hash_fd(fd: int) -> tuple[str, int]:
    """(digest, size) of everything readable from ``fd``."""
    h = hashlib.sha256()
    size = 0
    buf = bytearray(CHUNK)
    view = memoryview(buf)
    while n := os.readv(fd, [buf]):
        h.update(view[:n])
        size += n
    return f"sha256:{h.hexdigest()}", size


class _HashingReader:
    """The raw blob as zstd reads it, hashed on the way through."""

    def __init__(self, fd: int) -> None:
        self._fd = fd
        self.hash = hashlib.sha256()
        self.size = 0

    def read(self, n: int = -1) -> bytes:
        data = os.read(self._fd, CHUNK if n < 0 else n)
        self.hash.update(data)
        self.size += len(data)
        return data

    def drain(self) -> None:
        while self.read(CHUNK):
            pass

    def digest(self) -> str:
        return f"sha256:{self.hash.hexdigest()}"


def _decompressor() -> zstandard.ZstdDecompressor:
    return zstandard.ZstdDecompressor()


class RawBound:
    """The raw size recorded for what a blob decompresses to, held to the byte.

    A decompression counts its output here (``add``) before using it: the first
    byte past ``size`` is DataLoss, so nothing beyond the recorded size is ever
    written, whatever the blob expands to. ``end`` refuses output that stops short.
    """

    def __init__(self, size: int, describe: str) -> None:
        self.size = size
        self.count = 0
        self._describe = describe

    def room(self, want: int) -> int:
        """How much of ``want`` to ask a decompressor for: one byte past the bound at
        most, which is enough to tell that the output goes on."""
        return max(0, min(want, self.size - self.count + 1))

    def add(self, n: int) -> None:
        if n > self.size - self.count:
            raise errors.DataLoss(
                f"{self._describe}: decompresses to more than the {self.size} bytes recorded "
                f"for it; refused at byte {self.size + 1}, nothing past it written (the "
                "checkpoint is damaged or forged)"
            )
        self.count += n

    def end(self) -> None:
        if self.count != self.size:
            raise errors.DataLoss(
                f"{self._describe}: decompresses to {self.count} bytes, {self.size} recorded for it"
            )


class ZstdReader(io.RawIOBase):
    """``source`` (one zstd frame) decompressed, held to ``bound`` (see RawBound);
    DataLoss for corrupt zstd data, or output longer or shorter than the bound."""

    def __init__(self, source: _Readable | Buffer, bound: RawBound, describe: str) -> None:
        super().__init__()
        self._zreader = _decompressor().stream_reader(
            source,  # type: ignore[arg-type]
            read_size=CHUNK,
            closefd=False,
        )
        self.bound = bound
        self._describe = describe
        self._ended = False

    def readable(self) -> bool:
        return True

    def readinto(self, b: Buffer) -> int:
        view = memoryview(b).cast("B")
        want = self.bound.room(len(view))
        if want == 0:
            return 0  # an empty buffer: not the end of the stream
        try:
            n: int = self._zreader.readinto(view[:want])
        except zstandard.ZstdError as err:
            raise errors.DataLoss(f"{self._describe}: corrupt zstd data ({err})") from None
        self.bound.add(n)
        if n == 0 and not self._ended:
            self._ended = True
            self.bound.end()
        return n

    def drain(self) -> None:
        """Read to the end (the bound's checks, the frame's checksum)."""
        buf = bytearray(CHUNK)
        while self.readinto(buf):
            pass

    def close(self) -> None:
        if not self.closed:
            self._zreader.close()  # type: ignore[no-untyped-call]
        super().close()


class LayerStream(io.RawIOBase):
    """Decompressed layer bytes (``raw_size`` of them); raises DataLoss at EOF if the
    blob's digest is off.

    The store verifies the blob before handing this out; checking again as it
    streams costs nothing and catches a blob changed underneath the reader.
    """

    def __init__(self, fd: int, digest: str, size: int, raw_size: int, describe: str) -> None:
        super().__init__()
        self._fd = fd
        self._expected = (digest, size)
        self._describe = describe
        self._hreader = _HashingReader(fd)
        self._zreader = ZstdReader(self._hreader, RawBound(raw_size, describe), describe)
        self._checked = False

    def readable(self) -> bool:
        return True

    def readinto(self, b: Buffer) -> int:
        n = self._zreader.readinto(b)
        if n == 0 and not self._checked:
            self._checked = True
            self._hreader.drain()
            got = (self._hreader.digest(), self._hreader.size)
            if got != self._expected:
                raise errors.DataLoss(
                    f"{self._describe}: blob changed while it was read "
                    f"(now {got[0]}, {got[1]} bytes; expected {self._expected[0]}, "
                    f"{self._expected[1]} bytes)"
                )
        return n

    def close(self) -> None:
        if not self.closed:
            try:
                self._zreader.close()
            finally:
                os.close(self._fd)
        super().close()


def member_path(member: tarfile.TarInfo) -> str | None:
    """The member's path relative to the destination; None for the root itself.

    Stricter than tarfile's "data" filter on purpose: no link of any kind is
    accepted, so no path can ever resolve outside the destination, whatever
    tricks realpath-based checks have been fooled by.
    """
    name = member.name
    if "\x00" in name:
        raise ValueError("NUL in its name")
    if name.startswith("/"):
        raise ValueError("absolute path")
    parts = [p for p in name.split("/") if p not in ("", ".")]
    if ".." in parts:
        raise ValueError("'..' in its path")
    if member.isreg() or member.isdir():
        pass
    elif member.issym() or member.islnk():
        raise ValueError(f"{'symbolic' if member.issym() else 'hard'} link to {member.linkname!r}")
    elif member.ischr() or member.isblk():
        raise ValueError("device node")
    elif member.isfifo():
        raise ValueError("FIFO")
    else:
        raise ValueError(f"unsupported member type {member.type!r}")
    if not parts:
        if member.isdir():
            return None
        raise ValueError("a file with an empty name")
    return "/".join(parts)


def _extract_member(
    tar: tarfile.TarFile,
    member: tarfile.TarInfo,
    rel: str,
    dest: str,
    dirs: list[tuple[str, tarfile.TarInfo]],
) -> None:
    path = os.path.join(dest, rel)
    parent = os.path.dirname(path)
    # Safe to let makedirs walk: dest is a fresh private directory holding no
    # links (none are ever extracted), so every component is a real directory.
    os.makedirs(parent, mode=0o700, exist_ok=True)
    if member.isdir():
        try:
            os.mkdir(path, 0o700)
        except FileExistsError:
            if not os.path.isdir(path):
                raise
        dirs.append((path, member))
        return
    src = tar.extractfile(member)
    assert src is not None  # regular files always have data
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        while data := src.read(CHUNK):
            write_all(fd, data)
        # Created private, opened up to the recorded mode once complete; never
        # setuid/setgid/sticky from an archive.
        os.fchmod(fd, member.mode & 0o777)
        os.utime(fd, (member.mtime, member.mtime))
    finally:
        os.close(fd)


def extract_tar(source: _Readable, dest: str, describe: str) -> None:
    """Extract the tar read from ``source`` into the empty private directory ``dest``.

    Raises DataLoss (naming ``describe``) for a broken tar or an unsafe member.
    OSErrors about the destination itself (ENOSPC...) propagate as they are.
    On error ``dest`` may hold partial output: the caller owns its removal.
    """
    dirs: list[tuple[str, tarfile.TarInfo]] = []
    member_name = ""
    try:
        with tarfile.open(
            fileobj=source,  # type: ignore[call-overload]
            mode="r|",
            bufsize=CHUNK,
            copybufsize=CHUNK,
        ) as tar:
            for member in tar:
                member_name = member.name
                try:
                    rel = member_path(member)
                except ValueError as why:
                    raise errors.DataLoss(
                        f"{describe}: unsafe tar member {member.name!r} ({why}); "
                        "refusing to extract it: the checkpoint is corrupt or was tampered with"
                    ) from None
                if rel is not None:
                    _extract_member(tar, member, rel, dest, dirs)
    except tarfile.TarError as err:
        raise errors.DataLoss(f"{describe}: broken tar stream ({err})") from None
    except OSError as err:
        if err.errno in _MEMBER_ERRNOS and member_name:
            raise errors.DataLoss(
                f"{describe}: cannot extract tar member {member_name!r} ({err.strerror})"
            ) from None
        raise
    # Deepest first, so a read-only directory does not block setting its children.
    for path, member in reversed(dirs):
        os.chmod(path, member.mode & 0o777)
        os.utime(path, (member.mtime, member.mtime))


def extract_tar_zstd(
    fd: int, digest: str, size: int, raw_size: int, dest: str, describe: str
) -> None:
    """Extract the zstd tar readable from ``fd`` (a blob) into the empty directory ``dest``.

    As extract_tar, plus DataLoss for a digest or size mismatch, corrupt zstd, or a
    tar of other than ``raw_size`` bytes (refused at the byte past it).
    """
    have = os.fstat(fd).st_size
    if have != size:
        raise errors.DataLoss(f"{describe}: blob is {have} bytes, expected {size} (truncated?)")
    hreader = _HashingReader(fd)
    with ZstdReader(hreader, RawBound(raw_size, describe), describe) as zreader:
        extract_tar(zreader, dest, describe)
        # Past the tar's end-of-archive blocks: read the rest so the zstd
        # frame checksum, the raw size and the blob digest cover every byte.
        zreader.drain()
    hreader.drain()
    if (hreader.digest(), hreader.size) != (digest, size):
        raise errors.DataLoss(
            f"{describe}: digest mismatch (blob hashes to {hreader.digest()}, "
            f"index says {digest}); the blob is corrupt"
        )
