"""The runner keeper's own mount namespace (inside the task's).

The job's root is the host's ``/`` bound without the mounts below it (job_spec);
that bind is made in a mount namespace of the keeper's own, so that the host never
shows it and it goes away with the keeper, whatever ends it. Mount events of the
host still propagate in (``rslave``), so runc and CRIU see the node's mounts.
"""

from __future__ import annotations

import ctypes
import os
from typing import Final

CLONE_NEWNS: Final = 0x00020000
MS_REC: Final = 0x4000
MS_SLAVE: Final = 1 << 19


def enter_mounts_of(pid: int) -> None:
    """Join the mount namespace of process ``pid`` when it is not this process's
    already (a keeper forked by the warm template lives in the template's; the job's
    files are those of the task's). Call it before any other thread exists."""
    if not pid or os.stat(f"/proc/{pid}/ns/mnt").st_ino == os.stat("/proc/self/ns/mnt").st_ino:
        return
    fd = os.open(f"/proc/{pid}/ns/mnt", os.O_RDONLY | os.O_CLOEXEC)
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        if libc.setns(fd, CLONE_NEWNS) != 0:  # os.setns is Python >= 3.12
            err = ctypes.get_errno()
            raise OSError(err, f"setns(mount namespace of {pid}): {os.strerror(err)}")
    finally:
        os.close(fd)


def private_mounts() -> None:
    """Move this process (its calling thread: call it before any other thread
    exists) into a mount namespace of its own."""
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.unshare(CLONE_NEWNS) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"unshare(CLONE_NEWNS): {os.strerror(err)}")
    if libc.mount(None, b"/", None, MS_SLAVE | MS_REC, None) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"mount --make-rslave /: {os.strerror(err)}")


__all__ = ["enter_mounts_of", "private_mounts"]
