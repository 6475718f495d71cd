"""Slurm batch jobs on a node with `cedana slurm install`: the SPANK plugin hands
an opted-in batch step to the runner (as root, in the task's own process, with the
contract's arguments) and leaves every other job exactly as Slurm runs it."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator
from pathlib import Path

import pytest

from .harness.config import SHIM_BIN_DIR
from .harness.slurm import (
    CLUSTER_NAME,
    TEST_USERS,
    SlurmCluster,
    User,
    cedana,
    counter_script,
    counters,
    ensure_user,
    runner_record,
    running_cluster,
    write_fake_runner,
)
from .harness.util import wait_for

SHIM_CONFIG = Path("/etc/cedana/slurm-itest.toml")
PROBE = """\
#!/bin/bash
#SBATCH --output={output}
{export}
echo "uid=$(id -u) gid=$(id -g) cwd=$(pwd) pid=$$"
echo "$(grep -E '^Cap(Prm|Eff)' /proc/self/status | tr -s '\\t' ' ' | tr '\\n' ' ')"
echo "restarts=${{SLURM_RESTART_COUNT:-0}} job=$SLURM_JOB_ID path=${{PATH:+set}}"
"""


class Node:
    def __init__(self, cluster: SlurmCluster, prefix: Path) -> None:
        self.cluster = cluster
        self.prefix = prefix
        self.records = cluster.dir / "records"
        self.records.mkdir(exist_ok=True)
        self.runner = write_fake_runner(cluster.dir / "fake-runner", self.records)

    def install(self, *more: str) -> None:
        done = cedana(
            "slurm",
            "install",
            "--node-role",
            "worker",
            "--slurm-conf",
            str(self.cluster.conf),
            "--prefix",
            str(self.prefix),
            "--runner",
            str(self.runner),
            *more,
        )
        assert done.returncode == 0, done.stderr

    def uninstall(self) -> None:
        done = cedana(
            "slurm",
            "uninstall",
            "--slurm-conf",
            str(self.cluster.conf),
            "--prefix",
            str(self.prefix),
        )
        assert done.returncode == 0, done.stderr

    def run_probe(self, name: str, export: str | None, user: User) -> tuple[int, dict[str, str]]:
        """Run the probe script to completion; its job id and what it printed."""
        line = f"#SBATCH --export={export}" if export else ""
        script = self.cluster.write_script(
            f"{name}.sh", PROBE.format(output=f"{name}.out", export=line), user
        )
        job_id = self.cluster.sbatch(script, user=user)
        fields = self.cluster.wait_state(job_id, "COMPLETED", "FAILED", timeout=60)
        assert fields["JobState"] == "COMPLETED", (fields, self.cluster.output(f"{name}.out"))
        printed: dict[str, str] = {}
        for word in self.cluster.output(f"{name}.out").split():
            key, sep, value = word.partition("=")
            if sep:
                printed[key] = value
            elif word.endswith(":"):
                printed["_cap"] = word[:-1]
            elif "_cap" in printed:
                printed[printed.pop("_cap")] = word
        return job_id, printed


@pytest.fixture(scope="module")
def cluster() -> Iterator[SlurmCluster]:
    with running_cluster() as c:
        yield c


@pytest.fixture(scope="module")
def users(cluster: SlurmCluster) -> tuple[User, User]:
    home = cluster.dir / "home"
    home.mkdir(mode=0o755, exist_ok=True)
    a, b = (ensure_user(name, home) for name in TEST_USERS)
    return a, b


@pytest.fixture
def node(cluster: SlurmCluster, tmp_path: Path) -> Iterator[Node]:
    n = Node(cluster, tmp_path / "prefix")
    # The node config the runner reads comes from the plugstack line (root's).
    n.install("--shim-config", str(SHIM_CONFIG))
    yield n
    n.uninstall()


def test_a_job_without_variables_runs_exactly_as_before_the_install(
    cluster: SlurmCluster, users: tuple[User, User], tmp_path: Path
) -> None:
    user = users[0]
    n = Node(cluster, tmp_path / "prefix")
    script = cluster.write_script(
        "plain.sh", counter_script("plain.out", export=None, seconds=2), user
    )
    before = cluster.wait_state(cluster.sbatch(script, user=user), "COMPLETED", timeout=60)
    output_before = cluster.output("plain.out")

    n.install()
    try:
        job_id = cluster.sbatch(script, user=user)
        after = cluster.wait_state(job_id, "COMPLETED", timeout=60)
        assert (
            cluster.output("plain.out")
            == output_before
            == "".join(f"Counter: {i}\n" for i in range(3))
        )
        for key in ("ExitCode", "UserId", "GroupId", "Restarts", "WorkDir", "StdOut"):
            assert after[key] == before[key], key
        assert runner_record(n.records, job_id) == {}
        _, printed = n.run_probe("plain-probe", None, user)
        assert printed["uid"] == str(user.uid) and printed["CapPrm"] == "0000000000000000"
    finally:
        n.uninstall()


@pytest.mark.parametrize(
    "export",
    [
        "CEDANA_ENABLE=1,CEDANA_CHECKPOINT=victim",  # replaces the environment
        "ALL,CEDANA_ENABLE=1",
        "ALL,CEDANA_CHECKPOINT=victim",
    ],
)
def test_an_opted_in_batch_step_is_handed_to_the_runner(
    node: Node, users: tuple[User, User], export: str
) -> None:
    user = users[1]
    job_id, printed = node.run_probe("optin", export, user)
    record = runner_record(node.records, job_id)
    # The runner: root with every capability, in the task's own process.
    assert record["uid"] == "0" and int(record["caps"], 16) != 0
    assert record["pid"] == record["task_pid"]
    assert record["cedana_slurm"] == "1"
    # The job's environment reached it on a file descriptor, not as its own.
    assert record["own_env"] == "0"
    assert record["cwd"] == str(node.cluster.jobs)
    script = f"{node.cluster.dir}/spool/job{job_id:05d}/slurm_script"
    assert record["argv"] == (
        f"--job-id|{job_id}|--step-id|batch|--uid|{user.uid}|--gid|{user.gid}|"
        f"--gids|{user.gid}|--cwd|{node.cluster.jobs}|--env-fd|{record['env_fd']}|"
        f"--config|{SHIM_CONFIG}|--|{script}|"
    )
    assert record["env_fd"].isdigit()
    # The job itself: the user, no capability left over, Slurm's environment.
    assert printed["uid"] == str(user.uid) and printed["gid"] == str(user.gid)
    assert printed["CapPrm"] == printed["CapEff"] == "0000000000000000"
    assert printed["job"] == str(job_id) and printed["path"] == "set"


@pytest.mark.parametrize("breakage", ["missing", "writable by others"])
def test_a_broken_runner_leaves_the_job_running_unprotected(
    node: Node, users: tuple[User, User], breakage: str
) -> None:
    if breakage == "missing":
        node.runner.unlink()
    else:
        os.chmod(node.runner, 0o777)
    log_offset = len(node.cluster.slurmd_log())
    job_id, printed = node.run_probe("broken", "ALL,CEDANA_ENABLE=1", users[0])
    assert runner_record(node.records, job_id) == {}
    assert printed["uid"] == str(users[0].uid)
    assert printed["CapPrm"] == printed["CapEff"] == "0000000000000000"
    log = node.cluster.slurmd_log()[log_offset:]
    assert f"cedana: runner {node.runner}" in log and "job runs without checkpoints" in log


# -- end to end, with the real runner ---------------------------------------------------

RUNNER = SHIM_BIN_DIR / "cedana-slurm-task"
VICTIM_EXPORT = "CEDANA_ENABLE=1,CEDANA_CHECKPOINT=victim"


class Protected:
    """A node installed with the real runner and a private store."""

    def __init__(self, cluster: SlurmCluster, prefix: Path) -> None:
        self.cluster = cluster
        self.prefix = prefix
        self.store = cluster.dir / "store"
        self.config = cluster.dir / "shim.toml"
        self.config.write_text(
            f'store_path = "{self.store}"\nlog_file = "{cluster.dir / "log" / "shim.log"}"\n'
        )

    def install(self) -> None:
        done = cedana(
            "slurm", "install", "--node-role", "worker", "--slurm-conf", str(self.cluster.conf),
            "--prefix", str(self.prefix), "--runner", str(RUNNER),
            "--shim-config", str(self.config),
        )  # fmt: skip
        assert done.returncode == 0, done.stderr

    def uninstall(self) -> None:
        done = cedana(
            "slurm", "uninstall", "--slurm-conf", str(self.cluster.conf),
            "--prefix", str(self.prefix),
        )  # fmt: skip
        assert done.returncode == 0, done.stderr

    def checkpoints(self, user: str, label: str) -> list[dict[str, object]]:
        scope = f"slurm-{CLUSTER_NAME}-{user}"
        done = cedana(
            "checkpoints", "list", "--store", str(self.store), "--json",
            "--namespace", scope, "--label", label,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        listed: list[dict[str, object]] = json.loads(done.stdout)
        return listed

    def wait_checkpoint(self, user: str, label: str) -> None:
        wait_for(
            lambda: self.checkpoints(user, label),
            timeout=self.cluster.kill_wait + 30,
            interval=0.5,
            what=f"a checkpoint of {user}'s {label}",
        )

    def victim(self, name: str, export: str = VICTIM_EXPORT) -> int:
        """Root's victim: CRIU must read the job's rlimits, which a root without
        CAP_SYS_RESOURCE (this test machine's bounding set lacks it) may do only
        for its own uid's processes."""
        script = self.cluster.write_script(
            f"{name}.sh",
            counter_script(f"{name}.out", export=export, options=("--exclusive", "--requeue")),
        )
        job_id = self.cluster.sbatch(script, "--partition=low")
        self.cluster.wait_state(job_id, "RUNNING", timeout=60)
        self.cluster.wait_output(f"{name}.out", r"^Counter: 3$", timeout=60)
        return job_id

    def requeued_and_resumed(self, job_id: int, name: str, before: int) -> list[int]:
        """Wait for the requeue, start the job again, and for it to count past
        ``before``; the counters printed since the restart."""
        fields = self.cluster.wait_state(job_id, "PENDING", timeout=self.cluster.kill_wait + 60)
        assert fields["Restarts"] == "1"
        self.cluster.release(job_id)
        self.cluster.wait_state(job_id, "RUNNING", timeout=60)
        text = self.cluster.wait_output(f"{name}.out", rf"^Counter: {before + 3}$", timeout=90)
        assert "\0" not in text, "the restored job wrote at its old offset into a truncated file"
        values = counters(text)
        restart = values.index(before) + 1 if before in values else 0
        return values[restart:]


@pytest.fixture
def protected(cluster: SlurmCluster, tmp_path: Path) -> Iterator[Protected]:
    p = Protected(cluster, tmp_path / "prefix")
    p.install()
    yield p
    cluster.cancel_all()
    p.uninstall()


def test_a_preempted_victim_resumes_its_count_after_the_requeue(protected: Protected) -> None:
    cluster = protected.cluster
    victim = protected.victim("victim")
    preemptor = cluster.write_script(
        "preemptor.sh",
        counter_script("preemptor.out", export=None, seconds=3, options=("--exclusive",)),
    )
    pre_id = cluster.sbatch(preemptor, "--partition=high")
    cluster.wait_state(victim, "PENDING", "REQUEUED", "COMPLETING", timeout=60)
    before = max(counters(cluster.output("victim.out")))
    protected.wait_checkpoint("root", "victim")
    cluster.wait_state(pre_id, "COMPLETED", timeout=60)

    after = protected.requeued_and_resumed(victim, "victim", before)
    assert after and 0 not in after and after[0] > before - 3, after
    assert cluster.job(victim)["Restarts"] == "1"


def test_scontrol_requeue_resumes_and_another_user_never_gets_the_checkpoint(
    protected: Protected, users: tuple[User, User]
) -> None:
    cluster = protected.cluster
    b = users[1]
    victim = protected.victim("requeued")
    cluster.requeue(victim)
    cluster.wait_state(victim, "PENDING", "REQUEUED", "COMPLETING", timeout=60)
    before = max(counters(cluster.output("requeued.out")))
    protected.wait_checkpoint("root", "victim")

    # B uses the same label: B's scope has no checkpoint, so B's job starts cold.
    other = cluster.write_script(
        "other.sh", counter_script("other.out", export=VICTIM_EXPORT, seconds=3), b
    )
    other_id = cluster.sbatch(other, "--partition=high", user=b)
    cluster.wait_state(other_id, "COMPLETED", timeout=60)
    assert counters(cluster.output("other.out")) == [0, 1, 2, 3]
    assert protected.checkpoints(b.name, "victim") == []

    after = protected.requeued_and_resumed(victim, "requeued", before)
    assert after and 0 not in after, after


# 3 GiB of random bytes: dumping them takes longer than slurmd's grace before SIGKILL
# (MAX(KillWait, 5) seconds in 22.05's _rpc_terminate_job; KillWait=1 here).
HOG = """\
#!/bin/bash
#SBATCH --output=hog.out
#SBATCH --requeue
#SBATCH --export=ALL,CEDANA_CHECKPOINT=hog
exec python3 -u -c '
import os, time
hog = [os.urandom(1 << 30) for _ in range(3)]
i = 0
while True:
    print(f"Counter: {i}", flush=True)
    i += 1
    time.sleep(0.2)
'
"""


def test_a_checkpoint_killed_at_killwait_leaves_nothing_partial(tmp_path: Path) -> None:
    with running_cluster(kill_wait=1) as cluster:
        protected = Protected(cluster, tmp_path / "prefix")
        protected.install()
        try:
            job_id = cluster.sbatch(cluster.write_script("hog.sh", HOG))
            cluster.wait_state(job_id, "RUNNING", timeout=60)
            cluster.wait_output("hog.out", r"^Counter: 3$", timeout=120)
            cluster.requeue(job_id)
            cluster.wait_state(job_id, "PENDING", timeout=60)
            assert "committed" not in cluster.output("hog.out")
            assert protected.checkpoints("root", "hog") == []

            cluster.release(job_id)
            cluster.wait_state(job_id, "RUNNING", timeout=60)

            def restarted() -> str | None:
                # The restart truncates the output (Slurm's default --open-mode).
                text = cluster.output("hog.out")
                fresh = "DUE TO JOB REQUEUE" not in text and "Counter: 1\n" in text
                return text if fresh else None

            text = wait_for(restarted, timeout=120, interval=0.2, what="the cold restart")
            assert text.startswith("cedana: starting cold"), text
            assert counters(text)[:2] == [0, 1]
        finally:
            cluster.cancel_all()
            protected.uninstall()
