"""A restore that outlives its daemon: runc restore runs in a process group of its own,
recorded in the bundle while it runs, and `delete` kills that group (and only that
group) before `runc delete`. Real process groups of `sleep`s stand in for runc and CRIU;
runc itself is a fake script."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any

import pytest
from cedana_shim.bundle_state import (
    CRIU_GROUP_MARK,
    BundleState,
    clear_criu_group,
    mark_criu_group,
    read_criu_group,
)
from cedana_shim.cli import delete, fork_client
from cedana_shim.cli.args import ShimArgs
from cedana_shim.runtime.pgroup import has_live_members, is_same_group, kill_criu_group, start_time
from cedana_shim.runtime.reaper import Reaper
from cedana_shim.runtime.runc import CheckpointOpts, RestoreOpts, Runc, RuncError
from support.processes import proc_stats, run_with_reaper

# -- helpers ------------------------------------------------------------------------------


def group_members(pgid: int) -> set[int]:
    """Live (not zombie) processes of group ``pgid``, from /proc."""
    return {pid for pid, f in proc_stats() if int(f[2]) == pgid and f[0] not in ("Z", "X")}


def wait_until(predicate: Callable[[], object], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.01)


@pytest.fixture
def group() -> Iterator[subprocess.Popen[bytes]]:
    """A process group like runc + CRIU: a leader (`sh`) and two `sleep` members."""
    proc = subprocess.Popen(
        ["sh", "-c", "sleep 600 & sleep 600 & wait"], process_group=0, stdin=subprocess.DEVNULL
    )
    wait_until(lambda: len(group_members(proc.pid)) == 3)
    yield proc
    for pid in group_members(proc.pid):
        kill_quietly(pid)
    proc.kill()
    proc.wait()


def kill_quietly(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGKILL)


# -- pgroup -------------------------------------------------------------------------------


def test_start_time_survives_a_process_name_with_parentheses(tmp_path: Path) -> None:
    """comm may hold ") (" and spaces: fields are counted after the last ')'."""
    odd = tmp_path / "x) 7 8 (y"
    odd.symlink_to("/bin/sleep")
    plain = subprocess.Popen(["sleep", "30"])
    weird = subprocess.Popen([str(odd), "30"])
    try:
        plain_start, weird_start = start_time(plain.pid), start_time(weird.pid)
        assert plain_start is not None and weird_start is not None
        assert 0 <= weird_start - plain_start < 500  # started right after, in clock ticks
        assert Path(f"/proc/{weird.pid}/comm").read_text().strip() == "x) 7 8 (y"
    finally:
        for p in (plain, weird):
            p.kill()
            p.wait()
    assert start_time(weird.pid) is None


def test_kill_criu_group_kills_the_leader_and_every_member(group: subprocess.Popen[bytes]) -> None:
    leader_start = start_time(group.pid)
    assert leader_start is not None
    assert kill_criu_group(group.pid, leader_start, timeout=5)
    assert group.wait(5) == -signal.SIGKILL
    assert not group_members(group.pid)
    assert not has_live_members(group.pid)


def test_a_reused_pid_is_never_killed(group: subprocess.Popen[bytes]) -> None:
    """Same pid, another start time: the recorded group is gone, this is someone else."""
    leader_start = start_time(group.pid)
    assert leader_start is not None
    assert not is_same_group(group.pid, leader_start + 1)
    assert kill_criu_group(group.pid, leader_start + 1, timeout=1)
    assert len(group_members(group.pid)) == 3
    assert group.poll() is None


def test_members_left_by_a_dead_leader_are_killed() -> None:
    """runc died (or exited) but CRIU, in its group, runs on: the group is still the
    recorded one, since its number cannot be reused while it has members."""
    leader = subprocess.Popen(
        ["sh", "-c", "sleep 600 & echo $!"], process_group=0, stdout=subprocess.PIPE
    )
    assert leader.stdout is not None
    orphan = int(leader.stdout.readline())
    leader_start = start_time(leader.pid)
    assert leader_start is not None
    assert leader.wait(5) == 0
    try:
        assert start_time(leader.pid) is None
        assert group_members(leader.pid) == {orphan}
        assert is_same_group(leader.pid, leader_start)
        assert kill_criu_group(leader.pid, leader_start, timeout=5)
        assert not group_members(leader.pid)
    finally:
        kill_quietly(orphan)


def test_a_finished_group_is_left_alone() -> None:
    proc = subprocess.Popen(["true"], process_group=0)
    leader_start = start_time(proc.pid)
    proc.wait()
    assert leader_start is not None
    started = time.monotonic()
    assert kill_criu_group(proc.pid, leader_start, timeout=5)
    assert time.monotonic() - started < 1
    assert not is_same_group(1, 0)  # never init's group, whatever a record says


# -- the bundle record --------------------------------------------------------------------


def test_criu_group_record_round_trip(tmp_path: Path) -> None:
    assert read_criu_group(str(tmp_path)) is None
    mark_criu_group(str(tmp_path), 4242, 987654)
    assert read_criu_group(str(tmp_path)) == (4242, 987654, False)
    assert not list(tmp_path.glob(".*.tmp"))
    clear_criu_group(str(tmp_path))
    clear_criu_group(str(tmp_path))  # idempotent
    assert read_criu_group(str(tmp_path)) is None
    (tmp_path / CRIU_GROUP_MARK).write_text("garbage\n")
    assert read_criu_group(str(tmp_path)) is None


# -- the runc driver ----------------------------------------------------------------------

FAKE_RUNC = r"""#!{python}
# restore or checkpoint: waits for the driver's record, reports what it sees, starts a
# "criu" (a sleep, same process group) and behaves as control.json says.
import json, os, signal, subprocess, sys, time

