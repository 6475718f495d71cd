"""Slurm batch jobs on a node with `cedana slurm install`: the SPANK plugin hands
an opted-in batch step to the runner (as root, in the task's own process, with the
contract's arguments) and leaves every other job exactly as Slurm runs it."""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from cedana_shim.slurm.job_spec import checkpoint_obstacle
from cedana_shim.slurm.runner import scope_name

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
from .harness.slurm_jobs import VICTIM_EXPORT, Protected, wait_nothing_left
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
    log_offset = len(node.cluster.log("slurmd.log"))
    job_id, printed = node.run_probe("broken", "ALL,CEDANA_ENABLE=1", users[0])
    assert runner_record(node.records, job_id) == {}
    assert printed["uid"] == str(users[0].uid)
    assert printed["CapPrm"] == printed["CapEff"] == "0000000000000000"
    log = node.cluster.log("slurmd.log")[log_offset:]
    assert f"cedana: runner {node.runner}" in log and "job runs without checkpoints" in log


# -- end to end, with the real runner ---------------------------------------------------


@pytest.fixture
def protected(cluster: SlurmCluster, tmp_path: Path) -> Iterator[Protected]:
    p = Protected(cluster, tmp_path / "prefix")
    p.install()
    yield p
    cluster.cancel_all()
    p.uninstall()


def test_a_preempted_victim_resumes_its_count_after_the_requeue(protected: Protected) -> None:
    protected.preempted_and_resumed("victim")


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


def test_a_job_requeued_onto_another_node_resumes_through_a_shared_directory(
    protected: Protected,
) -> None:
    """`registry` set to a directory every node mounts: the stop's checkpoint is
    written there before the job's exit; the requeued job starts on a node whose own
    store is empty (the node config now names another ``store_path``, as another node's
    would) and resumes from the shared directory, pulled and verified."""
    cluster = protected.cluster
    shared = cluster.dir / "shared"
    shared.mkdir(mode=0o700)
    protected.configure(extra=f'registry = "{shared}"\n')
    job_id = protected.victim("moved", export="ALL,CEDANA_CHECKPOINT=moved")
    cluster.requeue(job_id)
    cluster.wait_state(job_id, "PENDING", timeout=cluster.kill_wait + 60)
    before = max(counters(cluster.output("moved.out")))
    (checkpoint,) = protected.checkpoints("root", "moved")
    tags = os.listdir(shared / scope_name(CLUSTER_NAME, "root") / "tags")
    # Pushed before the exit (registry_sync = before-exit): the tag, its marker gone.
    (tag,) = tags
    assert str(checkpoint["id"]).rsplit("-", 1)[1] in tag and not tag.endswith(".pending")

    other_node = cluster.dir / "store-other-node"
    protected.configure(other_node, extra=f'registry = "{shared}"\n')
    wait_nothing_left(job_id)
    cluster.release(job_id)
    text = cluster.wait_output(
        "moved.out", rf"restored from {checkpoint['id']} (.|\n)*(Counter: \d+\n){{3}}", timeout=90
    )
    after = counters(text[text.index("restored from") :])
    assert after and before - 3 < after[0] <= before + 1, (after[:3], before)
    # The other node's own store now holds it, pulled whole.
    assert [c["id"] for c in protected.checkpoints("root", "moved")] == [checkpoint["id"]]
    cluster.cancel(job_id, "KILL")


def test_periodic_checkpoints_while_running_and_a_requeue_resumes_from_the_latest(
    protected: Protected,
) -> None:
    """CEDANA_CHECKPOINT_INTERVAL: checkpoints while the job runs; after a hard end
    with no checkpoint of its own (SIGKILL: a crashed node, the OOM killer), the
    requeued job resumes from the latest of them."""
    cluster = protected.cluster
    export = "ALL,CEDANA_CHECKPOINT=periodic,CEDANA_CHECKPOINT_INTERVAL=10s"
    job_id = protected.victim("periodic", export=export)

    def two() -> list[dict[str, object]] | None:
        listed = protected.checkpoints("root", "periodic")
        return listed if len(listed) >= 2 else None

    wait_for(two, timeout=45, interval=0.5, what="two periodic checkpoints")
    assert cluster.state(job_id) == "RUNNING"
    subprocess.run(
        ["scancel", "--batch", "--signal=KILL", str(job_id)], env=cluster.env(), check=True
    )
    cluster.wait_state(job_id, "FAILED", "CANCELLED", "COMPLETED", timeout=60)
    cluster.wait_idle()  # requeued only once the node is done with it
    last = max(counters(cluster.output("periodic.out")))
    listed = protected.checkpoints("root", "periodic")
    assert {c["reason"] for c in listed} == {"periodic"}, listed
    latest = max(listed, key=lambda c: str(c["created"]))["id"]

    cluster.requeue(job_id)
    cluster.wait_state(job_id, "PENDING", timeout=60)
    wait_nothing_left(job_id)
    cluster.release(job_id)
    text = cluster.wait_output(
        "periodic.out", rf"restored from {latest} \(label periodic(.|\n)*(Counter: \d+\n){{3}}"
    )
    after = counters(text)
    # From the latest checkpoint (>= 10 s in), not from the top; at most where it was.
    assert 8 <= after[0] <= last + 1, (after[:3], last)


