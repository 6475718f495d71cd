"""Garbage collection of the checkpoint store's blobs.

The caller holds ``index.lock``: blobs only enter ``blobs/sha256`` under that
lock, in the same hold as the index.json write that references them, so a blob
not reachable from index.json at that moment is garbage, with no grace period.
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
from collections.abc import Callable, Iterable
from typing import Any, Final

from cedana_shim import errors
from cedana_shim.checkpoint.layout import (
    MEDIA_TYPE_INDEX,
    MEDIA_TYPE_MANIFEST,
    Descriptor,
    load_json,
    parse_descriptor,
)

__all__ = ["manifest_children", "referenced", "sweep_blobs", "sweep_stale_files"]

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


def sweep_blobs(blobs_dir: str, keep: set[str]) -> int:
    """Unlink every regular file in ``blobs_dir`` whose digest is not in ``keep``."""
    freed = 0
    for name in os.listdir(blobs_dir):
        if f"sha256:{name}" in keep:
            continue
        path = os.path.join(blobs_dir, name)
        with contextlib.suppress(FileNotFoundError):
            st = os.lstat(path)
            if not stat.S_ISREG(st.st_mode):
                continue  # not something this store writes; leave it to a human
            os.unlink(path)
            freed += st.st_size
    return freed


def sweep_stale_files(directory: str, prefix: str) -> int:
    """Remove temp files named ``prefix*``; only call while no writer can be making one."""
    freed = 0
    for name in os.listdir(directory):
        if name.startswith(prefix):
            path = os.path.join(directory, name)
            with contextlib.suppress(FileNotFoundError):
                freed += os.lstat(path).st_size
                os.unlink(path)
    return freed
