"""The runc driver against the real runc and CRIU, with a busybox bundle.

Needs root, runc, criu and busybox-static; a missing one fails the tests (it
does not skip them): these are the checks that the driver speaks real runc.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import glob
import json
import os
import shutil
import signal
import subprocess
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from cedana_shim import errors
from cedana_shim.runtime.console import ConsoleSocket
from cedana_shim.runtime.reaper import Exit, Reaper, set_child_subreaper
from cedana_shim.runtime.runc import (
    CheckpointOpts,
    CreateOpts,
    ExecOpts,
    RestoreOpts,
    Runc,
    RuncError,
    Stdio,
    read_pid_file,
)
from support.cgroup_version import host_cgroup_version
from support.processes import run_with_reaper

PR_SET_CHILD_SUBREAPER = 36
BUSYBOX = "/bin/busybox"
APPLETS = ("sh", "sleep", "echo", "cat", "true")
COUNTER = "i=0; while true; do i=$((i+1)); echo $i > /tmp/c; sleep 0.05; done"
TEST_TIMEOUT = 40.0


class Exits:
    """Exits of processes the test did not spawn (container inits, execs)."""

    def __init__(self, reaper: Reaper) -> None:
        self.seen: dict[int, Exit] = {}
        self._changed = asyncio.Event()
        self.unsubscribe = reaper.subscribe(self._on_exit)

    def _on_exit(self, ex: Exit) -> None:
        self.seen[ex.pid] = ex
        self._changed.set()

    async def wait(self, pid: int, timeout: float = 10.0) -> int:
        async with asyncio.timeout(timeout):
            while pid not in self.seen:
                self._changed.clear()
                await self._changed.wait()
        return self.seen[pid].status


@dataclass
class Host:
    tmp: Path
    root: str
    runc_binary: str
    containers: list[str] = field(default_factory=list)
    pids: list[int] = field(default_factory=list)
    cgroups: list[str] = field(default_factory=list)

    def bundle(self, args: list[str], *, terminal: bool = False, name: str = "bundle") -> Path:
        bundle = self.tmp / name
        rootfs = bundle / "rootfs"
        for d in ("bin", "tmp", "proc", "dev", "sys"):
            (rootfs / d).mkdir(parents=True)
        shutil.copy2(BUSYBOX, rootfs / "bin" / "busybox")
        for applet in APPLETS:
            os.symlink("busybox", rootfs / "bin" / applet)
        subprocess.run([self.runc_binary, "spec", "--bundle", str(bundle)], check=True)
        config = json.loads((bundle / "config.json").read_text())
        config["process"]["terminal"] = terminal
        config["process"]["args"] = args
        config["root"]["readonly"] = False
        cgroup = f"cedana-test-{uuid.uuid4().hex[:12]}"
        config["linux"]["cgroupsPath"] = f"/{cgroup}"
        self.cgroups.append(cgroup)
        (bundle / "config.json").write_text(json.dumps(config))
        return bundle

    def runc(self, reaper: Reaper, bundle: Path) -> Runc:
        return Runc(reaper=reaper, root=self.root, log_path=str(bundle / "log.json"))

    def new_id(self) -> str:
        cid = f"cedana-test-{uuid.uuid4().hex[:8]}"
        self.containers.append(cid)
        return cid


def _set_subreaper(on: bool) -> None:
    if on:
        set_child_subreaper()
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl")


@pytest.fixture
def host(tmp_path: Path) -> Iterator[Host]:
    assert os.geteuid() == 0, "real runc tests need root"
    runc_binary = shutil.which("runc")
    assert runc_binary, "runc is not installed"
    assert shutil.which("criu"), "criu is not installed"
    assert os.path.exists(BUSYBOX), "busybox-static is not installed"
    h = Host(tmp_path, str(tmp_path / "runc-root"), runc_binary)
    # Container inits re-parent to us once runc exits, as they do to the shim.
    _set_subreaper(True)
    try:
        yield h
    finally:
        _set_subreaper(False)
        for cid in h.containers:  # in case the test failed before its own cleanup
            subprocess.run(
                [runc_binary, "--root", h.root, "delete", "--force", cid],
                capture_output=True,
                check=False,
            )
        for pid in h.pids:  # anything killed just now is our zombie
            with contextlib.suppress(ChildProcessError):
                os.waitpid(pid, 0)
        for cgroup in h.cgroups:
            # One per v1 hierarchy, or the unified one's.
            for path in [*glob.glob(f"/sys/fs/cgroup/*/{cgroup}"), f"/sys/fs/cgroup/{cgroup}"]:
                with contextlib.suppress(OSError):
                    os.rmdir(path)
        listed = subprocess.run(
            [runc_binary, "--root", h.root, "list", "-q"], capture_output=True, check=False
        )
        assert listed.stdout.strip() == b"", f"containers left behind: {listed.stdout!r}"


async def wait_for(predicate: Callable[[], bool], timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition never became true"
        await asyncio.sleep(0.02)


def test_lifecycle(host: Host) -> None:
    bundle = host.bundle(["sleep", "1000"])
    cid = host.new_id()

    async def body(reaper: Reaper) -> None:
        r = host.runc(reaper, bundle)
        exits = Exits(reaper)
        try:
            await r.create(cid, CreateOpts(str(bundle), pid_file=str(bundle / "init.pid")))
            pid = read_pid_file(str(bundle / "init.pid"))
            host.pids.append(pid)
            state = await r.state(cid)
            assert (state["status"], state["pid"]) == ("created", pid)
            await r.start(cid)
            assert (await r.state(cid))["status"] == "running"
            assert await r.ps(cid) == [pid]
            await r.pause(cid)
            assert (await r.state(cid))["status"] == "paused"
            await r.resume(cid)
            assert (await r.state(cid))["status"] == "running"
            await r.kill(cid, signal.SIGKILL)
            assert await exits.wait(pid) == 128 + signal.SIGKILL
            assert (await r.state(cid))["status"] == "stopped"
            with pytest.raises(errors.NotFound):
                await r.kill(cid, signal.SIGKILL)
            with pytest.raises(errors.FailedPrecondition):
                await r.pause(cid)
            await r.delete(cid)
            with pytest.raises(errors.NotFound):
                await r.state(cid)
            with pytest.raises(errors.NotFound):
                await r.kill(cid, signal.SIGTERM)
            await r.delete(cid)  # already gone: not an error
        finally:
            await r.delete(cid, force=True)

    run_with_reaper(body, timeout=TEST_TIMEOUT)


def test_exit_code(host: Host) -> None:
    bundle = host.bundle(["sh", "-c", "exit 3"])
    cid = host.new_id()

    async def body(reaper: Reaper) -> None:
        r = host.runc(reaper, bundle)
        exits = Exits(reaper)
        try:
            await r.create(cid, CreateOpts(str(bundle), pid_file=str(bundle / "init.pid")))
            pid = read_pid_file(str(bundle / "init.pid"))
            host.pids.append(pid)
            await r.start(cid)
            assert await exits.wait(pid) == 3
            await r.delete(cid)
        finally:
            await r.delete(cid, force=True)

    run_with_reaper(body, timeout=TEST_TIMEOUT)


def test_errors_come_from_this_calls_log(host: Host) -> None:
    bundle = host.bundle(["/no/such/binary"])
    cid = host.new_id()

    async def body(reaper: Reaper) -> None:
        r = host.runc(reaper, bundle)
        try:
            with pytest.raises(RuncError) as info:
                await r.create(cid, CreateOpts(str(bundle), pid_file=str(bundle / "init.pid")))
            assert isinstance(info.value, errors.Unknown)
            assert "/no/such/binary" in info.value.message
            # The create error is still in log.json; a later failure must not repeat it.
            with pytest.raises(errors.NotFound) as missing:
                await r.state("cedana-test-never-created")
            assert "/no/such/binary" not in str(missing.value)
        finally:
            await r.delete(cid, force=True)

    run_with_reaper(body, timeout=TEST_TIMEOUT)


def test_duplicate_create_is_already_exists(host: Host) -> None:
    bundle = host.bundle(["sleep", "1000"])
    cid = host.new_id()

    async def body(reaper: Reaper) -> None:
        r = host.runc(reaper, bundle)
        try:
            await r.create(cid, CreateOpts(str(bundle), pid_file=str(bundle / "init.pid")))
            host.pids.append(read_pid_file(str(bundle / "init.pid")))
            with pytest.raises(errors.AlreadyExists):
                await r.create(cid, CreateOpts(str(bundle)))
        finally:
            await r.delete(cid, force=True)

    run_with_reaper(body, timeout=TEST_TIMEOUT)


def test_exec_with_stdio_and_update(host: Host) -> None:
    bundle = host.bundle(["sleep", "1000"])
    cid = host.new_id()
    out_r, out_w = os.pipe()
    spec: dict[str, Any] = {
        "args": ["sh", "-c", "echo exec-out; exit 5"],
        "cwd": "/",
        "env": ["PATH=/bin"],
        "user": {"uid": 0, "gid": 0},
    }

    async def body(reaper: Reaper) -> None:
        nonlocal out_w
        r = host.runc(reaper, bundle)
        exits = Exits(reaper)
        try:
            await r.create(cid, CreateOpts(str(bundle), pid_file=str(bundle / "init.pid")))
            host.pids.append(read_pid_file(str(bundle / "init.pid")))
            await r.start(cid)
            pid_file = str(bundle / "e1.pid")
            opts = ExecOpts(json.dumps(spec).encode(), pid_file=pid_file, stdio=Stdio(stdout=out_w))
            await r.exec(cid, opts)
            os.close(out_w)
            out_w = -1
            exec_pid = read_pid_file(pid_file)
            host.pids.append(exec_pid)
            assert await exits.wait(exec_pid) == 5
            assert os.read(out_r, 100) == b"exec-out\n"

            await r.update(cid, json.dumps({"pids": {"limit": 50}}).encode())
            cgroup = host.cgroups[-1]
            pids = "" if host_cgroup_version() == 2 else "pids/"
            assert Path(f"/sys/fs/cgroup/{pids}{cgroup}/pids.max").read_text().strip() == "50"
        finally:
            await r.delete(cid, force=True)

    try:
        run_with_reaper(body, timeout=TEST_TIMEOUT)
    finally:
        os.close(out_r)
        if out_w >= 0:
            os.close(out_w)


def test_terminal_through_console_socket(host: Host) -> None:
    bundle = host.bundle(["sh", "-c", "echo tty-hello; sleep 1000"], terminal=True)
    cid = host.new_id()

    async def body(reaper: Reaper) -> None:
        r = host.runc(reaper, bundle)
        try:
            async with ConsoleSocket(base_dir=str(host.tmp)) as console:
                opts = CreateOpts(
                    str(bundle), pid_file=str(bundle / "init.pid"), console_socket=console.path
                )
                await r.create(cid, opts)
                host.pids.append(read_pid_file(str(bundle / "init.pid")))
                master = await console.receive_master(timeout=5)
            try:
                assert os.isatty(master)
                os.set_blocking(master, False)
                await r.start(cid)
                seen = bytearray()

                def read_some() -> bool:
                    with contextlib.suppress(BlockingIOError):
                        seen.extend(os.read(master, 1024))
                    return b"tty-hello" in seen

                await wait_for(read_some)
            finally:
                os.close(master)
        finally:
            await r.delete(cid, force=True)

    run_with_reaper(body, timeout=TEST_TIMEOUT)


def test_checkpoint_and_restore_continue_the_counter(host: Host) -> None:
    bundle = host.bundle(["sh", "-c", COUNTER])
    counter = bundle / "rootfs" / "tmp" / "c"
    cid = host.new_id()
    image, work = host.tmp / "image", host.tmp / "work"

    def count() -> int:
        with contextlib.suppress(FileNotFoundError, ValueError):
            return int(counter.read_text())
        return 0

    async def body(reaper: Reaper) -> None:
        r = host.runc(reaper, bundle)
        exits = Exits(reaper)
        pid_file = str(bundle / "init.pid")
        try:
            await r.create(cid, CreateOpts(str(bundle), pid_file=pid_file))
            pid = read_pid_file(pid_file)
            host.pids.append(pid)
            await r.start(cid)
            await wait_for(lambda: count() >= 10)

            # A dump that CRIU itself fails: no page server listens there.
            failing = CheckpointOpts(
                image_path=str(host.tmp / "bad-image"),
                work_path=str(host.tmp / "bad-work"),
                page_server="127.0.0.1:1",
                leave_running=True,
            )
            with pytest.raises(RuncError) as info:
                await r.checkpoint(cid, failing)
            kept = bundle / "criu-dump.log"
            assert kept.exists() and str(kept) in info.value.message
            assert (await r.state(cid))["status"] == "running"

            await r.checkpoint(cid, CheckpointOpts(image_path=str(image), work_path=str(work)))
            assert await exits.wait(pid) == 128 + signal.SIGKILL  # a dump without leave-running
            at_dump = count()
            await r.delete(cid)  # runc already destroyed it; "does not exist" is fine
            await asyncio.sleep(0.3)
            assert count() == at_dump  # nothing runs any more

            opts = RestoreOpts(
                bundle=str(bundle),
                image_path=str(image),
                work_path=str(host.tmp / "restore-work"),
                pid_file=pid_file,
            )
            await r.restore(cid, opts)
            restored = read_pid_file(pid_file)
            host.pids.append(restored)
            assert (await r.state(cid))["status"] == "running"
            await wait_for(lambda: count() > at_dump)
            # It went on from where it was: a restart would count from 1 again.
            assert at_dump < count() < at_dump + 100
            await r.kill(cid, signal.SIGKILL)
            assert await exits.wait(restored) == 128 + signal.SIGKILL
            await r.delete(cid)
        finally:
            await r.delete(cid, force=True)

    run_with_reaper(body, timeout=TEST_TIMEOUT)


def test_checkpoint_of_a_missing_container(host: Host) -> None:
    bundle = host.bundle(["true"])

    async def body(reaper: Reaper) -> None:
        r = host.runc(reaper, bundle)
        with pytest.raises(errors.NotFound):
            await r.checkpoint(
                "cedana-test-missing", CheckpointOpts(image_path=str(host.tmp / "i"))
            )
        assert not (bundle / "criu-dump.log").exists()

    run_with_reaper(body, timeout=TEST_TIMEOUT)
