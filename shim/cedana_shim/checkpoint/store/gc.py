"""Garbage collection of the checkpoint store's blobs and raw directories.

The caller holds ``index.lock``: blobs and raw dirs only enter ``blobs/sha256``
and ``raw/`` under that lock, in the same hold as the index.json write that
references them, so one not reachable from index.json at that moment is
garbage, with no grace period. Nothing here follows a symlink: entries are
looked at with lstat and removed with unlink/rmtree relative to a dir fd.
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
from collections.abc import Callable, Iterable
from typing import Any, Final

from cedana_shim import errors

from .filelist import CACHE_LIST_SUFFIX
from .fsutil import remove_entry
from .layout import (
    MEDIA_TYPE_INDEX,
    MEDIA_TYPE_MANIFEST,
    Descriptor,
    load_json,
    parse_descriptor,
)

__all__ = [
    "manifest_children",
    "referenced",
    "sweep_blobs",
    "sweep_raw",
    "sweep_stale_files",
    "trim_cache",
]

log = logging.getLogger(__name__)

# Manifests (ours, or of other tools sharing the layout) whose references gc follows.
_MANIFEST_TYPES: Final = frozenset(
    {
        MEDIA_TYPE_MANIFEST,
        MEDIA_TYPE_INDEX,
        "application/vnd.docker.distribution.manifest.v2+json",
        "application/vnd.docker.distribution.manifest.list.v2+json",
    }
)


def manifest_children(data: bytes, where: str) -> list[Descriptor]:
    """Descriptors a manifest or index references (config, layers, manifests, subject)."""
    obj: Any = load_json(data, where)
    if not isinstance(obj, dict):
        raise errors.DataLoss(f"{where}: not a JSON object")
    children = [
        parse_descriptor(obj[key], f"{where}: {key}") for key in ("config", "subject") if key in obj
    ]
    for key in ("layers", "manifests", "blobs"):
        items = obj.get(key, [])
        if not isinstance(items, list):
            raise errors.DataLoss(f"{where}: {key} is not a list")
        children.extend(parse_descriptor(x, f"{where}: {key}[{i}]") for i, x in enumerate(items))
    return children


def referenced(
    roots: Iterable[Descriptor], read_manifest: Callable[[Descriptor], bytes]
) -> set[str] | None:
    """Every digest reachable from ``roots``; None if that cannot be known.

    ``read_manifest`` returns a manifest's verified bytes or raises DataLoss.
    """
    seen: set[str] = set()
    pending = list(roots)
    while pending:
        desc = pending.pop()
        if desc.digest in seen:
            continue
        seen.add(desc.digest)
        if desc.media_type not in _MANIFEST_TYPES:
            continue
        try:
            pending.extend(manifest_children(read_manifest(desc), f"manifest {desc.digest}"))
        except errors.DataLoss as err:
            # A manifest that cannot be read may reference any blob: delete none.
            log.warning("gc: keeping every unreferenced blob for now: %s", err)
            return None
    return seen


def sweep_blobs(blobs_fd: int, keep: set[str]) -> int:
    """Unlink every regular file in ``blobs_fd`` whose digest is not in ``keep``."""
    freed = 0
    for name in os.listdir(blobs_fd):
        if f"sha256:{name}" in keep:
            continue
        with contextlib.suppress(FileNotFoundError):
            st = os.lstat(name, dir_fd=blobs_fd)
            if not stat.S_ISREG(st.st_mode):
                continue  # not something this store writes; leave it to a human
            os.unlink(name, dir_fd=blobs_fd)
            freed += st.st_size
    return freed


def sweep_stale_files(dir_fd: int, prefix: str, older_than: float | None = None) -> int:
    """Remove entries named ``prefix*`` (older than ``older_than``, a time, if given).

    Only call while no writer can be making one (or with a cutoff that excludes them).
    """
    freed = 0
    for name in os.listdir(dir_fd):
        if not name.startswith(prefix):
            continue
        with contextlib.suppress(FileNotFoundError):
            if older_than is None or os.lstat(name, dir_fd=dir_fd).st_mtime < older_than:
                freed += remove_entry(dir_fd, name)
    return freed


def trim_cache(raw_fd: int, name: str) -> int:
    """Keep only complete (``<layer>/``, ``<layer>.files.json``) pairs in raw/<name>."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC,
                     dir_fd=raw_fd)  # fmt: skip
    except OSError:
        return remove_entry(raw_fd, name)
    freed = 0
    try:
        kinds = {n: os.lstat(n, dir_fd=fd).st_mode for n in os.listdir(fd)}
        keep = {
            n
            for n, mode in kinds.items()
            if stat.S_ISDIR(mode) and stat.S_ISREG(kinds.get(n + CACHE_LIST_SUFFIX, 0))
        }
        keep |= {n + CACHE_LIST_SUFFIX for n in keep}
        for n in kinds.keys() - keep:
            freed += remove_entry(fd, n)
    finally:
        os.close(fd)
    if not keep:
        freed += remove_entry(raw_fd, name)
    return freed


def sweep_raw(raw_fd: int, *, whole: set[str], cached: set[str]) -> int:
    """Remove what no checkpoint needs from ``raw/``; returns the bytes freed.

    ``whole``: raw checkpoints, and those whose state is unknown (kept as they
    are); ``cached``: compacted checkpoints whose raw-image cache is kept (only
    complete layer + file-list pairs). Everything else goes, a symlink (never
    the store's) whatever its name.
    """
    freed = 0
    for name in os.listdir(raw_fd):
        with contextlib.suppress(FileNotFoundError):
            mode = os.lstat(name, dir_fd=raw_fd).st_mode
            if stat.S_ISLNK(mode):
                log.warning("gc: removing a symlink planted in the store", extra={"path": name})
            elif name in whole:
                continue
            elif name in cached and stat.S_ISDIR(mode):
                freed += trim_cache(raw_fd, name)
                continue
            freed += remove_entry(raw_fd, name)
    return freed
