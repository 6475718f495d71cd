"""Label-driven stop and resume over `ctr` on a cgroup v2 node (runc's cgroupfs driver on
the unified hierarchy: `/<namespace>/<id>`).

The restored container must live in its own cgroup, as a fresh one does: every restored
process in the new container's cgroup (not in a recreation of the checkpointed one's),
under its memory limit, its freezer stopping them, `runc kill --all` reaching them, its
view of its cgroup a fresh container's. (Its OOM kill and event: test_cri.py.)
"""

from __future__ import annotations

import uuid
from collections.abc import Callable

from integration.harness import procs
from integration.harness.config import CTR_NAMESPACE
from integration.harness.containerd import Containerd
from integration.harness.cr_events import TOPIC_EXIT, EventStream
from integration.harness.cr_support import (
    Box,
    Workloads,
    assert_continues,
    counter_script,
    restored_from,
    wait_ticks,
)
from integration.harness.ctr import Ctr
from integration.harness.util import wait_for

from .nodes import TIMEOUT, MiB, assert_cgroup_holds, cgroup_dir, cgroup_pids

NewId = Callable[[str], str]


def _stop_and_commit(work: Workloads, events: EventStream, box: Box) -> str:
    """SIGTERM, the checkpoint committed, the container gone; the checkpoint's id."""
    work.ctr("task", "kill", "-s", "SIGTERM", box.cid)
    exited = events.wait_topic(TOPIC_EXIT, box.cid, id=box.cid, timeout=TIMEOUT)
    assert exited.field("exit_status") == 143, exited
    committed = events.wait_commit(box.cid, timeout=TIMEOUT)
    work.delete(box)
    return committed.checkpoint_id


SLEEPER = ("sleep", "100000")


def _tree(ctr: Ctr, cid: str) -> set[int]:
    """The container's init and its long-lived child (SLEEPER); the counter's own
    children (its tick's `sleep`, `mv`) come and go."""
    task = ctr.task(cid)
    assert task is not None and task.status == "RUNNING", task
    sleepers = {p for p in procs.descendants({task.pid}) if procs.read_argv(p) == SLEEPER}
    assert len(sleepers) == 1, f"{cid}: expected one {SLEEPER} under pid {task.pid}"
    return {task.pid, *sleepers}


def _inside_view(ctr: Ctr, cid: str) -> str:
    """How the container's init sees its cgroup (its cgroup namespace's view)."""
    exec_id = f"cg-{uuid.uuid4().hex[:6]}"
    return ctr("task", "exec", "--exec-id", exec_id, cid, "cat", "/proc/1/cgroup").stdout


def _frozen(path: str) -> bool:
    events = dict(
        line.split() for line in (cgroup_dir(path) / "cgroup.events").read_text().splitlines()
    )
    return events["frozen"] == "1"


def test_restored_container_lives_in_its_own_cgroup(
    containerd: Containerd, ctr: Ctr, new_id: NewId
) -> None:
    """Every restored process is in `/<ns>/<new id>` under the new container's memory
    limit; exec, metrics, pause/resume (the v2 freezer) and kill --all act on them; the
    checkpointed container's cgroup is not recreated."""
    label = f"cg-{uuid.uuid4().hex[:8]}"
    script = counter_script(tick=0.5, extra=f"{' '.join(SLEEPER)} &\n")  # a second process
    with (
        EventStream(containerd.socket) as events,
        Workloads(containerd, new_id, label=label, script=script, namespace=CTR_NAMESPACE) as work,
    ):
        first = work.start("first", extra=("--memory-limit", str(64 * MiB)))
        before_view = wait_for(
            lambda: _inside_view(ctr, first.cid), timeout=TIMEOUT, what="an exec"
        )
        wait_ticks(first.lines, count=3, timeout=TIMEOUT)
        old_cgroup = f"/{CTR_NAMESPACE}/{first.cid}"
        assert_cgroup_holds(old_cgroup, _tree(ctr, first.cid))
        checkpoint = _stop_and_commit(work, events, first)
        before = first.ticks()
        assert before is not None

        second = work.start("second", extra=("--memory-limit", str(48 * MiB)))
        restored_from(events, second, checkpoint)
        after = wait_ticks(second.lines, count=2, timeout=TIMEOUT)
        assert_continues(before, after, "restore on cgroup v2")

        new_cgroup = f"/{CTR_NAMESPACE}/{second.cid}"
        tree = _tree(ctr, second.cid)
        assert_cgroup_holds(new_cgroup, tree)
        assert not cgroup_dir(old_cgroup).exists(), (
            f"the checkpointed container's cgroup {old_cgroup} was recreated: "
            f"{cgroup_pids(old_cgroup)}"
        )
        assert (cgroup_dir(new_cgroup) / "memory.max").read_text().strip() == str(48 * MiB)
        # No cgroup namespace for ctr's containers: each sees its own path, as a fresh one.
        assert before_view == f"0::{old_cgroup}\n", before_view
        assert _inside_view(ctr, second.cid) == f"0::{new_cgroup}\n"

        metrics = ctr("task", "metrics", second.cid).stdout
        usage = {row.split()[0]: row.split()[-1] for row in metrics.splitlines()[1:] if row.split()}
        assert int(usage["memory.usage"]) > 0 and int(usage["pids.current"]) >= 2, metrics

        ctr("task", "pause", second.cid)
        assert ctr.task(second.cid).status == "PAUSED"  # type: ignore[union-attr]
        assert _frozen(new_cgroup), "ctr task pause left the restored cgroup thawed"
        ctr("task", "resume", second.cid)
        assert not _frozen(new_cgroup)
        later = wait_ticks(second.lines, count=len(after.values) + 2, timeout=TIMEOUT)
        assert_continues(before, later, "after pause/resume")

        mark = events.mark()
        ctr("task", "kill", "--all", "-s", "SIGKILL", second.cid)
        events.wait_topic(TOPIC_EXIT, second.cid, id=second.cid, timeout=60, since=mark)
        ctr("task", "delete", "--force", second.cid, timeout=60)
        assert not any(procs.pid_alive(pid) for pid in tree), tree
