"""Rootfs mounts, after containerd's ``mount_linux.go``.

``mount(2)``/``umount2(2)`` are called through ctypes: creating a container
must not fork a ``mount`` binary per layer. Both entry points block (EBUSY
retries sleep), so the daemon calls them through ``asyncio.to_thread``.
"""

from __future__ import annotations

import errno
import logging
import os
import re
import stat
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final, NamedTuple

from cedana_shim import errors
from cedana_shim.runtime.unmount import mountpoints_under, unmount, unmount_all

if TYPE_CHECKING:
    import ctypes

__all__ = [
    "KNOWN_FLAGS",
    "PROPAGATION_FLAGS",
    "Mount",
    "ParsedOptions",
    "compact_lowerdir",
    "mount_all",
    "mountpoints_under",
    "parse_options",
    "resolve_target",
    "unmount_all",
]

MS_RDONLY: Final = 0x1
MS_NOSUID: Final = 0x2
MS_NODEV: Final = 0x4
MS_NOEXEC: Final = 0x8
MS_SYNCHRONOUS: Final = 0x10
MS_REMOUNT: Final = 0x20
MS_MANDLOCK: Final = 0x40
MS_DIRSYNC: Final = 0x80
MS_NOSYMFOLLOW: Final = 0x100
MS_NOATIME: Final = 0x400
MS_NODIRATIME: Final = 0x800
MS_BIND: Final = 0x1000
MS_REC: Final = 0x4000
MS_UNBINDABLE: Final = 0x20000
MS_PRIVATE: Final = 0x40000
MS_SLAVE: Final = 0x80000
MS_SHARED: Final = 0x100000
MS_RELATIME: Final = 0x200000
MS_STRICTATIME: Final = 0x1000000
MS_LAZYTIME: Final = 0x2000000

_CLONE_FS: Final = 0x200

# word -> (clear?, bits), as containerd's flagsMap.
_FLAGS: Final[dict[str, tuple[bool, int]]] = {
    "async": (True, MS_SYNCHRONOUS),
    "atime": (True, MS_NOATIME),
    "bind": (False, MS_BIND),
    "dev": (True, MS_NODEV),
    "diratime": (True, MS_NODIRATIME),
    "dirsync": (False, MS_DIRSYNC),
    "exec": (True, MS_NOEXEC),
    "lazytime": (False, MS_LAZYTIME),
    "mand": (False, MS_MANDLOCK),
    "noatime": (False, MS_NOATIME),
    "nodev": (False, MS_NODEV),
    "nodiratime": (False, MS_NODIRATIME),
    "noexec": (False, MS_NOEXEC),
    "nolazytime": (True, MS_LAZYTIME),
    "nomand": (True, MS_MANDLOCK),
    "norelatime": (True, MS_RELATIME),
    "nostrictatime": (True, MS_STRICTATIME),
    "nosuid": (False, MS_NOSUID),
    "nosymfollow": (False, MS_NOSYMFOLLOW),
    "rbind": (False, MS_BIND | MS_REC),
    "relatime": (False, MS_RELATIME),
    "remount": (False, MS_REMOUNT),
    "ro": (False, MS_RDONLY),
    "rw": (True, MS_RDONLY),
    "strictatime": (False, MS_STRICTATIME),
    "suid": (True, MS_NOSUID),
    "sync": (False, MS_SYNCHRONOUS),
}
_PROPAGATION: Final[dict[str, int]] = {
    "private": MS_PRIVATE,
    "rprivate": MS_PRIVATE | MS_REC,
    "shared": MS_SHARED,
    "rshared": MS_SHARED | MS_REC,
    "slave": MS_SLAVE,
    "rslave": MS_SLAVE | MS_REC,
    "unbindable": MS_UNBINDABLE,
    "runbindable": MS_UNBINDABLE | MS_REC,
}


def _union(values: Iterable[int]) -> int:
    out = 0
    for v in values:
        out |= v
    return out


KNOWN_FLAGS: Final = _union(bits for _, bits in _FLAGS.values())
PROPAGATION_FLAGS: Final = frozenset(_PROPAGATION.values())
# Options containerd implements with machinery this shim does not have.
_UNSUPPORTED: Final = re.compile(r"^(?:loop|uidmap=.*|gidmap=.*|X-containerd\..*)$", re.DOTALL)
# ``statvfs`` f_flag bits -> mount flags the kernel may have locked on a bind source.
_LOCKED: Final = (
    (0x2, MS_NOSUID),
    (0x4, MS_NODEV),
    (0x8, MS_NOEXEC),
    (0x400, MS_NOATIME),
    (0x800, MS_NODIRATIME),
)
logger = logging.getLogger(__name__)

