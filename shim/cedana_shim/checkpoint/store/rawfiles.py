"""Raw layer files: sealed at publish, checked against their file list afterwards.

Publishing seals a layer's staged files where they are: each file fsynced,
chmod 0600 (directories 0700) and its CRC-32 computed, in a small thread pool
(zlib releases the GIL; ~0.25 s per GiB on 2 threads, sha256 would be ~0.6 s).
Files are named, opened and walked through directory fds without following a
symlink: a layer holds regular files and directories, nothing else.

Later passes check the files against the list in the same read that uses them:
compaction (tar), extraction (copy), restores (verify).
"""

from __future__ import annotations

import contextlib
import os
import stat
import tarfile
import threading
import zlib
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future, ThreadPoolExecutor, wait
from types import MappingProxyType
from typing import IO, Any, Final

from cedana_shim import errors

from .early_seal import Prefix
from .filelist import MAX_DEPTH, FileList, RawFile, check_rel_path
from .fsutil import open_dir, open_file, write_all

__all__ = [
    "CHUNK",
    "CheckingReader",
    "TellingWriter",
    "copy_dir",
    "copy_file",
    "copy_out",
    "crc_pool",
    "open_listed",
    "seal_dir",
    "seal_file",
    "verify_files",
    "write_layer",
    "write_tar",
]

# See compress.CHUNK: reused buffers below glibc's mmap threshold.
CHUNK: Final = 128 << 10
_CRC_THREADS: Final = max(2, min(4, os.cpu_count() or 1))
_MAX_OPEN: Final = 64  # files handed to the pool and not yet closed
_DIR_FLAGS: Final = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


def crc_pool() -> ThreadPoolExecutor:
    return ThreadPoolExecutor(max_workers=_CRC_THREADS, thread_name_prefix="cedana-crc")


def _crc_fd(fd: int, size: int = 0, crc: int = 0) -> tuple[int, int]:
    """(CRC-32, size) of everything readable from ``fd``, its first ``size`` bytes
    taken as having CRC-32 ``crc``."""
    buf = bytearray(CHUNK)
    view = memoryview(buf)
    if size:
        os.lseek(fd, size, os.SEEK_SET)
    while n := os.readv(fd, [buf]):
        crc = zlib.crc32(view[:n], crc)
        size += n
    return crc, size


# -- walking -----------------------------------------------------------------------------


def _walk(
    dir_fd: int, describe: str, on_dir_done: Callable[[int], None] | None, prefix: str = ""
) -> Iterator[tuple[str, int, str, os.stat_result]]:
    """(relative path, parent fd, name, lstat) of everything under ``dir_fd``, in tar order.

    A directory comes before what it holds; ``on_dir_done`` gets each
    subdirectory's fd once its whole subtree was walked.
    """
    if prefix.count("/") >= MAX_DEPTH:
        raise errors.InvalidArgument(f"{describe}: deeper than {MAX_DEPTH} levels at {prefix}")
    with os.scandir(dir_fd) as it:
        names = sorted(e.name for e in it)
    subdirs: list[str] = []
    for name in names:
        st = os.lstat(name, dir_fd=dir_fd)
        yield prefix + name, dir_fd, name, st
        if stat.S_ISDIR(st.st_mode):
            subdirs.append(name)
    for name in subdirs:
        fd = os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
        try:
            yield from _walk(fd, describe, on_dir_done, f"{prefix}{name}/")
            if on_dir_done is not None:
                on_dir_done(fd)
        finally:
            os.close(fd)


def _check_entry(rel: str, st: os.stat_result, describe: str) -> None:
    if (why := check_rel_path(rel)) is not None:
        raise errors.InvalidArgument(f"{describe}: {why}")
    if not (stat.S_ISREG(st.st_mode) or stat.S_ISDIR(st.st_mode)):
        raise errors.InvalidArgument(
            f"{describe}: {rel} is not a regular file or directory; a checkpoint layer "
            "holds only those"
        )


def _dir_entry(rel: str, st: os.stat_result) -> RawFile:
    return RawFile(rel, "dir", stat.S_IMODE(st.st_mode), int(st.st_mtime))


# -- sealing staged files in place (publish) -----------------------------------------------


def _crc_and_close(fd: int, prefix: Prefix | None) -> tuple[int, int]:
    try:
        return _crc_fd(fd) if prefix is None else _crc_fd(fd, prefix.size, prefix.crc)
    finally:
        os.close(fd)


