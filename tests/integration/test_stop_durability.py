"""A stop never loses the workload: when the exit of a labelled container is reported,
its checkpoint is durable, or the application got its signal and shut down as it would
without us.

- the next container of the label, started the moment the exit is reported, resumes
  from that checkpoint (it used to start cold: the commit ran in the background);
- a container started while a checkpoint of its label is still being written waits
  for it and resumes from it;
- a store too full for the checkpoint: the application gets its SIGTERM (its trap runs)
  and the failure says the store is full;
- the shim SIGKILLed while the durable checkpoint is being compressed: the checkpoint
  stays, the next start resumes from it, and a later shim compresses it;
- the compression's outcome reaches the shim's own log file after containerd stopped
  reading the task's log.

Runs on containerd 1.6 and 2.1 (the fault tests' versions: what varies between
containerd versions is how exits are reported, which each test asserts).
"""

from __future__ import annotations

import json
import os
import signal
import sys
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from cedana_shim.checkpoint.store import Entry

from .harness.config import CTR_NAMESPACE
from .harness.containerd import Containerd
from .harness.cr_events import TOPIC_COMMITTED, TOPIC_EXIT, TOPIC_FAILED, EventStream
from .harness.cr_support import (
    ShimLog,
    Workloads,
    assert_continues,
    counter_script,
    criu_hold,
    entries,
    ingest_dirs,
    restored_from,
    shim_pid,
    started_cold,
    store_is_sound,
    tmpfs_store,
    unique_label,
    wait_compacted,
    wait_ticks,
)
from .harness.util import wait_for

NewId = Callable[[str], str]
pytestmark = pytest.mark.ctrd_versions("1.6", "2.1")
# ~170 MiB of memory: its compression takes about a second here, its fsync much less.
BIG_KIB = 128 * 1024
# Plus 40 idle children: CRIU has a tree to seize, the dump lasts a few hundred ms.
CHILDREN = "for n in $(seq 40); do sleep 2147483647 & done\n"


def test_next_container_resumes_the_moment_the_exit_is_reported(
    fresh_containerd: Containerd, new_id: NewId
) -> None:
    """SIGTERM, and as soon as containerd reports the exit (143) a new container of the
    label starts: it resumes from the checkpoint of the stop, which was committed before
    the exit was reported."""
    c = fresh_containerd
    with (
        EventStream(c.socket) as events,
        Workloads(
            c, new_id, label=unique_label("race"), script=counter_script(mem_kib=BIG_KIB),
            namespace=CTR_NAMESPACE,
        ) as w,
    ):  # fmt: skip
        a = w.start("a")
        wait_ticks(a.lines, count=3)
        w.ctr("task", "kill", "-s", "SIGTERM", a.cid)
        exited = events.wait_topic(TOPIC_EXIT, a.cid, timeout=60)
        assert exited.field("exit_status") == 143, exited
        committed = events.of(TOPIC_COMMITTED, a.cid)
        assert committed, "the exit was reported before the checkpoint was committed"
        assert committed[0].received <= exited.received
        b = w.start("b")  # at once: no waiting for anything in the background
        counted = a.ticks()
        assert counted is not None and "got-TERM" not in a.lines()
        restored_from(events, b, committed[0].checkpoint_id)
        assert_continues(counted, wait_ticks(b.lines, count=3), "resume right after the stop")


def test_start_during_a_stop_waits_for_its_checkpoint(
    fresh_containerd: Containerd, new_id: NewId
) -> None:
    """A container of the label created while the stopping one is still being dumped
    (another pod on the node) waits for that checkpoint and resumes from it, instead of
    starting cold."""
    c = fresh_containerd
    log = ShimLog(c)
    script = counter_script(mem_kib=BIG_KIB, extra=CHILDREN)
    with (
        criu_hold(c, "post-dump") as hold,
        EventStream(c.socket) as events,
        Workloads(
            c, new_id, label=unique_label("wait"), script=script, namespace=CTR_NAMESPACE
        ) as w,
        ThreadPoolExecutor(1) as pool,
    ):
        a = w.start("a")
        wait_ticks(a.lines, count=3)
        hold.arm()
        w.ctr("task", "kill", "-s", "SIGTERM", a.cid)
        hold.wait_held()  # the dump is under way
        starting = pool.submit(w.start, "b")  # its Create waits for the checkpoint
        log.wait("waiting for a checkpoint of the label being written", label=w.label)
        hold.resume()
        b = starting.result(timeout=120)
        committed = events.wait_commit(a.cid, timeout=60)
        counted = a.ticks()
        assert counted is not None
        restored_from(events, b, committed.checkpoint_id)
        assert_continues(counted, wait_ticks(b.lines, count=3), "start during the stop")
        assert log.find("waited for a checkpoint of the label being written", container=b.cid)


