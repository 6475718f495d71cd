"""`cedana` against a real containerd and the cedana shim: on-demand checkpoints of real
containers, then the store they land in. Parametrized over containerd 1.6/1.7/2.1.

Each harness containerd gives its shims a private store (`Containerd.store`, passed
as `CEDANA_STORE_PATH` in containerd's environment); the CLI is pointed at it with
`--store`.
"""

from __future__ import annotations

import json
import re
import subprocess
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime

import pytest

from .harness.config import CEDANA as CEDANA_RUNTIME
from .harness.config import CTR_NAMESPACE, SHIM_BIN_DIR
from .harness.containerd import Containerd
from .harness.ctr import Ctr
from .harness.util import wait_for

NewId = Callable[[str], str]
CEDANA = SHIM_BIN_DIR / "cedana"
CHECKPOINT_ID = re.compile(r"[0-9]{8}T[0-9]{6}Z-[0-9a-f]{8}")
RFC3339 = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?(Z|[+-]\d\d:\d\d)")
COUNTER = "i=0; while true; do i=$((i+1)); echo $i > /tmp/count; sleep 0.1; done"


@dataclass(frozen=True)
class Node:
    containerd: Containerd
    ctr: Ctr

    def cedana(self, *args: str, timeout: float = 90) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run(
            [str(CEDANA), *args],
            capture_output=True,
            text=True,
            timeout=timeout,
            stdin=subprocess.DEVNULL,
            check=False,
        )
        assert "Traceback" not in proc.stderr, proc.stderr
        return proc

    def checkpoint(self, cid: str, *flags: str) -> subprocess.CompletedProcess[str]:
        state = str(self.containerd.state)
        return self.cedana("checkpoint", cid, "--containerd-state", state, *flags)

    def store_args(self) -> tuple[str, str]:
        return ("--store", str(self.containerd.store))

    def listing(self, *flags: str) -> list[dict[str, object]]:
        proc = self.cedana("checkpoints", "list", "--json", *self.store_args(), *flags)
        assert proc.returncode == 0, proc.stderr
        items: list[dict[str, object]] = json.loads(proc.stdout)
        return items


@pytest.fixture
def node(containerd: Containerd, ctr: Ctr) -> Node:
    return Node(containerd, ctr)


def _count(node: Node, cid: str) -> int:
    """The counter, read from the host through the task's mounted rootfs (no exec: an
    exec process that exits during a dump is not what these tests are about)."""
    rootfs = node.containerd.bundle(CTR_NAMESPACE, cid) / "rootfs"
    try:
        return int((rootfs / "tmp" / "count").read_text() or 0)
    except (OSError, ValueError):
        return 0


def _run_counter(
    node: Node, cid: str, *env: str, runtime: str = CEDANA_RUNTIME.runtime_type
) -> None:
    """A counter under the cedana shim whatever CEDANA_TEST_RUNTIME says: `cedana
    checkpoint` is a feature of this shim only."""
    flags = ["-d"]
    for item in env:
        flags += ["--env", item]
    ctr = node.ctr
    args = ctr.run_args(
        node.containerd.images.busybox, cid, "sh", "-c", COUNTER, flags=tuple(flags)
    )
    args[args.index("--runtime") + 1] = runtime
    ctr(*args)
    ctr.wait_status(cid, "RUNNING")
    wait_for(lambda: _count(node, cid) >= 3, timeout=10, what=f"{cid} counting")


