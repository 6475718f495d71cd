"""A lazy restore's daemon (runtime/lazy_pages.py) through the runc driver, against a
fake `criu lazy-pages` and a fake runc (Python scripts): who leads which process group,
what the bundle records while the daemon lives, and how a failing or cancelled daemon
takes the restored tasks down before itself. The real CRIU is in
tests/integration/test_lazy_restore.py."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from cedana_shim.bundle_state import read_criu_group
from cedana_shim.runtime.lazy_pages import LazyPagesFailed
from cedana_shim.runtime.reaper import Reaper
from cedana_shim.runtime.runc import RestoreOpts, Runc, RuncError
from support.processes import run_with_reaper

# Told what to do by <dir>/criu.json: {"before_ready": "exit"|"hang", "after": "exit0"|
# "exit1"|"hang", "status": N}. Records its argv, pid and pgid; exits 0 once <dir>/done
# exists ("all pages transferred").
FAKE_CRIU = r"""#!{python}
import json, os, sys, time
HERE = {here!r}
argv = sys.argv[1:]
with open(os.path.join(HERE, "criu.json")) as f:
    control = json.load(f)
with open(os.path.join(HERE, "criu-calls.jsonl"), "a") as f:
    fds = sorted(int(n) for n in os.listdir("/proc/self/fd"))
    call = {{"argv": argv, "pid": os.getpid(), "pgid": os.getpgid(0), "fds": fds}}
    f.write(json.dumps(call) + "\n")
status_fd = int(argv[argv.index("--status-fd") + 1])
before = control.get("before_ready")
if before == "exit":
    sys.stderr.write("Error (criu/uffd.c:42): uffd: not supported here\n")
    sys.exit(control.get("status", 1))
if before == "hang":
    time.sleep(600)
os.write(status_fd, b"\0")
os.close(status_fd)
after = control.get("after", "exit0")
deadline = time.monotonic() + 600
while time.monotonic() < deadline:
    if after == "exit1":
        time.sleep(0.2)
        sys.stderr.write("Error (criu/uffd.c:99): uffd: cannot read pages\n")
        sys.exit(1)
    if after == "exit0" and os.path.exists(os.path.join(HERE, "done")):
        sys.exit(0)
    time.sleep(0.01)
"""

# Records argv and its process group; `restore` sleeps <dir>/runc-sleep seconds and
# exits with <dir>/runc-exit (default 0).
FAKE_RUNC = r"""#!{python}
import json, os, sys, time
HERE = {here!r}
argv = sys.argv[1:]
with open(os.path.join(HERE, "runc-calls.jsonl"), "a") as f:
    f.write(json.dumps({{"argv": argv, "pid": os.getpid(), "pgid": os.getpgid(0)}}) + "\n")
def read(name, default):
    try:
        with open(os.path.join(HERE, name)) as f:
            return type(default)(f.read())
    except FileNotFoundError:
        return default
if "restore" in argv:
    time.sleep(read("runc-sleep", 0.0))
    sys.exit(read("runc-exit", 0))
"""


class World:
    def __init__(self, tmp: Path) -> None:
        self.dir = tmp
        self.criu = tmp / "criu"
        self.criu.write_text(FAKE_CRIU.format(python=sys.executable, here=str(tmp)))
        self.criu.chmod(0o755)
        self.runc = tmp / "runc"
        self.runc.write_text(FAKE_RUNC.format(python=sys.executable, here=str(tmp)))
        self.runc.chmod(0o755)
        self.bundle = tmp / "bundle"
        self.bundle.mkdir()
        self.images = tmp / "images"
        self.images.mkdir()
        self.work = tmp / "work"
        self.control({})

    def control(self, criu: dict[str, Any]) -> None:
        (self.dir / "criu.json").write_text(json.dumps(criu))

    def driver(self, reaper: Reaper) -> Runc:
        return Runc(
            reaper=reaper,
            root=str(self.dir / "root"),
            log_path=str(self.bundle / "log.json"),
            binary=str(self.runc),
            criu=str(self.criu),
        )

    def opts(self) -> RestoreOpts:
        return RestoreOpts(
            bundle=str(self.bundle),
            image_path=str(self.images),
            work_path=str(self.work),
            lazy_pages=True,
        )

    def calls(self, who: str) -> list[dict[str, Any]]:
        path = self.dir / f"{who}-calls.jsonl"
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines()]

    def verbs(self) -> list[list[str]]:
        out = []
        for call in self.calls("runc"):
            argv = call["argv"]
            i = 0
            while argv[i].startswith("-"):
                i += 2 if argv[i] in ("--root", "--log", "--log-format", "--criu") else 1
            out.append(argv[i:])
        return out


@pytest.fixture
def world(tmp_path: Path) -> World:
    return World(tmp_path)


def alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except OSError:
        return False


def test_runc_joins_the_daemons_group_which_the_bundle_records_until_every_page_is_in(
    world: World,
) -> None:
    async def body(reaper: Reaper) -> None:
        daemon = await world.driver(reaper).restore("c1", world.opts())
        assert daemon is not None
        (criu,) = world.calls("criu")
        assert criu["argv"][:7] == [
            "lazy-pages", "--images-dir", str(world.images), "--work-dir", str(world.work),
            "--log-file", "lazy-pages.log",
        ]  # fmt: skip
        assert criu["pgid"] == criu["pid"]  # a group of its own
        (runc,) = world.calls("runc")
        assert runc["pgid"] == criu["pid"]  # runc (and CRIU under it) joined it
        assert "--lazy-pages" in runc["argv"]
        # runc is done, the daemon still serves: the record stays for delete.
        record = read_criu_group(str(world.bundle))
        assert record is not None and record[0] == criu["pid"]
        assert record[2]  # lazy: delete kills the tasks first
        waiting = asyncio.ensure_future(daemon.wait())
        await asyncio.sleep(0.2)
        assert not waiting.done()
        (world.dir / "done").touch()
        await asyncio.wait_for(waiting, 10)
        assert read_criu_group(str(world.bundle)) is None
        assert [v[0] for v in world.verbs()] == ["restore"]  # nothing killed

    run_with_reaper(body)


def test_a_daemon_fed_by_a_page_server_inherits_both_ends_of_its_connection(
    world: World,
) -> None:
    """--ps-socket names its own end; the server's end is inherited too (unused), so that
    the server's process dying is no EOF to the daemon (see PagesDaemon.start)."""
    import socket

    ours, theirs = socket.socketpair()

    async def body(reaper: Reaper) -> None:
        opts = dataclasses.replace(world.opts(), lazy_page_server=(theirs.fileno(), ours.fileno()))
        daemon = await world.driver(reaper).restore("c1", opts)
        assert daemon is not None
        (criu,) = world.calls("criu")
        assert criu["argv"][7:10] == ["--page-server", "--ps-socket", str(theirs.fileno())]
        assert {theirs.fileno(), ours.fileno()} <= set(criu["fds"])
        (world.dir / "done").touch()
        await asyncio.wait_for(daemon.wait(), 10)

    try:
        run_with_reaper(body)
    finally:
        ours.close()
        theirs.close()


