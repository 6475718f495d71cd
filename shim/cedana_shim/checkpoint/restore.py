"""Choosing and preparing the checkpoint a new container resumes from.

The planner walks a label's checkpoints newest first. For each it verifies
every blob, checks the checkpoint fits this node, unpacks the CRIU images into
the bundle's work dir and applies the rootfs diff (and /dev/shm) to the new
container's rootfs. The first that gets through becomes the :class:`RestorePlan`;
each one skipped is recorded with its reason, so the log and the
``/cedana/restore`` event say exactly why a container resumed from an older
checkpoint, or started cold.
"""

from __future__ import annotations

import logging
import os
import platform
import shutil
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ..errors import ShimError
from .gpu_steps import GpuSteps
from .netinfo import same_addresses
from .pipeline import CRIU_LAYER, ROOTFS_LAYER, SHM_LAYER, shm_source
from .rootfs_diff import apply, apply_dir
from .store import Entry, Store

log = logging.getLogger(__name__)

RESTORE_DIR = "cedana-restore"


@dataclass(frozen=True, slots=True)
class RestorePlan:
    entry: Entry
    image_dir: str
    work_dir: str
    keep_tcp: bool  # the pod kept its addresses: established connections can live
    gpu_device_map: Mapping[str, str] | None = None  # recorded GPU UUID -> this node's
    cached: bool = False  # image_dir is the store's raw cache: verify while restoring

    @property
    def gpu(self) -> Mapping[str, Any]:
        """The checkpoint's GPU record; empty for a CPU-only checkpoint."""
        recorded = self.entry.metadata.get("gpu")
        return recorded if isinstance(recorded, Mapping) else {}


@dataclass
class Attempts:
    """Why candidates were passed over, in order."""

    skipped: list[str] = field(default_factory=list)

    def add(self, entry: Entry, why: str) -> None:
        self.skipped.append(f"{entry.id}: {why}")

    def __str__(self) -> str:
        return "; ".join(self.skipped) if self.skipped else "no checkpoint for this label"


def compatible(entry: Entry) -> str:
    """Why this node cannot restore ``entry``; empty when it can."""
    versions = entry.metadata.get("versions")
    if not isinstance(versions, Mapping):
        return "the checkpoint records no tool versions"
    arch = versions.get("arch")
    if arch and arch != platform.machine():
        return f"it was taken on {arch}, this node is {platform.machine()}"
    return ""


class Planner:
    def __init__(self, store: Store, gpu: GpuSteps, container_id: str) -> None:
        self.store = store
        self.gpu = gpu
        self.container_id = container_id

    def prepare(
        self,
        candidates: list[Entry],
        *,
        bundle: str,
        rootfs: str,
        spec: Mapping[str, Any],
        network: Any,
        reset_rootfs: Callable[[], None],
        attempts: Attempts,
    ) -> tuple[RestorePlan | None, list[Entry]]:
        """The first candidate that unpacks cleanly, and the ones left after it.

        Blocking (disk and CPU bound); the daemon runs it in a thread.
        """
        for index, entry in enumerate(candidates):
            why = compatible(entry)
            if why:
                attempts.add(entry, why)
                continue
            work = os.path.join(bundle, "work", RESTORE_DIR, entry.id)
            try:
                device_map = self._gpu_mapping(entry, spec)
                shutil.rmtree(work, ignore_errors=True)
                os.makedirs(work, mode=0o700)
                cached = self.store.raw_cache.lookup(
                    entry.id, CRIU_LAYER, entry.layer(CRIU_LAYER).digest
                )
                if cached is not None:
                    # Blobs present with their sizes now; the cached images' digests
                    # are checked while CRIU restores (the container waits for both).
                    self.store.verify(entry, deep=False)
                    image_dir = cached
                else:
                    self.store.verify(entry)
                    image_dir = os.path.join(work, "images")
                    self.store.extract_layer(entry, CRIU_LAYER, image_dir)
                names = {layer.name for layer in entry.layers}
                if ROOTFS_LAYER in names:
                    with self.store.open_layer(entry, ROOTFS_LAYER) as stream:
                        apply(stream, rootfs)
                shm = shm_source(spec)
                if SHM_LAYER in names and shm is not None:
                    with self.store.open_layer(entry, SHM_LAYER) as stream:
                        apply_dir(stream, shm)
            except (ShimError, OSError) as err:
                attempts.add(entry, str(err))
                log.warning(
                    "skipping checkpoint", extra={"checkpoint": entry.id, "error": str(err)}
                )
                shutil.rmtree(work, ignore_errors=True)
                reset_rootfs()
                continue
            keep_tcp = same_addresses(entry.metadata.get("network"), network)
            plan = RestorePlan(
                entry,
                image_dir,
                os.path.join(work, "criu-work"),
                keep_tcp,
                device_map,
                cached=cached is not None,
            )
            return plan, candidates[index + 1 :]
        return None, []

    def _gpu_mapping(self, entry: Entry, spec: Mapping[str, Any]) -> dict[str, str] | None:
        recorded = entry.metadata.get("gpu")
        if not isinstance(recorded, Mapping) or not recorded.get("processes"):
            return None
        return self.gpu.restore_mapping(recorded, spec, self.container_id)

    @staticmethod
    def discard(plan: RestorePlan) -> None:
        # The work dir only: a cached image dir belongs to the store.
        shutil.rmtree(os.path.dirname(plan.work_dir), ignore_errors=True)
