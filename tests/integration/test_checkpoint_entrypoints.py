"""The other ways into the checkpoint pipeline, and a label that must be refused.

- `ctr task checkpoint` (the Task API's Checkpoint) of an opted-in container goes
  through cedana's pipeline: the checkpoint lands in the node's store (reason
  "task-api") and containerd still gets its images (a checkpoint image it can list);
- an invalid label fails the container's creation with a message naming the label
  and the rule: an opted-in workload never runs silently without protection; a huge
  value is quoted by its start and length, and an interval in other digits than 0-9
  is refused.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
from cedana_shim.checkpoint.policy import echoed
from cedana_shim.checkpoint.store import Store, StoreConfig

from .harness.config import CEDANA
from .harness.containerd import Containerd
from .harness.ctr import Ctr
from .harness.util import wait_for

NewId = Callable[[str], str]
COUNTER = "i=0; while true; do i=$((i+1)); echo $i > /tmp/count; sleep 0.1; done"


def _entries(containerd: Containerd, label: str) -> list[dict[str, object]]:
    store = Store(StoreConfig(root=str(containerd.store)))
    return [dict(e.metadata) for e in store.catalog.list(label=label)]


def _cedana_run(ctr: Ctr, image: str, cid: str, *cmd: str, env: str) -> list[str]:
    """`ctr run` under the cedana shim whatever CEDANA_TEST_RUNTIME says: these are
    features of this shim only."""
    args = ctr.run_args(image, cid, *cmd, flags=("-d", "--env", env))
    args[args.index("--runtime") + 1] = CEDANA.runtime_type
    return args


def test_task_api_checkpoint_lands_in_the_store(
    containerd: Containerd, ctr: Ctr, new_id: NewId
) -> None:
    cid = new_id("taskapi")
    try:
        ctr(*_cedana_run(ctr, containerd.images.busybox, cid, "sh", "-c", COUNTER,
                         env="CEDANA_ENABLE=1"))  # fmt: skip
        ctr.wait_status(cid, "RUNNING")
        ctr("task", "checkpoint", cid, timeout=120)
        # CEDANA_ENABLE without a label: checkpoints land under the container's name.
        entries = wait_for(lambda: _entries(containerd, cid) or None, timeout=60,
                           what="the checkpoint in the store")  # fmt: skip
        assert entries[0]["reason"] == "task-api"
        assert entries[0]["containerId"] == cid
        # containerd archived the images the shim mirrored into its checkpoint path.
        images = ctr("images", "ls", "-q").stdout.split()
        assert any(cid in name for name in images), images
        # The task kept running (ctr resumes it after the checkpoint).
        row = ctr.task(cid)
        assert row is not None and row.status == "RUNNING", row
    finally:
        ctr.remove(cid)


@pytest.mark.parametrize(
    "label, rule", [("team/a", "path separator"), ("a..b", "'..'"), ("", "empty")]
)
def test_invalid_label_fails_the_create(
    containerd: Containerd, ctr: Ctr, new_id: NewId, label: str, rule: str
) -> None:
    cid = new_id("badlabel")
    try:
        args = _cedana_run(
            ctr, containerd.images.busybox, cid, "true", env=f"CEDANA_CHECKPOINT={label}"
        )
        proc = ctr(*args, check=False)
        assert proc.returncode != 0, "a container with an invalid label ran"
        assert repr(label) in proc.stderr and rule in proc.stderr, proc.stderr
        assert ctr.task(cid) is None
    finally:
        ctr.remove(cid)


@pytest.mark.parametrize(
    "env, rule",
    [
        (f"CEDANA_CHECKPOINT={'a' * 100_000}", "over 128"),
        (f"CEDANA_CHECKPOINT_INTERVAL={'9' * 100_000}m", "not a duration"),
        ("CEDANA_CHECKPOINT_INTERVAL=\u0661\u0660m", "(digits 0-9)"),  # Arabic-Indic 10m
    ],
    ids=["huge-label", "huge-interval", "arabic-indic-interval"],
)
def test_a_bad_value_fails_the_create_quoted_in_short(
    containerd: Containerd, ctr: Ctr, new_id: NewId, env: str, rule: str
) -> None:
    cid = new_id("badvalue")
    try:
        proc = ctr(*_cedana_run(ctr, containerd.images.busybox, cid, "true", env=env), check=False)
        assert proc.returncode != 0, "a container with an invalid setting ran"
        assert echoed(env.partition("=")[2]) in proc.stderr and rule in proc.stderr, proc.stderr
        assert len(proc.stderr) < 2000, proc.stderr[:3000]
        assert ctr.task(cid) is None
    finally:
        ctr.remove(cid)
