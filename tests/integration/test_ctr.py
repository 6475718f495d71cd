"""Task lifecycle through `ctr`: every test is parametrized over containerd 1.6/1.7/2.1
and passes against containerd's runc shim (CEDANA_TEST_RUNTIME=runc); the cedana shim
must behave the same."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from .harness import procs
from .harness.config import CTR_NAMESPACE
from .harness.containerd import Containerd
from .harness.ctr import Ctr, PtySession, TaskRow
from .harness.tasks_api import update_task
from .harness.util import WaitAborted, wait_for

NewId = Callable[[str], str]
# pid 1 of a pid namespace ignores signals it has no handler for, so a shell loop as
# init survives SIGTERM; the loop keeps the container busy without a long `sleep`.
IDLE = ("sh", "-c", "while :; do sleep 0.1; done")
# /tmp/count by rename: a reader never sees it truncated and not yet written.
COUNTER = (
    "i=0; while true; do i=$((i+1)); echo $i > /tmp/count.new; mv /tmp/count.new /tmp/count; "
    "echo $i; sleep 0.1; done"
)


def _host_pidns() -> str:
    # /proc/1/ns/pid is not openable on this VM (its init is protected); our own pid
    # namespace is the host's.
    return f"pid:/proc/{os.getpid()}/ns/pid"


# -- ctr run ---------------------------------------------------------------------------


def _read_streams(proc: subprocess.Popen[str], *, stdout: str, stderr: str) -> None:
    """Read an attached ctr's stdout and stderr until they hold exactly ``stdout`` and
    ``stderr`` (bounded); fails at once on anything else, or if ctr exits first."""
    assert proc.stdout is not None and proc.stderr is not None
    want = {proc.stdout.fileno(): stdout.encode(), proc.stderr.fileno(): stderr.encode()}
    got = dict.fromkeys(want, b"")
    for fd in want:
        os.set_blocking(fd, False)

    def complete() -> bool:
        for fd, expected in want.items():
            with contextlib.suppress(BlockingIOError):
                got[fd] += os.read(fd, 65536)
            if not expected.startswith(got[fd]):
                raise WaitAborted(f"ctr printed {got!r}, expected {want!r}")
        if got == want:
            return True
        if proc.poll() is not None:
            raise WaitAborted(f"ctr exited {proc.returncode} having printed {got!r}")
        return False

    wait_for(complete, timeout=30, what=f"ctr to print {want!r}")
    for fd in want:
        os.set_blocking(fd, True)


@contextlib.contextmanager
def _attached(proc: subprocess.Popen[str]) -> Iterator[subprocess.Popen[str]]:
    """An attached ctr, killed if the test fails before it ended."""
    try:
        yield proc
    except BaseException:
        proc.kill()
        proc.communicate()
        raise


def test_run_stdout_and_stderr_are_separate(
    containerd: Containerd, ctr: Ctr, new_id: NewId
) -> None:
    """The container's stdout and stderr reach ctr's own, apart.

    The container exits only once ctr has printed both: ctr's task Delete closes its
    FIFOs as soon as it learns of the exit (io.Close in containerd 1.6, io.Cancel in 1.7
    and 2.x), so what it had not read by then is lost, and with two busy loops beside
    that happened to containerd's runc shim in 1 to 3 runs out of 150 on each version. The
    shim's own part, never reporting an exit before the output is copied out, is
    tests/unit/test_task_stdio_at_exit.py."""
    cid = new_id("c")
    go = containerd.bundle(CTR_NAMESPACE, cid) / "rootfs" / "go"
    script = "echo out-line; echo err-line >&2; echo out-2; until [ -e /go ]; do sleep 0.05; done"
    argv = ctr.run_args(containerd.images.busybox, cid, "sh", "-c", script, flags=("--rm",))
    with _attached(ctr.popen(*argv)) as proc:
        _read_streams(proc, stdout="out-line\nout-2\n", stderr="err-line\n")
        go.touch()
        rest = proc.communicate(timeout=60)
    assert (proc.returncode, *rest) == (0, "", "")
    assert cid not in ctr.containers()


def test_exit_is_reported_while_the_output_pipe_is_held_open(
    containerd: Containerd, ctr: Ctr, new_id: NewId
) -> None:
    """Something outside the container (here the test; a process escaped from its cgroup
    would do the same) keeps its stdout pipe open after the init exited: the shim's copy
    never sees EOF, yet the exit is reported and the task deleted, after bounded waits
    (containerd's runc shim bounds its wait in Delete as well)."""
    cid = new_id("held")
    go = containerd.bundle(CTR_NAMESPACE, cid) / "rootfs" / "go"
    script = "echo head; until [ -e /go ]; do sleep 0.05; done; exit 3"
    argv = ctr.run_args(containerd.images.busybox, cid, "sh", "-c", script, flags=("--rm",))
    with _attached(ctr.popen(*argv)) as proc:
        _read_streams(proc, stdout="head\n", stderr="")
        task = ctr.task(cid)
        assert task is not None
        held = os.open(f"/proc/{task.pid}/fd/1", os.O_WRONLY | os.O_CLOEXEC)
        try:
            go.touch()
            rest = proc.communicate(timeout=60)
        finally:
            os.close(held)
    assert proc.returncode == 3, rest
    assert rest == ("", "")
    assert cid not in ctr.containers()


@pytest.mark.parametrize("code", [0, 3])
def test_run_returns_exit_code(containerd: Containerd, ctr: Ctr, new_id: NewId, code: int) -> None:
    cid = new_id(f"exit{code}")
    proc = ctr(
        *ctr.run_args(
            containerd.images.busybox, cid, "sh", "-c", f"echo bye; exit {code}", flags=("--rm",)
        ),
        check=False,
    )
    assert proc.returncode == code, proc.stderr
    assert proc.stdout == "bye\n"
    assert cid not in ctr.containers(), "--rm must remove the container"


def test_run_forwards_stdin(containerd: Containerd, ctr: Ctr, new_id: NewId) -> None:
    cid = new_id("stdin")
    proc = ctr(
        *ctr.run_args(
            containerd.images.busybox,
            cid,
            "sh",
            "-c",
            'read a; read b; echo "$b|$a"',
            flags=("--rm",),
        ),
        input="first line\nsecond line\n",
    )
    assert proc.stdout == "second line|first line\n"
    assert cid not in ctr.containers()


def test_exec_closes_stdin_on_eof(containerd: Containerd, ctr: Ctr, new_id: NewId) -> None:
    """`cat` only exits once the shim closes the process's stdin (CloseIO) after ctr
    saw EOF. Checked through `ctr task exec`: `ctr run` sends CloseIO only when the EOF
    arrives after the task started, so it hangs against the runc shim as well."""
    cid = new_id("eof")
    data = "first line\nsecond line\n"
    with ctr.detached(containerd.images.busybox, cid, *IDLE):
        proc = ctr("task", "exec", "--exec-id", "cat", cid, "cat", input=data, timeout=20)
        assert proc.stdout == data


def test_run_of_missing_binary_fails_cleanly(
    containerd: Containerd, ctr: Ctr, new_id: NewId
) -> None:
    cid = new_id("nobin")
    proc = ctr(
        *ctr.run_args(containerd.images.busybox, cid, "/no/such/binary", flags=("--rm",)),
        check=False,
    )
    assert proc.returncode != 0
    assert "/no/such/binary" in proc.stderr, proc.stderr
    assert ctr.task(cid) is None
    # ctr removes the container itself when task creation fails under --rm.
    ctr("containers", "delete", cid, check=False)
    assert cid not in ctr.containers()
    bundle = containerd.bundle(CTR_NAMESPACE, cid)
    wait_for(lambda: not bundle.exists(), timeout=10, what="the failed task's bundle to go")
    assert not procs.mounts_under(bundle)


@pytest.mark.parametrize(
    ("sig", "pidns", "expected"),
    [
        # In the host pid namespace `sleep` is not an init: SIGTERM really kills it and
        # the shim must report 128+15 from the wait status.
        ("SIGTERM", "host", 143),
        ("SIGKILL", "own", 137),
    ],
    ids=["sigterm-143", "sigkill-137"],
)
def test_killed_task_reports_signal_exit(
    containerd: Containerd, ctr: Ctr, new_id: NewId, sig: str, pidns: str, expected: int
) -> None:
    cid = new_id("sig")
    flags = ["--rm"] + (["--with-ns", _host_pidns()] if pidns == "host" else [])
    run = ctr.popen(
        *ctr.run_args(containerd.images.busybox, cid, "sleep", "60", flags=tuple(flags))
    )
    try:
        row = ctr.wait_status(cid, "RUNNING", proc=run)
        assert procs.pid_alive(row.pid)
        ctr("task", "kill", "-s", sig, cid)
        rc = run.wait(timeout=15)
        assert rc == expected, run.stderr.read() if run.stderr else ""
        wait_for(lambda: not procs.pid_alive(row.pid), timeout=5, what="container pid to exit")
    finally:
        if run.poll() is None:
            run.kill()
        ctr.remove(cid)


def _expect_stty(session: PtySession, rows: int, cols: int) -> None:
    """Ask the container's shell for its terminal size until it reports `rows cols`.

    The resize travels ctr -> containerd -> shim -> console asynchronously, and ctr
    only starts listening for SIGWINCH after its initial resize: a window change that
    lands in between is lost, so repeat the signal the kernel sent on each retry.
    """
    want = f"{rows} {cols}".encode()
    deadline = time.monotonic() + 10
    while True:
        start = len(session.output)
        session.write(b"s\n")
        try:
            session.expect(want, timeout=0.5, since=start)
            return
        except AssertionError:
            if time.monotonic() > deadline:
                raise
            os.kill(session.pid, signal.SIGWINCH)


TTY_SCRIPT = 'tty; echo tty-ready; while read line; do [ "$line" = q ] && exit 6; stty size; done'


def test_run_with_tty_and_resize(containerd: Containerd, ctr: Ctr, new_id: NewId) -> None:
    cid = new_id("tty")
    argv = ctr.argv(
        *ctr.run_args(containerd.images.busybox, cid, "sh", "-c", TTY_SCRIPT, flags=("--rm", "-t"))
    )
    session = PtySession(argv, rows=24, cols=80)
    try:
        session.expect(b"tty-ready", timeout=15)
        assert re.search(rb"/dev/pts/\d+", session.output), session.output
        _expect_stty(session, 24, 80)
        session.resize(40, 132)
        _expect_stty(session, 40, 132)
        session.write(b"q\n")
        result = session.wait(timeout=15)
    finally:
        session.close()
        ctr.remove(cid)
    assert result.returncode == 6, result.output
    assert cid not in ctr.containers()


# -- exec, ps, pause/resume, metrics, update ---------------------------------------------


def test_exec_output_and_exit_code(containerd: Containerd, ctr: Ctr, new_id: NewId) -> None:
    cid = new_id("exec")
    with ctr.detached(containerd.images.busybox, cid, *IDLE):
        proc = ctr(
            "task",
            "exec",
            "--exec-id",
            "e1",
            cid,
            "sh",
            "-c",
            "echo exec-out; echo exec-err >&2; exit 5",
            check=False,
        )
        assert proc.returncode == 5, proc.stderr
        assert proc.stdout == "exec-out\n"
        assert proc.stderr == "exec-err\n"
        # The exec id is free again once the exec was waited for.
        again = ctr("task", "exec", "--exec-id", "e1", cid, "cat", "/etc/passwd")
        assert again.stdout.startswith("root:x:0:0:")


def test_exec_stdin_and_missing_binary(containerd: Containerd, ctr: Ctr, new_id: NewId) -> None:
    cid = new_id("execio")
    with ctr.detached(containerd.images.busybox, cid, *IDLE) as task:
        proc = ctr(
            "task",
            "exec",
            "--exec-id",
            "rd",
            cid,
            "sh",
            "-c",
            "read a; echo got:$a",
            input="via stdin\n",
        )
        assert proc.stdout == "got:via stdin\n"
        bad = ctr("task", "exec", "--exec-id", "bad", cid, "/no/such/binary", check=False)
        assert bad.returncode != 0
        assert "/no/such/binary" in bad.stderr, bad.stderr
        # A failed exec leaves the task untouched and the exec id reusable.
        assert ctr.task(cid) == task
        assert ctr("task", "exec", "--exec-id", "bad", cid, "true").returncode == 0


def test_exec_with_tty(containerd: Containerd, ctr: Ctr, new_id: NewId) -> None:
    cid = new_id("exectty")
    with ctr.detached(containerd.images.busybox, cid, *IDLE):
        argv = ctr.argv(
            "task",
            "exec",
            "-t",
            "--exec-id",
            "t1",
            cid,
            "sh",
            "-c",
            "tty; echo tty-exec-ok; exit 4",
        )
        session = PtySession(argv)
        try:
            result = session.wait(timeout=20)
        finally:
            session.close()
        assert result.returncode == 4, result.output
        assert b"tty-exec-ok" in result.output
        assert re.search(rb"/dev/pts/\d+", result.output), result.output


def _wait_argv(pid: int, argv: tuple[str, ...]) -> None:
    wait_for(lambda: procs.read_argv(pid) == argv, timeout=5, what=f"pid {pid} to run {argv}")


def _ps_pids(ctr: Ctr, cid: str) -> set[int]:
    lines = ctr("task", "ps", cid).stdout.splitlines()
    assert lines and lines[0].split()[0] == "PID", lines
    return {int(line.split()[0]) for line in lines[1:] if line.strip()}


def test_ps_lists_init_and_exec_pids(containerd: Containerd, ctr: Ctr, new_id: NewId) -> None:
    cid = new_id("ps")
    # A lone `sleep` as init: no short-lived children to race with the listing.
    with ctr.detached(containerd.images.busybox, cid, "sleep", "300") as task:
        assert _ps_pids(ctr, cid) == {task.pid}
        exec_proc = ctr.popen("task", "exec", "--exec-id", "sleeper", cid, "sleep", "77")
        try:

            def with_exec() -> set[int] | None:
                pids = _ps_pids(ctr, cid)
                return pids if len(pids) == 2 else None

            pids = wait_for(with_exec, timeout=10, what="the exec's pid in `ctr task ps`")
            (exec_pid,) = pids - {task.pid}
            assert task.pid in pids
            # (`runc start`/`runc exec` return just before the process's own execve.)
            _wait_argv(exec_pid, ("sleep", "77"))
            _wait_argv(task.pid, ("sleep", "300"))
            ctr("task", "kill", "--exec-id", "sleeper", "-s", "SIGKILL", cid)
            assert exec_proc.wait(timeout=10) == 137
            wait_for(
                lambda: _ps_pids(ctr, cid) == {task.pid},
                timeout=5,
                what="exec pid to leave `ctr task ps`",
            )
        finally:
            if exec_proc.poll() is None:
                exec_proc.kill()


@pytest.mark.cgroup_v1  # freezer.state; tests/vm covers cgroup v2
def test_pause_and_resume(containerd: Containerd, ctr: Ctr, new_id: NewId) -> None:
    cid = new_id("pause")
    with ctr.detached(containerd.images.busybox, cid, "sh", "-c", COUNTER) as task:
        freezer = procs.cgroup_dir(task.pid, "freezer") / "freezer.state"
        ctr("task", "pause", cid)
        assert ctr.task(cid).status == "PAUSED"  # type: ignore[union-attr]
        assert freezer.read_text().strip() == "FROZEN"
        count = ctr("task", "exec", "--exec-id", "c1", cid, "cat", "/tmp/count", check=False)
        assert count.returncode != 0, "an exec into a paused task must fail"
        ctr("task", "resume", cid)
        assert ctr.task(cid).status == "RUNNING"  # type: ignore[union-attr]
        assert freezer.read_text().strip() == "THAWED"
        before = int(ctr("task", "exec", "--exec-id", "c2", cid, "cat", "/tmp/count").stdout)
        wait_for(
            lambda: (
                int(ctr("task", "exec", "--exec-id", "c3", cid, "cat", "/tmp/count").stdout)
                > before
            ),
            timeout=5,
            what="the counter to move after resume",
        )


@pytest.mark.cgroup_v1  # v1 metrics; tests/vm covers cgroup v2
def test_metrics_report_memory_and_cpu(containerd: Containerd, ctr: Ctr, new_id: NewId) -> None:
    cid = new_id("metrics")
    with ctr.detached(containerd.images.busybox, cid, "sh", "-c", COUNTER):
        time.sleep(0.3)  # let it burn some CPU
        table = ctr("task", "metrics", cid).stdout
        assert re.search(r"memory\.usage_in_bytes\s+[1-9]\d*", table), table
        assert re.search(r"cpuacct\.usage\s+[1-9]\d*", table), table
        data = json.loads(ctr("task", "metrics", "--format", "json", cid).stdout)
        assert data["memory"]["usage"]["usage"] > 0, data
        assert data["cpu"]["usage"]["total"] > 0, data
        assert data["pids"]["current"] >= 2, data


@pytest.mark.cgroup_v1  # memory.limit_in_bytes; tests/vm covers cgroup v2
def test_update_memory_limit(containerd: Containerd, ctr: Ctr, new_id: NewId) -> None:
    # ctr has no `task update`: make the Tasks.Update call its client library makes.
    cid = new_id("update")
    limit = 64 * 1024 * 1024
    with ctr.detached(containerd.images.busybox, cid, *IDLE) as task:
        cg = procs.cgroup_dir(task.pid, "memory")
        assert procs.read_int(cg / "memory.limit_in_bytes") != limit
        update_task(containerd.socket, CTR_NAMESPACE, cid, {"memory": {"limit": limit}})
        assert procs.read_int(cg / "memory.limit_in_bytes") == limit
        metrics = json.loads(ctr("task", "metrics", "--format", "json", cid).stdout)
        assert metrics["memory"]["usage"]["limit"] == limit
        # Still running and usable under the new limit.
        assert ctr("task", "exec", "--exec-id", "u1", cid, "echo", "alive").stdout == "alive\n"


# -- checkpoint / restore ------------------------------------------------------------------


def _count(ctr: Ctr, cid: str, exec_id: str) -> int:
    return int(ctr("task", "exec", "--exec-id", exec_id, cid, "cat", "/tmp/count").stdout)


def test_checkpoint_and_live_restore_continue_counting(
    containerd: Containerd, ctr: Ctr, new_id: NewId
) -> None:
    cid = new_id("ckpt")
    image_ref = f"cedana-itest/checkpoint:{cid}"
    try:
        ctr(*ctr.run_args(containerd.images.busybox, cid, "sh", "-c", COUNTER, flags=("-d",)))
        ctr.wait_status(cid, "RUNNING")
        # 15 counts = 1.5 s: a cold start could not get there in the time the checks take.
        before = wait_for(
            lambda: n if (n := _count(ctr, cid, "w")) >= 15 else None,
            timeout=10,
            what="count >= 15",
        )
        ctr("containers", "checkpoint", "--task", cid, image_ref, timeout=60)
        assert image_ref in ctr("images", "ls", "-q").stdout.split()
        # The checkpoint leaves the task running.
        assert ctr.task(cid) is not None
        assert _count(ctr, cid, "after-ckpt") >= before

        ctr.remove(cid)
        assert cid not in ctr.containers()

        ctr("containers", "restore", "--live", cid, image_ref, timeout=60)
        restored = ctr.wait_status(cid, "RUNNING")
        # The rootfs is fresh from the image: /tmp/count is rewritten by the restored
        # process from its in-memory counter, maybe only after its current `sleep`.
        first = wait_for(lambda: _count(ctr, cid, "r1"), timeout=5, what="restored count")
        assert first >= before, f"count {first} after restore, {before} before: a cold start?"
        wait_for(lambda: _count(ctr, cid, "r2") > first, timeout=5, what="counting on")
        assert procs.pid_alive(restored.pid)
    finally:
        ctr.remove(cid)
        ctr("images", "rm", image_ref, check=False)


# -- containerd restart, dead shim ----------------------------------------------------------


@pytest.mark.parametrize("how", ["graceful", "crash"])
def test_containerd_restart_keeps_tasks(
    fresh_containerd: Containerd, new_id: NewId, how: str
) -> None:
    c = fresh_containerd
    ctr = c.ctr(CTR_NAMESPACE)
    trapper, sleeper = new_id("trap"), new_id("sleep")
    ctr(
        *ctr.run_args(
            c.images.busybox,
            trapper,
            "sh",
            "-c",
            'trap "exit 7" TERM; while :; do sleep 0.1; done',
            flags=("-d",),
        )
    )
    ctr(*ctr.run_args(c.images.busybox, sleeper, "sleep", "300", flags=("-d",)))
    before = {cid: ctr.wait_status(cid, "RUNNING").pid for cid in (trapper, sleeper)}
    shims_before = set(c.shim_daemons())
    assert len(shims_before) == 2, c.shim_daemons()

    c.restart(signal.SIGTERM if how == "graceful" else signal.SIGKILL)

    for cid, pid in before.items():
        assert procs.pid_alive(pid), f"{cid} (pid {pid}) died with containerd"

    def both_running() -> dict[str, TaskRow] | None:
        tasks = ctr.tasks()
        ok = all(cid in tasks and tasks[cid].status == "RUNNING" for cid in before)
        return tasks if ok else None

    tasks = wait_for(both_running, timeout=15, what="both tasks RUNNING after restart")
    assert {cid: tasks[cid].pid for cid in before} == before
    assert set(c.shim_daemons()) == shims_before, "shims must be reconnected, not replaced"

    # Exit codes still travel from the (reconnected) shim to containerd.
    attach = ctr.popen("task", "attach", trapper)
    time.sleep(0.3)  # attach subscribes to the exit before we signal
    ctr("task", "kill", "-s", "SIGTERM", trapper)
    assert attach.wait(timeout=15) == 7
    ctr("task", "kill", "-s", "SIGKILL", sleeper)
    wait_for(
        lambda: (t := ctr.task(sleeper)) is None or t.status == "STOPPED",
        timeout=10,
        what="sleeper to stop",
    )
    deleted = ctr("task", "delete", sleeper)
    assert "137" in deleted.stderr, deleted.stderr
    for cid in before:
        ctr.remove(cid)
    wait_for(
        lambda: not any(procs.pid_alive(p) for p in shims_before),
        timeout=10,
        what="shims to exit after their tasks were deleted",
    )


def test_killed_shim_is_cleaned_up(fresh_containerd: Containerd, new_id: NewId) -> None:
    c = fresh_containerd
    ctr = c.ctr(CTR_NAMESPACE)
    cid = new_id("deadshim")
    ctr(*ctr.run_args(c.images.busybox, cid, *IDLE, flags=("-d",)))
    task = ctr.wait_status(cid, "RUNNING")
    bundle = c.bundle(CTR_NAMESPACE, cid)
    assert procs.mounts_under(bundle), "the running task's rootfs should be mounted"
    shims = c.shim_pids(CTR_NAMESPACE, cid)
    assert len(shims) == 1, shims
    (shim_pid,) = shims
    assert procs.read_ppid(task.pid) == shim_pid, "the shim should be the task's parent"

    os.kill(shim_pid, signal.SIGKILL)

    wait_for(lambda: not procs.pid_alive(shim_pid), timeout=5, what="shim to die")

    def task_gone_or_stopped() -> str | None:
        row = ctr.task(cid)
        if row is None:
            return "gone"
        return "stopped" if row.status == "STOPPED" else None

    outcome = wait_for(task_gone_or_stopped, timeout=15, what="containerd to notice the dead shim")
    wait_for(
        lambda: not procs.pid_alive(task.pid), timeout=10, what="the orphaned task to be killed"
    )
    if outcome == "stopped":
        ctr("task", "delete", cid)
    ctr("containers", "delete", cid)
    assert cid not in ctr.containers()
    wait_for(
        lambda: not procs.mounts_under(c.state),
        timeout=5,
        what="no mounts under containerd's state dir",
    )
    assert not bundle.exists() or not procs.mounts_under(bundle)
    assert not c.shim_daemons()
    assert Path(c.log_path).read_text().count("cleaning up after shim") >= 1
