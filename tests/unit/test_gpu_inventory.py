"""NVML inventory and the container's CUDA processes, against a fake ``pynvml`` module
shaped like nvidia-ml-py's (friendly objects, bytes from older releases, None for
memory NVML cannot account, NVMLError subclasses)."""

from __future__ import annotations

import json
import sys
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any

import pytest
from cedana_shim.gpu.driver import GpuUnavailable
from cedana_shim.gpu.inventory import (
    GpuProcess,
    Inventory,
    cuda_processes,
    gpu_metadata,
    inventory,
)

UUID0 = "GPU-4bd1d1e2-8f3c-4e0a-a0b9-7f1f63a3e0c1"
UUID1 = "GPU-9a9c3a47-2a5e-4b8e-8d7e-2f4c9d3b1a55"
NVML_ERROR_NOT_SUPPORTED = 3
NVML_ERROR_DRIVER_NOT_LOADED = 9


class NVMLError(Exception):
    def __init__(self, value: int) -> None:
        super().__init__(value)
        self.value = value

    def __str__(self) -> str:
        return {3: "Not Supported", 9: "Driver Not Loaded"}.get(self.value, "Unknown Error")


@dataclass
class Memory:  # c_nvmlMemory_t
    total: int
    free: int
    used: int


@dataclass
class PciInfo:  # nvmlPciInfo_t
    busId: bytes


@dataclass
class ProcessInfo:  # nvmlProcessInfo_t as nvmlStructToFriendlyObject returns it
    pid: int
    usedGpuMemory: int | None
    gpuInstanceId: int = 0xFFFFFFFF
    computeInstanceId: int = 0xFFFFFFFF


