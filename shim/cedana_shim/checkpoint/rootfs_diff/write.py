"""Writing a validated plan into a rootfs without ever following a symlink.

Every path is reached from a descriptor of the rootfs one component at a time
with ``O_NOFOLLOW | O_DIRECTORY`` (``openat``), and every leaf operation is
``*at`` relative to its parent's descriptor with no-follow semantics
(``mkdirat``, ``unlinkat``, ``symlinkat``, ``linkat`` without
``AT_SYMLINK_FOLLOW``, ``fchownat``/``utimensat`` with
``AT_SYMLINK_NOFOLLOW``, files created ``O_CREAT | O_EXCL | O_NOFOLLOW``).
A symlink already in the rootfs (``etc -> /``) is therefore either replaced
(where the archive itself makes that path a directory, as OCI layers do) or
makes :func:`preflight` refuse the archive before anything is written; it is
never traversed.
"""

from __future__ import annotations

import errno
import logging
import os
import stat
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import BinaryIO, Final

from cedana_shim import errors

from .plan import Entry, Parts, Plan
from .tar import DIR, LNK, REG, SYM, Member
from .types import (
    Counter,
    DiffStats,
    os_error,
    refuse,
    show,
    xattr_allowed,
)

__all__ = ["ArchiveSource", "DirChain", "execute", "preflight"]

logger = logging.getLogger(__name__)

_DIR_FLAGS: Final = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_NEW_FILE: Final = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
_NOT_A_DIR: Final = frozenset({errno.ENOTDIR, errno.ELOOP})
_FALLBACK: Final = frozenset({errno.EXDEV, errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP})
_CHUNK: Final = 1 << 20

Enter = Callable[[int, Parts], "int | None"]


def _join(parts: Parts) -> bytes:
    return b"/".join(parts)


class DirChain:
    """Descriptors of the directories along the last path walked, kept for the next.

    Members arrive in tree order, so consecutive walks share most components
    and cost one ``openat`` per new directory instead of one per level.
    """

    def __init__(self, root_fd: int) -> None:
        self._root = root_fd
        self._parts: list[bytes] = []
        self._fds: list[int] = []

    def descend(self, parts: Parts, enter: Enter) -> int | None:
        """Descriptor of ``parts``; ``enter(parent_fd, prefix)`` opens each new level
        (or returns None: nothing below exists)."""
        keep = 0
        for have, want in zip(self._parts, parts, strict=False):
            if have != want:
                break
            keep += 1
        self._truncate(keep)
        fd = self._fds[-1] if self._fds else self._root
        for i in range(keep, len(parts)):
            child = enter(fd, parts[: i + 1])
            if child is None:
                return None
            self._parts.append(parts[i])
            self._fds.append(child)
            fd = child
        return fd

    def close(self) -> None:
        self._truncate(0)

    def _truncate(self, keep: int) -> None:
        while len(self._fds) > keep:
            os.close(self._fds.pop())
            self._parts.pop()


def _open_existing(fd: int, sub: Parts) -> int | None:
    try:
        return os.open(sub[-1], _DIR_FLAGS, dir_fd=fd)
    except FileNotFoundError:
        return None
    except OSError as err:
        if err.errno in _NOT_A_DIR:
            return None
        raise


def preflight(root_fd: int, plan: Plan) -> None:
    """Refuse, before any write, an archive whose members would have to pass
    through a symlink or file the rootfs has where they need a directory."""
    chain = DirChain(root_fd)

    def check(entry: Entry) -> Enter:
        def enter(fd: int, sub: Parts) -> int | None:
            if plan.removed(sub):
                return None  # deleted first, then made afresh as a plain directory
            try:
                st = os.stat(sub[-1], dir_fd=fd, follow_symlinks=False)
            except FileNotFoundError:
                return None
            if stat.S_ISDIR(st.st_mode):
                return os.open(sub[-1], _DIR_FLAGS, dir_fd=fd)
            if sub in plan.dirs:
                return None  # the archive's own directory entry replaces it
            what = "a symlink" if stat.S_ISLNK(st.st_mode) else "not a directory"
            raise refuse(
                _join(entry.parts),
                f"would be written through {show(_join(sub))!r}, which is {what} in the "
                "target rootfs (it is never followed)",
            )

        return enter

    try:
        for entry in plan.entries:
            chain.descend(entry.parts[:-1], check(entry))
    finally:
        chain.close()