def _fsync_and_close(fd: int) -> None:
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _seal_dir_fd(fd: int) -> None:
    os.fchmod(fd, 0o700)
    os.fsync(fd)


class _Sealer:
    """Seals files in a pool: the CRC read and the fsync (writeback) of a file overlap.

    At most _MAX_OPEN fds are handed out at a time (two per file).
    """

    def __init__(self, pool: ThreadPoolExecutor) -> None:
        self._pool = pool
        self._slots = threading.BoundedSemaphore(_MAX_OPEN)
        self._synced: list[Future[None]] = []

    def _release(self, future: Future[Any]) -> None:
        self._slots.release()

    def submit(
        self, dir_fd: int, name: str, prefix: Prefix | None = None
    ) -> tuple[os.stat_result, Future[tuple[int, int]]]:
        """Start sealing ``name``: its stat (before chmod) and its (CRC-32, size) to come;
        ``prefix``: what an EarlySealer read of it, used when it is still that file."""
        self._slots.acquire()
        self._slots.acquire()
        try:
            fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
        except BaseException:
            self._slots.release()
            self._slots.release()
            raise
        try:
            st = os.fstat(fd)
            os.fchmod(fd, 0o600)
            sync_fd = os.dup(fd)
        except BaseException:
            os.close(fd)
            self._slots.release()
            self._slots.release()
            raise
        synced = self._pool.submit(_fsync_and_close, sync_fd)
        synced.add_done_callback(self._release)
        self._synced.append(synced)
        if prefix is not None and (
            (prefix.dev, prefix.ino) != (st.st_dev, st.st_ino) or prefix.size > st.st_size
        ):
            prefix = None  # not the file that was followed, or not all of it is left
        checked = self._pool.submit(_crc_and_close, fd, prefix)
        checked.add_done_callback(self._release)
        return st, checked

    def wait(self) -> None:
        """Every fsync done; re-raises the first failure."""
        for future in self._synced:
            future.result()


def seal_dir(
    dir_fd: int,
    pool: ThreadPoolExecutor,
    describe: str,
    prefixes: Mapping[str, Prefix] = MappingProxyType({}),
) -> list[RawFile]:
    """Seal every file under ``dir_fd`` (see the module doc); their entries, in tar order.

    ``prefixes``: what an EarlySealer read of files, by relative path."""
    sealer = _Sealer(pool)
    pending: list[tuple[RawFile, Future[tuple[int, int]] | None]] = []
    try:
        for rel, parent, name, st in _walk(dir_fd, describe, _seal_dir_fd):
            _check_entry(rel, st, describe)
            if stat.S_ISDIR(st.st_mode):
                pending.append((_dir_entry(rel, st), None))
                continue
            _, checked = sealer.submit(parent, name, prefixes.get(rel))
            pending.append(
                (RawFile(rel, "file", stat.S_IMODE(st.st_mode), int(st.st_mtime)), checked)
            )
        _seal_dir_fd(dir_fd)
    except BaseException:
        # Let every handed-out fd be closed before the caller removes anything.
        with contextlib.suppress(BaseException):
            wait(f for _, f in pending if f is not None)
        with contextlib.suppress(BaseException):
            sealer.wait()
        raise
    entries: list[RawFile] = []
    for raw, future in pending:
        if future is not None:
            crc, size = future.result()
            raw = RawFile(raw.path, "file", raw.mode, raw.mtime, size, crc)
        entries.append(raw)
    sealer.wait()
    return entries


def seal_file(dir_fd: int, name: str, rel: str, pool: ThreadPoolExecutor) -> RawFile:
    """Seal one staged file (a file layer's tar), recorded under ``rel``."""
    sealer = _Sealer(pool)
    st, checked = sealer.submit(dir_fd, name)
    crc, size = checked.result()
    sealer.wait()
    return RawFile(rel, "file", stat.S_IMODE(st.st_mode), int(st.st_mtime), size, crc)


# -- copying a caller's files in (publish of a layer staged outside the ingest) ----------


def _copy_fd(src: int, dst: int) -> tuple[int, int]:
    buf = bytearray(CHUNK)
    view = memoryview(buf)
    crc = size = 0
    while n := os.readv(src, [buf]):
        write_all(dst, view[:n])
        crc = zlib.crc32(view[:n], crc)
        size += n
    os.fsync(dst)
    return crc, size


