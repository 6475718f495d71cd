"""Back to the image's pristine rootfs: a restore attempt that failed half-way must
not leave its files behind for the next candidate or a cold start."""

from __future__ import annotations

import os
import shutil
from collections.abc import Sequence

from cedana_shim.runtime.mount import Mount, mount_all, unmount_all

from .capture import upperdir_of


def reset_layer(mounts: Sequence[Mount], target: str) -> bool:
    """Empty the writable layer of the rootfs mounted at ``target`` and mount it again.

    False (nothing done) when the root is not an overlay with an upper layer. The
    rootfs is unmounted while the layer is emptied: on an error it may stay unmounted.
    """
    upper = upperdir_of(mounts)
    if upper is None:
        return False
    unmount_all(target)
    for name in os.listdir(upper):
        path = os.path.join(upper, name)
        if os.path.isdir(path) and not os.path.islink(path):
            shutil.rmtree(path)
        else:
            os.unlink(path)
    mount_all(mounts, target)
    return True
