"""What another user on the node can do to a protected job through its runner's
control socket, and what the runner does when it has no descriptor left (issue 24
§1): against real slurmd, with a real unprivileged user as the attacker.

The review's attack: 7 idle connections (one byte, no newline) from a user who is not
the job's owner exhausted the runner's descriptors; the owner could no longer
checkpoint, ``scancel`` neither checkpointed nor signalled the job, which outlived
its Slurm job, and the shim log was flooded with tracebacks. Slurm propagates only the
soft limit of a job's ``ulimit -n`` (slurmstepd's hard one stays), so this node's
slurmd, and with it every keeper, runs with 256 descriptors; a keeper with none left
at all is made with prlimit (:func:`squeeze_descriptors`).
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from cedana_shim.log import REPEAT_BURST, REPEAT_WINDOW
from cedana_shim.slurm.control import socket_path

from .harness.slurm import TEST_USERS, SlurmCluster, User, cedana, ensure_user, running_cluster
from .harness.slurm_jobs import (
    Protected,
    keeper_pid,
    squeeze_descriptors,
    stranger,
    wait_nothing_left,
)
from .harness.util import wait_for

NOFILE = 256
ATTACK = 400  # connections: more than the keeper's descriptors


@pytest.fixture(scope="module")
def cluster() -> Iterator[SlurmCluster]:
    with running_cluster(nofile=NOFILE) as c:
        yield c


@pytest.fixture(scope="module")
def users(cluster: SlurmCluster) -> tuple[User, User]:
    home = cluster.dir / "home"
    home.mkdir(mode=0o755, exist_ok=True)
    a, b = (ensure_user(name, home) for name in TEST_USERS)
    return a, b


@pytest.fixture
def protected(cluster: SlurmCluster, tmp_path: Path) -> Iterator[Protected]:
    p = Protected(cluster, tmp_path / "prefix")
    p.install()
    yield p
    cluster.cancel_all()
    p.uninstall()


def shim_log(cluster: SlurmCluster) -> list[dict[str, object]]:
    return [json.loads(line) for line in cluster.log("shim.log").splitlines()]


def test_a_stranger_holding_connections_stops_neither_the_owners_checkpoint_nor_scancel(
    protected: Protected, users: tuple[User, User]
) -> None:
    cluster = protected.cluster
    # Root's job: this node's root can dump only its own (CAP_SYS_RESOURCE).
    job_id = protected.victim("held", export="CEDANA_ENABLE=1,CEDANA_CHECKPOINT=held")
    path = socket_path(f"{job_id}.batch")
    keeper = keeper_pid(job_id)
    with stranger(users[0], path, ATTACK) as report:
        attacked = time.monotonic()
        # Each connection answered at once and closed: nothing of the stranger's is held.
        assert report["connected"] == report["refused"] == ATTACK, report
        assert f"uid {users[0].uid} may not control this job" in report["first"]
        assert len(os.listdir(f"/proc/{keeper}/fd")) < NOFILE // 2
        env = {**os.environ, **cluster.env()}
        done = cedana("slurm", "checkpoint", str(job_id), "--json", env=env)
        assert done.returncode == 0, done.stderr
        manual = json.loads(done.stdout)["checkpoint"]

        # The log: the earlier lines are there, the refusals cut to a burst; once the
        # burst's window is over, the next refusal comes after the count of the rest.
        time.sleep(max(0.0, attacked + REPEAT_WINDOW - time.monotonic()))
        with stranger(users[0], path, 1) as last:
            assert last["refused"] == 1, last
    lines = shim_log(cluster)
    container = f"slurm-{job_id}.batch"
    assert [x for x in lines if x["msg"] == "starting cold" and x.get("container") == container]
    refusal = "control socket: connection refused"
    written = [x for x in lines if x["msg"] == refusal]
    summaries = [x for x in lines if x.get("like") == refusal]
    # A burst per window (one, unless the attack outlasted it), and every refusal counted.
    assert summaries, "no line counts the refusals held back"
    assert len(written) <= REPEAT_BURST * (len(summaries) + 1) + 1, len(written)
    suppressed = [int(str(x["msg"]).split()[0]) for x in summaries]
    assert len(written) + sum(suppressed) == ATTACK + 1, (len(written), suppressed)
    assert not [x for x in lines if "accept() out of system resource" in str(x["msg"])]

    cluster.cancel(job_id)
    cluster.wait_output("held.out", r"committed \(stop", timeout=cluster.kill_wait + 30)
    cluster.wait_state(job_id, "CANCELLED", timeout=60)
    wait_nothing_left(job_id)
    stored = [c["id"] for c in protected.checkpoints("root", "held")]
    assert manual in stored and len(stored) == 2, stored


def test_scancel_checkpoints_a_job_whose_keeper_has_no_descriptor_left(
    protected: Protected,
) -> None:
    """What the stranger did to the keeper before, done with prlimit: the stop's
    checkpoint runs on the descriptors the keeper kept in reserve for it."""
    cluster = protected.cluster
    job_id = protected.victim("squeezed", export="CEDANA_ENABLE=1,CEDANA_CHECKPOINT=squeezed")
    squeeze_descriptors(keeper_pid(job_id))
    cluster.cancel(job_id)
    cluster.wait_output("squeezed.out", r"committed \(stop", timeout=cluster.kill_wait + 30)
    cluster.wait_state(job_id, "CANCELLED", timeout=60)
    wait_nothing_left(job_id)
    assert protected.checkpoints("root", "squeezed")


def test_a_job_that_ignores_sigterm_dies_with_its_slurm_job_though_the_keeper_has_no_descriptor(
    protected: Protected,
) -> None:
    """No checkpoint on stop (CEDANA_ENABLE only), so scancel's SIGTERM goes to the
    job (without runc: it cannot run), which ignores it; KillWait's SIGKILL then kills
    the task process, and the keeper kills the job through its init's pidfd."""
    cluster = protected.cluster
    script = cluster.write_script(
        "stubborn.sh",
        "#!/bin/bash\n#SBATCH --output=stubborn.out\n#SBATCH --export=ALL,CEDANA_ENABLE=1\n"
        "trap 'echo GOT-TERM' TERM\n"
        'for i in {0..600}; do echo "Counter: $i"; sleep 1; done\n',
    )
    job_id = cluster.sbatch(script)
    cluster.wait_output("stubborn.out", r"^Counter: 3$", timeout=60)
    squeeze_descriptors(keeper_pid(job_id))
    cluster.cancel(job_id)
    cluster.wait_output("stubborn.out", r"^GOT-TERM$", timeout=30)
    cluster.wait_state(job_id, "CANCELLED", timeout=cluster.kill_wait + 60)
    wait_nothing_left(job_id, timeout=60)


