"""Filesystem helpers for the checkpoint store: durable writes, no symlink followed.

Every file is created 0600 and every directory 0700 from the start (never
chmod'ed wider: checkpoints hold process memory). Durability follows the usual
POSIX recipe: fsync the file, rename it into place, fsync the directory.

Nothing under the store root is reached through a path that the kernel would
resolve through a symlink: the store opens its root once (the root itself may
be a symlink to another disk, on purpose), then descends with directory fds,
``O_NOFOLLOW | O_DIRECTORY``, ``*at`` calls and ``lstat``. A symlink where the
store expects a directory or a file is DataLoss, never followed. Every function
here that takes a ``dir_fd`` works that way; ``path`` arguments only name the
thing in messages.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import functools
import hashlib
import os
import secrets
import shutil
import stat
from collections.abc import Callable, Iterator
from typing import Final, TypeAlias

from cedana_shim import errors

__all__ = [
    "TooLarge",
    "create_file_at",
    "flocked",
    "mkdtemp_private",
    "open_dir",
    "open_file",
    "opened_dir",
    "pwrite_all",
    "read_file_at",
    "remove_entry",
    "sha256_bytes",
    "tree_bytes",
    "write_all",
    "write_file_atomic",
]

Bytes: TypeAlias = bytes | bytearray | memoryview

_DIR_FLAGS: Final = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_NEW_FILE: Final = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


class TooLarge(Exception):
    pass


def write_all(fd: int, data: Bytes) -> None:
    view = memoryview(data).cast("B")
    while view:
        n = os.write(fd, view)
        view = view[n:]


def pwrite_all(fd: int, data: Bytes, offset: int) -> None:
    """``data`` at ``offset`` of ``fd``, however many writes it takes."""
    view = memoryview(data).cast("B")
    while view:
        n = os.pwrite(fd, view, offset)
        view, offset = view[n:], offset + n


_SYNC_FILE_RANGE_WRITE: Final = 2  # start writing the range back; wait for nothing


@functools.cache
def _sync_file_range() -> Callable[[int, int, int, int], int] | None:
    """libc's sync_file_range (Python's os has none); looked up at the first dump, not
    at import: the daemon that imports the store may never dump."""
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        call = libc.sync_file_range
    except (OSError, AttributeError):
        return None
    call.argtypes = [ctypes.c_int, ctypes.c_longlong, ctypes.c_longlong, ctypes.c_uint]
    call.restype = ctypes.c_int
    return call


def start_writeback(fd: int, offset: int, length: int) -> None:
    """Have the kernel start writing ``length`` bytes at ``offset`` of ``fd`` to disk
    (fdatasync where sync_file_range is missing)."""
    call = _sync_file_range()
    if call is None:
        os.fdatasync(fd)
    elif call(fd, offset, length, _SYNC_FILE_RANGE_WRITE) != 0:
        import ctypes

        code = ctypes.get_errno()
        raise OSError(code, os.strerror(code))


def sha256_bytes(data: bytes) -> str:
    return f"sha256:{hashlib.sha256(data).hexdigest()}"


# -- descending without following ----------------------------------------------------


def _unsafe(path: str, what: str) -> errors.DataLoss:
    return errors.DataLoss(
        f"{path} is {what}, where the checkpoint store keeps a directory or file of its "
        "own; refusing to follow or use it. Move it out of the store (nothing under the "
        "store root may be a symbolic link)"
    )


def _describe_mode(mode: int) -> str:
    if stat.S_ISLNK(mode):
        return "a symbolic link"
    if stat.S_ISDIR(mode):
        return "a directory"
    if stat.S_ISREG(mode):
        return "a regular file"
    return "a special file"


def open_dir(dir_fd: int, name: str, *, path: str, create: bool = False) -> int:
    """An fd of the directory ``name`` in ``dir_fd``; DataLoss if it is a symlink.

    ``create`` makes it (0700) when missing. FileNotFoundError when it is
    missing and not to be created.
    """
    if create:
        with contextlib.suppress(FileExistsError):
            os.mkdir(name, 0o700, dir_fd=dir_fd)
    try:
        return os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
    except OSError as err:
        if err.errno in (errno.ELOOP, errno.ENOTDIR):
            mode = os.lstat(name, dir_fd=dir_fd).st_mode
            raise _unsafe(path, _describe_mode(mode)) from None
        raise


@contextlib.contextmanager
def opened_dir(dir_fd: int, *names: str, path: str, create: bool = False) -> Iterator[int]:
    """Descend through ``names`` from ``dir_fd``; yields the last directory's fd."""
    fd = os.dup(dir_fd)
    try:
        where = path
        for name in names:
            where = os.path.join(where, name)
            child = open_dir(fd, name, path=where, create=create)
            os.close(fd)
            fd = child
        yield fd
    finally:
        os.close(fd)