@dataclass
class FakeNvml:
    devices: list[dict[str, Any]]
    driver: str = "580.65.06"
    cuda: int = 13000
    init_error: int | None = None
    process_error: int | None = None
    calls: list[str] = field(default_factory=list)

    NVMLError = NVMLError

    def nvmlInit(self) -> None:
        self.calls.append("init")
        if self.init_error is not None:
            raise NVMLError(self.init_error)

    def nvmlShutdown(self) -> None:
        self.calls.append("shutdown")

    def nvmlDeviceGetCount(self) -> int:
        return len(self.devices)

    def nvmlDeviceGetHandleByIndex(self, i: int) -> dict[str, Any]:
        return self.devices[i]

    def nvmlDeviceGetUUID(self, h: dict[str, Any]) -> str | bytes:
        return h["uuid"]  # type: ignore[no-any-return]

    def nvmlDeviceGetName(self, h: dict[str, Any]) -> str | bytes:
        return h["name"]  # type: ignore[no-any-return]

    def nvmlDeviceGetMemoryInfo(self, h: dict[str, Any]) -> Memory:
        return Memory(h["mem"], h["mem"] // 2, h["mem"] // 2)

    def nvmlDeviceGetPciInfo(self, h: dict[str, Any]) -> PciInfo:
        return PciInfo(h["bus"])

    def nvmlDeviceGetMigMode(self, h: dict[str, Any]) -> tuple[int, int]:
        if h.get("mig") is None:
            raise NVMLError(NVML_ERROR_NOT_SUPPORTED)
        return (h["mig"], h["mig"])

    def nvmlDeviceGetComputeRunningProcesses(self, h: dict[str, Any]) -> list[ProcessInfo]:
        if self.process_error is not None:
            raise NVMLError(self.process_error)
        return list(h["procs"])

    def nvmlSystemGetDriverVersion(self) -> str:
        return self.driver

    def nvmlSystemGetCudaDriverVersion(self) -> int:
        return self.cuda


def two_h200() -> FakeNvml:
    return FakeNvml(
        [
            {
                "uuid": UUID0,
                "name": "NVIDIA H200",
                "mem": 150_754_820_096,
                "bus": b"00000000:19:00.0",
                "mig": 0,
                "procs": [ProcessInfo(1001, 4 << 30), ProcessInfo(1002, 1 << 30)],
            },
            {
                # Older nvidia-ml-py releases hand out bytes.
                "uuid": UUID1.encode(),
                "name": b"NVIDIA H200",
                "mem": 150_754_820_096,
                "bus": b"00000000:3B:00.0",
                "mig": None,
                "procs": [
                    ProcessInfo(1001, 2 << 30),
                    ProcessInfo(1003, None),
                    ProcessInfo(7777, 8 << 30),
                ],
            },
        ]
    )


def test_inventory_reads_every_device_and_the_driver() -> None:
    nv = two_h200()
    inv = inventory(nv)
    assert inv.driver_version == "580.65.06"
    assert inv.cuda_driver_version == 13000
    assert [d.uuid for d in inv.devices] == [UUID0, UUID1]
    assert [d.index for d in inv.devices] == [0, 1]
    assert {d.name for d in inv.devices} == {"NVIDIA H200"}
    assert inv.devices[1].pci_bus_id == "00000000:3B:00.0"
    assert inv.devices[0].memory_total_bytes == 150_754_820_096
    assert not any(d.mig_enabled for d in inv.devices)
    assert nv.calls == ["init", "shutdown"]
    assert Inventory.from_dict(json.loads(json.dumps(inv.to_dict()))) == inv


def test_cuda_processes_intersects_nvml_with_the_containers_pids() -> None:
    procs = cuda_processes([1001, 1003, 1004], two_h200())
    assert procs == [
        GpuProcess(1001, (UUID0, UUID1), (4 << 30) + (2 << 30)),
        GpuProcess(1003, (UUID1,), 0),  # NVML could not account its memory
    ]
    assert GpuProcess.from_dict(procs[0].to_dict()) == procs[0]


def test_no_pids_asks_nvml_nothing() -> None:
    nv = two_h200()
    assert cuda_processes([], nv) == []
    assert nv.calls == []


def test_gpu_metadata_is_json_and_orders_the_visible_gpus() -> None:
    meta = gpu_metadata([1002], visible=f"1,{UUID0}", nvml=two_h200())
    assert json.loads(json.dumps(meta)) == meta
    assert meta["visible"] == [UUID1, UUID0]
    assert meta["processes"] == [{"pid": 1002, "gpuUuids": [UUID0], "memoryBytes": 1 << 30}]
    assert meta["inventory"]["driverVersion"] == "580.65.06"


def test_mig_mode_is_recorded() -> None:
    nv = two_h200()
    nv.devices[0]["mig"] = 1
    assert inventory(nv).devices[0].mig_enabled


def test_nvml_that_cannot_start_is_unavailable() -> None:
    nv = two_h200()
    nv.init_error = NVML_ERROR_DRIVER_NOT_LOADED
    with pytest.raises(GpuUnavailable, match="NVML cannot start: Driver Not Loaded"):
        inventory(nv)


def test_a_failed_query_is_unavailable_and_still_shuts_nvml_down() -> None:
    nv = two_h200()
    nv.process_error = NVML_ERROR_NOT_SUPPORTED
    with pytest.raises(GpuUnavailable, match="NVML query failed: Not Supported"):
        cuda_processes([1001], nv)
    assert nv.calls == ["init", "shutdown"]


def test_missing_nvidia_ml_py_says_what_to_install(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)  # import raises ImportError
    with pytest.raises(GpuUnavailable, match=r"cedana-shim\[gpu\]"):
        inventory()


def test_the_pynvml_module_is_imported_lazily(monkeypatch: pytest.MonkeyPatch) -> None:
    module = ModuleType("pynvml")
    fake = two_h200()
    for name in dir(fake):
        if name.startswith("nvml") or name == "NVMLError":
            setattr(module, name, getattr(fake, name))
    monkeypatch.setitem(sys.modules, "pynvml", module)
    assert [p.pid for p in cuda_processes([1002, 7777])] == [1002, 7777]
