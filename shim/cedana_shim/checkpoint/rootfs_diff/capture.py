"""Capture entry points: an overlay upperdir or a plain directory into a diff archive."""

from __future__ import annotations

import contextlib
import os
import posixpath
from collections.abc import Iterable, Sequence
from typing import BinaryIO, Final

from cedana_shim import errors
from cedana_shim.runtime.mount import Mount

from .tar import TarWriter
from .types import DEFAULT_LIMITS, DiffStats, Limits, open_dir, os_error
from .walk import capture_tree

__all__ = ["ALWAYS_EXCLUDED", "capture", "capture_dir", "upperdir_of"]

# Kernel filesystems the runtime mounts afresh in every container.
ALWAYS_EXCLUDED: Final = ("/proc", "/sys", "/dev")


def upperdir_of(mounts: Sequence[Mount]) -> str | None:
    """The writable layer under the container's root: ``upperdir=`` of its overlay.

    None when the root is not an overlay with an upper layer (a bind mount from
    the native or another snapshotter, a read-only view): there is no layer
    directory to diff. The last mount on the root wins, as it does in the kernel.
    """
    upper: str | None = None
    for m in mounts:
        if m.target.strip("/"):
            continue  # a submount, not the root
        upper = None
        if m.type != "overlay":
            continue
        for word in m.options:
            for option in word.split(","):
                if option.startswith("upperdir="):
                    upper = option.removeprefix("upperdir=")
        if upper is not None and not os.path.isabs(upper):
            raise errors.InvalidArgument(
                f"overlay rootfs mount has a relative upperdir {upper!r}; containerd "
                "always passes absolute snapshot paths, so the mount list is malformed"
            )
    return upper


def capture(
    upperdir: str,
    out_tar: str | BinaryIO,
    *,
    exclude: Iterable[str] = (),
    limits: Limits = DEFAULT_LIMITS,
) -> DiffStats:
    """Write everything the container changed in ``upperdir`` to ``out_tar``.

    ``exclude`` are container paths (``/etc/hosts``, volume destinations)
    whose subtrees are bind mounts, not layer content; :data:`ALWAYS_EXCLUDED`
    are added. They match the layer's paths literally, so resolve symlinks in
    them against the rootfs first (``/var/run/x`` is stored as ``run/x``
    where ``/var/run -> /run``). A path ``out_tar`` is removed if the capture
    fails; the caller fsyncs and commits it.
    """
    if os.geteuid() != 0:
        raise errors.PermissionDenied(
            "capturing an overlay upperdir reads its trusted.overlay.* xattrs, which needs root"
        )
    skip = frozenset(_layer_path(p) for p in (*ALWAYS_EXCLUDED, *exclude))
    return _capture(upperdir, out_tar, overlay=True, exclude=skip, limits=limits)


def capture_dir(src: str, out_tar: str | BinaryIO, *, limits: Limits = DEFAULT_LIMITS) -> DiffStats:
    """Snapshot a plain directory's contents (its root's own metadata is not kept)."""
    return _capture(src, out_tar, overlay=False, exclude=frozenset(), limits=limits)


def _layer_path(path: str) -> bytes:
    norm = posixpath.normpath("/" + path).lstrip("/")
    if norm in ("", "."):
        raise errors.InvalidArgument(
            f"cannot exclude {path!r} from the rootfs diff: it is the whole rootfs"
        )
    return os.fsencode(norm)


def _capture(
    src: str,
    out: str | BinaryIO,
    *,
    overlay: bool,
    exclude: frozenset[bytes],
    limits: Limits,
) -> DiffStats:
    root_fd = open_dir(src, "layer directory")
    try:
        if not isinstance(out, str):
            return capture_tree(
                root_fd,
                TarWriter(out),
                overlay=overlay,
                exclude=exclude,
                max_depth=limits.max_depth,
                skip_inode=None,
            )
        try:
            out_fd = os.open(out, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        except OSError as err:
            raise os_error(err, "creating the diff archive") from err
        try:
            st = os.fstat(out_fd)
            stats = capture_tree(
                root_fd,
                TarWriter(out_fd),
                overlay=overlay,
                exclude=exclude,
                max_depth=limits.max_depth,
                skip_inode=(st.st_dev, st.st_ino),
            )
        except BaseException:
            os.close(out_fd)
            _unlink_quietly(out)
            raise
        os.close(out_fd)
        return stats
    except OSError as err:  # writing the archive (listing errors are classified inside)
        raise os_error(err, f"writing the diff of {src}") from err
    finally:
        os.close(root_fd)


def _unlink_quietly(path: str) -> None:
    with contextlib.suppress(OSError):  # the original error matters more
        os.unlink(path)