def open_file(dir_fd: int, name: str, *, path: str, flags: int = os.O_RDONLY) -> int:
    """Open the regular file ``name`` in ``dir_fd``; DataLoss for anything else."""
    try:
        fd = os.open(name, flags | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError as err:
        if err.errno == errno.ELOOP:
            raise _unsafe(path, "a symbolic link") from None
        raise
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            raise _unsafe(path, _describe_mode(mode))
    except BaseException:
        os.close(fd)
        raise
    return fd


# -- writing --------------------------------------------------------------------------


def create_file_at(dir_fd: int, name: str, data: bytes) -> None:
    """Write a new 0600 file and fsync it (the caller renames it into place)."""
    fd = os.open(name, _NEW_FILE, 0o600, dir_fd=dir_fd)
    try:
        write_all(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)


def write_file_atomic(dir_fd: int, name: str, data: bytes, tmp_prefix: str | None = None) -> None:
    """Replace ``name`` with ``data`` so that readers see the old or the new file, whole."""
    prefix = tmp_prefix if tmp_prefix is not None else f"{name}.tmp-"
    tmp = f"{prefix}{os.getpid()}-{secrets.token_hex(4)}"
    try:
        create_file_at(dir_fd, tmp, data)
        os.replace(tmp, name, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp, dir_fd=dir_fd)
        raise
    os.fsync(dir_fd)


def read_file_at(dir_fd: int, name: str, limit: int, *, path: str) -> bytes:
    """The whole regular file, refusing (TooLarge) to read more than ``limit`` bytes."""
    fd = open_file(dir_fd, name, path=path)
    try:
        chunks: list[bytes] = []
        total = 0
        while data := os.read(fd, min(1 << 20, limit + 1 - total)):
            chunks.append(data)
            total += len(data)
            if total > limit:
                raise TooLarge(f"{path} is larger than the {limit} bytes allowed")
        return b"".join(chunks)
    finally:
        os.close(fd)


@contextlib.contextmanager
def flocked(dir_fd: int, name: str, *, path: str) -> Iterator[None]:
    """Hold an exclusive flock(2) on ``name`` (created 0600 if missing)."""
    # A fresh open file description per acquisition, so the lock also excludes
    # other threads of this process, not just other processes.
    try:
        fd = os.open(name, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                     dir_fd=dir_fd)  # fmt: skip
    except OSError as err:
        if err.errno == errno.ELOOP:
            raise _unsafe(path, "a symbolic link") from None
        raise
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # drops the lock


def mkdtemp_private(parent: str, prefix: str) -> str:
    """A new 0700 directory in ``parent`` (outside the store: a restore's work dir)."""
    while True:
        path = os.path.join(parent, prefix + secrets.token_hex(4))
        try:
            os.mkdir(path, 0o700)
            return path
        except FileExistsError:
            continue


# -- sizing and removal ---------------------------------------------------------------


def free_bytes(path: str) -> int:
    """Bytes an unprivileged writer may still use on the filesystem of ``path`` (the
    root reserve is the node's own margin)."""
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def tree_bytes(dir_fd: int, name: str) -> int:
    """Bytes of the regular files at or under ``name``; never follows a symlink."""
    try:
        st = os.lstat(name, dir_fd=dir_fd)
    except FileNotFoundError:
        return 0
    if not stat.S_ISDIR(st.st_mode):
        return st.st_size if stat.S_ISREG(st.st_mode) else 0
    try:
        fd = os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
    except OSError:
        return 0
    total = 0
    try:
        with os.scandir(fd) as it:
            for entry in it:
                total += tree_bytes(fd, entry.name)
    finally:
        os.close(fd)
    return total


def remove_entry(dir_fd: int, name: str) -> int:
    """Delete ``name`` in ``dir_fd``, whatever it is; returns the bytes freed.

    A symlink is unlinked, never followed; a directory is removed with
    shutil.rmtree's fd-based walk, which does not follow links inside either.
    """
    try:
        st = os.lstat(name, dir_fd=dir_fd)
    except FileNotFoundError:
        return 0
    if stat.S_ISDIR(st.st_mode):
        freed = tree_bytes(dir_fd, name)
        shutil.rmtree(name, dir_fd=dir_fd, ignore_errors=True)
        return freed
    with contextlib.suppress(FileNotFoundError):
        os.unlink(name, dir_fd=dir_fd)
    return st.st_size if stat.S_ISREG(st.st_mode) else 0
