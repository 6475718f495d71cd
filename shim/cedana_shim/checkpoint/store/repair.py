"""Rebuilding a damaged or missing index.json from what the store still holds.

Every checkpoint's manifest carries the same annotations as its index entry
(id, scope, label, created), so the index can be rebuilt from the manifests in
blobs/sha256: those that parse as ours and whose config, layer blobs (sizes)
or raw files (sizes) check out. A checkpoint found both raw and compacted (a
crash during compaction) is recovered compacted. The damaged file is kept
aside as ``index.json.damaged-<UTC time>``. Entries of other tools sharing the
layout cannot be recovered: only index.json knew them. Pins are not in the
manifests (a pin changes no digest): the rebuild puts back those recorded in
pins.json (pins.py).
"""

from __future__ import annotations

import contextlib
import os
import stat
from datetime import UTC, datetime
from typing import TYPE_CHECKING, TypeAlias

from cedana_shim import errors

from . import fsutil
from .core import INDEX, INDEX_DAMAGED_PREFIX
from .layout import (
    ANN_CREATED,
    ANN_ID,
    ANN_LABEL,
    ANN_SCOPE,
    MAX_MANIFEST_BYTES,
    MEDIA_TYPE_MANIFEST,
    CheckpointRef,
    Descriptor,
    Index,
    is_digest,
    parse_checkpoint_ref,
    parse_manifest,
)
from .model import Entry, RepairReport
from .pins import PINS, read_pins, with_pins

if TYPE_CHECKING:
    from .catalog import Catalog
    from .core import StoreCore

Found: TypeAlias = tuple[CheckpointRef, Entry]

__all__ = ["rebuild"]


def _our_manifest(blobs_fd: int, name: str) -> Descriptor | None:
    """The descriptor of blob ``name`` if it is one of our checkpoint manifests."""
    digest = f"sha256:{name}"
    try:
        st = os.lstat(name, dir_fd=blobs_fd)
        if not is_digest(digest) or not stat.S_ISREG(st.st_mode):
            return None
        if not 0 < st.st_size <= MAX_MANIFEST_BYTES:
            return None
        fd = fsutil.open_file(blobs_fd, name, path=name)
    except (OSError, errors.DataLoss):
        return None
    try:
        if os.pread(fd, 1, 0) != b"{":  # layers (tar+zstd) need not be read at all
            return None
        data = os.read(fd, MAX_MANIFEST_BYTES + 1)
    finally:
        os.close(fd)
    if fsutil.sha256_bytes(data) != digest:
        return None
    try:
        manifest = parse_manifest(data, name)
    except errors.DataLoss:
        return None
    keys = (ANN_ID, ANN_SCOPE, ANN_LABEL, ANN_CREATED)
    annotations = {k: manifest.annotations[k] for k in keys if k in manifest.annotations}
    if ANN_ID not in annotations:
        return None
    return Descriptor(MEDIA_TYPE_MANIFEST, digest, len(data), annotations)


def _candidates(
    core: StoreCore, catalog: Catalog, dropped: list[tuple[str, str]]
) -> dict[str, Found]:
    """The best intact checkpoint found for each id."""
    found: dict[str, Found] = {}
    with core.opened_blobs() as blobs:
        names = sorted(os.listdir(blobs))
        descriptors = [d for d in (_our_manifest(blobs, n) for n in names) if d is not None]
    for desc in descriptors:
        what = f"manifest {desc.digest}"
        try:
            ref = parse_checkpoint_ref(desc, 0, what)
        except errors.DataLoss as err:
            dropped.append((what, str(err)))
            continue
        entry = catalog.load_entry(ref)
        try:
            if entry.damage is not None:
                raise errors.DataLoss(entry.damage)
            catalog.check(entry, deep=False)
        except errors.DataLoss as err:
            dropped.append((f"checkpoint {ref.id} ({what})", str(err)))
            continue
        other = found.get(ref.id)
        if other is None:
            found[ref.id] = (ref, entry)
        elif other[1].state == entry.state:
            dropped.append((f"{what} of checkpoint {ref.id}", "another copy was kept"))
        else:  # a crash during compaction left both forms
            if entry.state == "compacted":
                found[ref.id] = (ref, entry)
            dropped.append((f"checkpoint {ref.id} (raw)", "superseded by its compacted form"))
    return found


def _keep_damaged(root_fd: int) -> str | None:
    """Rename index.json aside; its new name, or None when there was none."""
    with contextlib.suppress(FileNotFoundError):
        os.lstat(INDEX, dir_fd=root_fd)
        stamp = datetime.now(UTC).strftime("%Y%m%dT%H%M%SZ")
        for n in range(1000):
            name = f"{INDEX_DAMAGED_PREFIX}{stamp}" + (f"-{n}" if n else "")
            try:
                os.lstat(name, dir_fd=root_fd)
            except FileNotFoundError:
                os.rename(INDEX, name, src_dir_fd=root_fd, dst_dir_fd=root_fd)
                return name
        raise errors.Internal(f"too many damaged copies of {INDEX} from {stamp}")
    return None


def rebuild(core: StoreCore, catalog: Catalog, reason: str) -> RepairReport:
    """Write a new index.json from the intact checkpoints found; the caller holds the lock."""
    dropped: list[tuple[str, str]] = []
    found = sorted(
        _candidates(core, catalog, dropped).values(), key=lambda f: (f[0].created_at, f[0].id)
    )
    damaged = _keep_damaged(core.root_fd)
    pins = read_pins(core.root_fd, core.path(PINS))
    core.write_index(Index((), (), {}), [with_pins(ref.descriptor, pins) for ref, _ in found])
    return RepairReport(
        core.index_path,
        os.path.join(core.root, damaged) if damaged is not None else None,
        reason,
        tuple((ref.id, entry.state) for ref, entry in found),
        tuple(dropped),
    )
