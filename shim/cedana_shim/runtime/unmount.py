"""Unmounting everything under a directory, light enough for ``delete``.

The ``delete`` command runs once per container on containerd's cleanup path
and must start fast, so this module imports only what it uses (ctypes lazily).
"""

from __future__ import annotations

import errno
import os
import time

MNT_DETACH = 0x2
UMOUNT_NOFOLLOW = 0x8
_BUSY_RETRIES = 10
_BUSY_SLEEP = 0.05

__all__ = ["mountpoints_under", "unmount", "unmount_all"]


def unmount_all(path: str) -> None:
    """Unmount everything at or under ``path``, deepest first; fine if nothing is.

    Raises :class:`errors.Internal` when a mount cannot be removed.
    """
    from cedana_shim import errors  # only now: enum's import is not free on delete's path

    root = os.path.realpath(path)
    if root == "/":
        raise errors.InvalidArgument("refusing to unmount everything under /")
    while True:
        targets = mountpoints_under(root)
        if not targets:
            return
        for target in targets:
            try:
                unmount(target)
            except OSError as err:
                raise errors.Internal(f"unmount {target}: {os.strerror(err.errno or 0)}") from err
        if mountpoints_under(root) == targets:
            raise errors.Internal(f"mounts under {root} do not go away: {', '.join(targets)}")


def mountpoints_under(root: str) -> list[str]:
    """Mount points at or under ``root`` (a real path), in unmount order.

    Deepest first; at equal depth the later mount (mountinfo order) first, so
    stacked mounts come off top down.
    """
    prefix = root.rstrip("/") + "/"
    found: list[tuple[int, int, str]] = []
    with open("/proc/self/mountinfo", "rb") as f:
        for order, line in enumerate(f):
            fields = line.split(b" ", 5)
            if len(fields) < 5:
                continue
            point = os.fsdecode(_unescape(fields[4]))
            if point == root or point.startswith(prefix):
                found.append((point.count("/"), order, point))
    found.sort(reverse=True)
    return [point for _, _, point in found]


def _unescape(field: bytes) -> bytes:
    # mountinfo writes space, tab, newline and backslash as \ooo.
    if b"\\" not in field:
        return field
    out = bytearray()
    i = 0
    while i < len(field):
        chunk = field[i + 1 : i + 4]
        if field[i] == 0x5C and len(chunk) == 3 and all(0x30 <= c <= 0x37 for c in chunk):
            out.append(int(chunk, 8))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return bytes(out)


def unmount(target: str) -> None:
    for _ in range(_BUSY_RETRIES):
        err = _umount2(target, UMOUNT_NOFOLLOW)
        if err in (0, errno.EINVAL, errno.ENOENT):  # EINVAL: not a mount point (any more)
            return
        if err != errno.EBUSY:
            raise OSError(err, os.strerror(err), target)
        time.sleep(_BUSY_SLEEP)
    # Still in use (a process has its cwd or a file there): detach it lazily, as
    # containerd's UnmountAll ends up doing.
    err = _umount2(target, UMOUNT_NOFOLLOW | MNT_DETACH)
    if err not in (0, errno.EINVAL, errno.ENOENT):
        raise OSError(err, os.strerror(err), target)


def _umount2(target: str, flags: int) -> int:
    """0 or the errno."""
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.umount2(os.fsencode(target), ctypes.c_int(flags)) == 0:
        return 0
    return ctypes.get_errno()