def copy_file(src_fd: int, dest_dir_fd: int, name: str, rel: str) -> RawFile:
    """Copy the open file ``src_fd`` into a new 0600 file; its entry, recorded as ``rel``."""
    st = os.fstat(src_fd)
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    dst = os.open(name, flags, 0o600, dir_fd=dest_dir_fd)
    try:
        crc, size = _copy_fd(src_fd, dst)
    finally:
        os.close(dst)
    return RawFile(rel, "file", stat.S_IMODE(st.st_mode), int(st.st_mtime), size, crc)


def copy_dir(src_fd: int, dest_fd: int, describe: str) -> list[RawFile]:
    """Copy the tree under ``src_fd`` into the empty private ``dest_fd``; its entries."""
    entries: list[RawFile] = []
    for rel, parent, name, st in _walk(src_fd, describe, None):
        _check_entry(rel, st, describe)
        if stat.S_ISDIR(st.st_mode):
            # Our own fresh directory tree: no component can be a symlink.
            os.mkdir(rel, 0o700, dir_fd=dest_fd)
            entries.append(_dir_entry(rel, st))
            continue
        src = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=parent)
        try:
            entries.append(copy_file(src, dest_fd, rel, rel))
        finally:
            os.close(src)
    for raw in reversed(entries):
        if raw.kind == "dir":
            fd = os.open(raw.path, _DIR_FLAGS, dir_fd=dest_fd)
            try:
                os.fsync(fd)
            finally:
                os.close(fd)
    os.fsync(dest_fd)
    return entries


# -- checking ----------------------------------------------------------------------------


def _open_rel(dir_fd: int, rel: str, *, path: str) -> int:
    """Open the regular file at ``rel`` under ``dir_fd``, following no symlink."""
    parts = rel.split("/")
    fd = os.dup(dir_fd)
    try:
        where = path
        for part in parts[:-1]:
            where = os.path.join(where, part)
            child = open_dir(fd, part, path=where)
            os.close(fd)
            fd = child
        return open_file(fd, parts[-1], path=os.path.join(path, rel))
    finally:
        os.close(fd)


def open_listed(dir_fd: int, raw: RawFile, *, path: str, describe: str) -> int:
    """Open a listed file of the layer at ``dir_fd`` (``path``); DataLoss naming it."""
    try:
        return _open_rel(dir_fd, raw.path, path=path)
    except FileNotFoundError:
        raise errors.DataLoss(f"{describe}: {raw.path} is missing") from None
    except errors.DataLoss as err:
        raise errors.DataLoss(f"{describe}: {err}") from None


class CheckingReader:
    """read(n) over one raw file, checking its size and CRC-32 against the list.

    Answers from one reused buffer (see CHUNK): each chunk must be consumed
    before the next read, which tarfile and zstd do. ``check`` raises DataLoss
    once everything was read, if anything was off.
    """

    def __init__(self, fd: int, raw: RawFile, describe: str) -> None:
        self._fd = fd
        self._raw = raw
        self._describe = describe
        self._view = memoryview(bytearray(CHUNK))
        self._crc = 0
        self._size = 0
        have = os.fstat(fd).st_size
        if have != raw.size:
            raise errors.DataLoss(
                f"{describe}: {raw.path} is {have} bytes, the file list says {raw.size} "
                "(truncated or changed after it was published)"
            )

    def read(self, n: int = CHUNK) -> memoryview:
        n = CHUNK if n < 0 else min(n, CHUNK)
        got = self.readinto(self._view[:n])
        return self._view[:got]

    def readinto(self, view: memoryview) -> int:
        """Fill ``view`` (the caller's buffer) as far as the file goes; the bytes read."""
        got = 0
        while got < len(view) and (k := os.readv(self._fd, [view[got:]])):
            got += k
        self._crc = zlib.crc32(view[:got], self._crc)
        self._size += got
        return got

    def check(self) -> None:
        if (self._size, self._crc) != (self._raw.size, self._raw.crc32):
            raise errors.DataLoss(
                f"{self._describe}: {self._raw.path} does not match its file list "
                f"(read {self._size} bytes with CRC-32 {self._crc:08x}; published "
                f"{self._raw.size} bytes with CRC-32 {self._raw.crc32:08x})"
            )

    def drain(self) -> None:
        """Read to the end and check (a reader that stopped at the data's end)."""
        while self.read(CHUNK):
            pass
        self.check()