class ArchiveSource:
    """Member data of the archive being applied, read at validated offsets."""

    def __init__(self, f: BinaryIO) -> None:
        self._f = f
        self._fd: int | None = None
        self._kernel = True
        try:
            fd = f.fileno()
            if stat.S_ISREG(os.fstat(fd).st_mode):
                self._fd = fd
        except (OSError, AttributeError, ValueError):
            pass  # an in-memory stream: plain reads

    def copy(self, m: Member, dst: int) -> None:
        done = 0
        if self._fd is not None:
            done = self._copy_fd(self._fd, m.offset, m.size, dst)
        else:
            self._f.seek(m.offset)
            while done < m.size:
                chunk = self._f.read(min(_CHUNK, m.size - done))
                if not chunk:
                    break
                _write_all(dst, chunk)
                done += len(chunk)
        if done < m.size:
            raise errors.DataLoss(
                f"rootfs diff archive ends inside {show(m.name)}; the checkpoint is damaged"
            )

    def _copy_fd(self, src: int, offset: int, size: int, dst: int) -> int:
        done = 0
        # copy_file_range can clone extents; sendfile covers cross-filesystem
        # targets such as an overlay merged view; pread/write is the last resort.
        while done < size and self._kernel:
            try:
                n = os.copy_file_range(src, dst, size - done, offset + done)
            except OSError as err:
                if err.errno not in _FALLBACK:
                    raise
                self._kernel = False
                break
            if n == 0:
                return done
            done += n
        while done < size:
            try:
                n = os.sendfile(dst, src, offset + done, size - done)
            except OSError as err:
                if err.errno not in _FALLBACK:
                    raise
                break
            if n == 0:
                return done
            done += n
        while done < size:
            chunk = os.pread(src, min(_CHUNK, size - done), offset + done)
            if not chunk:
                break
            _write_all(dst, chunk)
            done += len(chunk)
        return done


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def execute(root_fd: int, plan: Plan, source: ArchiveSource, max_depth: int) -> DiffStats:
    """Deletions first (they only concern what the rootfs had), then entries."""
    counter = Counter()
    writer = _Writer(root_fd, plan, source, max_depth, counter)
    try:
        writer.delete()
        writer.create()
    finally:
        writer.close()
    return counter.freeze()


class _Writer:
    def __init__(
        self, root_fd: int, plan: Plan, source: ArchiveSource, max_depth: int, counter: Counter
    ) -> None:
        self._plan = plan
        self._source = source
        self._max_depth = max_depth
        self._count = counter
        self._chain = DirChain(root_fd)
        self._links = DirChain(root_fd)
        self.path = b""

    def close(self) -> None:
        self._chain.close()
        self._links.close()

    def delete(self) -> None:
        for parts in self._plan.whiteouts:
            self.path = _join(parts)
            with _os_errors(self):
                fd = self._chain.descend(parts[:-1], _open_existing)
                if fd is not None:  # a parent that is gone or not a directory hides nothing
                    self._remove(fd, parts[-1])
            self._count.deletions += 1
        for parts in self._plan.opaques:
            self.path = _join(parts)
            with _os_errors(self):
                fd = self._chain.descend(parts, _open_existing)
                if fd is not None:
                    for name in os.listdir(fd):
                        self._remove(fd, os.fsencode(name))
            self._count.deletions += 1

    def create(self) -> None:
        dirs: list[Entry] = []
        for entry in self._plan.entries:
            m = entry.member
            self.path = _join(entry.parts)
            with _os_errors(self):
                parent = self._chain.descend(entry.parts[:-1], self._enter)
                assert parent is not None
                name = entry.parts[-1]
                if m.typeflag == DIR:
                    self._make_dir(parent, name, m)
                    dirs.append(entry)
                    self._count.dirs += 1
                elif m.typeflag == REG:
                    self._make_file(parent, name, m)
                    self._count.files += 1
                    self._count.size += m.size
                elif m.typeflag == SYM:
                    self._replace(parent, name)
                    os.symlink(m.linkname, name, dir_fd=parent)
                    _chown(name, m, dir_fd=parent)
                    os.utime(
                        name, ns=(m.mtime_ns, m.mtime_ns), dir_fd=parent, follow_symlinks=False
                    )
                    self._count.symlinks += 1
                elif m.typeflag == LNK:
                    source = self._links.descend(entry.link[:-1], _open_existing)
                    if source is None:
                        raise errors.Internal(f"hard link target of {show(self.path)} vanished")
                    self._replace(parent, name)
                    os.link(
                        entry.link[-1],
                        name,
                        src_dir_fd=source,
                        dst_dir_fd=parent,
                        follow_symlinks=False,
                    )
                    self._count.files += 1
        # Creating children moved the directories' mtimes; put them back last.
        for entry in reversed(dirs):
            self.path = _join(entry.parts)
            with _os_errors(self):
                parent = self._chain.descend(entry.parts[:-1], _open_existing)
                assert parent is not None
                ns = entry.member.mtime_ns
                os.utime(entry.parts[-1], ns=(ns, ns), dir_fd=parent, follow_symlinks=False)

    def _enter(self, fd: int, sub: Parts) -> int:
        name = sub[-1]
        try:
            return os.open(name, _DIR_FLAGS, dir_fd=fd)
        except FileNotFoundError:
            pass
        except OSError as err:
            if err.errno not in _NOT_A_DIR or sub not in self._plan.dirs:
                raise  # preflight refused every other case; the rootfs changed under us
            os.unlink(name, dir_fd=fd)
        # A parent the archive does not list (or lists later): root-owned 0755,
        # as tar(1) and containerd make them.
        os.mkdir(name, 0o700, dir_fd=fd)
        child = os.open(name, _DIR_FLAGS, dir_fd=fd)
        os.fchmod(child, 0o755)
        return child

    def _make_dir(self, parent: int, name: bytes, m: Member) -> None:
        try:
            existing = stat.S_ISDIR(os.stat(name, dir_fd=parent, follow_symlinks=False).st_mode)
            if not existing:
                os.unlink(name, dir_fd=parent)
        except FileNotFoundError:
            existing = False
        if not existing:
            os.mkdir(name, 0o700, dir_fd=parent)
        fd = os.open(name, _DIR_FLAGS, dir_fd=parent)
        try:
            _chown(fd, m)
            os.fchmod(fd, m.mode)
            _set_xattrs(fd, m, replace=existing)
        finally:
            os.close(fd)

    def _make_file(self, parent: int, name: bytes, m: Member) -> None:
        # A new inode, never a rewrite in place: the old file may be hard-linked
        # elsewhere in the rootfs, and must not change there.
        self._replace(parent, name)
        fd = os.open(name, _NEW_FILE, 0o600, dir_fd=parent)
        try:
            self._source.copy(m, fd)
            # chown clears setuid/setgid and file capabilities, so it goes first.
            _chown(fd, m)
            os.fchmod(fd, m.mode)
            _set_xattrs(fd, m, replace=False)
            os.utime(fd, ns=(m.mtime_ns, m.mtime_ns))
        finally:
            os.close(fd)

    def _replace(self, parent: int, name: bytes) -> None:
        self._remove(parent, name)

    def _remove(self, parent: int, name: bytes) -> None:
        try:
            st = os.stat(name, dir_fd=parent, follow_symlinks=False)
        except FileNotFoundError:
            return
        if stat.S_ISDIR(st.st_mode):
            remove_tree(parent, name, self._max_depth)
        else:
            os.unlink(name, dir_fd=parent)