@pytest.mark.parametrize("opt_in", ["enable", "label"])
def test_checkpoint_leave_running_then_stop(node: Node, new_id: NewId, opt_in: str) -> None:
    ctr = node.ctr
    cid = new_id("ck")
    label = cid if opt_in == "enable" else f"lbl-{uuid.uuid4().hex[:8]}"
    env = "CEDANA_ENABLE=1" if opt_in == "enable" else f"CEDANA_CHECKPOINT={label}"
    try:
        _run_counter(node, cid, env)
        running = node.checkpoint(cid, "--leave-running")
        assert (running.returncode, running.stderr) == (0, ""), running.stderr
        first = running.stdout.strip()
        assert CHECKPOINT_ID.fullmatch(first), running.stdout  # not a TTY: the id alone

        task = ctr.task(cid)
        assert task is not None and task.status == "RUNNING"
        before = _count(node, cid)
        wait_for(lambda: _count(node, cid) > before, timeout=5, what="counting on")

        items = node.listing("--label", label)
        assert [i["id"] for i in items] == [first], items
        item = items[0]
        assert (item["namespace"], item["label"], item["container"]) == (CTR_NAMESPACE, label, cid)
        assert isinstance(item["created"], str) and RFC3339.fullmatch(item["created"])
        assert isinstance(item["size"], int) and item["size"] > 0
        assert item["reason"] == "manual"

        stopped = node.checkpoint(cid, "--json", "--namespace", CTR_NAMESPACE)
        assert stopped.returncode == 0, stopped.stderr
        doc = json.loads(stopped.stdout)
        assert (doc["namespace"], doc["label"], doc["containerId"]) == (CTR_NAMESPACE, label, cid)
        assert (doc["containerdNamespace"], doc["leaveRunning"]) == (CTR_NAMESPACE, False)
        second = doc["id"]
        assert CHECKPOINT_ID.fullmatch(second) and second != first

        ctr.wait_status(cid, "STOPPED", timeout=30)
        deleted = ctr("task", "delete", cid)
        assert re.search(r"\b143\b", deleted.stderr), deleted.stderr  # 128 + SIGTERM

        items = node.listing("--namespace", CTR_NAMESPACE, "--label", label)
        assert [i["id"] for i in items] == [second, first]  # newest first
        created = [datetime.fromisoformat(str(i["created"])) for i in items]
        assert created[0] > created[1]

        inspect = node.cedana("checkpoints", "inspect", second, "--verify", *node.store_args())
        assert inspect.returncode == 0, inspect.stderr
        assert re.search(rf"^Container: +{re.escape(cid)}$", inspect.stdout, re.M)
        assert re.search(rf"^Task: +{cid} \(containerd namespace {CTR_NAMESPACE}\)$",
                         inspect.stdout, re.M)  # fmt: skip
        assert re.search(r"^  criu +\S+ \S+ +\S+ \S+ +application/vnd\.cedana\.checkpoint\.criu",
                         inspect.stdout, re.M)  # fmt: skip
        assert re.search(r"^Verify: +OK ", inspect.stdout, re.M), inspect.stdout
    finally:
        ctr.remove(cid)


def test_checkpoint_without_opt_in_is_refused(node: Node, new_id: NewId) -> None:
    cid = new_id("noopt")
    try:
        _run_counter(node, cid)
        proc = node.checkpoint(cid, "--leave-running")
        assert (proc.returncode, proc.stdout) == (1, "")
        assert proc.stderr == (
            f"cedana: container {cid} has not opted in to checkpoints: set CEDANA_ENABLE=1 "
            "or CEDANA_CHECKPOINT=<label> in its environment\n"
        )
        task = node.ctr.task(cid)
        assert task is not None and task.status == "RUNNING"
        assert node.listing("--label", cid) == []
    finally:
        node.ctr.remove(cid)


def test_checkpoint_of_a_runc_container_names_the_runtime(node: Node, new_id: NewId) -> None:
    cid = new_id("runc")
    try:
        _run_counter(node, cid, "CEDANA_ENABLE=1", runtime="io.containerd.runc.v2")
        proc = node.checkpoint(cid)
        assert proc.returncode == 1
        assert proc.stderr.startswith(f"cedana: the shim of container {cid} (unix://")
        assert "does not serve cedana.shim.v1.Checkpoint: is the container running under " \
            "the `cedana` handler?" in proc.stderr  # fmt: skip
        task = node.ctr.task(cid)
        assert task is not None and task.status == "RUNNING"
    finally:
        node.ctr.remove(cid)


def test_checkpoint_of_an_unknown_container_says_where_it_looked(node: Node) -> None:
    proc = node.checkpoint("no-such-container")
    tasks = node.containerd.task_state_dir
    assert (proc.returncode, proc.stdout) == (1, "")
    assert proc.stderr.startswith("cedana: container no-such-container: no running task")
    assert str(tasks) in proc.stderr
