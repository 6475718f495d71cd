"""Apply entry points: a diff archive into a mounted rootfs or a plain directory."""

from __future__ import annotations

import os
from typing import BinaryIO

from .plan import make_plan
from .spool import open_archive
from .tar import read_members
from .types import DEFAULT_LIMITS, DiffStats, Limits, open_dir, os_error
from .write import ArchiveSource, execute, preflight

__all__ = ["apply", "apply_dir"]

# Both take their two paths positionally only, so they share one callable type and a
# caller can choose either per layer.


def apply(
    tar_stream: BinaryIO | str,
    rootfs: str,
    /,
    *,
    limits: Limits = DEFAULT_LIMITS,
    spool_dir: str | None = None,
    expected_bytes: int | None = None,
) -> DiffStats:
    """Apply a diff from :func:`capture` to a mounted, not yet running rootfs.

    Whiteouts and opaque markers delete what the rootfs had before the archive's
    entries are written, as OCI layer semantics require. Nothing is written
    before every member has been validated, so the archive is read twice: pass
    the path of a raw tar or a seekable file (read in place), or a stream (a
    decompressor) together with ``spool_dir``, a private directory on the
    checkpoint store's filesystem where it is spooled (never $TMPDIR; without
    ``spool_dir`` a stream is refused). ``expected_bytes``, the uncompressed
    size the checkpoint recorded, lets a stream be refused before its first
    byte is spooled when it would not fit, and cut off when it runs longer.
    """
    return _apply(tar_stream, rootfs, limits, spool_dir, expected_bytes, whiteouts=True)


def apply_dir(
    tar_stream: BinaryIO | str,
    dest: str,
    /,
    *,
    limits: Limits = DEFAULT_LIMITS,
    spool_dir: str | None = None,
    expected_bytes: int | None = None,
) -> DiffStats:
    """Restore a :func:`capture_dir` snapshot into ``dest``, merging over what is there.

    Names starting with ``.wh.`` are ordinary files here; all other rules of
    :func:`apply` hold, the spool rules included.
    """
    return _apply(tar_stream, dest, limits, spool_dir, expected_bytes, whiteouts=False)


def _apply(
    src: BinaryIO | str,
    dest: str,
    limits: Limits,
    spool_dir: str | None,
    expected_bytes: int | None,
    *,
    whiteouts: bool,
) -> DiffStats:
    # The target first: a missing rootfs must not cost a spool of the whole stream.
    root_fd = open_dir(dest, "rootfs")
    try:
        with open_archive(src, limits, spool_dir=spool_dir, expected_bytes=expected_bytes) as f:
            plan = make_plan(read_members(f, limits), limits, whiteouts=whiteouts)
            try:
                preflight(root_fd, plan)
            except OSError as err:
                raise os_error(err, f"checking {dest} before applying the diff") from err
            return execute(root_fd, plan, ArchiveSource(f), limits.max_depth)
    finally:
        os.close(root_fd)