_MAX_SYMLINKS: Final = 40


@dataclass(frozen=True, slots=True)
class Mount:
    """One ``containerd.types.Mount``; ``target`` is relative to the rootfs (2.x)."""

    type: str
    source: str
    target: str = ""
    options: tuple[str, ...] = ()


class ParsedOptions(NamedTuple):
    flags: int
    propagation: tuple[int, ...]
    data: str
    unsupported: tuple[str, ...]


def parse_options(options: Iterable[str]) -> ParsedOptions:
    """fstab words -> mount flags, propagation changes and the fs ``data`` string.

    Words are applied in order, so a later ``rw`` clears an earlier ``ro``.
    Anything unknown (``lowerdir=...``, ``size=64m``, ``userxattr``) is data.
    """
    flags = 0
    propagation: list[int] = []
    data: list[str] = []
    unsupported: list[str] = []
    for word in options:
        if word in _FLAGS:
            clear, bits = _FLAGS[word]
            flags = flags & ~bits if clear else flags | bits
        elif word in _PROPAGATION:
            propagation.append(_PROPAGATION[word])
        elif word == "defaults" or not word:
            continue
        elif _UNSUPPORTED.match(word):
            unsupported.append(word)
        else:
            data.append(word)
    return ParsedOptions(flags, tuple(propagation), ",".join(data), tuple(unsupported))


def mount_all(mounts: Sequence[Mount], rootfs: str) -> None:
    """Mount each of ``mounts`` in order onto ``rootfs``; all or nothing."""
    root = os.path.realpath(rootfs)
    done: list[str] = []
    try:
        for m in mounts:
            parsed = parse_options(m.options)
            if parsed.unsupported:
                raise errors.Unimplemented(
                    f"{_describe(m)}: unsupported options {', '.join(parsed.unsupported)}"
                )
            target = resolve_target(root, m.target)
            try:
                if _mount_one(m, parsed, target):
                    done.append(target)
            except OSError as err:
                cls = errors.InvalidArgument if err.errno in _BAD_REQUEST else errors.Internal
                raise cls(f"{_describe(m)} on {target}: {os.strerror(err.errno or 0)}") from err
    except BaseException:
        for target in reversed(done):
            try:
                unmount(target)
            except OSError as err:  # keep the original error; this one is only logged
                logger.error("unwinding mount %s: %s", target, err)
        raise


_BAD_REQUEST: Final = frozenset(
    {errno.EINVAL, errno.ENOENT, errno.ENOTDIR, errno.ENODEV, errno.ENAMETOOLONG, errno.ELOOP}
)


def _describe(m: Mount) -> str:
    options = ",".join(m.options) or "-"
    if len(options) > 300:  # a page of overlay layers helps nobody in an error
        options = options[:300] + "..."
    return f"mount {m.type} {m.source} (options {options})"


def resolve_target(root: str, target: str) -> str:
    """``target`` inside ``root``, symlinks resolved as if ``root`` were ``/``.

    A target that climbs out of the root with ``..`` is refused; a symlink that
    points outside is clamped to the root, as ``fs.RootPath`` does.
    """
    depth = 0
    for part in target.split("/"):
        if part == "..":
            depth -= 1
            if depth < 0:
                raise errors.InvalidArgument(f"mount target {target!r} escapes the rootfs")
        elif part not in ("", "."):
            depth += 1
    pending = [p for p in reversed(target.split("/")) if p not in ("", ".")]
    current: list[str] = []
    links = 0
    while pending:
        part = pending.pop()
        if part == "..":
            if current:
                current.pop()
            continue
        candidate = os.path.join(root, *current, part)
        try:
            st = os.lstat(candidate)
        except OSError:
            current.append(part)
            continue
        if stat.S_ISLNK(st.st_mode):
            links += 1
            if links > _MAX_SYMLINKS:
                raise errors.InvalidArgument(f"mount target {target!r}: too many symlinks")
            dest = os.readlink(candidate)
            if dest.startswith("/"):
                current = []
            pending.extend(p for p in reversed(dest.split("/")) if p not in ("", "."))
            continue
        current.append(part)
    return os.path.join(root, *current)


