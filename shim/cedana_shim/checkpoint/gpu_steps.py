"""The GPU steps of checkpoint and restore, between the pipeline and ``gpu/``.

A container that asked for NVIDIA GPUs has its CUDA processes' GPU state moved
into host memory (lock, checkpoint) before CRIU dumps it, so the dump holds
everything; after a leave-running dump, or after a restore, the state goes back
(restore, unlock). ``gpu.orchestrator`` does that for all processes in parallel
and undoes a partial freeze, so a failure never leaves the workload locked.

The pipeline and the restore session ask for these steps through
:class:`GpuStepRunner`; :class:`GpuSteps` runs them on the node's GPUs (tests use
tests/unit/fakes/stub_gpu_steps.py).
"""

from __future__ import annotations

import asyncio
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol

from ..config import NodeConfig
from ..runtime.reaper import Reaper
from ..runtime.runc import Runc

if TYPE_CHECKING:
    from ..gpu.driver import CudaCheckpointDriver
    from ..gpu.records import Frozen

GPU_DEVICE_PREFIX = "/dev/nvidia"
NO_DEVICES = {"", "void", "none"}


def visible_devices(spec: Mapping[str, Any]) -> str | None:
    """The container's NVIDIA_VISIBLE_DEVICES, as the NVIDIA toolkit reads it."""
    for item in (spec.get("process") or {}).get("env") or []:
        if isinstance(item, str) and item.startswith("NVIDIA_VISIBLE_DEVICES="):
            return item.partition("=")[2]
    return None


def gpu_requested(spec: Mapping[str, Any]) -> bool:
    """Does the container have NVIDIA GPUs (toolkit env, CDI annotation or devices)?"""
    visible = visible_devices(spec)
    if visible is not None and visible.strip().lower() not in NO_DEVICES:
        return True
    annotations = spec.get("annotations") or {}
    if any(
        k.startswith("cdi.k8s.io/") and "nvidia.com/gpu" in str(v) for k, v in annotations.items()
    ):
        return True
    devices = (spec.get("linux") or {}).get("devices") or []
    return any(
        str(d.get("path", "")).startswith(GPU_DEVICE_PREFIX)
        for d in devices
        if isinstance(d, Mapping)
    )


@dataclass
class GpuDump:
    metadata: dict[str, Any]
    frozen: Frozen | None = None  # None when no CUDA process was running
    driver: CudaCheckpointDriver | None = None


class GpuStepRunner(Protocol):
    """The GPU steps around CRIU: what the pipeline asks before and after a dump, and
    the restore session of a checkpoint with GPU state."""

    async def before_dump(
        self, container_id: str, spec: Mapping[str, Any], runc: Runc
    ) -> GpuDump | None:
        """Lock and checkpoint the container's CUDA processes; None for a CPU container."""
        ...

    async def after_dump(self, dump: GpuDump, *, thaw_processes: bool) -> None:
        """Give the GPU back to processes that go on running."""
        ...

    def restore_mapping(
        self, recorded: Mapping[str, Any], spec: Mapping[str, Any], container_id: str
    ) -> dict[str, str] | None:
        """GPU UUID map for restoring onto this node's GPUs; raises when they do not
        fit. Blocking."""
        ...

    async def after_restore(
        self,
        container_id: str,
        pids: Sequence[int],
        recorded: Mapping[str, Any],
        device_map: Mapping[str, str] | None,
    ) -> dict[str, Any]:
        """The GPU state back into the restored processes ``pids``, then unlocked."""
        ...


class GpuSteps:
    """The GPU steps on this node's GPUs, through ``gpu/`` (a :class:`GpuStepRunner`)."""

    def __init__(self, config: NodeConfig, reaper: Reaper) -> None:
        self.config = config
        self.reaper = reaper
        self._driver: CudaCheckpointDriver | None = None

    def _choose(self, container_id: str, loop: asyncio.AbstractEventLoop) -> CudaCheckpointDriver:
        from ..gpu.driver_cli import reaper_runner
        from ..gpu.select import choose_driver

        if self._driver is None:
            self._driver = choose_driver(
                container_id,
                prefer=self.config.gpu_backend,  # type: ignore[arg-type]
                run=reaper_runner(self.reaper, loop),
                cli_path=self.config.cuda_checkpoint_path or None,
            )
        return self._driver

    async def before_dump(
        self, container_id: str, spec: Mapping[str, Any], runc: Runc
    ) -> GpuDump | None:
        """Lock and checkpoint the container's CUDA processes; None for a CPU container."""
        if not gpu_requested(spec):
            return None
        from ..gpu.inventory import cuda_processes, inventory
        from ..gpu.orchestrator import freeze

        pids = await runc.ps(container_id)
        inv = await asyncio.to_thread(inventory)
        procs = await asyncio.to_thread(cuda_processes, pids)
        metadata: dict[str, Any] = {
            "inventory": inv.to_dict(),
            "visible": [d.uuid for d in inv.select(visible_devices(spec)).devices],
            "processes": [p.to_dict() for p in procs],
        }
        if not procs:
            return GpuDump(metadata)
        loop = asyncio.get_running_loop()
        driver = await asyncio.to_thread(self._choose, container_id, loop)
        frozen = await freeze(
            driver,
            procs,
            lock_timeout_ms=self.config.gpu_lock_timeout_ms,
            container_id=container_id,
        )
        metadata["freeze"] = frozen.to_dict()
        return GpuDump(metadata, frozen, driver)

    async def after_dump(self, dump: GpuDump, *, thaw_processes: bool) -> None:
        """Give the GPU back to processes that go on running (leave-running, or a failed dump)."""
        if dump.frozen is None or dump.driver is None or not thaw_processes:
            return
        from ..gpu.orchestrator import thaw

        thawed = await thaw(dump.driver, dump.frozen)
        dump.metadata["thaw"] = thawed.to_dict()

    def restore_mapping(
        self, recorded: Mapping[str, Any], spec: Mapping[str, Any], container_id: str
    ) -> dict[str, str] | None:
        """GPU UUID map for restoring onto this node's GPUs; raises when they do not fit.

        Blocking (NVML); the restore planner calls it from its thread.
        """
        from ..gpu.compat import check_restore, recorded_inventory
        from ..gpu.inventory import inventory

        current = inventory().select(visible_devices(spec))
        mapping = check_restore(recorded_inventory(recorded), current, container_id=container_id)
        return dict(mapping.device_map) or None

    async def after_restore(
        self,
        container_id: str,
        pids: Sequence[int],
        recorded: Mapping[str, Any],
        device_map: Mapping[str, str] | None,
    ) -> dict[str, Any]:
        """The GPU state back into the restored processes ``pids``, then unlocked."""
        from ..gpu.orchestrator import thaw

        if not recorded.get("processes"):
            return {}
        loop = asyncio.get_running_loop()
        driver = await asyncio.to_thread(self._choose, container_id, loop)
        total = (recorded.get("freeze") or {}).get("bytes")
        thawed = await thaw(
            driver,
            pids,
            device_map,
            container_id=container_id,
            total_bytes=total if isinstance(total, int) else None,
        )
        return thawed.to_dict()