here = {here!r}
argv = sys.argv[1:]
verb = next(a for a in argv if a in ("restore", "checkpoint", "delete"))
control = json.load(open(os.path.join(here, "control.json")))
if control.get("ignore_term"):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
if verb == "checkpoint":  # the driver's bundle is the dir of runc's log
    bundle = os.path.dirname(argv[argv.index("--log") + 1])
else:
    bundle = argv[argv.index("--bundle") + 1]
record = os.path.join(bundle, "cedana-criu-group")
deadline = time.monotonic() + 5
while not os.path.exists(record) and time.monotonic() < deadline:
    time.sleep(0.005)
stat = open("/proc/self/stat").read().rsplit(")", 1)[1].split()
criu = subprocess.Popen(["sleep", "600"])
with open(os.path.join(here, "seen.json"), "w") as f:
    json.dump({{
        "pid": os.getpid(), "pgid": os.getpgid(0), "start": int(stat[19]),
        "record": open(record).read() if os.path.exists(record) else None,
        "criu": criu.pid,
    }}, f)
time.sleep(control.get("sleep", 0))
sys.exit(control.get("exit", 0))
"""


class FakeRunc:
    def __init__(self, tmp: Path) -> None:
        self.dir = tmp
        self.binary = tmp / "runc"
        self.binary.write_text(FAKE_RUNC.format(python=sys.executable, here=str(tmp)))
        self.binary.chmod(0o755)
        self.bundle = tmp / "bundle"
        self.bundle.mkdir()
        self.control()

    def control(self, **settings: object) -> None:
        (self.dir / "control.json").write_text(json.dumps(settings))

    def seen(self) -> dict[str, Any]:
        path = self.dir / "seen.json"
        wait_until(lambda: path.exists() and path.read_text())
        seen: dict[str, Any] = json.loads(path.read_text())
        return seen

    def runc(self, reaper: Reaper, **kwargs: Any) -> Runc:
        return Runc(reaper=reaper, root=str(self.dir / "root"), binary=str(self.binary), **kwargs)

    def opts(self) -> RestoreOpts:
        return RestoreOpts(bundle=str(self.bundle), image_path=str(self.dir / "images"))

    def operation(self, runc: Runc, verb: str) -> Coroutine[Any, Any, None]:
        if verb == "restore":
            return runc.restore("c1", self.opts())
        return runc.checkpoint("c1", CheckpointOpts(image_path=str(self.dir / "images")))

    def runc_logging_to_bundle(self, reaper: Reaper, **kwargs: Any) -> Runc:
        return self.runc(reaper, log_path=str(self.bundle / "log.json"), **kwargs)


def test_restore_runs_in_its_own_group_recorded_while_it_runs(tmp_path: Path) -> None:
    fake = FakeRunc(tmp_path)

    async def body(reaper: Reaper) -> None:
        await fake.runc(reaper).restore("c1", fake.opts())

    run_with_reaper(body)
    seen = fake.seen()
    assert seen["pgid"] == seen["pid"] != os.getpgid(0)
    assert seen["record"] == f"{seen['pid']} {seen['start']}\n"
    assert read_criu_group(str(fake.bundle)) is None  # cleared once runc returned
    kill_quietly(seen["criu"])


def test_a_failed_restore_clears_the_record(tmp_path: Path) -> None:
    fake = FakeRunc(tmp_path)
    fake.control(exit=1)

    async def body(reaper: Reaper) -> None:
        with pytest.raises(RuncError):
            await fake.runc(reaper).restore("c1", fake.opts())

    run_with_reaper(body)
    assert read_criu_group(str(fake.bundle)) is None
    kill_quietly(fake.seen()["criu"])


def test_checkpoint_runs_in_its_own_group_recorded_while_it_runs(tmp_path: Path) -> None:
    """A daemon killed mid-dump leaves CRIU holding the tasks: delete needs the group."""
    fake = FakeRunc(tmp_path)

    async def body(reaper: Reaper) -> None:
        await fake.operation(fake.runc_logging_to_bundle(reaper), "checkpoint")

    run_with_reaper(body)
    seen = fake.seen()
    assert seen["pgid"] == seen["pid"] != os.getpgid(0)
    assert seen["record"] == f"{seen['pid']} {seen['start']}\n"
    assert read_criu_group(str(fake.bundle)) is None
    kill_quietly(seen["criu"])


@pytest.mark.parametrize("verb", ["restore", "checkpoint"])
@pytest.mark.parametrize("grace", [0.0, 0.3])
def test_a_cancelled_operation_takes_its_whole_group_down(
    tmp_path: Path, grace: float, verb: str
) -> None:
    """Before: only runc was signalled and its CRIU went on, orphaned (a dumping CRIU
    held in an action script kept the container's tasks from dying)."""
    fake = FakeRunc(tmp_path)
    fake.control(sleep=600, ignore_term=True)

    async def body(reaper: Reaper) -> None:
        runc = fake.runc_logging_to_bundle(reaper, kill_grace=grace)
        task = asyncio.create_task(fake.operation(runc, verb))
        await asyncio.to_thread(fake.seen)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    run_with_reaper(body)
    seen = fake.seen()
    wait_until(lambda: not group_members(seen["pgid"]), timeout=5)
    assert start_time(seen["criu"]) is None or seen["criu"] not in group_members(seen["pgid"])
    assert read_criu_group(str(fake.bundle)) is None


# -- delete -------------------------------------------------------------------------------

FAKE_RUNC_DELETE = r"""#!{python}
# Records its arguments, whether the restore's group was all stopped and whether a live
# process was left in it.
import os, sys

alive = False
stopped = True
for entry in filter(str.isdigit, os.listdir("/proc")):
    try:
        fields = open(f"/proc/{{entry}}/stat").read().rsplit(")", 1)[1].split()
    except OSError:
        continue
    if int(fields[2]) == {pgid} and fields[0] not in ("Z", "X"):
        alive = True
        stopped = stopped and fields[0] in ("T", "t")
with open({calls!r}, "a") as f:
    f.write(" ".join(sys.argv[1:]) + f" group-stopped={{'yes' if alive and stopped else 'no'}}"
            f" group-alive={{'yes' if alive else 'no'}}\n")
sys.stderr.write("container does not exist\n")
sys.exit(1)
"""


def _delete_bundle(tmp_path: Path, name: str = "bundle", pgid: int = 0) -> tuple[Path, Path]:
    bundle = tmp_path / name
    bundle.mkdir()
    calls = tmp_path / f"{name}.calls"
    runc = tmp_path / f"{name}.runc"
    runc.write_text(FAKE_RUNC_DELETE.format(python=sys.executable, pgid=pgid, calls=str(calls)))
    runc.chmod(0o755)
    BundleState(str(runc), str(tmp_path / "runc-root")).save(str(bundle))
    return bundle, calls


def _run_delete(bundle: Path, capsysbinary: pytest.CaptureFixture[bytes]) -> tuple[bytes, str]:
    assert delete.run_delete(ShimArgs(namespace="ns", id="c1", bundle=str(bundle))) == 0
    out, err = capsysbinary.readouterr()
    return out, err.decode()


def test_delete_kills_a_restore_left_by_a_dead_daemon_before_runc_delete(
    tmp_path: Path, group: subprocess.Popen[bytes], capsysbinary: pytest.CaptureFixture[bytes]
) -> None:
    """Before: runc delete found no container yet, and the restore finished on its own."""
    leader_start = start_time(group.pid)
    assert leader_start is not None
    bundle, calls = _delete_bundle(tmp_path, pgid=group.pid)
    mark_criu_group(str(bundle), group.pid, leader_start)

    started = time.monotonic()
    out, err = _run_delete(bundle, capsysbinary)
    assert time.monotonic() - started < delete.CRIU_KILL_TIMEOUT + delete.RUNC_DELETE_TIMEOUT

    assert out  # the DeleteResponse
    assert not group_members(group.pid)
    assert group.wait(5) == -signal.SIGKILL
    assert calls.read_text().splitlines() == [
        f"--root {tmp_path / 'runc-root'} delete --force c1 group-stopped=no group-alive=no",
    ]
    assert read_criu_group(str(bundle)) is None
    assert "restore" not in err, err


def test_delete_kills_a_lazy_restores_tasks_while_its_daemon_is_frozen(
    tmp_path: Path, group: subprocess.Popen[bytes], capsysbinary: pytest.CaptureFixture[bytes]
) -> None:
    """A lazy restore's daemon holds its tasks' memory: they are killed while it is
    stopped, then it, then runc delete."""
    leader_start = start_time(group.pid)
    assert leader_start is not None
    bundle, calls = _delete_bundle(tmp_path, pgid=group.pid)
    mark_criu_group(str(bundle), group.pid, leader_start, lazy=True)
    assert read_criu_group(str(bundle)) == (group.pid, leader_start, True)

    _run_delete(bundle, capsysbinary)

    assert not group_members(group.pid)
    root = tmp_path / "runc-root"
    assert calls.read_text().splitlines() == [
        f"--root {root} kill --all c1 9 group-stopped=yes group-alive=yes",
        f"--root {root} delete --force c1 group-stopped=no group-alive=no",
    ]
    assert read_criu_group(str(bundle)) is None


def test_delete_spares_a_process_that_reused_the_recorded_pid(
    tmp_path: Path, group: subprocess.Popen[bytes], capsysbinary: pytest.CaptureFixture[bytes]
) -> None:
    leader_start = start_time(group.pid)
    assert leader_start is not None
    bundle, calls = _delete_bundle(tmp_path, pgid=group.pid)
    mark_criu_group(str(bundle), group.pid, leader_start - 1)  # an older process had the pid

    _run_delete(bundle, capsysbinary)

    assert len(group_members(group.pid)) == 3
    assert calls.read_text().split()[-1] == "group-alive=yes"


def _bound_socket(path: Path, *, listening: bool) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    sock.bind(str(path))
    if listening:
        sock.listen(1)
    return sock


@pytest.mark.parametrize("age_limit", [0.0, 3600.0])
def test_delete_removes_the_socket_of_a_dead_daemon_only(
    tmp_path: Path,
    capsysbinary: pytest.CaptureFixture[bytes],
    monkeypatch: pytest.MonkeyPatch,
    age_limit: float,
) -> None:
    """A killed daemon leaves its socket; a live one (other containers of the pod) keeps
    it, and so does one bound too recently to be listening yet."""
    monkeypatch.setattr(fork_client, "STALE_SOCKET_AGE", age_limit)
    results = {}
    for name, listening in (("dead", False), ("live", True)):
        bundle, _ = _delete_bundle(tmp_path, name)
        path = tmp_path / f"{name}.sock"
        sock = _bound_socket(path, listening=listening)
        (bundle / "address").write_text(f"unix://{path}")
        try:
            _run_delete(bundle, capsysbinary)
        finally:
            sock.close()
        results[name] = path.exists()
    assert results == {"dead": age_limit > 0, "live": True}
