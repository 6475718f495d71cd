"""The shim's own robustness, with real containerd, runc and CRIU:

- a shim daemon SIGKILLed while it restores a container: containerd's `delete` stops the
  restore (runc, CRIU, its scripts, and the tasks CRIU already restored), so nothing of
  the container runs on outside containerd, and no `criu-root` mount nor any cgroup
  runc made for it is left behind;
- twenty containers started and stopped (one of them with its daemon SIGKILLed) leave
  the shim's run dir with exactly one fork server socket and no daemon socket, and `ps`
  names the fork server and the daemons for what they are.

CRIU is held at a chosen restore step by a CRIU action script added through the node
config (`criu_config_extra`), armed for the one restore the test interrupts: the step
is hit exactly, whatever the machine's speed.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import pytest
from cedana_shim.cli.fork_client import STALE_SOCKET_AGE
from cedana_shim.cli.proctitle import SHIM_NAME

from .harness import procs
from .harness.config import CTR_NAMESPACE
from .harness.containerd import RUNC_STATE_ROOT, Containerd
from .harness.cr_events import TOPIC_EXIT, EventStream
from .harness.cr_support import Box, Workloads, counter_script, criu_hold, wait_ticks
from .harness.util import wait_for

NewId = Callable[[str], str]
pytestmark = pytest.mark.ctrd_versions("1.6", "2.1")
RESTORE_TIMEOUT = 60  # node config: the gate's deadline; everything must end well before


def _configure(c: Containerd, env: dict[str, str]) -> None:
    c.extra_env.update(env)
    c.restart()


def _alive(pids: set[int]) -> set[int]:
    return {pid for pid in pids if procs.pid_alive(pid)}


def _gates(c: Containerd) -> set[int]:
    """Restore gates (CRIU action scripts the shim writes) of this containerd's shims."""
    base = f"{c.base}/"
    return {
        p.pid
        for p in procs.list_processes()
        if any(arg.startswith(base) and arg.endswith("/cedana-gate.sh") for arg in p.argv)
    }


def _cgroup_procs(cgroups_path: str) -> set[int]:
    """Processes left in the container's cgroup (v1: one dir per controller)."""
    found: set[int] = set()
    for procs_file in Path("/sys/fs/cgroup").glob(f"*/{cgroups_path.strip('/')}/cgroup.procs"):
        try:
            found |= {int(line) for line in procs_file.read_text().split()}
        except OSError:
            continue
    return found


def _runc_status(cid: str) -> str | None:
    listed = subprocess.run(
        ["runc", "--root", str(RUNC_STATE_ROOT / CTR_NAMESPACE), "list", "--format", "json"],
        capture_output=True,
        text=True,
        check=True,
        timeout=20,
    )
    for entry in json.loads(listed.stdout or "null") or []:
        if entry["id"] == cid:
            return str(entry["status"])
    return None


def _checkpoint_on_stop(w: Workloads, events: EventStream) -> None:
    """A first container of the label, stopped with SIGTERM: the shim checkpoints it."""
    box = w.start("a")
    wait_ticks(box.lines, count=3)
    w.ctr("task", "kill", "-s", "SIGTERM", box.cid)
    exited = events.wait_topic(TOPIC_EXIT, box.cid, timeout=30)
    assert exited.field("exit_status") == 143, exited
    events.wait_commit(box.cid, timeout=60)
    w.delete(box)