def test_a_daemon_that_cannot_listen_fails_the_lazy_path_before_runc_runs(world: World) -> None:
    world.control({"before_ready": "exit", "status": 3})

    async def body(reaper: Reaper) -> None:
        with pytest.raises(LazyPagesFailed) as caught:
            await world.driver(reaper).restore("c1", world.opts())
        message = str(caught.value)
        assert "container c1" in message and "exited with status 3 before listening" in message
        assert "uffd: not supported here" in message

    run_with_reaper(body)
    assert world.calls("runc") == []
    assert read_criu_group(str(world.bundle)) is None


def test_a_daemon_that_dies_after_the_restore_gets_the_tasks_killed_first(world: World) -> None:
    world.control({"after": "exit1"})

    async def body(reaper: Reaper) -> None:
        daemon = await world.driver(reaper).restore("c1", world.opts())
        assert daemon is not None
        with pytest.raises(LazyPagesFailed) as caught:
            await asyncio.wait_for(daemon.wait(), 10)
        assert "before all memory was in" in str(caught.value)
        assert "cannot read pages" in str(caught.value)

    run_with_reaper(body)
    assert [v[0] for v in world.verbs()] == ["restore", "kill"]
    assert world.verbs()[1] == ["kill", "--all", "c1", "9"]
    assert read_criu_group(str(world.bundle)) is None


def test_a_cancelled_lazy_restore_kills_the_tasks_then_the_daemon(world: World) -> None:
    world.control({"after": "hang"})

    async def body(reaper: Reaper) -> None:
        daemon = await world.driver(reaper).restore("c1", world.opts())
        assert daemon is not None
        waiting = asyncio.ensure_future(daemon.wait())
        await asyncio.sleep(0.1)
        started = time.monotonic()
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert time.monotonic() - started < 5
        assert daemon.child.exited.done()

    run_with_reaper(body)
    (criu,) = world.calls("criu")
    assert not alive(criu["pid"])
    assert [v[0] for v in world.verbs()] == ["restore", "kill"]
    assert read_criu_group(str(world.bundle)) is None


def test_a_failed_runc_restore_takes_the_daemon_down(world: World) -> None:
    (world.dir / "runc-exit").write_text("1")

    async def body(reaper: Reaper) -> None:
        with pytest.raises(RuncError):
            await world.driver(reaper).restore("c1", world.opts())

    run_with_reaper(body)
    (criu,) = world.calls("criu")
    assert not alive(criu["pid"])
    assert read_criu_group(str(world.bundle)) is None


def test_a_daemon_dying_under_runc_gets_runc_killed_and_is_named_as_the_cause(
    world: World,
) -> None:
    """CRIU's failure path can hang once its daemon is gone: runc is not waited for."""
    world.control({"after": "exit1"})
    (world.dir / "runc-sleep").write_text("600")

    async def body(reaper: Reaper) -> None:
        started = time.monotonic()
        with pytest.raises(LazyPagesFailed) as caught:
            await world.driver(reaper).restore("c1", world.opts())
        assert time.monotonic() - started < 10
        assert "exited with status 1 during the restore" in str(caught.value)
        assert "cannot read pages" in str(caught.value)

    run_with_reaper(body)
    (runc,) = world.calls("runc")
    assert not alive(runc["pid"])
    assert read_criu_group(str(world.bundle)) is None


def test_cancelling_runc_kills_the_whole_group_daemon_included(world: World) -> None:
    world.control({"after": "hang"})
    (world.dir / "runc-sleep").write_text("600")

    async def body(reaper: Reaper) -> None:
        restoring = asyncio.ensure_future(world.driver(reaper).restore("c1", world.opts()))
        deadline = time.monotonic() + 10
        while not world.calls("runc"):
            assert time.monotonic() < deadline
            await asyncio.sleep(0.01)
        restoring.cancel()
        with pytest.raises(asyncio.CancelledError):
            await restoring

    run_with_reaper(body)
    (criu,) = world.calls("criu")
    (runc,) = world.calls("runc")
    assert not alive(criu["pid"]) and not alive(runc["pid"])
    assert read_criu_group(str(world.bundle)) is None
    assert os.path.isdir(world.work)  # made for the daemon's socket and log
