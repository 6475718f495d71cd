"""Walking a layer directory (an overlay upperdir, or any directory) into a tar.

The walk holds a descriptor per directory level and reaches every child with
``openat(O_NOFOLLOW)``/``fstatat(AT_SYMLINK_NOFOLLOW)``: a container that keeps
running during a leave-running checkpoint can swap a directory for a symlink
to ``/`` mid-walk, and a path-based walk would then copy host files into the
checkpoint. Data is streamed file by file; memory holds one directory listing
per level plus the (device, inode) of files with more than one link.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
from dataclasses import dataclass, field
from typing import Final

from cedana_shim import errors

from .tar import DIR, LNK, REG, SYM, TarWriter
from .types import (
    OPAQUE_MARKER,
    WHITEOUT_PREFIX,
    Counter,
    DiffStats,
    os_error,
    show,
    xattr_allowed,
)

__all__ = ["capture_tree"]

logger = logging.getLogger(__name__)

_DIR_FLAGS: Final = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# O_NONBLOCK: a FIFO swapped in for a file after the stat must not hang the checkpoint.
_FILE_FLAGS: Final = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_NOCTTY | os.O_CLOEXEC
_GONE: Final = frozenset({errno.ENOENT, errno.ENOTDIR, errno.ELOOP, errno.ENXIO})
_OVERLAY_XATTRS: Final = (b"trusted.overlay.", b"user.overlay.")
_LOGGED_SKIPS: Final = 20


@dataclass(slots=True)
class _Frame:
    fd: int
    prefix: bytes
    pending: list[tuple[bytes, os.stat_result]] = field(default_factory=list)


class _Capture:
    def __init__(
        self,
        writer: TarWriter,
        *,
        overlay: bool,
        exclude: frozenset[bytes],
        max_depth: int,
        skip_inode: tuple[int, int] | None,
    ) -> None:
        self._writer = writer
        self._overlay = overlay
        self._exclude = exclude
        self._max_depth = max_depth
        self._skip_inode = skip_inode
        self._links: dict[tuple[int, int], bytes] = {}
        self.count = Counter()

    def run(self, root_fd: int) -> None:
        stack = [self._frame(root_fd, b"")]
        try:
            while stack:
                frame = stack[-1]
                if not frame.pending:
                    stack.pop()
                    if frame.fd != root_fd:
                        os.close(frame.fd)
                    continue
                name, st = frame.pending.pop()
                try:
                    child = self._entry(frame, name, st)
                except OSError as err:
                    raise os_error(err, f"capturing {show(frame.prefix + name)}") from err
                if child is not None:
                    if len(stack) >= self._max_depth:
                        os.close(child.fd)
                        raise errors.FailedPrecondition(
                            f"cannot capture {show(child.prefix)}: directories nest deeper "
                            f"than {self._max_depth} levels"
                        )
                    stack.append(child)
        finally:
            for frame in stack:
                if frame.fd != root_fd:
                    os.close(frame.fd)
        if self.count.skipped > _LOGGED_SKIPS:
            logger.warning(
                "rootfs diff: %d more entries not captured", self.count.skipped - _LOGGED_SKIPS
            )

    def _frame(self, fd: int, prefix: bytes) -> _Frame:
        first: list[tuple[bytes, os.stat_result]] = []
        rest: list[tuple[bytes, os.stat_result]] = []
        for name in sorted(os.fsencode(n) for n in os.listdir(fd)):
            try:
                st = os.stat(name, dir_fd=fd, follow_symlinks=False)
            except FileNotFoundError:
                continue  # removed by the running container since the listing
            # OCI asks for whiteouts before their siblings.
            (first if self._is_whiteout_dev(st) else rest).append((name, st))
        # Popped from the end: reverse so the archive is in sorted order.
        return _Frame(fd, prefix, (first + rest)[::-1])

    def _is_whiteout_dev(self, st: os.stat_result) -> bool:
        return self._overlay and stat.S_ISCHR(st.st_mode) and st.st_rdev == 0

    def _entry(self, frame: _Frame, name: bytes, st: os.stat_result) -> _Frame | None:
        rel = frame.prefix + name
        if rel in self._exclude:
            return None
        if self._overlay and name.startswith(WHITEOUT_PREFIX):
            self._skip(rel, "its name would read as an OCI whiteout")
        elif self._is_whiteout_dev(st):
            self._whiteout(frame.prefix + WHITEOUT_PREFIX + name, st.st_mtime_ns)
        elif stat.S_ISDIR(st.st_mode):
            return self._dir(frame, name, rel)
        elif stat.S_ISREG(st.st_mode):
            self._file(frame, name, rel)
        elif stat.S_ISLNK(st.st_mode):
            try:
                target = os.readlink(name, dir_fd=frame.fd)
            except OSError as err:
                if err.errno not in _GONE | {errno.EINVAL}:
                    raise
                return None
            self._writer.add(
                rel,
                SYM,
                mode=0o777,
                uid=st.st_uid,
                gid=st.st_gid,
                mtime_ns=st.st_mtime_ns,
                linkname=target,
            )
            self.count.symlinks += 1
        else:
            kind = (
                "a socket"
                if stat.S_ISSOCK(st.st_mode)
                else ("a FIFO" if stat.S_ISFIFO(st.st_mode) else "a device node")
            )
            self._skip(rel, f"it is {kind}, which a rootfs diff does not carry")
        return None

    def _whiteout(self, name: bytes, mtime_ns: int) -> None:
        self._writer.add(name, REG, mode=0, uid=0, gid=0, mtime_ns=mtime_ns)
        self.count.deletions += 1

    def _dir(self, frame: _Frame, name: bytes, rel: bytes) -> _Frame | None:
        fd = _open(name, _DIR_FLAGS, frame.fd)
        if fd is None:
            return None
        try:
            st = os.fstat(fd)
            kept, ovl = _xattrs(fd)
            if self._overlay and ovl.get(b"redirect"):
                raise errors.FailedPrecondition(
                    f"cannot capture {show(rel)}: overlayfs records it as a renamed lower "
                    "directory (redirect_dir), whose contents stay in the image layers; mount "
                    "container rootfs overlays with redirect_dir=off (containerd's default)"
                )
            self._writer.add(
                rel + b"/",
                DIR,
                mode=st.st_mode,
                uid=st.st_uid,
                gid=st.st_gid,
                mtime_ns=st.st_mtime_ns,
                xattrs=kept,
            )
            self.count.dirs += 1
            if self._overlay and ovl.get(b"opaque") == b"y":
                self._whiteout(rel + b"/" + OPAQUE_MARKER, st.st_mtime_ns)
            return self._frame(fd, rel + b"/")
        except BaseException:
            os.close(fd)
            raise

    def _file(self, frame: _Frame, name: bytes, rel: bytes) -> None:
        fd = _open(name, _FILE_FLAGS, frame.fd)
        if fd is None:
            return
        try:
            st = os.fstat(fd)
            if not stat.S_ISREG(st.st_mode) or (st.st_dev, st.st_ino) == self._skip_inode:
                return  # swapped since the listing, or the archive being written
            kept, ovl = _xattrs(fd)
            if self._overlay and b"metacopy" in ovl:
                raise errors.FailedPrecondition(
                    f"cannot capture {show(rel)}: overlayfs copied up only its metadata "
                    "(metacopy=on), its data stays in the image layers; mount container "
                    "rootfs overlays with metacopy=off"
                )
            if self._overlay and b"whiteout" in ovl:  # an xattr whiteout (Linux >= 6.7)
                self._whiteout(frame.prefix + WHITEOUT_PREFIX + name, st.st_mtime_ns)
                return
            kind, link, size = REG, b"", st.st_size
            if st.st_nlink > 1:
                key = (st.st_dev, st.st_ino)
                first = self._links.get(key)
                if first is None:
                    self._links[key] = rel
                else:
                    kind, link, size, kept = LNK, first, 0, []
            self._writer.add(
                rel,
                kind,
                mode=st.st_mode,
                uid=st.st_uid,
                gid=st.st_gid,
                mtime_ns=st.st_mtime_ns,
                size=size,
                linkname=link,
                xattrs=kept,
            )
            self.count.files += 1
            if kind == LNK:
                return
            got = self._writer.content(fd, st.st_size)
            if got < st.st_size:
                logger.warning("rootfs diff: %s shrank while captured; zero-filled", show(rel))
            self.count.size += st.st_size
        finally:
            os.close(fd)

    def _skip(self, rel: bytes, why: str) -> None:
        self.count.skipped += 1
        if self.count.skipped <= _LOGGED_SKIPS:
            logger.warning("rootfs diff: %s not captured: %s", show(rel), why)


def _open(name: bytes, flags: int, dir_fd: int) -> int | None:
    try:
        return os.open(name, flags, dir_fd=dir_fd)
    except OSError as err:
        if err.errno in _GONE:
            return None  # changed by the running container since the listing
        raise


def _xattrs(fd: int) -> tuple[list[tuple[bytes, bytes]], dict[bytes, bytes]]:
    """(xattrs the diff carries, overlayfs' private ones keyed by suffix)."""
    kept: list[tuple[bytes, bytes]] = []
    overlay: dict[bytes, bytes] = {}
    try:
        names = os.listxattr(fd)
    except OSError as err:
        if err.errno == errno.EOPNOTSUPP:
            return kept, overlay
        raise
    for text in names:
        name = os.fsencode(text)
        private = name.startswith(_OVERLAY_XATTRS)
        if not private and not xattr_allowed(name):
            if name.startswith(b"user.") and b"=" in name:
                logger.warning("rootfs diff: xattr %r has '=' in its name; not captured", text)
            continue
        try:
            value = os.getxattr(fd, text)
        except OSError as err:
            if err.errno == errno.ENODATA:
                continue  # removed since the listing
            raise
        if private:
            overlay[name.split(b".overlay.", 1)[1]] = value
        else:
            kept.append((name, value))
    kept.sort()
    return kept, overlay


def capture_tree(
    root_fd: int,
    writer: TarWriter,
    *,
    overlay: bool,
    exclude: frozenset[bytes],
    max_depth: int,
    skip_inode: tuple[int, int] | None,
) -> DiffStats:
    """Write every entry under ``root_fd`` (not the root itself) to ``writer``.

    ``overlay`` reads 0/0 character devices and ``trusted.overlay.*`` xattrs as
    overlayfs' whiteouts and opaque markers and writes them the OCI way.
    """
    capture = _Capture(
        writer, overlay=overlay, exclude=exclude, max_depth=max_depth, skip_inode=skip_inode
    )
    capture.run(root_fd)
    writer.close()
    return capture.count.freeze()
