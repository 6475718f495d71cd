"""Durable-filesystem helpers for the checkpoint store.

Every file is created 0600 and every directory 0700 from the start (never
chmod'ed afterwards: checkpoints hold process memory, and a window in which a
file is readable by others is a leak). Durability follows the usual POSIX
recipe: fsync the file, rename it into place, fsync the directory.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import os
import secrets
import shutil
from collections.abc import Iterator
from typing import Final, TypeAlias

__all__ = [
    "create_file",
    "flocked",
    "fsync_dir",
    "mkdtemp_private",
    "read_file",
    "remove_path",
    "sha256_bytes",
    "tree_bytes",
    "write_all",
    "write_file_atomic",
]

Bytes: TypeAlias = bytes | bytearray | memoryview

_NEW_FILE: Final = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC


def write_all(fd: int, data: Bytes) -> None:
    view = memoryview(data).cast("B")
    while view:
        n = os.write(fd, view)
        view = view[n:]


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def create_file(path: str, data: bytes) -> None:
    """Write a new 0600 file and fsync it (the caller renames it into place)."""
    fd = os.open(path, _NEW_FILE, 0o600)
    try:
        write_all(fd, data)
        os.fsync(fd)
    finally:
        os.close(fd)


def write_file_atomic(path: str, data: bytes, tmp_prefix: str | None = None) -> None:
    """Replace ``path`` with ``data`` so that readers see the old or the new file, whole."""
    directory, name = os.path.split(path)
    prefix = tmp_prefix if tmp_prefix is not None else f"{name}.tmp-"
    tmp = os.path.join(directory, f"{prefix}{os.getpid()}-{secrets.token_hex(4)}")
    try:
        create_file(tmp, data)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    fsync_dir(directory)


class TooLarge(Exception):
    pass


def read_file(path: str, limit: int) -> bytes:
    """The whole file, refusing (TooLarge) to read more than ``limit`` bytes."""
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
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
def flocked(path: str) -> Iterator[None]:
    """Hold an exclusive flock(2) on ``path`` (created 0600 if missing)."""
    # A fresh open file description per acquisition, so the lock also excludes
    # other threads of this process, not just other processes.
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # drops the lock


def mkdtemp_private(parent: str, prefix: str) -> str:
    while True:
        path = os.path.join(parent, prefix + secrets.token_hex(4))
        try:
            os.mkdir(path, 0o700)
            return path
        except FileExistsError:
            continue


def tree_bytes(path: str) -> int:
    total = 0
    for dirpath, _dirs, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(dirpath, name)).st_size
    return total


def remove_path(path: str) -> None:
    if os.path.isdir(path) and not os.path.islink(path):
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path)


def sha256_bytes(data: bytes) -> str:
    return f"sha256:{hashlib.sha256(data).hexdigest()}"
