"""Can a checkpoint's GPU state be restored here, and onto which GPUs?

Checked before CRIU restores anything, so a refusal costs nothing. The CUDA
driver restores GPU memory only onto the same GPU model and count, with the same
or a newer driver. Before driver 580 it restores each GPU onto the device at the
same index; 580 added a device map (old UUID -> new UUID) that may point
anywhere, as long as it names every checkpointed GPU.

Both inventories are the *container's* GPUs in the container's order
(:meth:`.inventory.Inventory.select` with its NVIDIA_VISIBLE_DEVICES), so that
"same count" means what the workload saw, not what the node has.
"""

from __future__ import annotations

import re
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Final

from .driver import GpuFailedPrecondition
from .inventory import GpuDevice, Inventory

MIN_DRIVER: Final = (570,)  # the checkpoint API, NVML-aware checkpoints
REMAP_DRIVER: Final = (580,)  # --device-map / CUcheckpointRestoreArgs.gpuPairs


@dataclass(frozen=True, slots=True)
class RestoreMapping:
    """What the restore does with each checkpointed GPU.

    ``device_map`` is empty when the driver's default placement is right (same GPUs,
    or same indices before 580); otherwise pass it to ``thaw``/``restore``.
    """

    device_map: Mapping[str, str]
    pairs: tuple[tuple[str, str], ...]  # (recorded UUID, current UUID), in order
    notes: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {
            "deviceMap": dict(self.device_map),
            "pairs": [list(p) for p in self.pairs],
            "notes": list(self.notes),
        }


def parse_driver_version(text: str) -> tuple[int, ...]:
    """``"580.65.06"`` -> ``(580, 65, 6)``; ``()`` when there is no version."""
    match = re.match(r"\s*(\d+(?:\.\d+)*)", text or "")
    return tuple(int(x) for x in match.group(1).split(".")) if match else ()


def check_restore(
    recorded: Inventory | Mapping[str, Any],
    current: Inventory | Mapping[str, Any],
    driver_version: str | None = None,
    *,
    container_id: str = "",
) -> RestoreMapping:
    """The GPU pairing for restoring a checkpoint taken on ``recorded`` onto
    ``current``, or :class:`GpuFailedPrecondition` saying why it cannot be.

    ``driver_version`` is this node's driver (default: ``current``'s)."""
    rec = recorded if isinstance(recorded, Inventory) else Inventory.from_dict(recorded)
    cur = current if isinstance(current, Inventory) else Inventory.from_dict(current)
    driver_text = driver_version if driver_version is not None else cur.driver_version
    driver = parse_driver_version(driver_text)
    what = f"container {container_id}" if container_id else "the container"

    def refuse(reason: str) -> GpuFailedPrecondition:
        return GpuFailedPrecondition(f"cannot restore the GPU state of {what}: {reason}")

    if not rec.devices:
        return RestoreMapping({}, (), ("the checkpoint holds no GPU state",))
    if not driver:
        raise refuse(f"this node's NVIDIA driver version is unknown ({driver_text!r})")
    if driver < MIN_DRIVER:
        raise refuse(f"this node has driver {driver_text}; GPU restore needs driver >= 570")
    recorded_driver = parse_driver_version(rec.driver_version)
    if recorded_driver and driver < recorded_driver:
        raise refuse(
            f"the checkpoint was taken with driver {rec.driver_version} and this node has the "
            f"older {driver_text}: restore with the same or a newer driver"
        )
    mig = [d for d in cur.devices if d.mig_enabled]
    if mig:
        raise refuse(f"MIG is enabled on {_names(mig)}; MIG GPUs cannot be checkpointed")
    if len(cur.devices) != len(rec.devices) or Counter(_models(rec)) != Counter(_models(cur)):
        raise refuse(
            f"the checkpoint used {_census(rec)} and the restored container gets "
            f"{_census(cur)}: the same GPU model and count are needed"
        )

    pairs = _pair(rec.devices, cur.devices)
    for old, new in pairs:
        if new.memory_total_bytes < old.memory_total_bytes:
            raise refuse(
                f"{new.uuid} ({new.name}) has {new.memory_total_bytes} bytes of memory, less "
                f"than the {old.memory_total_bytes} of the checkpointed {old.uuid}"
            )
    uuid_pairs = tuple((old.uuid, new.uuid) for old, new in pairs)
    if all(old.uuid == new.uuid for old, new in pairs):
        return RestoreMapping({}, uuid_pairs, ("same GPUs as at checkpoint",))
    if driver >= REMAP_DRIVER:
        return RestoreMapping(
            dict(uuid_pairs),
            uuid_pairs,
            (f"remapping {len(pairs)} GPU(s) by UUID (driver {driver_text})",),
        )
    if all(old.index == new.index for old, new in pairs):
        return RestoreMapping(
            {},
            uuid_pairs,
            (
                f"other GPUs at the same indices: driver {driver_text} restores by index, "
                "no device map needed",
            ),
        )
    moved = ", ".join(
        f"{old.uuid} (index {old.index}) -> {new.uuid} (index {new.index})"
        for old, new in pairs
        if old.index != new.index
    )
    raise refuse(
        f"its GPUs would move to other indices ({moved}); restoring onto other GPU indices "
        f"needs driver >= 580 (device map), this node has {driver_text}"
    )


def _pair(
    recorded: tuple[GpuDevice, ...], current: tuple[GpuDevice, ...]
) -> list[tuple[GpuDevice, GpuDevice]]:
    """Same UUID first (a restore on the same node), then position, then any free GPU
    of the same model."""
    free = list(current)
    chosen: dict[int, GpuDevice] = {}
    for i, old in enumerate(recorded):
        same = next((d for d in free if d.uuid == old.uuid), None)
        if same is not None:
            chosen[i] = same
            free.remove(same)
    for i, old in enumerate(recorded):
        if i in chosen:
            continue
        positional = current[i]
        if positional in free and positional.name == old.name:
            chosen[i] = positional
            free.remove(positional)
    for i, old in enumerate(recorded):
        if i in chosen:
            continue
        # Model counts match (checked by the caller), so one is always left.
        other = next(d for d in free if d.name == old.name)
        chosen[i] = other
        free.remove(other)
    return [(old, chosen[i]) for i, old in enumerate(recorded)]


def _models(inv: Inventory) -> list[str]:
    return [d.name for d in inv.devices]


def _census(inv: Inventory) -> str:
    counts = Counter(_models(inv))
    return " + ".join(f"{n} x {name}" for name, n in sorted(counts.items())) or "no GPUs"


def _names(devices: list[GpuDevice]) -> str:
    return ", ".join(f"{d.uuid} ({d.name})" for d in devices)


def recorded_inventory(gpu_metadata: Mapping[str, Any]) -> Inventory:
    """The container's GPUs at checkpoint time, from :func:`.inventory.gpu_metadata`."""
    inv = Inventory.from_dict(gpu_metadata.get("inventory") or {})
    visible = gpu_metadata.get("visible")
    return inv if visible is None else inv.select(",".join(str(u) for u in visible))
