"""The job's stop without runc (slurm/job_signals.py): its init signalled and killed
through a pidfd opened at its start, with no descriptor left to open, and the job's
runc falling back to that when runc cannot run."""

from __future__ import annotations

import asyncio
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from cedana_shim.errors import NotFound
from cedana_shim.runtime.reaper import Reaper
from cedana_shim.slurm.job_signals import InitHandle, JobRunc

# In a process of its own (it gives up every descriptor): a child, a handle on it,
# no descriptor left to open, then the kill.
KILL_WITHOUT_DESCRIPTORS = """
import os, resource, signal, subprocess, sys
from cedana_shim.slurm.job_signals import InitHandle

child = subprocess.Popen(["sleep", "600"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
handle = InitHandle.open(child.pid, "/cedana-test-no-such-cgroup")
lowest = os.open(os.devnull, os.O_RDONLY)  # the lowest free number: all below are used
os.close(lowest)
resource.setrlimit(resource.RLIMIT_NOFILE, (lowest, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
try:
    os.open(os.devnull, os.O_RDONLY)
    child.kill()
    sys.exit("a descriptor could still be opened")
except OSError as err:
    opened = err.strerror
handle.kill()
_, status = os.waitpid(child.pid, 0)
print(opened, os.WTERMSIG(status) if os.WIFSIGNALED(status) else "exited", flush=True)
"""

RESERVE = """
import os, resource, subprocess
from cedana_shim.slurm.job_signals import FdReserve

reserve = FdReserve(16)
resource.setrlimit(resource.RLIMIT_NOFILE, (128, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
hoard = []
try:
    while True:
        hoard.append(os.open(os.devnull, os.O_RDONLY))
except OSError:
    pass
try:
    subprocess.run(["true"], check=True)
    print("ran without the reserve")
except OSError as err:
    print("no descriptor:", err.strerror)
reserve.release()
subprocess.run(["true"], check=True)
print("ran on the reserve", len(reserve), flush=True)
"""


def run_python(code: str) -> str:
    done = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60, check=False
    )
    assert done.returncode == 0, done.stderr
    return done.stdout


def test_the_job_is_killed_with_no_descriptor_left_to_open() -> None:
    assert run_python(KILL_WITHOUT_DESCRIPTORS) == f"Too many open files {signal.SIGKILL}\n"


def test_the_reserve_gives_a_process_out_of_descriptors_room_to_run_a_tool() -> None:
    assert run_python(RESERVE) == "no descriptor: Too many open files\nran on the reserve 0\n"


@pytest.fixture
def child() -> Iterator[subprocess.Popen[bytes]]:
    proc = subprocess.Popen(["sleep", "600"])
    yield proc
    proc.kill()
    proc.wait()


def test_a_signal_reaches_the_init_and_a_gone_one_is_not_found(
    child: subprocess.Popen[bytes],
) -> None:
    handle = InitHandle.open(child.pid, "")
    try:
        handle.deliver(signal.SIGTERM)
        assert child.wait(30) == -signal.SIGTERM
        with pytest.raises(NotFound, match=f"init {child.pid} is gone"):
            handle.deliver(signal.SIGTERM)  # a zombie reaped: the pidfd says so, no reuse
    finally:
        handle.close()


def test_the_jobs_runc_falls_back_to_the_init_when_runc_cannot_run(
    child: subprocess.Popen[bytes], tmp_path: Path
) -> None:
    async def main() -> None:
        runc = JobRunc(reaper=Reaper(asyncio.get_running_loop()), root=str(tmp_path),
                       binary=str(tmp_path / "no-runc"))  # fmt: skip
        with pytest.raises(Exception, match="cannot run"):
            await runc.kill("slurm-1.batch", signal.SIGUSR1)  # no init held: runc's error
        runc.init = InitHandle.open(child.pid, "")
        await runc.resume("slurm-1.batch")  # no freezer to thaw: nothing to do
        await runc.kill("slurm-1.batch", signal.SIGKILL, all=True)
        assert child.wait(30) == -signal.SIGKILL
        with pytest.raises(NotFound):
            await runc.kill("slurm-1.batch", signal.SIGKILL, all=True)
        runc.init.close()

    asyncio.run(main())
