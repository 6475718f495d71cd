"""``criu cpuinfo check`` through the shim (checkpoint/cpu_fit.py), with the real
CRIU: this CPU fits its own description and not one that claims more."""

from __future__ import annotations

from pathlib import Path

from cedana_shim.checkpoint import cpu_fit
from cedana_shim.runtime.reaper import Reaper
from cedana_shim.runtime.runc import Runc
from support.cpuinfo import this_cpu, unfit
from support.processes import run_with_reaper


def check(tmp_path: Path, image: bytes, cap: str = "") -> str:
    async def body(reaper: Reaper) -> str:
        return await cpu_fit.check(Runc(reaper=reaper, root=str(tmp_path)), image, cap)

    return run_with_reaper(body, timeout=30)


def test_this_cpu_fits_what_criu_recorded_of_it(tmp_path: Path) -> None:
    image = this_cpu(tmp_path / "images")
    assert cpu_fit.decode(cpu_fit.record(str(tmp_path / "images"))) == image
    assert check(tmp_path, image) == ""
    assert check(tmp_path, image, "fpu") == ""


def test_a_cpu_with_a_feature_this_one_lacks_is_named_by_criu(tmp_path: Path) -> None:
    why = check(tmp_path, unfit(this_cpu(tmp_path / "images")))
    assert why.startswith("this node's CPU lacks what the dumping node's had"), why
    assert "criu cpuinfo check: " in why and "xfeatures" in why, why
