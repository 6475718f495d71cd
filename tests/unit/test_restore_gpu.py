"""The restore session's GPU steps, on StubGpuSteps and a host whose restore only
returns a pid, from a real store in tmp_path: a checkpoint whose GPUs this node cannot
take is passed over when it is unpacked (the next one is restored), and the restored
processes get their GPU state back with the device map the plan made."""

from __future__ import annotations

import asyncio
import platform
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from cedana_shim.checkpoint.policy import Mode, Policy
from cedana_shim.checkpoint.restore import RestoreReport, RestoreRequest, RestoreSession
from cedana_shim.checkpoint.tool_versions import Versions
from cedana_shim.config import NodeConfig
from cedana_shim.hooks.stub import StubHookRunner
from fakes.stub_gpu_steps import StubGpuSteps
from support.checkpoints import SCOPE, commit_checkpoint, open_store

LABEL = "trainer"
PIDS = (4242, 4243)
HERE = {"arch": platform.machine(), "kernel": "6.8.0", "criu": "4.2"}
GPU = {"processes": [{"pid": 7}], "inventory": {}}  # what the dump recorded


class Host:
    """A RestoreHost that restores nothing: its restore returns the first of PIDS."""

    def __init__(self, bundle: Path) -> None:
        bundle.mkdir()
        self.bundle = str(bundle)
        self.rootfs = str(bundle / "rootfs")
        self.spec: dict[str, Any] = {"process": {"env": ["NVIDIA_VISIBLE_DEVICES=all"]}}
        self.runc = None  # never asked: the versions are given, no candidate is a registry's
        self.restored: list[str] = []  # the image dirs restored from

    async def network_facts(self) -> Any:
        return {}

    async def restore_images(self, request: RestoreRequest) -> int:
        self.restored.append(request.image_dir)
        return PIDS[0]

    async def pids(self) -> Sequence[int]:
        return PIDS

    async def discard_attempt(self) -> None:
        raise AssertionError("no attempt fails")

    async def reset_rootfs(self) -> None:
        pass

    async def create_cold(self) -> int:
        raise AssertionError("a checkpoint is restored")


def restore(tmp_path: Path, gpu: StubGpuSteps, *gpu_records: dict[str, Any]) -> RestoreReport:
    """Checkpoints of LABEL, oldest first, one per record (``{}``: a CPU-only one),
    restored by label."""
    store = open_store(tmp_path / "store")
    for record in gpu_records:
        metadata = {"versions": HERE, **({"gpu": record} if record else {})}
        commit_checkpoint(store, {"pages-1.img": b"x"}, label=LABEL, metadata=metadata)
    reports: list[RestoreReport] = []
    session = RestoreSession(
        store=store,
        hooks=StubHookRunner(),
        gpu=gpu,
        config=NodeConfig(store_path=str(tmp_path / "store")),
        policy=Policy(Mode.AUTO, LABEL, SCOPE),
        container_id="c1",
        report=reports.append,
        versions=Versions(values=HERE),
    )
    host = Host(tmp_path / "bundle")

    async def body() -> None:
        assert await session.prepare(host)  # type: ignore[arg-type]
        assert await session.run(host) == PIDS[0]  # type: ignore[arg-type]

    asyncio.run(body())
    assert len(host.restored) == 1
    (report,) = reports
    return report


def test_the_gpu_state_goes_back_with_the_plans_device_map(tmp_path: Path) -> None:
    gpu = StubGpuSteps(device_map={"GPU-old": "GPU-new"})
    report = restore(tmp_path, gpu, GPU)
    assert (report.outcome, report.skipped) == ("restored", [])
    assert gpu.restored == [(PIDS, GPU, {"GPU-old": "GPU-new"})]
    assert gpu.steps == ["restore_mapping", "after_restore"]


def test_a_checkpoint_whose_gpus_do_not_fit_is_passed_over(tmp_path: Path) -> None:
    gpu = StubGpuSteps(misfit="2 GPUs recorded, 1 visible here")
    report = restore(tmp_path, gpu, {}, GPU)  # the newest needs GPUs
    assert report.outcome == "restored"
    [skipped] = report.skipped
    assert skipped.endswith(": GPU: 2 GPUs recorded, 1 visible here"), skipped
    assert report.checkpoint_id not in skipped
    assert gpu.restored == []  # the CPU-only one has no GPU state to put back
