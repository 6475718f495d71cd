"""`cedana doctor`'s cgroup lines: the node's cgroup version and driver, read from a
cgroup root and a /proc of our making."""

from __future__ import annotations

from pathlib import Path

import pytest
from cedana_shim.cli.admin_doctor import check_cgroups


def _node(tmp_path: Path, *, unified: bool, init: str) -> tuple[str, str]:
    root, proc = tmp_path / "cgroup", tmp_path / "proc"
    (proc / "1").mkdir(parents=True)
    (proc / "1" / "comm").write_text(f"{init}\n")
    if unified:
        root.mkdir()
        (root / "cgroup.controllers").write_text("cpuset cpu io memory pids\n")
    else:
        for controller in ("cpu", "memory", "systemd"):
            (root / controller).mkdir(parents=True)
    return str(root), str(proc)


@pytest.mark.parametrize(
    ("unified", "init", "version", "driver"),
    [
        (True, "systemd", 2, "systemd"),
        (True, "bash", 2, "cgroupfs"),
        (False, "tini", 1, "cgroupfs"),
    ],
)
def test_version_and_driver(
    tmp_path: Path, unified: bool, init: str, version: int, driver: str
) -> None:
    root, proc = _node(tmp_path, unified=unified, init=init)
    report = check_cgroups(root, proc)
    assert (report["version"], report["driver"]) == (version, driver)
    assert f"cgroup v{version}" in report["meaning"]
    assert ("SystemdCgroup = false" in report["meaning"]) == (driver == "cgroupfs")


def test_controllers_are_listed(tmp_path: Path) -> None:
    root, proc = _node(tmp_path, unified=True, init="systemd")
    assert check_cgroups(root, proc)["controllers"] == ["cpuset", "cpu", "io", "memory", "pids"]
    root, proc = _node(tmp_path / "v1", unified=False, init="systemd")
    assert check_cgroups(root, proc)["controllers"] == ["cpu", "memory", "systemd"]
