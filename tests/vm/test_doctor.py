"""`cedana doctor` on the node kind real clusters run: it says cgroup v2, the systemd
driver, dirty-page tracking and CAP_SYS_RESOURCE (the project's host has none of them)."""

from __future__ import annotations

import json
import subprocess
from typing import Any

from integration.harness.config import SHIM_BIN_DIR


def test_doctor_reports_cgroup_v2_systemd_dirty_tracking_and_sys_resource() -> None:
    done = subprocess.run(
        [str(SHIM_BIN_DIR / "cedana"), "doctor", "--json"],
        capture_output=True,
        text=True,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    report: dict[str, Any] = json.loads(done.stdout)
    assert report["cgroups"]["version"] == 2, report["cgroups"]
    assert report["cgroups"]["driver"] == "systemd", report["cgroups"]
    assert report["criu"]["features"]["dirtyTracking"]["available"] is True, report["criu"]
    assert report["capabilities"]["sysResource"]["available"] is True, report["capabilities"]
    text = subprocess.run(
        [str(SHIM_BIN_DIR / "cedana"), "doctor"], capture_output=True, text=True, timeout=600
    ).stdout
    assert "cgroup v2 (unified), managed by systemd" in text, text
    assert "the kernel tracks dirty pages" in text, text