def test_the_jobs_owner_may_ask_for_a_checkpoint_and_no_one_else(
    protected: Protected, users: tuple[User, User]
) -> None:
    """`cedana slurm checkpoint JOBID` by the job's owner reaches its runner; another
    user is refused. Where the node's root lacks CAP_SYS_RESOURCE (this machine's),
    CRIU cannot checkpoint another user's job: the job says so when it starts and the
    owner's request fails with that reason."""
    cluster = protected.cluster
    owner, other = users
    script = cluster.write_script(
        "owned.sh", counter_script("owned.out", export="ALL,CEDANA_ENABLE=1", seconds=60), owner
    )
    job_id = cluster.sbatch(script, user=owner)
    cluster.wait_state(job_id, "RUNNING", timeout=60)
    cluster.wait_output("owned.out", r"^Counter: 1$", timeout=60)

    def checkpoint_as(user: User) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            ["setpriv", f"--reuid={user.uid}", f"--regid={user.gid}", "--init-groups",
             str(SHIM_BIN_DIR / "cedana"), "slurm", "checkpoint", str(job_id)],
            capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip

    refused = checkpoint_as(other)
    assert refused.returncode == 1
    assert f"uid {other.uid} may not control this job" in refused.stderr, refused.stderr
    asked = checkpoint_as(owner)
    obstacle = checkpoint_obstacle(owner.uid)
    if obstacle is None:  # a node whose root has CAP_SYS_RESOURCE
        assert asked.returncode == 0, asked.stderr
        assert f"of job {job_id}.batch committed" in asked.stdout
    else:
        assert asked.returncode == 1
        assert f"cannot checkpoint job {job_id}.batch: {obstacle}" in asked.stderr, asked.stderr
        assert "Can't get rlimit" not in asked.stderr  # CRIU's log stays root's
        assert f"cedana: warning: {obstacle}" in cluster.output("owned.out")
    cluster.cancel(job_id)


def test_restore_by_hand_into_a_new_job_of_a_shell_that_keeps_its_script_open(
    protected: Protected,
) -> None:
    """`cedana slurm restore` submits a new job (another id) from a checkpoint of a
    batch shell that does not exec: bash keeps slurmd's copy of its script open, and
    CRIU restores that file by the old job's path, which left with the old job. The
    runner puts the new job's copy there for the restore (and removes it when the job
    ends): the new job continues the count."""
    cluster = protected.cluster
    job_id = protected.victim("byhand", export="ALL,CEDANA_ENABLE=1")
    env = {**os.environ, **cluster.env()}
    done = cedana("slurm", "checkpoint", str(job_id), "--json", env=env)
    assert done.returncode == 0, done.stderr
    checkpoint = json.loads(done.stdout)["checkpoint"]
    cluster.cancel(job_id, "KILL")
    cluster.wait_state(job_id, "CANCELLED", "FAILED", timeout=60)
    wait_nothing_left(job_id)
    old_dir = cluster.dir / "spool" / f"job{job_id:05d}"
    assert not old_dir.exists()

    done = cedana(
        "slurm", "restore", "--json", checkpoint, "--",
        "--partition=low", f"--chdir={cluster.jobs}", str(cluster.jobs / "byhand.sh"),
        env=env,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    new_id = int(json.loads(done.stdout)["job"])
    text = cluster.wait_output(
        "byhand.out", rf"restored from {checkpoint} (.|\n)*(Counter: \d+\n){{3}}", timeout=90
    )
    after = counters(text)
    assert after and after[0] >= 3, after  # from the checkpoint, not from the top
    assert old_dir.is_dir()  # the old path, while the restored shell runs
    cluster.cancel(new_id, "KILL")
    cluster.wait_state(new_id, "CANCELLED", "FAILED", timeout=60)
    wait_nothing_left(new_id)
    assert not old_dir.exists()
