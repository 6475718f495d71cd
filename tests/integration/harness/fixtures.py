"""The C programs of tests/integration/fixtures, built static: the test image has only
busybox, so a program a container runs is bind-mounted in."""

from __future__ import annotations

import subprocess
from pathlib import Path

FIXTURES = Path(__file__).resolve().parent.parent / "fixtures"


def build_static(name: str, out_dir: Path) -> Path:
    """fixtures/<name>.c built into out_dir/<name>."""
    out = out_dir / name
    subprocess.run(
        ["gcc", "-static", "-O2", "-o", str(out), str(FIXTURES / f"{name}.c")], check=True
    )
    return out
