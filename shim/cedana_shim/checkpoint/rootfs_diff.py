"""The container's writable-layer changes, captured at checkpoint and re-applied at restore.

CRIU saves processes, not what the container changed in its rootfs. At
checkpoint :func:`capture` writes the overlay upperdir as an OCI-layer-style
tar (CRI-O's ``rootfs-diff.tar``, with deletions as ``.wh.`` whiteouts rather
than a separate ``deleted.files``); at restore :func:`apply` writes it into the
new container's mounted rootfs before ``runc restore``. :func:`capture_dir` and
:func:`apply_dir` do the same for a plain directory (the pod's ``/dev/shm``).

What a diff carries: regular files (content, mode including setuid/setgid/
sticky, numeric uid/gid, mtime to the nanosecond), directories, symlinks, hard
links within the layer, deletions and opaque directories, and the xattrs
:func:`rootfs_diff_types.xattr_allowed` names (``security.capability``,
POSIX ACLs, ``user.*``). Not carried, each logged: sockets (the restored
process re-binds them), FIFOs and device nodes (refused on apply as a matter
of policy), files whose names start with ``.wh.`` (OCI cannot express them),
atimes, and the root directory's own metadata. setuid/setgid bits are kept
exactly as the layer had them: the container could set them itself, and the
files stay inside its rootfs and user namespace.

Untrusted input: a diff may come from another node's store or a shared
registry. :func:`apply` validates every header first (rootfs_diff_plan: the
rules), checks the target rootfs for symlinks in the way (preflight), and only
then writes, by descriptors that never follow a symlink (rootfs_diff_apply).
A refused archive raises :class:`errors.InvalidArgument` with nothing written.
An error *while* writing (disk full) leaves the rootfs partly written: the
caller discards that container's snapshot.
"""

from __future__ import annotations

import contextlib
import os
import posixpath
import tempfile
from collections.abc import Iterable, Iterator, Sequence
from contextlib import contextmanager
from typing import BinaryIO, Final

from cedana_shim import errors
from cedana_shim.checkpoint.rootfs_diff_apply import ArchiveSource, execute, preflight
from cedana_shim.checkpoint.rootfs_diff_capture import capture_tree
from cedana_shim.checkpoint.rootfs_diff_plan import make_plan
from cedana_shim.checkpoint.rootfs_diff_tar import TarWriter, read_members
from cedana_shim.checkpoint.rootfs_diff_types import DEFAULT_LIMITS, DiffStats, Limits, os_error
from cedana_shim.runtime.mount import Mount

__all__ = [
    "ALWAYS_EXCLUDED",
    "DEFAULT_LIMITS",
    "DiffStats",
    "Limits",
    "apply",
    "apply_dir",
    "capture",
    "capture_dir",
    "upperdir_of",
]

# Kernel filesystems the runtime mounts afresh in every container.
ALWAYS_EXCLUDED: Final = ("/proc", "/sys", "/dev")
_SPOOL_CHUNK: Final = 1 << 20


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


def apply(
    tar_stream: BinaryIO | str,
    rootfs: str,
    *,
    limits: Limits = DEFAULT_LIMITS,
    spool_dir: str | None = None,
) -> DiffStats:
    """Apply a diff from :func:`capture` to a mounted, not yet running rootfs.

    Whiteouts and opaque markers delete what the rootfs had before the archive's
    entries are written, as OCI layer semantics require. A non-seekable stream
    (a decompressor) is spooled to an unlinked temporary file in ``spool_dir``
    (default: $TMPDIR) first: nothing is written before every member has been
    validated. Pass a directory on disk where /tmp is a small tmpfs.
    """
    return _apply(tar_stream, rootfs, limits, spool_dir, whiteouts=True)


def apply_dir(
    tar_stream: BinaryIO | str,
    dest: str,
    *,
    limits: Limits = DEFAULT_LIMITS,
    spool_dir: str | None = None,
) -> DiffStats:
    """Restore a :func:`capture_dir` snapshot into ``dest``, merging over what is there.

    Names starting with ``.wh.`` are ordinary files here; all other rules of
    :func:`apply` hold.
    """
    return _apply(tar_stream, dest, limits, spool_dir, whiteouts=False)


def _layer_path(path: str) -> bytes:
    norm = posixpath.normpath("/" + path).lstrip("/")
    if norm in ("", "."):
        raise errors.InvalidArgument(
            f"cannot exclude {path!r} from the rootfs diff: it is the whole rootfs"
        )
    return os.fsencode(norm)


def _open_dir(path: str, what: str) -> int:
    try:
        return os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except FileNotFoundError as err:
        raise errors.NotFound(f"{what} {path} does not exist") from err
    except NotADirectoryError as err:
        raise errors.InvalidArgument(f"{what} {path} is not a directory") from err
    except OSError as err:
        raise os_error(err, f"opening {what}") from err


def _capture(
    src: str,
    out: str | BinaryIO,
    *,
    overlay: bool,
    exclude: frozenset[bytes],
    limits: Limits,
) -> DiffStats:
    root_fd = _open_dir(src, "layer directory")
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


def _apply(
    src: BinaryIO | str, dest: str, limits: Limits, spool_dir: str | None, *, whiteouts: bool
) -> DiffStats:
    with _archive(src, limits, spool_dir) as f:
        plan = make_plan(read_members(f, limits), limits, whiteouts=whiteouts)
        root_fd = _open_dir(dest, "rootfs")
        try:
            try:
                preflight(root_fd, plan)
            except OSError as err:
                raise os_error(err, f"checking {dest} before applying the diff") from err
            return execute(root_fd, plan, ArchiveSource(f), limits.max_depth)
        finally:
            os.close(root_fd)


@contextmanager
def _archive(src: BinaryIO | str, limits: Limits, spool_dir: str | None) -> Iterator[BinaryIO]:
    """A seekable view of the archive: validation reads headers before any write."""
    if isinstance(src, str):
        try:
            f = open(src, "rb")  # noqa: SIM115 - closed by the with below
        except OSError as err:
            raise os_error(err, "opening the diff archive") from err
        with f:
            size = os.fstat(f.fileno()).st_size
            if size > limits.max_archive_bytes:
                raise errors.InvalidArgument(
                    f"rootfs diff {src} is {size} bytes, over the {limits.max_archive_bytes} limit"
                )
            yield f
        return
    if _seekable(src):
        yield src
        return
    with tempfile.TemporaryFile(prefix="rootfs-diff-", dir=spool_dir) as spool:
        total = 0
        while chunk := src.read(_SPOOL_CHUNK):
            total += len(chunk)
            if total > limits.max_archive_bytes:
                raise errors.InvalidArgument(
                    f"rootfs diff stream is over the {limits.max_archive_bytes}-byte limit"
                )
            spool.write(chunk)
        spool.seek(0)
        yield spool


def _seekable(f: BinaryIO) -> bool:
    try:
        return f.seekable() and f.tell() >= 0
    except (OSError, ValueError, AttributeError):
        return False
