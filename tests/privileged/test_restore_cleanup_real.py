"""A restore cut short, with the real runc and CRIU: CRIU is held at post-restore (the
restored tasks exist, none resumed) by an action script, as the shim's gate holds it,
and then

- the daemon abandons the restore (cancelled, no grace): the driver kills runc's whole
  process group;
- the daemon is SIGKILLed: `delete` finds the group in the bundle and kills it.

Either way CRIU's death takes the tasks it restored with it, nothing of the container is
left running, and the rootfs runc bound for CRIU (`<runc root>/<id>/criu-root`) is
unmounted before runc's state dir is removed.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path

import pytest
from cedana_shim.bundle_state import BundleState, criu_root, read_criu_group
from cedana_shim.cli import delete
from cedana_shim.cli.args import ShimArgs
from cedana_shim.runtime.reaper import Reaper
from cedana_shim.runtime.runc import CheckpointOpts, CreateOpts, RestoreOpts, Runc
from cedana_shim.runtime.unmount import unmount_all

BUSYBOX = "/bin/busybox"
COUNTER = "i=0; while true; do i=$((i+1)); echo $i > /tmp/c; sleep 0.05; done"
HOLD = """#!/bin/sh
[ "$CRTOOLS_SCRIPT_ACTION" = post-restore ] || exit 0
touch {marker}
exec sleep 600
"""


def mounted(path: str) -> bool:
    with open("/proc/self/mountinfo") as f:
        return any(line.split()[4] == path for line in f)


def mounts_under(path: Path) -> list[str]:
    prefix = f"{os.path.realpath(path)}/"
    with open("/proc/self/mountinfo") as f:
        return [p for line in f if (p := line.split()[4]).startswith(prefix)]


def members(pgid: int) -> set[int]:
    found = set()
    for entry in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError, IndexError):
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            if int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
                found.add(int(entry))
    return found


def descendants(roots: set[int]) -> set[int]:
    children: dict[int, set[int]] = {}
    for entry in filter(str.isdigit, os.listdir("/proc")):
        with contextlib.suppress(OSError, IndexError):
            fields = Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()
            if fields[0] not in ("Z", "X"):
                children.setdefault(int(fields[1]), set()).add(int(entry))
    found: set[int] = set()
    stack = list(roots)
    while stack:
        for child in children.get(stack.pop(), ()):
            if child not in found:
                found.add(child)
                stack.append(child)
    return found


def wait_until(predicate: Callable[[], object], timeout: float = 20.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


class Checkpointed:
    """A busybox counter container, checkpointed (and so gone), ready to be restored
    with CRIU held at post-restore by an action script."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.root = str(tmp / "runc-root")
        self.id = f"cedana-held-{uuid.uuid4().hex[:8]}"
        self.bundle = tmp / "bundle"
        self.images = tmp / "images"
        self.marker = tmp / "held"
        self.work = self.bundle / "work"  # where delete looks for CRIU's leftovers
        self.cgroup = f"cedana-test-{uuid.uuid4().hex[:12]}"
        rootfs = self.bundle / "rootfs"
        for d in ("bin", "tmp", "proc", "dev", "sys"):
            (rootfs / d).mkdir(parents=True)
        shutil.copy2(BUSYBOX, rootfs / "bin" / "busybox")
        for applet in ("sh", "sleep", "echo"):
            os.symlink("busybox", rootfs / "bin" / applet)
        subprocess.run(["runc", "spec", "--bundle", str(self.bundle)], check=True)
        config = json.loads((self.bundle / "config.json").read_text())
        config["process"]["terminal"] = False
        config["process"]["args"] = ["sh", "-c", COUNTER]
        config["root"]["readonly"] = False
        config["linux"]["cgroupsPath"] = f"/{self.cgroup}"
        hold = tmp / "hold.sh"
        hold.write_text(HOLD.format(marker=self.marker))
        hold.chmod(0o755)
        criu_conf = tmp / "criu.conf"
        criu_conf.write_text(f"action-script {hold}\n")
        config.setdefault("annotations", {})["org.criu.config"] = str(criu_conf)
        (self.bundle / "config.json").write_text(json.dumps(config))
        BundleState("runc", self.root).save(str(self.bundle))

    def runc(self, reaper: Reaper) -> Runc:
        return Runc(reaper=reaper, root=self.root, log_path=str(self.bundle / "log.json"))

    async def checkpoint(self, reaper: Reaper) -> None:
        r = self.runc(reaper)
        await r.create(self.id, CreateOpts(str(self.bundle), pid_file=str(self.tmp / "a.pid")))
        await r.start(self.id)
        await asyncio.sleep(0.3)
        await r.checkpoint(self.id, CheckpointOpts(image_path=str(self.images)))
        await r.delete(self.id, force=True)

    def restore_opts(self) -> RestoreOpts:
        return RestoreOpts(
            bundle=str(self.bundle),
            image_path=str(self.images),
            work_path=str(self.work),
            pid_file=str(self.tmp / "b.pid"),
        )

    def held(self) -> tuple[int, set[int]]:
        """Once CRIU is held: runc's process group, and the tasks CRIU restored."""
        wait_until(self.marker.exists, what="CRIU to reach post-restore")
        record = read_criu_group(str(self.bundle))
        assert record is not None, "no restore recorded in the bundle"
        pgid = record[0]
        group = members(pgid)
        restored = descendants(group) - group
        assert restored, "CRIU restored no task"
        assert mounted(criu_root(self.root, self.id))
        return pgid, restored

    def assert_nothing_left(self, pgid: int, restored: set[int]) -> None:
        wait_until(lambda: not members(pgid), timeout=5, what="runc's group to die")
        alive = {pid for pid in restored if is_alive(pid)}
        assert not alive, f"restored tasks still alive after CRIU died: {sorted(alive)}"
        assert not mounted(criu_root(self.root, self.id))
        assert not mounts_under(self.work), "CRIU's cgroup yard is still mounted"
        assert read_criu_group(str(self.bundle)) is None
        listed = subprocess.run(
            ["runc", "--root", self.root, "list", "-q"], capture_output=True, text=True, check=False
        )
        assert self.id not in listed.stdout.split()

    def cleanup(self) -> None:
        subprocess.run(
            ["runc", "--root", self.root, "delete", "--force", self.id],
            capture_output=True,
            check=False,
        )
        for leftover in (criu_root(self.root, self.id), str(self.work)):
            with contextlib.suppress(Exception):  # left by a failing test
                unmount_all(leftover)
        # One per v1 hierarchy, or the unified one's.
        for path in [
            *Path("/sys/fs/cgroup").glob(f"*/{self.cgroup}"),
            Path("/sys/fs/cgroup", self.cgroup),
        ]:
            with contextlib.suppress(OSError):
                path.rmdir()


