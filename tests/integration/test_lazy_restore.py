"""Lazy restore (node config `lazy_restore`), end to end on real containerd, runc and
CRIU: the restored workload runs before its memory is in, CRIU's lazy-pages daemon
bringing the rest; its memory comes back intact. When the lazy path fails (the daemon
does not start, or dies during the restore or once the tasks run, which leaves their
memory zero-filled), the shim kills what runs and restores the same checkpoint eagerly,
saying why. A Kill while
the pages are still arriving leaves neither task nor daemon behind.

The failures are real CRIU with its lazy-pages daemon sabotaged: the node's PATH starts
with a `criu` wrapper that passes every other command to the real CRIU and, for
`criu lazy-pages`, refuses; or runs the real daemon on a copy of the images whose
memory pages stop half-way (it fails, during the restore or once the tasks run); or
stops the real daemon once the restore is done (the memory never arrives, for a Kill to
land).

Versions: containerd 1.6 and 2.1 (the shim's own machinery; see
test_checkpoint_faults.py for why those two).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest

from .harness import procs
from .harness.config import CRIU, CTR_NAMESPACE
from .harness.containerd import Containerd
from .harness.cr_events import TOPIC_EXIT, EventStream
from .harness.cr_support import (
    Box,
    Counter,
    ShimLog,
    Workloads,
    assert_continues,
    counter_script,
    restored_from,
    shim_pid,
    unique_label,
    wait_ticks,
)
from .harness.cr_tasks import TaskKiller
from .harness.util import wait_for

NewId = Callable[[str], str]
MakeNode = Callable[[dict[str, str]], Containerd]
pytestmark = pytest.mark.ctrd_versions("1.6", "2.1")
COMMIT_TIMEOUT = 60
MEM_KIB = 64 * 1024  # enough pages that the daemon has real work after the tasks resume
# The workload's own proof that its memory came back: the md5 of its 64 MiB, once at
# start and again whenever /var/check appears.
PADSUM = 'echo "padsum $(echo "$pad" | md5sum)"\n'
CHECK = f"  if [ -e /var/check ]; then rm /var/check; {PADSUM.strip()}; fi\n"
_PADSUM = re.compile(r"^padsum ([0-9a-f]{32})")

WRAPPER = """#!/bin/sh
# The node's criu for this test: the real one, but for its lazy-pages daemon (mode {mode}).
REAL={real}
[ "$1" = lazy-pages ] || exec "$REAL" "$@"
if [ {mode} = refuse ]; then
  echo "Error (test): lazy-pages refused for this test" >&2
  exit 1
fi
images=
work=
prev=
for arg in "$@"; do
  [ "$prev" = --images-dir ] && images=$arg
  [ "$prev" = --work-dir ] && work=$arg
  prev=$arg
done
if [ {mode} = truncate ]; then
  # The daemon gets a copy whose memory pages stop half-way: it serves the first
  # faults, then fails reading the rest, its tasks running.
  copy={scratch}/images
  rm -rf "$copy" && cp -a "$images" "$copy"
  for pages in "$copy"/pages-*.img; do
    truncate -s $(( $(stat -c %s "$pages") / 2 )) "$pages"
  done
  shift 3
  exec "$REAL" lazy-pages --images-dir "$copy" "$@"
fi
# freeze: the real daemon, stopped once CRIU says the restore is done (its tasks
# resumed): the rest of the memory never arrives, the tasks wait on their next fault.
# (Not earlier: CRIU's restore itself faults pages in through the daemon.)
"$REAL" "$@" &
daemon=$!
until grep -q "Restore finished successfully" "$work/restore.log" 2>/dev/null; do
  kill -0 $daemon 2>/dev/null || break
  sleep 0.005
done
kill -STOP $daemon 2>/dev/null
wait $daemon
"""


def lazy_node(make_node: MakeNode, tmp_path: Path, mode: str = "") -> Containerd:
    """A node with lazy_restore on; with `mode`, its criu's lazy-pages is sabotaged."""
    env = {"CEDANA_LAZY_RESTORE": "true"}
    if mode:
        wrapped = tmp_path / f"criu-{mode}"
        wrapped.mkdir()
        criu = wrapped / "criu"
        criu.write_text(WRAPPER.format(mode=mode, real=CRIU, scratch=wrapped))
        criu.chmod(0o755)
        env["PATH"] = str(wrapped)  # in front of the node's own
    return make_node(env)


def padsums(box: Box) -> list[str]:
    return [m.group(1) for line in box.lines() if (m := _PADSUM.match(line))]