def _fill_hook(hooks_dir: Path) -> None:
    """A postcheckpoint hook (it runs after the dump and the file capture, before the
    checkpoint is made durable) that fills the store's disk from inside the checkpoint's
    own staging dir, so the failed checkpoint frees it again."""
    script = hooks_dir / "fill.py"
    script.write_text(
        f"#!{sys.executable}\n"
        "import json, os, sys\n"
        "state = json.load(sys.stdin)\n"
        "images = state['annotations']['cedana.ai/checkpoint.path']\n"
        "with open(os.path.join(os.path.dirname(images), 'filler'), 'wb') as f:\n"
        "    try:\n"
        "        while True:\n"
        "            f.write(bytes(1 << 20))\n"
        "            f.flush()\n"
        "    except OSError:\n"
        "        pass\n"
    )
    script.chmod(0o755)
    (hooks_dir / "fill.json").write_text(
        json.dumps(
            {
                "version": "1.0.0",
                "hook": {"path": str(script)},
                "when": {"always": True},
                "stages": ["postcheckpoint"],
            }
        )
    )


def test_store_filling_up_before_the_checkpoint_is_durable_delivers_the_signal(
    fresh_containerd: Containerd, new_id: NewId, tmp_path: Path
) -> None:
    """The store's disk fills up after the dump, before the checkpoint is durable: the
    container is thawed and gets its SIGTERM (its trap prints got-TERM and exits 143 by
    itself), the failure says the store is full, nothing is listed or left staged, and
    the next start is cold."""
    c = fresh_containerd
    hooks = tmp_path / "hooks.d"
    hooks.mkdir()
    _fill_hook(hooks)
    with tmpfs_store(c, 96) as store:
        c.extra_env["CEDANA_HOOKS_DIRS"] = str(hooks)
        c.restart()
        with (
            EventStream(c.socket) as events,
            Workloads(
                c, new_id, label=unique_label("full"), script=counter_script(mem_kib=16 * 1024),
                namespace=CTR_NAMESPACE,
            ) as w,
        ):  # fmt: skip
            a = w.start("a")
            wait_ticks(a.lines, count=3)
            w.ctr("task", "kill", "-s", "SIGTERM", a.cid)
            failed = events.wait_topic(TOPIC_FAILED, a.cid, timeout=60)
            exited = events.wait_topic(TOPIC_EXIT, a.cid, timeout=30)
            assert exited.field("exit_status") == 143, exited
            wait_for(lambda: "got-TERM" in a.lines(), timeout=10, what="the TERM trap")
            error = str(failed.field("error"))
            assert "No space left on device" in error or "is full" in error, failed
            assert not events.of(TOPIC_COMMITTED, a.cid)
            w.delete(a)
            assert entries(store) == []
            assert not ingest_dirs(store), "the failed checkpoint's staging dir was left"
            started_cold(events, w.start("b"))


def test_shim_killed_while_the_checkpoint_compresses(
    fresh_containerd: Containerd, new_id: NewId
) -> None:
    """The checkpoint is durable (uncompressed) when the exit is reported; a SIGKILL to
    the shim while it compresses loses nothing: the next start resumes from it, and the
    next shim compresses it."""
    c = fresh_containerd
    with (
        EventStream(c.socket) as events,
        Workloads(
            c, new_id, label=unique_label("compact"), script=counter_script(mem_kib=BIG_KIB),
            namespace=CTR_NAMESPACE,
        ) as w,
    ):  # fmt: skip
        a = w.start("a")
        wait_ticks(a.lines, count=3)
        shim = shim_pid(c, a)
        w.ctr("task", "kill", "-s", "SIGTERM", a.cid)
        committed = events.wait_commit(a.cid, timeout=60)
        exited = events.wait_topic(TOPIC_EXIT, a.cid, timeout=30)
        assert exited.field("exit_status") == 143, exited
        listed = entries(c.store, label=w.label)
        assert [e.id for e in listed] == [committed.checkpoint_id]
        assert listed[0].state == "raw", "compressed before the test could kill the shim"
        os.kill(shim, signal.SIGKILL)
        counted = a.ticks()
        assert counted is not None
        w.ctr.remove(a.cid)

        b = w.start("b")
        restored_from(events, b, committed.checkpoint_id)
        assert_continues(counted, wait_ticks(b.lines, count=3), "resume after the shim died")
        # The next daemon that used the store compressed what the killed one left raw.
        wait_compacted(c.store, committed.checkpoint_id)
        (entry,) = store_is_sound(c.store)
        assert isinstance(entry, Entry) and entry.state == "compacted"


def test_compaction_after_the_task_is_deleted_is_logged_in_the_node_log(
    fresh_containerd: Containerd, new_id: NewId
) -> None:
    """containerd stops reading a shim's log once its last task is deleted; what the shim
    logs afterwards (the checkpoint compressed in the background) lands in the shims' own
    log file, with the same JSON records, mode 0600."""
    c = fresh_containerd
    with (
        EventStream(c.socket) as events,
        Workloads(
            c, new_id, label=unique_label("log"), script=counter_script(mem_kib=BIG_KIB),
            namespace=CTR_NAMESPACE,
        ) as w,
    ):  # fmt: skip
        a = w.start("a")
        wait_ticks(a.lines, count=3)
        w.ctr("task", "kill", "-s", "SIGTERM", a.cid)
        committed = events.wait_commit(a.cid, timeout=60)
        events.wait_topic(TOPIC_EXIT, a.cid, timeout=30)
        w.delete(a)  # at once: the compression is still running
        node_log = ShimLog(c, path=c.shim_log_file)
        node_log.wait("checkpoint compacted", checkpoint=committed.checkpoint_id, timeout=60)
        assert node_log.find("checkpoint committed", container=a.cid)
        assert c.shim_log_file.stat().st_mode & 0o777 == 0o600
