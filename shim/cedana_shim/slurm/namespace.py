"""The runner keeper's own mount namespace.

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


__all__ = ["private_mounts"]