def check_memory(w: Workloads, box: Box, expected: str) -> None:
    """The workload re-reads its whole memory (which the daemon may still be copying)."""
    before = len(padsums(box))
    Path(f"/proc/{w.pid(box)}/root/var/check").touch()
    wait_for(lambda: len(padsums(box)) > before, timeout=60, what=f"{box.cid} to check memory")
    assert padsums(box)[-1] == expected, f"{box.cid}: memory came back different"


def lazy_daemons(*shims: int) -> set[int]:
    """CRIU lazy-pages daemons (and our wrappers of them) working for these shims."""
    return {
        pid
        for pid in procs.descendants(set(shims))
        if (argv := procs.read_argv(pid)) and "lazy-pages" in argv
    }


def checkpointed(w: Workloads, events: EventStream) -> tuple[str, str, Counter]:
    """Container "a" with its 64 MiB, stopped with a checkpoint: (checkpoint id, a's
    memory sum, a's last count)."""
    a = w.start("a")
    wait_ticks(a.lines, count=3, timeout=60)
    (padsum,) = padsums(a)
    w.ctr("task", "kill", "-s", "SIGTERM", a.cid)
    exited = events.wait_topic(TOPIC_EXIT, a.cid, timeout=60)
    assert exited.field("exit_status") == 143, exited
    committed = events.wait_commit(a.cid, timeout=COMMIT_TIMEOUT)
    w.delete(a)
    counted = a.ticks()
    assert counted is not None
    return committed.checkpoint_id, padsum, counted


def workloads(c: Containerd, new_id: NewId, tag: str, mem_kib: int = MEM_KIB) -> Workloads:
    script = counter_script(mem_kib=mem_kib, extra=PADSUM, each_tick=CHECK)
    return Workloads(c, new_id, label=unique_label(tag), script=script, namespace=CTR_NAMESPACE)


def test_a_lazy_restore_resumes_the_workload_with_its_memory_intact(
    make_node: MakeNode, new_id: NewId, tmp_path: Path
) -> None:
    c = lazy_node(make_node, tmp_path)
    log = ShimLog(c)
    with EventStream(c.socket) as events, workloads(c, new_id, "lazy") as w:
        checkpoint, padsum, counted = checkpointed(w, events)
        b = w.start("b")
        restored_from(events, b, checkpoint)
        done = log.wait("restored from checkpoint", container=b.cid)
        assert done["memory"] == "lazy", done
        assert not done["why"], done  # nothing passed over: the lazy path itself worked
        pages = log.wait("lazy restore: all memory in", container_id=b.cid)
        assert pages["seconds"] > 0
        assert_continues(counted, wait_ticks(b.lines, count=3), "lazy restore")
        check_memory(w, b, padsum)
        assert lazy_daemons(shim_pid(c, b)) == set()  # it exited once all was in


# CI time: the fallback is the shim's own; containerd's version plays no part.
@pytest.mark.ctrd_versions("2.1")
@pytest.mark.parametrize("mode", ["refuse", "truncate"])
def test_a_failing_lazy_path_falls_back_to_an_eager_restore_of_the_same_checkpoint(
    make_node: MakeNode, new_id: NewId, tmp_path: Path, mode: str
) -> None:
    """refuse: the daemon never listens; truncate: it fails with the tasks running and
    half their memory not in (zero-filled from then on): they are killed and the same
    checkpoint restored eagerly, its memory intact."""
    c = lazy_node(make_node, tmp_path, mode)
    log = ShimLog(c)
    with EventStream(c.socket) as events, workloads(c, new_id, mode) as w:
        checkpoint, padsum, counted = checkpointed(w, events)
        b = w.start("b")
        restored_from(events, b, checkpoint)
        done = log.wait("restored from checkpoint", container=b.cid, timeout=120)
        assert done["memory"] == "eager", done
        why = done["why"]
        assert f"{checkpoint}: lazy restore failed, restoring eagerly: " in why, why
        if mode == "refuse":
            assert "lazy-pages refused for this test" in why, why
            assert "before listening" in why, why
        else:  # it fails on a fault of the restore itself, or on the tasks' first ones
            assert re.search(r"criu lazy-pages exited with status \d+ (during the restore|"
                             r"before all memory was in; the restored tasks were killed)",
                             why), why  # fmt: skip
        assert_continues(counted, wait_ticks(b.lines, count=3), f"eager after {mode}")
        check_memory(w, b, padsum)
        assert lazy_daemons(shim_pid(c, b)) == set()