def _verify_one(dir_fd: int, raw: RawFile, path: str, describe: str, deep: bool) -> None:
    fd = open_listed(dir_fd, raw, path=path, describe=describe)
    try:
        reader = CheckingReader(fd, raw, describe)
        if deep:
            reader.drain()
    finally:
        os.close(fd)


def verify_files(dir_fd: int, files: FileList, *, path: str, describe: str, deep: bool) -> None:
    """DataLoss naming the first file that is missing, of another size or (``deep``) CRC."""
    todo = list(files.regular_files())
    if not deep or len(todo) < 2:
        for raw in todo:
            _verify_one(dir_fd, raw, path, describe, deep)
        return
    with crc_pool() as pool:
        futures = [pool.submit(_verify_one, dir_fd, raw, path, describe, deep) for raw in todo]
        for future in futures:
            future.result()


# -- using ------------------------------------------------------------------------------------


class TellingWriter:
    """``out`` with tell(), which tarfile's "w" mode needs (a pipe has none)."""

    def __init__(self, out: IO[bytes]) -> None:
        self._out = out
        self._count = 0

    def write(self, data: bytes | memoryview) -> int:
        self._out.write(data)
        self._count += len(data)
        return len(data)

    def tell(self) -> int:
        return self._count


def write_tar(dir_fd: int, files: FileList, out: IO[bytes], *, path: str, describe: str) -> None:
    """The tar the list stands for, into ``out``; each file checked as it is read."""
    with tarfile.open(
        fileobj=TellingWriter(out),  # type: ignore[call-overload]
        mode="w",
        format=tarfile.PAX_FORMAT,
        copybufsize=CHUNK,
    ) as tar:
        for raw in files.files:
            info = tarfile.TarInfo(raw.path)
            info.mode, info.mtime = raw.mode, raw.mtime
            if raw.kind == "dir":
                info.type = tarfile.DIRTYPE
                tar.addfile(info)
                continue
            info.type, info.size = tarfile.REGTYPE, raw.size
            fd = open_listed(dir_fd, raw, path=path, describe=describe)
            try:
                reader = CheckingReader(fd, raw, describe)
                try:
                    tar.addfile(info, reader)
                except OSError as err:
                    if "unexpected end of data" not in str(err):
                        raise
                reader.check()
            finally:
                os.close(fd)


def write_layer(dir_fd: int, files: FileList, out: IO[bytes], *, path: str, describe: str) -> None:
    """The layer's tar into ``out``: made from a dir layer's files, or a file layer's own."""
    if files.kind == "dir":
        write_tar(dir_fd, files, out, path=path, describe=describe)
        return
    (raw,) = files.files
    fd = open_listed(dir_fd, raw, path=path, describe=describe)
    try:
        reader = CheckingReader(fd, raw, describe)
        while chunk := reader.read():
            out.write(chunk)
        reader.check()
    finally:
        os.close(fd)


def copy_out(dir_fd: int, files: FileList, dest_fd: int, *, path: str, describe: str) -> None:
    """Copy the listed files into the empty private ``dest_fd`` with their recorded modes."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
    for raw in files.files:
        if raw.kind == "dir":
            os.mkdir(raw.path, 0o700, dir_fd=dest_fd)
            continue
        src = open_listed(dir_fd, raw, path=path, describe=describe)
        try:
            reader = CheckingReader(src, raw, describe)
            dst = os.open(raw.path, flags, 0o600, dir_fd=dest_fd)
            try:
                while chunk := reader.read(CHUNK):
                    write_all(dst, chunk)
                reader.check()
                os.fchmod(dst, raw.mode & 0o777)
                os.utime(dst, (raw.mtime, raw.mtime))
            finally:
                os.close(dst)
        finally:
            os.close(src)
    # Deepest first, so a read-only directory does not block setting its children.
    for raw in reversed(files.files):
        if raw.kind == "dir":
            fd = os.open(raw.path, _DIR_FLAGS, dir_fd=dest_fd)
            try:
                os.fchmod(fd, raw.mode & 0o777)
                os.utime(fd, (raw.mtime, raw.mtime))
            finally:
                os.close(fd)