def is_alive(pid: int) -> bool:
    """Alive and not a zombie."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state not in ("Z", "X")


@pytest.fixture
def container(tmp_path: Path) -> Iterator[Checkpointed]:
    assert shutil.which("runc") and shutil.which("criu"), "runc and criu are needed"
    c = Checkpointed(tmp_path)
    try:
        yield c
    finally:
        c.cleanup()


def run(body: Callable[[Reaper], Awaitable[None]]) -> None:
    async def main() -> None:
        reaper = Reaper()
        reaper.install()
        try:
            async with asyncio.timeout(60):
                await body(reaper)
        finally:
            reaper.close()

    asyncio.run(main())


def test_an_abandoned_restore_leaves_no_task_and_no_mount(container: Checkpointed) -> None:
    async def body(reaper: Reaper) -> None:
        await container.checkpoint(reaper)
        runc = container.runc(reaper)  # kill_grace does not apply to a restore
        restoring = asyncio.create_task(runc.restore(container.id, container.restore_opts()))
        pgid, restored = await asyncio.to_thread(container.held)
        restoring.cancel()
        with pytest.raises(asyncio.CancelledError):
            await restoring
        assert not mounted(criu_root(container.root, container.id))
        await runc.delete(container.id, force=True)  # as the task service does next
        await asyncio.to_thread(container.assert_nothing_left, pgid, restored)

    run(body)


RESTORE_IN_A_DAEMON = """
import asyncio, sys
from cedana_shim.runtime.reaper import Reaper
from cedana_shim.runtime.runc import RestoreOpts, Runc

async def main():
    reaper = Reaper()
    reaper.install()
    runc = Runc(reaper=reaper, root=sys.argv[1], log_path=sys.argv[2] + "/log.json")
    opts = RestoreOpts(bundle=sys.argv[2], image_path=sys.argv[3], work_path=sys.argv[4],
                       pid_file=sys.argv[2] + "/b.pid")
    await runc.restore(sys.argv[5], opts)

asyncio.run(main())
"""


def test_delete_stops_the_restore_of_a_daemon_that_was_killed(
    container: Checkpointed, capsysbinary: pytest.CaptureFixture[bytes]
) -> None:
    """Before: runc delete found no container (its state is written at the end of the
    restore), and runc and CRIU finished the restore outside containerd."""

    async def body(reaper: Reaper) -> None:
        await container.checkpoint(reaper)

    run(body)
    container.work.mkdir()
    daemon = subprocess.Popen(
        [
            sys.executable,
            "-c",
            RESTORE_IN_A_DAEMON,
            container.root,
            str(container.bundle),
            str(container.images),
            str(container.work),
            container.id,
        ]
    )
    try:
        pgid, restored = container.held()
    finally:
        daemon.kill()
        daemon.wait()
    started = time.monotonic()
    args = ShimArgs(namespace="ns", id=container.id, bundle=str(container.bundle))
    assert delete.run_delete(args) == 0
    assert time.monotonic() - started < 5, "delete took longer than containerd's cleanup budget"
    assert capsysbinary.readouterr().out  # the DeleteResponse
    container.assert_nothing_left(pgid, restored)
