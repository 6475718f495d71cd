"""The Slurm job's pid 1 (job_spec.INIT_SCRIPT), run as pid 1 of a PID namespace of
its own, as runc runs it: it passes a signal on to the job and exits with the job's
own status, whatever the order in which the job's exit and the signal's trap land."""

from __future__ import annotations

import signal
import subprocess
from pathlib import Path

from cedana_shim.slurm.job_spec import INIT_ARGV0, INIT_SCRIPT, SHELL

ROUNDS = 60  # the old init lost the job's status in ~1 of 6 here (dash reaped it first)


def run_job(job: str, sig: int | None) -> int:
    """Start ``job`` (a sh script that prints a line once its traps are set) under
    the init in a new PID namespace, send ``sig`` to the init, return its status."""
    init = [SHELL, "-c", INIT_SCRIPT, INIT_ARGV0]
    proc = subprocess.Popen(
        ["unshare", "--fork", "--pid", "--kill-child", *init, SHELL, "-c", job],
        stdout=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,  # the shells' "Terminated"
    )
    assert proc.stdout is not None
    try:
        assert proc.stdout.readline() == b"ready\n"
        children = Path(f"/proc/{proc.pid}/task/{proc.pid}/children").read_text().split()
        assert len(children) == 1, children  # the init, pid 1 of the new namespace
        if sig is not None:
            subprocess.run(["kill", f"-{sig}", children[0]], check=True)
        return proc.wait(10)
    finally:
        proc.kill()
        proc.wait()
        proc.stdout.close()


def test_the_jobs_own_status_after_a_trapped_signal() -> None:
    job = 'trap "exit 99" TERM; echo ready; while :; do sleep 0.01; done'
    statuses = [run_job(job, signal.SIGTERM) for _ in range(ROUNDS)]
    assert statuses == [99] * ROUNDS


def test_a_job_the_signal_ends_reads_128_plus_the_signal() -> None:
    job = "echo ready; while :; do sleep 0.01; done"
    assert run_job(job, signal.SIGTERM) == 128 + signal.SIGTERM
    assert run_job(job, signal.SIGUSR1) == 128 + signal.SIGUSR1


def test_a_job_that_ends_by_itself_reads_its_exit_code() -> None:
    assert run_job("echo ready; exit 7", None) == 7
