"""A fake NVML: the part of nvidia-ml-py's ``pynvml`` (its names too) that
``cedana_shim.gpu.inventory`` calls, answering from the fake GPU node's state file (see
``fakegpu``).

The shim daemon imports it when this directory's parent comes first on its ``sys.path``
(ahead of an installed nvidia-ml-py). Like the real library, every query needs an
``nvmlInit()`` that no ``nvmlShutdown()`` has balanced yet (NVML counts them), and an
unknown device index is an error. ``nvmlDeviceGetComputeRunningProcesses`` lists the
state's CUDA processes that are alive and not CHECKPOINTED; each listing, and each
``nvmlInit``, is recorded in the event log with the pid of the process that asked.
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # mypy sees this directory as the package integration.fakes
    from .. import fakegpu
else:  # the shim imports this package as `pynvml`, its parent first on sys.path
    import fakegpu

NVML_SUCCESS = 0
NVML_ERROR_UNINITIALIZED = 1
NVML_ERROR_INVALID_ARGUMENT = 2
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_DRIVER_NOT_LOADED = 9

_MESSAGES = {
    NVML_ERROR_UNINITIALIZED: "Uninitialized",
    NVML_ERROR_INVALID_ARGUMENT: "Invalid Argument",
    NVML_ERROR_NOT_SUPPORTED: "Not Supported",
    NVML_ERROR_DRIVER_NOT_LOADED: "Driver Not Loaded",
}


class NVMLError(Exception):
    def __init__(self, value: int) -> None:
        super().__init__(value)
        self.value = value

    def __str__(self) -> str:
        return _MESSAGES.get(self.value, f"Unknown Error {self.value}")


_lock = threading.Lock()
_inits = 0


@dataclass(frozen=True)
class _Handle:
    index: int
    gpu: dict[str, Any]


@dataclass(frozen=True)
class c_nvmlMemory_t:
    total: int
    free: int
    used: int


@dataclass(frozen=True)
class nvmlPciInfo_t:
    busId: str
    busIdLegacy: str


@dataclass(frozen=True)
class c_nvmlProcessInfo_t:
    pid: int
    usedGpuMemory: int | None
    gpuInstanceId: int = 0xFFFFFFFF
    computeInstanceId: int = 0xFFFFFFFF


def _state() -> dict[str, Any]:
    return fakegpu.read_state(fakegpu.state_path())


def _require() -> None:
    with _lock:
        if _inits <= 0:
            raise NVMLError(NVML_ERROR_UNINITIALIZED)


def _record(event: dict[str, Any]) -> None:
    fakegpu.record({"src": "nvml", **event, "module": __file__})


def nvmlInit() -> None:
    global _inits
    if _state().get("nvml") == "no-driver":
        raise NVMLError(NVML_ERROR_DRIVER_NOT_LOADED)
    with _lock:
        _inits += 1
    _record({"call": "init"})


def nvmlShutdown() -> None:
    global _inits
    with _lock:
        if _inits <= 0:
            raise NVMLError(NVML_ERROR_UNINITIALIZED)
        _inits -= 1


def nvmlSystemGetDriverVersion() -> str:
    _require()
    return str(_state()["driver"])


def nvmlSystemGetCudaDriverVersion() -> int:
    _require()
    return int(_state()["cuda"])


def nvmlDeviceGetCount() -> int:
    _require()
    return len(_state()["gpus"])


def nvmlDeviceGetHandleByIndex(index: int) -> _Handle:
    _require()
    gpus = _state()["gpus"]
    if not 0 <= index < len(gpus):
        raise NVMLError(NVML_ERROR_INVALID_ARGUMENT)
    return _Handle(index, dict(gpus[index]))


def nvmlDeviceGetUUID(handle: _Handle) -> str:
    _require()
    return str(handle.gpu["uuid"])


def nvmlDeviceGetName(handle: _Handle) -> str:
    _require()
    return str(handle.gpu["name"])


def nvmlDeviceGetMemoryInfo(handle: _Handle) -> c_nvmlMemory_t:
    _require()
    total = int(handle.gpu["memory"])
    used = sum(int(p.usedGpuMemory or 0) for p in _processes(handle, record=False))
    return c_nvmlMemory_t(total=total, free=total - used, used=used)


def nvmlDeviceGetPciInfo(handle: _Handle) -> nvmlPciInfo_t:
    _require()
    bus = str(handle.gpu["pci"])
    return nvmlPciInfo_t(busId=bus, busIdLegacy=bus[4:])


def nvmlDeviceGetMigMode(handle: _Handle) -> tuple[int, int]:
    _require()
    mig = handle.gpu.get("mig")
    if mig is None:
        raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
    return (1, 1) if mig else (0, 0)


def nvmlDeviceGetComputeRunningProcesses(handle: _Handle) -> list[c_nvmlProcessInfo_t]:
    _require()
    return _processes(handle, record=True)


def _processes(handle: _Handle, *, record: bool) -> list[c_nvmlProcessInfo_t]:
    uuid = handle.gpu["uuid"]
    found = [
        c_nvmlProcessInfo_t(pid=int(pid), usedGpuMemory=int(rec.get("memory", 0)))
        for pid, rec in sorted(_state()["procs"].items())
        if uuid in rec.get("gpus", ())
        and rec.get("state") != fakegpu.CHECKPOINTED
        and fakegpu.alive(int(pid))
    ]
    if record:
        _record({"call": "processes", "gpu": uuid, "pids": [p.pid for p in found]})
    return found