def test_a_job_frozen_for_its_checkpoint_dies_at_killwait_though_the_keeper_has_no_descriptor(
    protected: Protected,
) -> None:
    """scancel's checkpoint is held after CRIU's dump (a postcheckpoint hook), the job
    frozen for it, when the keeper runs out of descriptors; KillWait's SIGKILL then
    ends the task process, and the keeper kills and thaws the job through the
    descriptors it held from the start, and cleans up on those it kept for the end."""
    cluster = protected.cluster
    marker = cluster.dir / "in-checkpoint"
    hook = cluster.dir / "slow-hook"
    # The abandoned dump runs the stage again to say it failed: that run is quick.
    hook.write_text(f"#!/bin/sh\ngrep -q failed && exit 0\ntouch {marker}\nexec sleep 120\n")
    hook.chmod(0o755)
    (protected.hooks / "slow.json").write_text(
        json.dumps(
            {
                "version": "1.0.0",
                "hook": {"path": str(hook), "timeout": 300},
                "when": {"always": True},
                "stages": ["postcheckpoint"],
            }
        )
    )
    try:
        job_id = protected.victim("frozen", export="CEDANA_ENABLE=1,CEDANA_CHECKPOINT=frozen")
        keeper = keeper_pid(job_id)
        cluster.cancel(job_id)
        wait_for(marker.exists, timeout=30, what="the checkpoint to reach its postcheckpoint hook")
        squeeze_descriptors(keeper)
        cluster.wait_state(job_id, "CANCELLED", timeout=cluster.kill_wait + 60)
        wait_nothing_left(job_id, timeout=60)
        assert "committed" not in cluster.output("frozen.out")
        assert protected.checkpoints("root", "frozen") == []
    finally:
        (protected.hooks / "slow.json").unlink()
