"""What GPUs this node has and which of a container's processes use them (NVML).

NVML comes from nvidia-ml-py (module ``pynvml``), imported on first use. Both
results serialise to plain dicts for checkpoint metadata; a restore reads them
back with ``from_dict`` and checks them against the node it lands on
(:mod:`.compat`).

The shim runs in the host pid namespace, and so does NVML: the pids it reports,
and the ones passed in here, are host pids.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from .driver import GpuUnavailable

# NVIDIA_VISIBLE_DEVICES values that give a container no GPU at all.
_NO_DEVICES = frozenset({"", "none", "void"})


@dataclass(frozen=True, slots=True)
class GpuDevice:
    index: int  # NVML's (host) index
    uuid: str  # GPU-xxxxxxxx-xxxx-xxxx-xxxx-xxxxxxxxxxxx
    name: str  # the model, e.g. "NVIDIA H200"
    memory_total_bytes: int
    pci_bus_id: str
    mig_enabled: bool

    def to_dict(self) -> dict[str, Any]:
        return {
            "index": self.index,
            "uuid": self.uuid,
            "name": self.name,
            "memoryTotalBytes": self.memory_total_bytes,
            "pciBusId": self.pci_bus_id,
            "migEnabled": self.mig_enabled,
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> GpuDevice:
        return cls(
            index=int(d["index"]),
            uuid=str(d["uuid"]),
            name=str(d["name"]),
            memory_total_bytes=int(d.get("memoryTotalBytes", 0)),
            pci_bus_id=str(d.get("pciBusId", "")),
            mig_enabled=bool(d.get("migEnabled", False)),
        )


@dataclass(frozen=True, slots=True)
class Inventory:
    driver_version: str  # e.g. "580.65.06"
    cuda_driver_version: int  # e.g. 13000 for CUDA 13.0
    devices: tuple[GpuDevice, ...]

    def to_dict(self) -> dict[str, Any]:
        return {
            "driverVersion": self.driver_version,
            "cudaDriverVersion": self.cuda_driver_version,
            "devices": [d.to_dict() for d in self.devices],
        }

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Inventory:
        return cls(
            driver_version=str(d.get("driverVersion", "")),
            cuda_driver_version=int(d.get("cudaDriverVersion", 0)),
            devices=tuple(GpuDevice.from_dict(x) for x in d.get("devices") or ()),
        )

    def select(self, visible: str | None) -> Inventory:
        """The GPUs a container sees, in its own (CUDA ordinal) order, from its
        ``NVIDIA_VISIBLE_DEVICES``: unset or ``all`` is every GPU; otherwise a comma
        list of indices or UUIDs (a UUID prefix is enough)."""
        if visible is None or visible.strip().lower() == "all":
            return self
        if visible.strip().lower() in _NO_DEVICES:
            return Inventory(self.driver_version, self.cuda_driver_version, ())
        chosen: list[GpuDevice] = []
        for item in (x.strip() for x in visible.split(",")):
            device = self._find(item)
            if device is None:
                raise GpuUnavailable(
                    f"NVIDIA_VISIBLE_DEVICES names {item!r}, which is not a GPU of this node "
                    f"({', '.join(d.uuid for d in self.devices) or 'no GPUs'})"
                )
            chosen.append(device)
        return Inventory(self.driver_version, self.cuda_driver_version, tuple(chosen))

    def _find(self, item: str) -> GpuDevice | None:
        if item.isdigit():
            return next((d for d in self.devices if d.index == int(item)), None)
        matches = [d for d in self.devices if d.uuid.lower().startswith(item.lower())]
        return matches[0] if len(matches) == 1 else None


@dataclass(frozen=True, slots=True)
class GpuProcess:
    pid: int
    gpu_uuids: tuple[str, ...]
    memory_bytes: int  # summed over its GPUs; 0 where NVML cannot tell

    def to_dict(self) -> dict[str, Any]:
        return {"pid": self.pid, "gpuUuids": list(self.gpu_uuids), "memoryBytes": self.memory_bytes}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> GpuProcess:
        return cls(
            pid=int(d["pid"]),
            gpu_uuids=tuple(str(u) for u in d.get("gpuUuids") or ()),
            memory_bytes=int(d.get("memoryBytes", 0)),
        )


def load_nvml() -> Any:
    try:
        return importlib.import_module("pynvml")
    except ImportError as err:
        raise GpuUnavailable(
            "NVML bindings are missing: pip install 'cedana-shim[gpu]' (nvidia-ml-py)"
        ) from err


@contextlib.contextmanager
def nvml_session(nvml: Any = None) -> Iterator[Any]:
    """nvmlInit/nvmlShutdown around the block (NVML counts nested inits); any NVML
    error inside becomes GpuUnavailable."""
    nvml = nvml if nvml is not None else load_nvml()
    try:
        nvml.nvmlInit()
    except nvml.NVMLError as err:
        raise GpuUnavailable(f"NVML cannot start: {err} (is the NVIDIA driver loaded?)") from err
    try:
        yield nvml
    except nvml.NVMLError as err:
        raise GpuUnavailable(f"NVML query failed: {err}") from err
    finally:
        with contextlib.suppress(nvml.NVMLError):
            nvml.nvmlShutdown()


def inventory(nvml: Any = None) -> Inventory:
    with nvml_session(nvml) as nv:
        devices = []
        for index in range(nv.nvmlDeviceGetCount()):
            handle = nv.nvmlDeviceGetHandleByIndex(index)
            devices.append(
                GpuDevice(
                    index=index,
                    uuid=_text(nv.nvmlDeviceGetUUID(handle)),
                    name=_text(nv.nvmlDeviceGetName(handle)),
                    memory_total_bytes=int(nv.nvmlDeviceGetMemoryInfo(handle).total),
                    pci_bus_id=_text(nv.nvmlDeviceGetPciInfo(handle).busId),
                    mig_enabled=_mig_enabled(nv, handle),
                )
            )
        return Inventory(
            driver_version=_text(nv.nvmlSystemGetDriverVersion()),
            cuda_driver_version=int(nv.nvmlSystemGetCudaDriverVersion()),
            devices=tuple(devices),
        )


def cuda_processes(pids: Iterable[int], nvml: Any = None) -> list[GpuProcess]:
    """The processes among ``pids`` that hold a CUDA context on any GPU, by pid."""
    wanted = set(pids)
    if not wanted:
        return []
    uuids: dict[int, list[str]] = {}
    memory: dict[int, int] = {}
    with nvml_session(nvml) as nv:
        for index in range(nv.nvmlDeviceGetCount()):
            handle = nv.nvmlDeviceGetHandleByIndex(index)
            uuid = _text(nv.nvmlDeviceGetUUID(handle))
            for proc in nv.nvmlDeviceGetComputeRunningProcesses(handle):
                pid = int(proc.pid)
                if pid not in wanted:
                    continue
                if uuid not in uuids.setdefault(pid, []):
                    uuids[pid].append(uuid)
                # None where the driver cannot account per process.
                memory[pid] = memory.get(pid, 0) + int(proc.usedGpuMemory or 0)
    return [GpuProcess(pid, tuple(uuids[pid]), memory.get(pid, 0)) for pid in sorted(uuids)]


def gpu_metadata(
    pids: Iterable[int], visible: str | None = None, nvml: Any = None
) -> dict[str, Any]:
    """What a checkpoint records about GPUs: the node's inventory, the container's
    GPUs in its own order (``visible`` is its NVIDIA_VISIBLE_DEVICES) and its CUDA
    processes."""
    inv = inventory(nvml)
    return {
        "inventory": inv.to_dict(),
        "visible": [d.uuid for d in inv.select(visible).devices],
        "processes": [p.to_dict() for p in cuda_processes(pids, nvml)],
    }


def _mig_enabled(nv: Any, handle: Any) -> bool:
    try:
        current, _pending = nv.nvmlDeviceGetMigMode(handle)
    except nv.NVMLError:
        return False  # NVML_ERROR_NOT_SUPPORTED: a GPU without MIG
    return bool(current)


def _text(value: str | bytes) -> str:
    # Older nvidia-ml-py releases return bytes.
    return value.decode() if isinstance(value, bytes) else str(value)
