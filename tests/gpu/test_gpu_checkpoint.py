"""The real-GPU check under pytest: runs gpu_check.py (the same script the GPU node runs
standalone) in a child process, so a wedged driver cannot take pytest down with it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import gpu_check
import pytest

pytestmark = pytest.mark.gpu


def test_checkpoint_and_restore_on_a_real_gpu(tmp_path: Path) -> None:
    reason = gpu_check.no_gpu_reason()
    if reason is None and gpu_check.pick_lib() is None:
        reason = "neither PyTorch nor CuPy is installed"
    if reason is not None:
        pytest.skip(f"no NVIDIA GPU/driver: {reason}")

    out = tmp_path / "gpu_check.json"
    done = subprocess.run(
        [sys.executable, gpu_check.__file__, "--json", str(out), "--log-dir", str(tmp_path)],
        capture_output=True,
        text=True,
        timeout=240,  # the script's own watchdog fires at 170 s
    )
    results = json.loads(out.read_text()) if out.exists() else {}
    failed = [c for c in results.get("checks", []) if c["required"] and not c["ok"]]
    assert done.returncode == 0, f"{done.stdout[-6000:]}\n{done.stderr[-3000:]}\n{failed}"
    assert results["ok"] is True
