"""Slurm as sites run it on cgroup v2 nodes: `CgroupPlugin=cgroup/v2`,
`ProctrackType=proctrack/cgroup`, `TaskPlugin=task/cgroup` (cores and memory
constrained), and a job of an ordinary user with the one `--export` line.

Preempted by a job on the high partition, the user's job is checkpointed (CRIU dumps
another user's processes: root here has CAP_SYS_RESOURCE), requeued and, run again,
resumes its count; the restored job lives in the new run's step cgroup, under the
memory limit Slurm set there.
"""

from __future__ import annotations

import contextlib
import shutil
import tempfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from integration.harness import procs
from integration.harness.slurm import (
    SlurmCluster,
    User,
    counter_script,
    counters,
    ensure_user,
    require_slurm,
)
from integration.harness.slurm_jobs import VICTIM_EXPORT, Protected, wait_nothing_left

from .nodes import TIMEOUT, cgroup_dir, cgroup_of

# Slurm's grace before its SIGKILL (MAX(KillWait, 5) s): the checkpoint fits in it here.
KILL_WAIT = 120


LOGS = ("slurmd.log", "slurmd.stderr", "slurmctld.log")


def _tail(path: Path, lines: int = 30) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError as err:
        return str(err)


class CgroupV2Cluster(SlurmCluster):
    """The harness's cluster with proctrack/cgroup and task/cgroup on cgroup/v2."""

    def _write_conf(self) -> None:
        super()._write_conf()
        (self.etc / "cgroup.conf").write_text(
            "CgroupPlugin=cgroup/v2\nCgroupMountpoint=/sys/fs/cgroup\n"
            "ConstrainCores=yes\nConstrainRAMSpace=yes\nConstrainDevices=no\n"
        )


@pytest.fixture(scope="module")
def cluster() -> Iterator[SlurmCluster]:
    require_slurm()
    workdir = Path(tempfile.mkdtemp(prefix="cedana-slurm-v2-"))
    workdir.chmod(0o755)
    c = CgroupV2Cluster(workdir, kill_wait=KILL_WAIT, proctrack="cgroup")
    try:
        try:
            c.start()
        except AssertionError as err:
            logs = {name: _tail(workdir / "log" / name) for name in LOGS}
            shown = "\n".join(f"-- {name}:\n{text}" for name, text in logs.items())
            raise AssertionError(f"{err}\n{shown}") from None
        yield c
    finally:
        notes = c.stop()
        if notes:
            print("[slurm teardown] " + "; ".join(notes))
        shutil.rmtree(workdir, ignore_errors=True)


@pytest.fixture(scope="module")
def user(cluster: SlurmCluster) -> User:
    home = cluster.dir / "home"
    home.mkdir(mode=0o755, exist_ok=True)
    return ensure_user("cedana-slurm-a", home)


@pytest.fixture
def protected(cluster: SlurmCluster, tmp_path: Path) -> Iterator[Protected]:
    p = Protected(cluster, tmp_path / "prefix")
    p.install()
    yield p
    cluster.cancel_all()
    p.uninstall()


def _job_cgroup(job_id: int) -> Path:
    """Slurm's cgroup/v2 cgroup of the job (`…/job_<id>`)."""
    found = sorted(cgroup_dir("/").rglob(f"job_{job_id}"))
    assert len(found) == 1, f"job {job_id}'s cgroups: {found}"
    return found[0]


RUNNER = "cedana-slurm-task"


def _scripts(pids: set[int]) -> dict[int, tuple[str, str]]:
    """Those of `pids` that run a Slurm batch script: pid -> (command line, cgroup)."""
    found = {}
    for pid in pids:
        argv = procs.read_argv(pid)
        if argv and any(arg.endswith("/slurm_script") for arg in argv):
            with contextlib.suppress(AssertionError, FileNotFoundError):
                found[pid] = (" ".join(argv), cgroup_of(pid))
    return found


def test_a_users_preempted_job_resumes_in_its_new_step_cgroup(
    cluster: SlurmCluster, user: User, protected: Protected
) -> None:
    name = "v2-victim"
    script = cluster.write_script(
        f"{name}.sh",
        counter_script(f"{name}.out", export=VICTIM_EXPORT, options=("--exclusive", "--requeue")),
        user,
    )
    victim = cluster.sbatch(script, "--partition=low", user=user)
    cluster.wait_state(victim, "RUNNING", timeout=TIMEOUT)
    cluster.wait_output(f"{name}.out", r"^Counter: 3$", timeout=TIMEOUT)

    preemptor = cluster.write_script(
        f"{name}-preemptor.sh",
        counter_script(f"{name}-preemptor.out", export=None, seconds=3, options=("--exclusive",)),
    )
    pre_id = cluster.sbatch(preemptor, "--partition=high")
    cluster.wait_state(victim, "PENDING", "REQUEUED", "COMPLETING", timeout=TIMEOUT)
    before = max(counters(cluster.output(f"{name}.out")))
    protected.wait_checkpoint(user.name, "victim")
    cluster.wait_state(pre_id, "COMPLETED", timeout=TIMEOUT)

    # The requeue, and the run again (the harness's steps, with the guest's timeouts).
    fields = cluster.wait_state(victim, "PENDING", timeout=KILL_WAIT + TIMEOUT)
    assert fields["Restarts"] == "1", fields
    wait_nothing_left(victim, timeout=TIMEOUT)
    cluster.release(victim)
    cluster.wait_state(victim, "RUNNING", timeout=TIMEOUT)
    text = cluster.wait_output(f"{name}.out", rf"^Counter: {before + 3}$", timeout=TIMEOUT)
    values = counters(text)
    # Slurm truncates the output file when the requeued job starts again (its default
    # open mode); the restored count then goes on in it.
    after = values[values.index(before) + 1 :] if before in values else values
    assert after and 0 not in after and after[0] > before - 3, (
        f"the job did not resume its count (ended at {before} before the preemption): {after}"
    )

    # The restored batch shell (it counts on) is in the new run's step cgroup, under
    # the memory limit Slurm (ConstrainRAMSpace) set on the job's.
    job = _job_cgroup(victim)
    step = "/" + str((job / "step_batch").relative_to(cgroup_dir("/")))
    running = _scripts({p.pid for p in procs.list_processes()})
    outside = {
        pid: seen for pid, seen in running.items() if not f"{seen[1]}/".startswith(f"{step}/")
    }
    assert running and not outside, f"batch scripts outside {step}: {outside} (all: {running})"
    # The job's own processes run as its user; the task process that execs the runner
    # (its argv ends with the script too) is root's.
    shells = {
        pid
        for pid, (argv, _) in running.items()
        if not any(Path(arg).name == RUNNER for arg in argv.split())
    }
    assert shells, f"no batch shell among {running}"
    for pid in shells:
        uid = Path(f"/proc/{pid}/status").read_text().split("Uid:")[1].split()[0]
        assert uid == str(user.uid), (pid, uid, running[pid])
    limit = (job / "memory.max").read_text().strip()
    assert limit.isdigit(), f"Slurm set no memory limit on {job}: {limit}"
