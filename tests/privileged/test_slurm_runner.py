"""The Slurm job runner for real (runc, CRIU, the store), without Slurm.

The runner is started as the SPANK plugin execs it (the contract's argv, the job's
environment), and Slurm's signals are sent as proctrack/linuxproc sends them: to
the task process and every process below it, all at once (kill_proc_tree).

CRIU reads a task's rlimits with prlimit(), which for a task of another user
needs CAP_SYS_RESOURCE; this test machine's root lacks it, so the jobs that are
checkpointed run as root here (on a compute node root has it).
"""

from __future__ import annotations

import contextlib
import json
import os
import resource
import shutil
import signal
import socket
import struct
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from cedana_shim.checkpoint.store import Store, StoreConfig
from cedana_shim.cli.fork_client import answers
from cedana_shim.cli.paths import code_fingerprint, forkserver_socket_path
from cedana_shim.cli.slurm_task import KIND
from cedana_shim.slurm import cgroups
from cedana_shim.slurm.control import RUN_DIR, request, socket_path
from support.processes import proc_stats

CLUSTER = "testcluster"
ROOT_SCOPE = f"slurm-{CLUSTER}-root"
# The batch script: a counter that says so if it ever gets SIGTERM.
COUNTER = """#!/bin/bash
trap 'echo GOT-TERM; exit 99' TERM
i=0
while true; do echo "Counter: $i"; i=$((i+1)); sleep 0.1; done
"""
RUNNER = "import sys; from cedana_shim.cli.slurm_task import main; sys.exit(main())"


@dataclass
class Job:
    job_id: str
    proc: subprocess.Popen[bytes]
    out: Path
    err: Path

    @property
    def name(self) -> str:
        return f"{self.job_id}.batch"

    def lines(self) -> list[str]:
        return self.out.read_text().splitlines()

    def stderr(self) -> str:
        return self.err.read_text()


@dataclass
class Node:
    tmp: Path
    config: Path
    store: Path
    jobs: list[Job]

    def start(
        self,
        argv: list[str],
        *,
        uid: int = 0,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        preexec: Callable[[], None] | None = None,
    ) -> Job:
        job_id = str(900_000_000 + int(uuid.uuid4().int % 99_999_999))
        out, err = self.tmp / f"{job_id}.out", self.tmp / f"{job_id}.err"
        job_env = {"PATH": "/usr/bin:/bin", "SLURM_CLUSTER_NAME": CLUSTER, "CEDANA_SLURM": "1"}
        job_env.update(env or {})
        with out.open("wb") as o, err.open("wb") as e:
            proc = subprocess.Popen(
                [
                    *(sys.executable, "-c", RUNNER, "--job-id", job_id, "--step-id", "batch"),
                    *("--uid", str(uid), "--gid", str(uid), "--cwd", cwd or str(self.tmp)),
                    *("--config", str(self.config), "--", *argv),
                ],
                stdout=o,
                stderr=e,
                env=job_env,
                cwd=str(self.tmp),
                preexec_fn=preexec,
            )
        job = Job(job_id, proc, out, err)
        self.jobs.append(job)
        return job

    def counter(self, label: str) -> Job:
        script = self.tmp / "counter.sh"
        script.write_text(COUNTER)
        script.chmod(0o755)
        return self.start([str(script)], env={"CEDANA_CHECKPOINT": label})

    def checkpoints(self, scope: str, label: str) -> list[str]:
        store = Store(StoreConfig(root=str(self.store)))
        return [e.id for e in store.reader.candidates(scope, label)]


def descendants(top: int) -> list[int]:
    children: dict[int, list[int]] = {}
    for pid, fields in proc_stats():
        children.setdefault(int(fields[1]), []).append(pid)
    found, todo = [], [top]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def slurm_signal(job: Job, sig: int) -> None:
    """What slurmstepd does with proctrack/linuxproc: the task and its whole tree."""
    for pid in [job.proc.pid, *descendants(job.proc.pid)]:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, sig)


def wait_for(predicate: Callable[[], bool], timeout: float = 30.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what or predicate}"
        time.sleep(0.05)


def processes_of(job: Job) -> list[int]:
    """Every process whose command line names this job (runner, keeper, job)."""
    return job_processes(job.job_id, f"slurm-{job.name}")


