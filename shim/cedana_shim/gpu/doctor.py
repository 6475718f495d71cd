"""Is this node ready to checkpoint GPU containers? One JSON-able report for
``cedana doctor``: every check says what it found or why it is not available."""

from __future__ import annotations

import platform
from typing import Any

from .compat import REMAP_DRIVER, parse_driver_version
from .driver import GpuError
from .driver_api import Binding, DriverApi, cuda_version_text
from .driver_cli import CliDriver, Runner, subprocess_runner
from .inventory import inventory

ARM64_DRIVER = (595,)  # the checkpoint API is x86-64 only before driver 595


def readiness(
    *,
    nvml: Any = None,
    binding: Binding | None = None,
    cli_path: str | None = None,
    run: Runner = subprocess_runner,
    machine: str | None = None,
) -> dict[str, Any]:
    report: dict[str, Any] = {}
    driver: tuple[int, ...] = ()
    try:
        inv = inventory(nvml)
    except GpuError as err:
        report["nvml"] = _missing(err.detail)
        report["driverVersion"] = None
        report["devices"] = []
    else:
        driver = parse_driver_version(inv.driver_version)
        report["nvml"] = {"available": True}
        report["driverVersion"] = inv.driver_version
        report["cudaDriverVersion"] = cuda_version_text(inv.cuda_driver_version)
        report["devices"] = [d.to_dict() for d in inv.devices]
        mig = [d.uuid for d in inv.devices if d.mig_enabled]
        if mig:
            report["migDevices"] = {
                "uuids": mig,
                "reason": "MIG is enabled on these GPUs: processes on them cannot be checkpointed",
            }

    try:
        api = DriverApi(binding)
    except GpuError as err:
        report["driverApi"] = _missing(err.detail)
    else:
        report["driverApi"] = {
            "available": True,
            "via": api.source,
            "cudaVersion": cuda_version_text(api.cuda_version),
        }

    try:
        info = CliDriver(cli_path, run=run).probe()
    except GpuError as err:
        report["cudaCheckpoint"] = _missing(err.detail)
    else:
        report["cudaCheckpoint"] = {
            "available": True,
            "path": info.path,
            "version": info.version,
            "deviceMap": info.device_map,
        }

    if not driver:
        report["deviceRemap"] = _missing("the driver version is unknown (NVML is not available)")
    elif driver >= REMAP_DRIVER:
        report["deviceRemap"] = {"available": True}
    else:
        report["deviceRemap"] = _missing(
            f"driver {report['driverVersion']} < 580: restores only onto the same GPU indices"
        )

    arch = machine or platform.machine()
    arch_ok = arch in ("x86_64", "AMD64") or (arch == "aarch64" and driver >= ARM64_DRIVER)
    report["arch"] = (
        {"available": True, "machine": arch}
        if arch_ok
        else _missing(f"{arch}: the CUDA checkpoint API needs x86-64 (arm64 from driver 595)")
    )

    backend = (
        "driver-api"
        if report["driverApi"]["available"]
        else "cuda-checkpoint"
        if report["cudaCheckpoint"]["available"]
        else None
    )
    report["backend"] = backend
    problems = []
    if backend is None:
        problems.append("no GPU checkpoint backend (see driverApi and cudaCheckpoint)")
    if not report["devices"]:
        problems.append("no GPUs found (see nvml)")
    if not arch_ok:
        problems.append(report["arch"]["reason"])
    report["ready"] = not problems
    if problems:
        report["reason"] = "not ready because " + "; ".join(problems)
    return report


def _missing(reason: str) -> dict[str, Any]:
    return {"available": False, "reason": f"not available because {reason}"}