def remove_tree(parent: int, name: bytes, max_depth: int) -> None:
    """``rm -rf`` of ``parent``/``name`` by descriptors, iteratively, never
    following a symlink (shutil.rmtree recurses and can hit the stack limit)."""
    stack: list[tuple[int, bytes, int, list[bytes]]] = []
    try:
        fd = os.open(name, _DIR_FLAGS, dir_fd=parent)
        stack.append((parent, name, fd, []))
        stack[-1][3].extend(os.fsencode(n) for n in os.listdir(fd))
        while stack:
            up, dname, fd, pending = stack[-1]
            if not pending:
                stack.pop()
                os.close(fd)
                os.rmdir(dname, dir_fd=up)
                continue
            child = pending.pop()
            try:
                st = os.stat(child, dir_fd=fd, follow_symlinks=False)
            except FileNotFoundError:
                continue
            if not stat.S_ISDIR(st.st_mode):
                os.unlink(child, dir_fd=fd)
                continue
            if len(stack) >= max_depth:
                raise errors.FailedPrecondition(
                    f"cannot remove a directory tree nested deeper than {max_depth} levels "
                    f"(at {os.fsdecode(child)!r}); raise Limits.max_depth"
                )
            cfd = os.open(child, _DIR_FLAGS, dir_fd=fd)
            stack.append((fd, child, cfd, []))
            stack[-1][3].extend(os.fsencode(n) for n in os.listdir(cfd))
    finally:
        for _, _, fd, _ in stack:
            os.close(fd)


def _chown(target: int | bytes, m: Member, *, dir_fd: int | None = None) -> None:
    try:
        if isinstance(target, int):
            os.fchown(target, m.uid, m.gid)
        else:
            os.chown(target, m.uid, m.gid, dir_fd=dir_fd, follow_symlinks=False)
    except PermissionError as err:
        raise errors.PermissionDenied(
            f"restoring owner {m.uid}:{m.gid} of {show(m.name)} needs root (CAP_CHOWN)"
        ) from err


def _set_xattrs(fd: int, m: Member, *, replace: bool) -> None:
    wanted = dict(m.xattrs)
    if replace:  # an existing directory: drop what the container had removed
        for text in os.listxattr(fd):
            raw = os.fsencode(text)
            if xattr_allowed(raw) and raw not in wanted:
                os.removexattr(fd, text)
    for name, value in wanted.items():
        try:
            os.setxattr(fd, name, value)
        except OSError as err:
            # user.* and ACLs are best effort where the target filesystem lacks
            # them; a lost file capability would break the binary, so it fails.
            if err.errno != errno.EOPNOTSUPP or name == b"security.capability":
                raise
            logger.warning("xattr %r not supported on %s; skipped", name, show(m.name))


@contextmanager
def _os_errors(writer: _Writer) -> Iterator[None]:
    """OSError while writing -> a classified error naming the container path."""
    try:
        yield
    except OSError as err:
        raise os_error(
            err,
            f"applying {show(writer.path)} (the rootfs is partly written: discard this "
            "container's snapshot before retrying)",
        ) from err