@pytest.mark.parametrize("stage", ["pre-restore", "post-restore"])
def test_a_shim_killed_while_it_restores_leaves_nothing_running(
    fresh_containerd: Containerd, new_id: NewId, stage: str
) -> None:
    """Before: `runc delete` in containerd's `delete` found no container (runc writes its
    state at the end of a restore), nothing was stopped, and runc and CRIU went on to
    run the container outside containerd; held at post-restore by the gate, the tasks
    waited far beyond restore_timeout, with `criu-root` still mounted; and the container's
    (empty) cgroup stayed in every controller."""
    c = fresh_containerd
    hold = criu_hold(c, stage, {"CEDANA_RESTORE_TIMEOUT": str(RESTORE_TIMEOUT)})
    script = counter_script()
    with (
        EventStream(c.socket) as events,
        Workloads(c, new_id, label=f"held-{stage}", script=script, namespace=CTR_NAMESPACE) as w,
    ):
        _checkpoint_on_stop(w, events)
        hold.arm()
        cid = new_id("b")
        w.started.append(Box(cid, w.logs / f"{cid}.log"))
        flags = ("-d", "--env", f"CEDANA_CHECKPOINT={w.label}")
        run = w.ctr.popen(*w.ctr.run_args(c.images.busybox, cid, "sh", "-c", script, flags=flags))
        everything: set[int] = set()
        try:
            hold.wait_held()
            bundle = c.bundle(CTR_NAMESPACE, cid)
            listing = procs.list_processes()
            (runc,) = [p.pid for p in listing if "restore" in p.argv and p.argv[-1] == cid]
            # CRIU, its scripts (the gate, the hold) and the tasks restored so far.
            everything = {runc} | procs.descendants({runc}, listing)
            restored = {
                p.pid for p in listing if p.pid in everything and p.argv[:2] == ("sh", "-c")
            }
            if stage == "post-restore":
                assert restored, "CRIU held at post-restore, but no restored task found"
            assert list(bundle.glob("work/*/*/cedana-gate.sh")), "not a gated (cached) restore"
            cgroups_path = json.loads((bundle / "config.json").read_text())["linux"]["cgroupsPath"]
            criu_root = RUNC_STATE_ROOT / CTR_NAMESPACE / cid / "criu-root"
            assert str(criu_root) in procs.mounts_under(criu_root), "runc bound no criu-root"
            (shim,) = c.shim_pids(CTR_NAMESPACE, cid)

            os.kill(shim, signal.SIGKILL)
            killed = time.monotonic()
            wait_for(
                lambda: not _alive(everything),
                timeout=20,
                what=f"runc, CRIU and the restored tasks to die (left: {_alive(everything)})",
            )
            assert time.monotonic() - killed < RESTORE_TIMEOUT
        finally:
            for pid in _alive(everything):  # what a failed assertion leaves held forever
                procs.kill_quietly(pid, signal.SIGKILL)
            try:
                run.communicate(timeout=30)
            except subprocess.TimeoutExpired:
                run.kill()
                run.communicate()
        # containerd's cleanup after the dead shim (its `delete`) has run to the end.
        wait_for(
            lambda: (t := w.ctr.task(cid)) is None or t.status == "STOPPED",
            timeout=20,
            what=f"containerd to clean up after the shim of {cid}",
        )
        wait_for(lambda: not procs.mounts_under(bundle), timeout=10, what=f"{bundle} unmounted")
        assert not _cgroup_procs(cgroups_path)
        # runc restore made the container's cgroup in every controller; runc never wrote
        # its state, so `runc delete` did not remove them: the dead shim's delete does.
        assert not procs.container_cgroups(cgroups_path), "the killed restore's cgroups were left"
        assert _runc_status(cid) in (None, "stopped")
        assert not procs.mounts_under(criu_root)
        assert not _gates(c)


def test_the_run_dir_stays_clean_over_many_containers(
    fresh_containerd: Containerd, new_id: NewId
) -> None:
    """Twenty containers, one of them with its daemon SIGKILLed: afterwards the run dir
    holds one fork server socket and no daemon socket. Before: the killed daemon's socket
    stayed, and `ps` showed every daemon as `python -m cedana_shim.cli.forkserver ...`."""
    c = fresh_containerd
    # A run dir of its own (short: socket paths are limited to 108 bytes).
    run_dir = Path(tempfile.mkdtemp(prefix="cedana-itest-", dir="/run"))
    try:
        _configure(c, {"CEDANA_RUN_DIR": str(run_dir)})
        _start_and_stop_containers(c, new_id, run_dir)
    finally:
        for path in run_dir.glob("forkserver-*.sock"):
            for pid in procs.socket_holders(procs.unix_listener_inodes(str(path))):
                procs.kill_quietly(pid, signal.SIGTERM)
        shutil.rmtree(run_dir, ignore_errors=True)


def _kill_its_daemon(c: Containerd, cid: str) -> None:
    """SIGKILL the daemon of a running container (found by name in `ps` first, as
    containerd's own shims are); containerd then runs `delete`."""
    (shim,) = c.shim_pids(CTR_NAMESPACE, cid)
    named = {s.pid: s for s in c.shims()}
    assert shim in named, f"`ps` does not name daemon {shim}: {procs.read_argv(shim)}"
    assert (named[shim].binary, named[shim].id) == (SHIM_NAME, cid)
    time.sleep(STALE_SOCKET_AGE + 0.5)  # no longer a socket that may be mid-bind
    os.kill(shim, signal.SIGKILL)
    ctr = c.ctr(CTR_NAMESPACE)
    wait_for(
        lambda: (t := ctr.task(cid)) is None or t.status == "STOPPED",
        timeout=20,
        what=f"containerd to clean up after the daemon of {cid}",
    )


def _start_and_stop_containers(c: Containerd, new_id: NewId, run_dir: Path) -> None:
    ctr = c.ctr(CTR_NAMESPACE)
    for i in range(20):
        cid = new_id(f"c{i}")
        if i != 10:
            ctr(*ctr.run_args(c.images.busybox, cid, "true", flags=("--rm",)))
            continue
        with ctr.detached(c.images.busybox, cid, "sleep", "600"):
            _kill_its_daemon(c, cid)

    def settled() -> list[str] | None:
        daemons = sorted(os.listdir(run_dir / "s"))
        return None if daemons else sorted(os.listdir(run_dir))

    entries = wait_for(settled, timeout=20, what=f"daemon sockets to go: {run_dir / 's'}")
    servers = [e for e in entries if e.startswith("forkserver-")]
    assert len(servers) == 1 and set(entries) == {servers[0], "s"}, entries
    (server,) = procs.socket_holders(procs.unix_listener_inodes(str(run_dir / servers[0])))
    assert procs.read_argv(server) == (SHIM_NAME, "template")
