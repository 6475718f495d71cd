"""Protected jobs under the most common site setup: proctrack/cgroup and task/cgroup
(cgroup/v1 on this machine). Slurm's SIGKILL at the end of KillWait goes to every
process in the step's cgroup: the keeper lives outside it, abandons the checkpoint in
progress, kills the job and removes every cgroup of the job (Slurm's own included,
which Slurm could not remove while ours were in them) before the requeued job runs.

KillWait=1 here: slurmd's grace before SIGKILL is MAX(KillWait, 5) s (22.05's
_rpc_terminate_job), longer than a small job's checkpoint."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import pytest

from .harness.slurm import SlurmCluster, counters, running_cluster
from .harness.slurm_jobs import Protected, wait_nothing_left
from .harness.util import wait_for

# Slurm's cgroup/v1 plugin; tests/vm/test_slurm.py runs its cgroup/v2 one.
pytestmark = pytest.mark.cgroup_v1


@pytest.fixture(scope="module")
def cluster() -> Iterator[SlurmCluster]:
    with running_cluster(kill_wait=1, proctrack="cgroup") as c:
        yield c


@pytest.fixture
def protected(cluster: SlurmCluster, tmp_path: Path) -> Iterator[Protected]:
    p = Protected(cluster, tmp_path / "prefix")
    p.install()
    yield p
    cluster.cancel_all()
    p.uninstall()


def test_a_preempted_victim_resumes_under_proctrack_cgroup(protected: Protected) -> None:
    protected.preempted_and_resumed("cg-victim")


def hold_checkpoints_in(protected: Protected, marker: Path) -> None:
    """A postcheckpoint hook that holds every checkpoint after CRIU wrote its images
    (touching ``marker``), for longer than slurmd's grace: what a dump too big for
    KillWait looks like, on any machine."""
    hook = protected.cluster.dir / "slow-hook"
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


def test_a_checkpoint_killed_at_killwait_leaves_nothing(protected: Protected) -> None:
    cluster = protected.cluster
    marker = cluster.dir / "in-checkpoint"
    hold_checkpoints_in(protected, marker)
    job_id = protected.victim("slow", export="ALL,CEDANA_CHECKPOINT=slow")
    cluster.requeue(job_id)
    wait_for(marker.exists, timeout=30, what="the checkpoint to reach its postcheckpoint hook")
    cluster.wait_state(job_id, "PENDING", timeout=60)
    assert "committed" not in cluster.output("slow.out")
    assert protected.checkpoints("root", "slow") == []
    # Before anything else runs on the node (no next runner sweeps for us).
    wait_nothing_left(job_id)

    cluster.release(job_id)
    cluster.wait_state(job_id, "RUNNING", timeout=60)

    def restarted() -> str | None:
        # The restart truncates the output (Slurm's default --open-mode).
        text = cluster.output("slow.out")
        fresh = "DUE TO JOB REQUEUE" not in text and "Counter: 1\n" in text
        return text if fresh else None

    text = wait_for(restarted, timeout=120, interval=0.2, what="the cold restart")
    assert text.startswith("cedana: starting cold"), text
    assert counters(text)[:2] == [0, 1]
