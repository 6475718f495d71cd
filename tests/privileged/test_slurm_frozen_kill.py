"""The job's SIGKILL without runc (slurm/job_signals.py) on a real freezer cgroup: a
job frozen for its checkpoint takes the kill, with no descriptor left to open.

Under cgroup v1 a frozen task sits on a pending SIGKILL until its cgroup thaws (it
shows in state D); cgroup v2 lets the SIGKILL through. The handle thaws either way."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from cedana_shim.slurm import cgroups

# In a process of its own (it gives up every descriptor): the handle of a frozen
# child, no descriptor left to open, then the kill.
KILL_FROZEN = """
import os, resource, sys
from cedana_shim.slurm.job_signals import InitHandle

pid, cgroup = int(sys.argv[1]), sys.argv[2]
handle = InitHandle.open(pid, cgroup)
lowest = os.open(os.devnull, os.O_RDONLY)
os.close(lowest)
resource.setrlimit(resource.RLIMIT_NOFILE, (lowest, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
try:
    os.open(os.devnull, os.O_RDONLY)
    sys.exit("a descriptor could still be opened")
except OSError:
    pass
handle.kill()
"""


@pytest.fixture
def frozen() -> Iterator[tuple[subprocess.Popen[bytes], str]]:
    """A child in a freezer cgroup of its own, frozen: (child, cgroup)."""
    mounted = {h.key: h for h in cgroups.hierarchies()}
    hierarchy = mounted.get("freezer") or mounted.get("")
    assert hierarchy is not None, "no cgroup v1 freezer nor cgroup v2 mounted"
    name, frozen_value = ("freezer.state", "FROZEN") if hierarchy.key else ("cgroup.freeze", "1")
    cgroup = f"/cedana-test-{uuid.uuid4().hex[:8]}"
    path = Path(hierarchy.path(cgroup))
    path.mkdir()
    child = subprocess.Popen(["sleep", "600"])
    try:
        (path / "cgroup.procs").write_text(str(child.pid))
        (path / name).write_text(frozen_value)
        events = path / ("freezer.state" if hierarchy.key else "cgroup.events")
        deadline = time.monotonic() + 30
        while "FROZEN" not in events.read_text() and "frozen 1" not in events.read_text():
            assert time.monotonic() < deadline, f"{path} does not freeze"
            time.sleep(0.02)
        yield child, cgroup
    finally:
        child.kill()
        (path / name).write_text("THAWED" if hierarchy.key else "0")
        child.wait()
        path.rmdir()


def test_a_frozen_job_is_killed_and_thawed_with_no_descriptor_left(
    frozen: tuple[subprocess.Popen[bytes], str],
) -> None:
    child, cgroup = frozen
    done = subprocess.run(
        [sys.executable, "-c", KILL_FROZEN, str(child.pid), cgroup],
        capture_output=True, text=True, timeout=60, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert child.wait(30) == -9
    assert not os.path.exists(f"/proc/{child.pid}")
