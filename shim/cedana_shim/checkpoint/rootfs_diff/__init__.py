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
:func:`types.xattr_allowed` names (``security.capability``,
POSIX ACLs, ``user.*``). Not carried, each logged: sockets (the restored
process re-binds them), FIFOs and device nodes (refused on apply as a matter
of policy), files whose names start with ``.wh.`` (OCI cannot express them),
atimes, and the root directory's own metadata. setuid/setgid bits are kept
exactly as the layer had them: the container could set them itself, and the
files stay inside its rootfs and user namespace.

Untrusted input: a diff may come from another node's store or a shared
registry. :func:`apply` validates every header first (:mod:`.plan`: the
rules), checks the target rootfs for symlinks in the way (preflight), and only
then writes, by descriptors that never follow a symlink (:mod:`.write`).
A refused archive raises :class:`errors.InvalidArgument` with nothing written.
An error *while* writing (disk full) leaves the rootfs partly written: the
caller discards that container's snapshot. A stream is spooled only into the
caller's ``spool_dir`` (:mod:`.spool`).

Modules: :mod:`.capture` and :mod:`.apply` (entry points), :mod:`.walk`
(upperdir -> archive), :mod:`.tar` (reader, writer), :mod:`.plan` (validation),
:mod:`.spool` (a seekable archive), :mod:`.write` (plan -> rootfs),
:mod:`.types` (limits, counts, error mapping).
"""

from .apply import apply, apply_dir
from .capture import ALWAYS_EXCLUDED, capture, capture_dir, upperdir_of
from .reset import reset_layer
from .types import DEFAULT_LIMITS, DiffStats, Limits

__all__ = [
    "ALWAYS_EXCLUDED",
    "DEFAULT_LIMITS",
    "DiffStats",
    "Limits",
    "apply",
    "apply_dir",
    "capture",
    "capture_dir",
    "reset_layer",
    "upperdir_of",
]