def _mount_one(m: Mount, parsed: ParsedOptions, target: str) -> bool:
    """One Mount, as containerd's ``Mount.mount``; whether it added a mount."""
    flags = parsed.flags
    if m.type == "bind":  # the kernel would look for a filesystem named "bind"
        flags |= MS_BIND
    data = parsed.data
    chdir = None
    if m.type == "overlay" and len(data.encode()) >= os.sysconf("SC_PAGE_SIZE") - 512:
        chdir, data = compact_lowerdir(data)
    remount = bool(flags & MS_REMOUNT)
    # A remount that only changes propagation must not also reset the flags
    # (mount(8) skips that call too); a plain mount always needs it.
    changes_flags = any(w in _FLAGS and w != "remount" for w in m.options)
    added = False
    if not remount or data or changes_flags:
        _mount_at(chdir, m.source, target, m.type, flags, data)
        added = not remount
    try:
        for prop in parsed.propagation:
            _mount(None, target, None, prop, None)
        if not remount and flags & (MS_BIND | MS_RDONLY) == MS_BIND | MS_RDONLY:
            # A new bind ignores MS_RDONLY until remounted; keep the flags the
            # kernel locked on the source or the remount fails with EPERM.
            vfs = os.statvfs(target).f_flag
            flags |= sum(ms for st, ms in _LOCKED if vfs & st)
            _mount(None, target, None, flags | MS_REMOUNT, None)
    except OSError:
        if added:
            unmount(target)
        raise
    return added


def compact_lowerdir(data: str) -> tuple[str, str]:
    """Make ``lowerdir`` relative to the layers' common parent (containerd's
    ``compactLowerdirOption``): the kernel reads at most one page of mount data.

    Returns the directory to mount from and the shortened data.
    """
    words = data.split(",")
    index = next((i for i, w in enumerate(words) if w.startswith("lowerdir=")), None)
    if index is None:
        raise errors.InvalidArgument(f"overlay options are {len(data)} bytes, over a page")
    dirs = words[index].removeprefix("lowerdir=").split(":")
    common = os.path.commonpath(dirs) if len(dirs) > 1 else os.path.dirname(dirs[0])
    if not os.path.isabs(common) or common == "/":
        raise errors.InvalidArgument("overlay lowerdirs share no parent to shorten them from")
    words[index] = "lowerdir=" + ":".join(os.path.relpath(d, common) for d in dirs)
    compacted = ",".join(words)
    if len(compacted.encode()) >= os.sysconf("SC_PAGE_SIZE"):
        raise errors.InvalidArgument(
            f"overlay options are {len(compacted)} bytes even relative to {common}, over a page"
        )
    return common, compacted


_libc: ctypes.CDLL | None = None


def _lib() -> ctypes.CDLL:
    global _libc
    if _libc is None:
        import ctypes

        lib = ctypes.CDLL(None, use_errno=True)
        lib.mount.argtypes = [
            ctypes.c_char_p,
            ctypes.c_char_p,
            ctypes.c_char_p,
            ctypes.c_ulong,
            ctypes.c_char_p,
        ]
        lib.mount.restype = ctypes.c_int
        lib.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
        lib.umount2.restype = ctypes.c_int
        lib.unshare.argtypes = [ctypes.c_int]
        lib.unshare.restype = ctypes.c_int
        _libc = lib
    return _libc


def _errno() -> int:
    import ctypes

    return ctypes.get_errno()


def _b(s: str | None) -> bytes | None:
    return None if not s else os.fsencode(s)


def _mount(
    source: str | None, target: str, fstype: str | None, flags: int, data: str | None
) -> None:
    if _lib().mount(_b(source), os.fsencode(target), _b(fstype), flags, _b(data)) != 0:
        err = _errno()
        raise OSError(err, os.strerror(err), target)


def _mount_at(
    chdir: str | None, source: str, target: str, fstype: str, flags: int, data: str
) -> None:
    if chdir is None:
        _mount(source, target, fstype, flags, data)
        return
    # Relative lowerdirs resolve against the cwd, which is per process. A thread
    # that unshares its fs context can chdir without moving anyone else's cwd,
    # and takes that context with it when it ends (containerd's mountAt).
    import threading

    failure: list[BaseException] = []

    def run() -> None:
        try:
            if _lib().unshare(_CLONE_FS) != 0:
                err = _errno()
                raise OSError(err, os.strerror(err), "unshare(CLONE_FS)")
            os.chdir(chdir)
            _mount(source, target, fstype, flags, data)
        except BaseException as exc:
            failure.append(exc)

    thread = threading.Thread(target=run, name="mount-at", daemon=True)
    thread.start()
    thread.join()
    if failure:
        raise failure[0]