def job_processes(*markers: str) -> list[int]:
    """Every process whose command line holds one of ``markers``."""
    found = []
    for pid, _ in proc_stats():
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if any(m.encode() in cmdline for m in markers):
            found.append(pid)
    return found


# The runner's warm template (the fork server of kind slurm) serving this checkout.
def template_socket() -> Path:
    """The socket of the template serving this checkout's code."""
    return Path(forkserver_socket_path(code_fingerprint(), KIND))


def template_pid() -> int | None:
    """The pid of the template serving this checkout's code, if one answers."""
    path = template_socket()
    if not answers(str(path)):
        return None
    with contextlib.suppress(OSError), socket.socket(socket.AF_UNIX) as s:
        s.connect(str(path))
        creds = s.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        pid: int = struct.unpack("3i", creds)[0]
        return pid
    return None


def stop_template(timeout: float = 10.0) -> None:
    """SIGTERM the template (it ends between requests and removes its socket)."""
    pid = template_pid()
    if pid is None:
        return
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + timeout
    while template_socket().exists() and time.monotonic() < deadline:
        time.sleep(0.05)


@pytest.fixture(scope="module", autouse=True)
def warm_template(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Jobs start from the runner's warm template (as on a node after its first
    protected job); the cold path is tested on its own. Stopped at the end."""
    tmp = tmp_path_factory.mktemp("template")
    tmp.chmod(0o755)
    config = tmp / "shim.toml"
    config.write_text(f'store_path = "{tmp / "store"}"\n')
    first = Node(tmp, config, tmp / "store", []).start(["/bin/true"], env={"CEDANA_ENABLE": "1"})
    assert first.proc.wait(60) == 0, first.stderr()
    wait_for(lambda: template_pid() is not None, what="the runner's warm template")
    yield
    stop_template()


@pytest.fixture
def node(tmp_path: Path) -> Iterator[Node]:
    for tool in ("runc", "criu"):
        assert shutil.which(tool), f"{tool} is not installed"
    tmp_path.chmod(0o755)
    store = tmp_path / "store"
    config = tmp_path / "shim.toml"
    config.write_text(
        f'store_path = "{store}"\nlog_file = "{tmp_path / "shim.log"}"\n'
        f'hooks_dirs = "{tmp_path / "hooks.d"}"\n'
    )
    n = Node(tmp_path, config, store, [])
    try:
        yield n
    finally:
        for job in n.jobs:
            for pid in processes_of(job):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                job.proc.wait(10)
            subprocess.run(
                ["runc", "--root", f"{RUN_DIR}/runc", "delete", "--force", f"slurm-{job.name}"],
                capture_output=True,
                check=False,
            )


def test_sigterm_checkpoints_before_the_job_sees_it_and_a_requeue_continues(node: Node) -> None:
    label = f"victim-{uuid.uuid4().hex[:8]}"
    first = node.counter(label)
    wait_for(lambda: len(first.lines()) >= 10, what="the first run's output")
    slurm_signal(first, signal.SIGTERM)
    assert first.proc.wait(60) == 128 + signal.SIGTERM, first.stderr()
    assert "GOT-TERM" not in first.lines(), "the job saw SIGTERM before its checkpoint"
    saved = node.checkpoints(ROOT_SCOPE, label)
    assert len(saved) == 1, first.stderr()
    assert f"checkpoint {saved[0]} committed (stop" in first.stderr()
    assert "starting cold: no checkpoint for this label" in first.stderr()
    # The keeper compresses the checkpoint after the job's exit, then ends too.
    wait_for(lambda: not processes_of(first), what="the first run's processes to end")

    second = node.counter(label)  # the requeued job: same label, same user
    wait_for(lambda: len(second.lines()) >= 3, what="the restored run's output")
    assert f"cedana: restored from {saved[0]} (label {label})" in second.stderr()
    last = int(first.lines()[-1].split()[-1])
    assert second.lines()[0] == f"Counter: {last + 1}", (first.lines()[-2:], second.lines()[:2])
    slurm_signal(second, signal.SIGTERM)
    assert second.proc.wait(60) == 128 + signal.SIGTERM, second.stderr()
    assert "GOT-TERM" not in second.lines()
    assert len(node.checkpoints(ROOT_SCOPE, label)) == 2


def test_another_users_job_with_the_same_label_starts_cold(node: Node) -> None:
    label = f"shared-{uuid.uuid4().hex[:8]}"
    owner = node.counter(label)
    wait_for(lambda: len(owner.lines()) >= 3, what="the owner's output")
    slurm_signal(owner, signal.SIGTERM)
    assert owner.proc.wait(60) == 128 + signal.SIGTERM, owner.stderr()
    assert node.checkpoints(ROOT_SCOPE, label)

    other = node.start(
        ["/bin/sh", "-c", "echo cold start as $(id -u); exit 3"],
        uid=65534,
        env={"CEDANA_CHECKPOINT": label},
        cwd="/",
    )
    assert other.proc.wait(60) == 3, other.stderr()  # the job's own exit status
    assert other.lines() == ["cold start as 65534"]
    assert "cedana: starting cold: no checkpoint for this label" in other.stderr()
    assert "restored" not in other.stderr()


def test_sigkill_of_the_runner_mid_checkpoint_leaves_nothing(node: Node) -> None:
    """KillWait ran out: the checkpoint in progress (CRIU's images staged, the
    postcheckpoint hook still running) is abandoned and the job is killed."""
    marker = node.tmp / "in-checkpoint"
    hook = node.tmp / "slow-hook"
    # The abandoned dump runs the stage again to say it failed: that run is quick.
    hook.write_text(f"#!/bin/sh\ngrep -q failed && exit 0\ntouch {marker}\nexec sleep 60\n")
    hook.chmod(0o755)
    (node.tmp / "hooks.d").mkdir()
    (node.tmp / "hooks.d" / "slow.json").write_text(
        json.dumps(
            {
                "version": "1.0.0",
                "hook": {"path": str(hook), "timeout": 120},
                "when": {"always": True},
                "stages": ["postcheckpoint"],
            }
        )
    )
    label = f"killed-{uuid.uuid4().hex[:8]}"
    job = node.counter(label)
    wait_for(lambda: len(job.lines()) >= 3, what="the job's output")
    slurm_signal(job, signal.SIGTERM)
    wait_for(marker.exists, what="the checkpoint to reach its postcheckpoint hook")
    slurm_signal(job, signal.SIGKILL)  # what reaches the step's tree: the task process
    assert job.proc.wait(10) == -signal.SIGKILL
    wait_for(lambda: not os.path.exists(socket_path(job.name)), what="the keeper to finish")
    wait_for(lambda: not processes_of(job), what="the job's processes to be gone")
    assert "GOT-TERM" not in job.lines()
    # Nothing after the step's end: its output file may be the requeued job's by then.
    assert "checkpoint failed" not in job.stderr()
    store = Store(StoreConfig(root=str(node.store)))
    assert store.reader.candidates(ROOT_SCOPE, label) == []
    assert store.reader.in_flight(ROOT_SCOPE, label) == []
    assert os.listdir(node.store / "ingest") == []


def test_on_demand_checkpoint_through_the_control_socket(node: Node) -> None:
    label = f"ondemand-{uuid.uuid4().hex[:8]}"
    job = node.counter(label)
    wait_for(lambda: os.path.exists(socket_path(job.name)), what="the control socket")
    status = request(socket_path(job.name), {"op": "status"})
    assert (status["job"], status["label"], status["state"]) == (job.job_id, label, "running")
    reply = request(socket_path(job.name), {"op": "checkpoint"})
    assert node.checkpoints(ROOT_SCOPE, label) == [reply["checkpoint"]]
    before = len(job.lines())
    wait_for(lambda: len(job.lines()) > before + 2, what="the job to go on after it")
    slurm_signal(job, signal.SIGUSR1)  # not a stop signal: passed on, job ends as usual
    job_exit = job.proc.wait(30)
    assert job_exit == 128 + signal.SIGUSR1, job.stderr()


def test_restore_by_hand_from_an_on_demand_checkpoint(node: Node) -> None:
    """CEDANA_ENABLE=1 only: no checkpoint on SIGTERM, and CEDANA_RESTORE=<id> (what
    `cedana slurm restore` exports) starts a new job from the one asked for."""
    script = node.tmp / "counter.sh"
    script.write_text(COUNTER)
    script.chmod(0o755)
    first = node.start([str(script)], env={"CEDANA_ENABLE": "1"})
    wait_for(lambda: os.path.exists(socket_path(first.name)), what="the control socket")
    wait_for(lambda: len(first.lines()) >= 3, what="the first run's output")
    checkpoint = request(socket_path(first.name), {"op": "checkpoint"})["checkpoint"]
    at = len(first.lines())
    slurm_signal(first, signal.SIGTERM)  # no label: the job gets it, as without us
    assert first.proc.wait(30) == 99, first.stderr()
    assert first.lines()[-1] == "GOT-TERM"

    second = node.start([str(script)], env={"CEDANA_ENABLE": "1", "CEDANA_RESTORE": checkpoint})
    wait_for(lambda: len(second.lines()) >= 2, what="the restored run's output")
    assert f"cedana: restored from {checkpoint}" in second.stderr()
    resumed = int(second.lines()[0].split()[-1])
    assert at - 2 <= resumed <= at + 1, (at, second.lines()[:2])
    slurm_signal(second, signal.SIGKILL)
    wait_for(lambda: not processes_of(second), what="the restored job to be killed")


def test_sigterm_while_the_job_is_being_restored_waits_for_it(node: Node) -> None:
    """Preempted again before the restore finished: the signal is not lost; the
    restored job is checkpointed and stopped as soon as it runs."""
    label = f"early-{uuid.uuid4().hex[:8]}"
    first = node.counter(label)
    wait_for(lambda: len(first.lines()) >= 3, what="the first run's output")
    slurm_signal(first, signal.SIGTERM)
    assert first.proc.wait(60) == 128 + signal.SIGTERM, first.stderr()
    wait_for(lambda: not processes_of(first), what="the first run's processes to end")

    marker = node.tmp / "restoring"
    hook = node.tmp / "slow-prerestore"
    hook.write_text(f"#!/bin/sh\ncat >/dev/null\ntouch {marker}\nsleep 2\n")
    hook.chmod(0o755)
    (node.tmp / "hooks.d").mkdir()
    (node.tmp / "hooks.d" / "slow.json").write_text(
        json.dumps(
            {
                "version": "1.0.0",
                "hook": {"path": str(hook), "timeout": 60},
                "when": {"always": True},
                "stages": ["prerestore"],
            }
        )
    )
    second = node.counter(label)
    wait_for(marker.exists, what="the restore to begin")
    slurm_signal(second, signal.SIGTERM)
    assert second.proc.wait(60) == 128 + signal.SIGTERM, second.stderr()
    assert "cedana: restored from" in second.stderr()
    assert "committed (stop" in second.stderr()
    assert "GOT-TERM" not in second.lines()
    assert len(node.checkpoints(ROOT_SCOPE, label)) == 2


def test_a_missing_command_fails_as_it_would_without_us(node: Node) -> None:
    job = node.start(["/nonexistent/program"], env={"CEDANA_ENABLE": "1"})
    assert job.proc.wait(30) == 127
    assert "/nonexistent/program: not found" in job.stderr()


def test_a_job_that_cannot_start_fails_with_the_reason_and_leaves_nothing(node: Node) -> None:
    job = node.start(["/bin/true"], env={"CEDANA_ENABLE": "1"}, cwd="/nonexistent-cwd")
    assert job.proc.wait(30) == 125
    assert (
        f"cedana: cannot run job {job.name}: the job's working directory /nonexistent-cwd "
        "does not exist"
    ) in job.stderr()
    assert not os.path.exists("/nonexistent-cwd")  # runc would have made it
    wait_for(lambda: not processes_of(job), what="the runner's processes to end")
    listed = subprocess.run(
        ["runc", "--root", f"{RUN_DIR}/runc", "list", "-q"], capture_output=True, check=True
    )
    assert f"slurm-{job.name}".encode() not in listed.stdout
    assert not os.path.exists(f"{RUN_DIR}/bundles/{job.name}")
    assert not os.path.exists(socket_path(job.name))


def test_a_job_whose_keeper_died_is_killed_by_the_next_runner_on_the_node(node: Node) -> None:
    marker = f"orphan-{uuid.uuid4().hex[:8]}"

    def orphans() -> list[int]:  # the job's processes, not the runner's
        return [
            pid
            for pid in job_processes(marker)
            if RUNNER.encode() not in Path(f"/proc/{pid}/cmdline").read_bytes()
        ]

    job = node.start(["/bin/sh", "-c", f"sleep 600; : {marker}"], env={"CEDANA_ENABLE": "1"})
    wait_for(lambda: os.path.exists(socket_path(job.name)), what="the control socket")
    keeper = request(socket_path(job.name), {"op": "status"})["runner_pid"]
    os.kill(keeper, signal.SIGKILL)  # not the task process: nothing kills the job now
    assert job.proc.wait(30) == 125  # the task process learns its keeper is gone
    assert "keeper process died" in job.stderr()
    time.sleep(0.5)
    assert orphans(), "the job died with its keeper: nothing left to test"

    next_job = node.start(["/bin/true"], env={"CEDANA_ENABLE": "1"})
    assert next_job.proc.wait(30) == 0, next_job.stderr()
    wait_for(lambda: not orphans(), what="the orphaned job to be killed")
    assert not os.path.exists(f"{RUN_DIR}/bundles/{job.name}")
    assert not os.path.exists(socket_path(job.name))


@pytest.mark.cgroup_v1  # the task's v1 memory cgroup
@pytest.mark.parametrize("path", ["template", "cold"])
def test_the_job_gets_what_slurm_set_on_the_task_and_its_cgroups_go_with_it(
    node: Node, path: str
) -> None:
    """Umask, rlimits, OOM score and cgroup are the task process's, whichever process
    forked the keeper; the keeper itself sits in the root cgroups (Slurm's
    proctrack/cgroup kills what is in the step's); every cgroup directory runc made
    for the job is gone after it."""
    if path == "template":
        assert template_pid() is not None
    task_cg = f"cedana-test-{uuid.uuid4().hex[:8]}"  # the task's memory cgroup only
    memory = Path("/sys/fs/cgroup/memory") / task_cg
    memory.mkdir()

    def as_slurm_sets_the_task() -> None:
        os.umask(0o027)
        resource.setrlimit(resource.RLIMIT_NOFILE, (777, 4096))
        Path("/proc/self/oom_score_adj").write_text("123")
        (memory / "cgroup.procs").write_text(str(os.getpid()))

    try:
        job = node.start(
            ["/bin/sh", "-c", 'echo "$(umask) $(ulimit -n) $(cat /proc/self/oom_score_adj)"; '
             "cat /proc/self/cgroup; exec sleep 600"],
            env={"CEDANA_ENABLE": "1", **({"CEDANA_FORKSERVER": "0"} if path == "cold" else {})},
            preexec=as_slurm_sets_the_task,
        )  # fmt: skip
        wait_for(lambda: os.path.exists(socket_path(job.name)), what="the control socket")
        wait_for(lambda: len(job.lines()) > 3, what="the job's output")
        assert job.lines()[0] == "0027 777 123", job.stderr()
        container = f"/{task_cg}/cedana-slurm-{job.name}"
        assert f"4:memory:{container}" in job.lines(), job.lines()
        keeper = request(socket_path(job.name), {"op": "status"})["runner_pid"]
        for line in Path(f"/proc/{keeper}/cgroup").read_text().splitlines():
            assert line.endswith(":/"), f"the keeper is not in a root cgroup: {line}"
        made = [h.path(f"/{task_cg}") for h in cgroups.hierarchies() if h.key != "memory"]
        assert made and all(os.path.isdir(d) for d in made)  # runc's mkdir -p

        slurm_signal(job, signal.SIGUSR1)
        assert job.proc.wait(30) == 128 + signal.SIGUSR1, job.stderr()
        assert [d for d in made if os.path.exists(d)] == [], "runc's cgroup dirs stayed"
        assert [p.name for p in memory.iterdir() if p.is_dir()] == []
    finally:
        with contextlib.suppress(OSError):
            memory.rmdir()
