"""A :class:`~cedana_shim.checkpoint.gpu_steps.GpuStepRunner` for tests of the
checkpoint layer: records every call, answers what the test set, and refuses a restore
onto this node's GPUs when told to, without a GPU or NVML."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from cedana_shim.checkpoint.gpu_steps import GpuDump
from cedana_shim.gpu.driver import GpuFailedPrecondition
from cedana_shim.runtime.runc import Runc


@dataclass
class StubGpuSteps:
    dump: GpuDump | None = None  # what before_dump returns (None: a CPU container)
    device_map: dict[str, str] | None = None  # what restore_mapping returns
    misfit: str = ""  # restore_mapping refuses with this, as gpu.compat does
    calls: list[tuple[str, str]] = field(default_factory=list)  # (step, container id)
    # after_restore's (pids, recorded GPU state, device map), in order.
    restored: list[tuple[tuple[int, ...], Mapping[str, Any], Mapping[str, str] | None]] = field(
        default_factory=list
    )

    @property
    def steps(self) -> list[str]:
        return [step for step, _ in self.calls]

    async def before_dump(
        self, container_id: str, spec: Mapping[str, Any], runc: Runc
    ) -> GpuDump | None:
        self.calls.append(("before_dump", container_id))
        return self.dump

    async def after_dump(self, dump: GpuDump, *, thaw_processes: bool) -> None:
        self.calls.append(("after_dump", ""))

    def restore_mapping(
        self, recorded: Mapping[str, Any], spec: Mapping[str, Any], container_id: str
    ) -> dict[str, str] | None:
        self.calls.append(("restore_mapping", container_id))
        if self.misfit:
            raise GpuFailedPrecondition(self.misfit)
        return self.device_map

    async def after_restore(
        self,
        container_id: str,
        pids: Sequence[int],
        recorded: Mapping[str, Any],
        device_map: Mapping[str, str] | None,
    ) -> dict[str, Any]:
        self.calls.append(("after_restore", container_id))
        self.restored.append((tuple(pids), recorded, device_map))
        return {}