@dataclass
class HeldRestore:
    """A lazy restore whose daemon was stopped once the tasks resumed (mode freeze)."""

    cid: str
    run: subprocess.Popen[str]  # the `ctr run -d`, waiting for Start
    shim: int
    daemons: set[int]  # the wrapper and the real daemon
    restored: set[int]  # the restored tasks


def held_restore(c: Containerd, w: Workloads, events: EventStream, new_id: NewId) -> HeldRestore:
    checkpointed(w, events)
    cid = new_id("b")
    b = Box(cid, w.logs / f"{cid}.log")
    w.started.append(b)
    run = w.ctr.popen(
        *w.ctr.run_args(
            c.images.busybox, cid, "sh", "-c", w.script,
            flags=("-d", "--env", f"CEDANA_CHECKPOINT={w.label}",
                   "--log-uri", f"file://{b.out}"),
        )
    )  # fmt: skip

    def serving() -> tuple[set[int], set[int]] | None:
        """(the shim daemon, its lazy-pages processes); the socket is briefly `start`'s
        before the daemon takes it over."""
        shims = c.shim_pids(CTR_NAMESPACE, cid)
        daemons = lazy_daemons(*shims)
        return (shims, daemons) if len(shims) == 1 and daemons else None

    found: tuple[set[int], set[int]] = wait_for(
        serving, timeout=60, what="b's shim daemon and its lazy-pages daemon"
    )
    shims, daemons = found
    (shim,) = shims
    restored: set[int] = wait_for(
        lambda: {p for p in procs.descendants(shims) if _is_workload(p)},
        timeout=60,
        what="the restored tasks",
    )
    time.sleep(0.5)
    assert run.poll() is None, (
        "ctr run returned: the daemon brought all the memory in before the wrapper could "
        "stop it (a faster machine: give the workload more memory)"
    )
    return HeldRestore(cid, run, shim, daemons | lazy_daemons(shim), restored)


def all_gone(held: HeldRestore) -> None:
    left = held.daemons | held.restored
    wait_for(
        lambda: not any(procs.pid_alive(p) for p in left),
        timeout=10,
        what=f"the daemon {held.daemons} and the tasks {held.restored} to be gone",
    )


# CI time: the kill is the shim's own; the dead-shim cleanup below runs on both.
@pytest.mark.ctrd_versions("2.1")
def test_kill_while_the_pages_arrive_leaves_no_process_behind(
    make_node: MakeNode, new_id: NewId, tmp_path: Path
) -> None:
    """The daemon is stopped once the restore is done: the restored tasks wait on their
    next page fault, and Start waits for the pages. A SIGKILL then kills the tasks and
    the daemon: the exit is 137, nothing is left. (With 256 MiB the daemon needs a few
    hundred ms for the rest, in which the wrapper stops it.)"""
    c = lazy_node(make_node, tmp_path, "freeze")
    with (
        EventStream(c.socket) as events,
        workloads(c, new_id, "freeze", mem_kib=4 * MEM_KIB) as w,
        TaskKiller(c.socket, CTR_NAMESPACE) as tasks,
    ):
        held = held_restore(c, w, events, new_id)
        tasks.kill(held.cid, signal.SIGKILL, timeout=10)
        exited = events.wait_topic(TOPIC_EXIT, held.cid, timeout=30)
        assert exited.field("exit_status") == 137, exited
        held.run.communicate(timeout=60)
        all_gone(held)
        assert lazy_daemons(held.shim) == set()


def test_a_shim_killed_while_the_pages_arrive_is_cleaned_up_by_delete(
    make_node: MakeNode, new_id: NewId, tmp_path: Path
) -> None:
    """The daemon outlives a SIGKILLed shim (it is the tasks' memory); containerd's
    `delete` finds its process group in the bundle and kills the tasks, then it."""
    c = lazy_node(make_node, tmp_path, "freeze")
    with (
        EventStream(c.socket) as events,
        workloads(c, new_id, "shimkill", mem_kib=4 * MEM_KIB) as w,
    ):
        held = held_restore(c, w, events, new_id)
        os.kill(held.shim, signal.SIGKILL)
        held.run.communicate(timeout=60)
        all_gone(held)
        w.ctr.remove(held.cid)


def _is_workload(pid: int) -> bool:
    """The restored shell (the container's init) or its `sleep`, by the kernel's name
    for it: its argv is in its own memory, which the stopped daemon never brings in."""
    try:
        comm = Path(f"/proc/{pid}/comm").read_text().strip()
    except OSError:
        return False
    return comm in ("sh", "sleep")
