"""choose_driver picks the driver API, else cuda-checkpoint, else says what to install;
doctor reports each piece with a reason when it is missing."""

from __future__ import annotations

import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

import pytest
from cedana_shim import errors
from cedana_shim.gpu import doctor, driver_api
from cedana_shim.gpu.driver import GpuUnavailable
from cedana_shim.gpu.driver_api import DriverApi
from cedana_shim.gpu.driver_cli import CliDriver
from cedana_shim.gpu.select import choose_driver
from test_gpu_driver_api import FakeBinding
from test_gpu_inventory import two_h200

HELP = "Version 580.65.06.\n--action lock | checkpoint | restore | unlock [--device-map <uuids>]\n"


def no_driver() -> driver_api.Binding:
    raise GpuUnavailable("no NVIDIA driver: cannot load libcuda.so.1")


def fake_tool(directory: Path, help_text: str = HELP) -> Path:
    path = directory / "cuda-checkpoint"
    path.write_text(f"#!{sys.executable}\nprint({help_text!r})\n")
    path.chmod(0o755)
    return path


@pytest.fixture
def bare_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """PATH holds only an empty directory the test may put a cuda-checkpoint in."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    monkeypatch.setenv("PATH", str(bin_dir))
    return bin_dir


def test_the_driver_api_comes_first(monkeypatch: pytest.MonkeyPatch, bare_path: Path) -> None:
    fake_tool(bare_path)
    monkeypatch.setattr(driver_api, "load_binding", lambda: FakeBinding())
    assert isinstance(choose_driver("c1"), DriverApi)


def test_cuda_checkpoint_when_the_driver_api_is_missing(
    monkeypatch: pytest.MonkeyPatch, bare_path: Path
) -> None:
    tool = fake_tool(bare_path)
    monkeypatch.setattr(driver_api, "load_binding", no_driver)
    chosen = choose_driver("c1")
    assert isinstance(chosen, CliDriver) and chosen.path == str(tool)


def test_the_injected_runner_starts_cuda_checkpoint(
    monkeypatch: pytest.MonkeyPatch, bare_path: Path
) -> None:
    fake_tool(bare_path)
    monkeypatch.setattr(driver_api, "load_binding", no_driver)
    seen: list[list[str]] = []

    def run(argv: Sequence[str], *, timeout: float) -> tuple[int, str, str]:
        seen.append(list(argv))
        return 0, HELP, ""

    choose_driver("c1", run=run)
    assert seen == [[str(bare_path / "cuda-checkpoint"), "--help"]]


def test_a_preference_skips_the_other_backend(
    monkeypatch: pytest.MonkeyPatch, bare_path: Path
) -> None:
    fake_tool(bare_path)
    monkeypatch.setattr(driver_api, "load_binding", lambda: FakeBinding())
    assert isinstance(choose_driver(prefer="cuda-checkpoint"), CliDriver)
    with pytest.raises(GpuUnavailable, match="the driver-api GPU checkpoint backend"):
        monkeypatch.setattr(driver_api, "load_binding", no_driver)
        choose_driver("c2", prefer="driver-api")


def test_neither_backend_says_what_to_install(
    monkeypatch: pytest.MonkeyPatch, bare_path: Path
) -> None:
    monkeypatch.setattr(driver_api, "load_binding", no_driver)
    with pytest.raises(GpuUnavailable) as info:
        choose_driver("job-42")
    text = str(info.value)
    assert text.startswith(
        "container job-42 needs GPU checkpoint/restore but neither the CUDA driver checkpoint "
        "API (driver >= 570, cuda-bindings) nor cuda-checkpoint on PATH is available: install"
    )
    assert "cedana-shim[gpu]" in text and "github.com/NVIDIA/cuda-checkpoint" in text
    assert "driver API: no NVIDIA driver" in text
    assert "cuda-checkpoint: cuda-checkpoint is not on PATH" in text
    assert isinstance(info.value, errors.Unavailable)


def test_an_old_driver_and_an_old_tool_are_both_explained(
    monkeypatch: pytest.MonkeyPatch, bare_path: Path
) -> None:
    fake_tool(bare_path, "Version 550.54.15.\n--toggle --pid <pid>\n")
    monkeypatch.setattr(driver_api, "load_binding", lambda: FakeBinding(version=12040))
    with pytest.raises(GpuUnavailable) as info:
        choose_driver("c3")
    assert "needs NVIDIA driver >= 570" in str(info.value)
    assert "does not offer --action" in str(info.value)


# -- doctor ----------------------------------------------------------------------------


def test_doctor_on_a_ready_node(bare_path: Path) -> None:
    fake_tool(bare_path)
    report = doctor.readiness(nvml=two_h200(), binding=FakeBinding(version=13000))
    assert report["ready"] is True
    assert report["backend"] == "driver-api"
    assert report["driverVersion"] == "580.65.06"
    assert report["cudaDriverVersion"] == "13.0"
    assert [d["name"] for d in report["devices"]] == ["NVIDIA H200", "NVIDIA H200"]
    assert report["driverApi"] == {"available": True, "via": "fake", "cudaVersion": "13.0"}
    assert report["cudaCheckpoint"]["available"] is True
    assert report["cudaCheckpoint"]["deviceMap"] is True
    assert report["deviceRemap"] == {"available": True}
    assert "reason" not in report


def test_doctor_says_why_each_piece_is_missing(
    monkeypatch: pytest.MonkeyPatch, bare_path: Path
) -> None:
    monkeypatch.setitem(sys.modules, "pynvml", None)
    monkeypatch.setattr(driver_api, "load_binding", no_driver)
    report = doctor.readiness(machine="x86_64")
    assert report["ready"] is False
    assert report["backend"] is None
    for key in ("nvml", "driverApi", "cudaCheckpoint", "deviceRemap"):
        assert report[key]["available"] is False
        assert report[key]["reason"].startswith("not available because ")
    assert "nvidia-ml-py" in report["nvml"]["reason"]
    assert "libcuda.so.1" in report["driverApi"]["reason"]
    assert "not on PATH" in report["cudaCheckpoint"]["reason"]
    assert report["reason"].startswith("not ready because no GPU checkpoint backend")


def test_doctor_on_arm64_before_595(bare_path: Path) -> None:
    nv = two_h200()
    report = doctor.readiness(nvml=nv, binding=FakeBinding(), machine="aarch64")
    assert report["arch"]["available"] is False
    assert "arm64 from driver 595" in report["reason"]
    nv.driver = "595.12.01"
    assert doctor.readiness(nvml=nv, binding=FakeBinding(), machine="aarch64")["ready"]


def test_doctor_without_remap_support(bare_path: Path) -> None:
    nv = two_h200()
    nv.driver = "570.86.10"
    report = doctor.readiness(nvml=nv, binding=FakeBinding())
    assert report["ready"] is True
    assert "570.86.10 < 580" in report["deviceRemap"]["reason"]
    assert os.environ["PATH"] == str(bare_path)


def test_no_nvidia_module_is_imported_with_the_gpu_layer() -> None:
    code = (
        "import sys\n"
        "import cedana_shim.gpu.compat, cedana_shim.gpu.doctor\n"
        "import cedana_shim.gpu.orchestrator, cedana_shim.gpu.select\n"
        "loaded = [m for m in sys.modules if m == 'pynvml' or m.split('.')[0] == 'cuda']\n"
        "assert not loaded, loaded\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
