"""Trimming and fixing the store: remove, prune, gc and repair."""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Final, TypeAlias

from cedana_shim import errors

from . import gc
from .catalog import Catalog, newest_first
from .core import INDEX_TMP_PREFIX, StoreCore
from .failures import FailureRecords, failed_last
from .ingest import sweep_ingests
from .layout import ANN_ID, ANN_PINNED, CheckpointRef, Descriptor, Index, check_checkpoint_id
from .model import RepairReport
from .pins import write_pins

__all__ = ["Maintenance"]

log = logging.getLogger(__name__)

# A spool file left behind (a restore killed while spooling) is collected after this.
SPOOL_GRACE_S: Final = 3600.0
_Ids: TypeAlias = list[str]


class Maintenance:
    """Trims and fixes the store (see the module doc)."""

    def __init__(self, core: StoreCore, catalog: Catalog, failures: FailureRecords) -> None:
        self._core = core
        self._catalog = catalog
        self._failures = failures  # prune keeps a good checkpoint before a failed one

    def remove(self, checkpoint_id: str) -> None:
        if (why := check_checkpoint_id(checkpoint_id)) is not None:
            raise errors.InvalidArgument(why)
        self._drop(
            lambda index: {checkpoint_id} & {r.id for r in index.checkpoints} or None, checkpoint_id
        )

    def pin(self, checkpoint_id: str, pinned: bool = True, *, by_policy: bool = False) -> None:
        """Exempt the checkpoint from retention and prune (``pinned``), or end that;
        ``by_policy`` marks the pin as a namespace policy's (node/policies.py).
        Its descriptor in index.json changes, and pins.json (which a repair of the
        index reads, pins.py): its manifest and blobs stay as they are, and a
        compaction carries the annotation over."""
        if (why := check_checkpoint_id(checkpoint_id)) is not None:
            raise errors.InvalidArgument(why)
        try:
            with self._core.index_lock():
                index = self._catalog.index_for_write()
                if checkpoint_id not in {r.id for r in index.checkpoints}:
                    raise errors.NotFound(
                        f"checkpoint {checkpoint_id} not found in {self._core.root}"
                    )
                descriptors = [
                    _with_pin(d, pinned, by_policy)
                    if d.annotations.get(ANN_ID) == checkpoint_id
                    else d
                    for d in index.descriptors
                ]
                self._core.write_index(index, descriptors)
                write_pins(self._core.root_fd, descriptors)  # what a repair puts back
        except OSError as err:
            raise self._core.os_error(err, f"pinning {checkpoint_id} in {self._core.root}") from err

    def prune(self, *, scope: str | None = None, label: str | None = None, keep: int) -> _Ids:
        """Keep the newest ``keep`` per matching (scope, label); return the removed ids."""
        if keep < 0:
            raise errors.InvalidArgument(f"keep must be >= 0, got {keep}")

        def select(index: Index) -> set[str]:
            groups: dict[tuple[str, str], list[CheckpointRef]] = {}
            for r in index.checkpoints:
                if r.pinned:
                    continue  # exempt from retention until unpinned
                if (scope is None or r.scope == scope) and (label is None or r.label == label):
                    groups.setdefault((r.scope, r.label), []).append(r)
            failed = self._failures.failures()
            return {
                r.id
                for g in groups.values()
                for r in failed_last(newest_first(g), lambda r: r.id in failed)[keep:]
            }

        return self._drop(select, None)

    def _drop(self, select: Callable[[Index], set[str] | None], must: str | None) -> _Ids:
        try:
            with self._core.index_lock():
                index = self._catalog.index_for_write()
                drops = select(index)
                if drops is None:
                    raise errors.NotFound(f"checkpoint {must} not found in {self._core.root}")
                if not drops:
                    return []
                removed = [r.id for r in newest_first(index.checkpoints) if r.id in drops]
                descriptors = [
                    d for d in index.descriptors if d.annotations.get(ANN_ID) not in drops
                ]
                self._catalog.sweep_locked(self._core.write_index(index, descriptors))
                return removed
        except OSError as err:
            raise self._core.os_error(err, f"removing checkpoints from {self._core.root}") from err

    def gc(self) -> int:
        """Delete what no published checkpoint needs; returns the bytes freed.

        Unreferenced blobs and raw dirs (of crashed publishes and compactions, of
        removed checkpoints), raw-image caches of all but the newest checkpoint
        per label, the previous format's ``cache/``, ingest and compaction dirs
        of dead writers, stale index.json temp files and spool files. Never
        touches a write in progress in another process (see the module doc).
        """
        try:
            with self._core.index_lock():
                # Index temp files are only written under the lock: any seen now is stale.
                freed = gc.sweep_stale_files(self._core.root_fd, INDEX_TMP_PREFIX)
                freed += self._catalog.sweep_locked(self._catalog.index_for_write())
            with self._core.opened_dir("ingest") as ingest_root:
                freed += sweep_ingests(ingest_root)
            try:
                with self._core.opened_dir("spool") as spool:
                    freed += gc.sweep_stale_files(spool, "", time.time() - SPOOL_GRACE_S)
            except FileNotFoundError:
                pass
            return freed
        except OSError as err:
            raise self._core.os_error(err, f"collecting garbage in {self._core.root}") from err

    def repair(self) -> RepairReport:
        """Rebuild index.json if it is missing or damaged (see repair.py); else do nothing."""
        try:
            with self._core.index_lock():
                try:
                    self._core.load_index()
                except errors.DataLoss as err:
                    return self._catalog.repair_locked(str(err))
                return RepairReport(
                    self._core.index_path, None, f"{self._core.index_path} is intact", rebuilt=False
                )
        except OSError as err:
            raise self._core.os_error(err, f"repairing {self._core.index_path}") from err


def _with_pin(desc: Descriptor, pinned: bool, by_policy: bool) -> Descriptor:
    annotations = {k: v for k, v in desc.annotations.items() if k != ANN_PINNED}
    if pinned:
        annotations[ANN_PINNED] = "policy" if by_policy else "true"
    return replace(desc, annotations=annotations)
