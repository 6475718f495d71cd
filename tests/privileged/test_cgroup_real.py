"""Cgroup discovery, metrics and OOM watching against the real kernel (needs root).

Each test makes its own cgroups named ``cedana-test-<uuid>`` below this process's
own cgroups and removes them afterwards, killing whatever is left inside.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from cedana_shim.api.cgroups.v1 import metrics_pb2 as v1pb
from cedana_shim.errors import FailedPrecondition, NotFound
from cedana_shim.task.cgroups import Cgroup, load_cgroup, parse_mountinfo
from cedana_shim.task.oom import OomWatcher
from cedana_shim.task.stats import V1_TYPE_URL, collect_metrics

LIMIT = 16 << 20
# Waits on stdin so the parent can move it into the cgroup first, then runs BODY.
GATED = "import sys\nsys.stdin.readline()\n{body}\nsys.stdin.readline()\n"
BURN = (
    "import time\n"
    "data = bytearray(b'x') * (4 << 20)  # charged to the new cgroup: allocated after the move\n"
    "t = time.process_time()\n"
    "while time.process_time() - t < 0.2: pass\n"
    "print('done', flush=True)"
)
# bytearray(b'x') * n writes every page; bytearray(n) could leave them untouched.
HOG = "data = bytearray(b'x') * (64 << 20)\nprint('survived', flush=True)"
V1_CONTROLLERS = ("memory", "cpu", "cpuacct", "pids")


def _own_v1() -> Cgroup | None:
    try:
        own = load_cgroup(os.getpid())
    except NotFound:
        return None
    if own.version != 1 or not all(c in own.controllers for c in V1_CONTROLLERS):
        return None
    return own


@pytest.fixture(autouse=True)
def _needs_root() -> None:
    # Not a skip: CI runs as root, and a check that cannot run must say so loudly.
    if os.geteuid() != 0:
        pytest.fail("these tests create cgroups: run them as root")


@pytest.fixture
def _v1() -> None:
    if _own_v1() is None:
        pytest.fail("this node has no cgroup v1 memory/cpu/cpuacct/pids hierarchies")


def needs_v1(test: Callable[..., None]) -> Callable[..., None]:
    """Written for v1 hierarchies: skipped on a cgroup v2 host (support.cgroup_version);
    on a v1 host without the controllers it needs, a failure."""
    marked: Callable[..., None] = pytest.mark.cgroup_v1(pytest.mark.usefixtures("_v1")(test))
    return marked


def _kill_members(directory: str) -> None:
    with contextlib.suppress(OSError):
        for pid in Path(directory, "cgroup.procs").read_text().split():
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(pid), signal.SIGKILL)


def _rmdir(directory: str) -> None:
    # A killed process leaves its cgroup a moment after SIGKILL; rmdir says EBUSY until then.
    deadline = time.monotonic() + 5
    while True:
        _kill_members(directory)
        try:
            os.rmdir(directory)
            return
        except FileNotFoundError:
            return
        except OSError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.02)


@dataclass
class CgroupSet:
    """Test cgroup directories (one per distinct hierarchy) and the children in them."""

    dirs: list[str]
    children: list[subprocess.Popen[bytes]] = field(default_factory=list)

    def write(self, name: str, value: str) -> None:
        for directory in self.dirs:
            path = Path(directory, name)
            if path.exists():
                path.write_text(value)

    def spawn(self, body: str) -> subprocess.Popen[bytes]:
        child = subprocess.Popen(
            [sys.executable, "-c", GATED.format(body=body)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
        )
        self.children.append(child)
        for directory in self.dirs:
            Path(directory, "cgroup.procs").write_text(str(child.pid))
        return child

    @staticmethod
    def release(child: subprocess.Popen[bytes]) -> None:
        assert child.stdin is not None
        child.stdin.write(b"\n")
        child.stdin.flush()

    def cleanup(self) -> None:
        for child in self.children:
            with contextlib.suppress(ProcessLookupError):
                child.kill()
            child.wait(timeout=5)
            for stream in (child.stdin, child.stdout):
                if stream is not None:
                    stream.close()
        for directory in self.dirs:
            _rmdir(directory)


@pytest.fixture
def v1_cgroups() -> Iterator[CgroupSet]:
    own = _own_v1()
    assert own is not None
    name = f"cedana-test-{uuid.uuid4().hex[:12]}"
    # cpu and cpuacct may share one mount; create each directory once.
    dirs = sorted({os.path.join(own.controllers[c], name) for c in V1_CONTROLLERS})
    made = CgroupSet(dirs=[])
    try:
        for directory in dirs:
            os.mkdir(directory)
            made.dirs.append(directory)
        yield made
    finally:
        made.cleanup()
        for directory in dirs:
            assert not os.path.exists(directory), f"cgroup {directory} leaked"


async def _wait_until(predicate: Callable[[], bool], timeout: float) -> bool:
    deadline = time.monotonic() + timeout
    while not predicate():
        if time.monotonic() > deadline:
            return False
        await asyncio.sleep(0.02)
    return True


# -- discovery and metrics (v1) ----------------------------------------------------


@needs_v1
def test_load_cgroup_finds_the_child_and_metrics_are_live(v1_cgroups: CgroupSet) -> None:
    child = v1_cgroups.spawn(BURN)
    cg = load_cgroup(child.pid)
    assert cg.version == 1
    for controller in V1_CONTROLLERS:
        assert cg.controllers[controller] in v1_cgroups.dirs, controller

    v1_cgroups.release(child)
    assert child.stdout is not None
    assert child.stdout.readline() == b"done\n"

    stats = collect_metrics(cg)
    assert stats.type_url == V1_TYPE_URL
    m = v1pb.Metrics.FromString(stats.value)
    assert m.memory.usage.usage >= 4 << 20
    assert m.memory.total_rss + m.memory.total_cache > 0
    assert m.memory.usage.limit > 0
    assert m.cpu.usage.total >= 150_000_000  # ns; it burnt 0.2 s of CPU time in here
    assert sum(m.cpu.usage.per_cpu) > 0
    assert m.cpu.usage.user + m.cpu.usage.kernel > 0
    assert m.pids.current >= 1
    assert m.HasField("memory_oom_control") and m.memory_oom_control.oom_kill == 0


@needs_v1
def test_removed_cgroup_is_not_found(v1_cgroups: CgroupSet) -> None:
    child = v1_cgroups.spawn("pass")
    cg = load_cgroup(child.pid)
    v1_cgroups.cleanup()
    with pytest.raises(NotFound):
        collect_metrics(cg)
    with pytest.raises(NotFound):
        load_cgroup(child.pid)  # reaped


# -- OOM (v1) ------------------------------------------------------------------------


@needs_v1
def test_v1_oom_kill_calls_back_with_the_container_id(v1_cgroups: CgroupSet) -> None:
    v1_cgroups.write("memory.limit_in_bytes", str(LIMIT))
    v1_cgroups.write("memory.memsw.limit_in_bytes", str(LIMIT))  # no swapping out of it
    child = v1_cgroups.spawn(HOG)
    cg = load_cgroup(child.pid)
    calls: list[str] = []

    async def scenario() -> None:
        async with OomWatcher(calls.append) as watcher:
            watcher.add("ctr-oom", cg)
            v1_cgroups.release(child)
            assert await _wait_until(lambda: bool(calls), timeout=10), "no OOM callback"
            await asyncio.sleep(0.1)  # any duplicate would arrive now

    asyncio.run(scenario())
    assert calls == ["ctr-oom"]
    assert child.wait(timeout=5) == -signal.SIGKILL
    m = v1pb.Metrics.FromString(collect_metrics(cg).value)
    assert m.memory_oom_control.oom_kill >= 1
    assert (m.memory.usage.limit, m.memory.usage.max) == (LIMIT, LIMIT)


@needs_v1
def test_v1_kill_before_add_is_reported_once(v1_cgroups: CgroupSet) -> None:
    v1_cgroups.write("memory.limit_in_bytes", str(LIMIT))
    v1_cgroups.write("memory.memsw.limit_in_bytes", str(LIMIT))
    child = v1_cgroups.spawn(HOG)
    cg = load_cgroup(child.pid)
    v1_cgroups.release(child)
    assert child.wait(timeout=10) == -signal.SIGKILL
    calls: list[str] = []

    async def scenario() -> None:
        async with OomWatcher(calls.append) as watcher:
            watcher.add("ctr-early", cg)
            assert calls == []  # never from inside add()
            assert await _wait_until(lambda: bool(calls), timeout=2)
            await asyncio.sleep(0.1)

    asyncio.run(scenario())
    assert calls == ["ctr-early"]


@needs_v1
def test_v1_watch_ends_without_callback_when_the_cgroup_is_removed(
    v1_cgroups: CgroupSet,
) -> None:
    child = v1_cgroups.spawn("pass")
    cg = load_cgroup(child.pid)
    calls: list[str] = []

    async def scenario() -> None:
        async with OomWatcher(calls.append) as watcher:
            watcher.add("ctr-gone", cg)
            assert "ctr-gone" in watcher
            v1_cgroups.cleanup()  # kill and rmdir
            assert await _wait_until(lambda: "ctr-gone" not in watcher, timeout=5)

    asyncio.run(scenario())
    assert calls == []


# -- OOM (v2) ------------------------------------------------------------------------


def _cgroup2_mount() -> str | None:
    mounts = parse_mountinfo(Path("/proc/self/mountinfo").read_text())
    return next((m.mount_point for m in mounts if m.fstype == "cgroup2"), None)


def test_v2_metrics_on_a_live_cgroup2_directory() -> None:
    mount = _cgroup2_mount()
    assert mount is not None, "no cgroup2 hierarchy is mounted on this node"
    directory = os.path.join(mount, f"cedana-test-{uuid.uuid4().hex[:12]}")
    os.mkdir(directory)
    made = CgroupSet(dirs=[directory])
    try:
        child = made.spawn("pass")
        assert Path(f"/proc/{child.pid}/cgroup").read_text().count(directory[len(mount) :]) == 1
        own = load_cgroup(child.pid)
        # On a hybrid node the v1 controllers decide; only a pure v2 node yields v2.
        assert own.version == (1 if _own_v1() is not None else 2)
        cg = Cgroup.v2(directory)
        stats = collect_metrics(cg)
        assert stats.type_url == "io.containerd.cgroups.v2.Metrics"
        made.cleanup()
        with pytest.raises(NotFound):
            collect_metrics(cg)
    finally:
        made.cleanup()


# -- the v2 watcher's inotify handling, on plain files ------------------------------


def test_v2_watcher_reports_rises_of_oom_kill_and_stops_on_removal(tmp_path: Path) -> None:
    directory = tmp_path / "ctr"
    directory.mkdir()
    events = directory / "memory.events"
    events.write_text("low 0\nhigh 0\nmax 0\noom 0\noom_kill 0\n")
    calls: list[str] = []

    async def scenario() -> None:
        async with OomWatcher(calls.append) as watcher:
            watcher.add("c1", Cgroup.v2(str(directory)))
            events.write_text("low 0\nhigh 0\nmax 3\noom 1\noom_kill 0\n")  # no kill yet
            await asyncio.sleep(0.1)
            assert calls == []
            events.write_text("low 0\nhigh 0\nmax 4\noom 2\noom_kill 1\n")
            assert await _wait_until(lambda: calls == ["c1"], timeout=2)
            events.write_text("low 0\nhigh 0\nmax 5\noom 2\noom_kill 1\n")  # same count
            await asyncio.sleep(0.1)
            assert calls == ["c1"]
            events.write_text("low 0\nhigh 0\nmax 9\noom 4\noom_kill 3\n")
            assert await _wait_until(lambda: calls == ["c1", "c1"], timeout=2)
            events.unlink()
            directory.rmdir()
            assert await _wait_until(lambda: "c1" not in watcher, timeout=2)

    asyncio.run(scenario())
    assert calls == ["c1", "c1"]


def test_v2_watcher_reports_a_kill_from_before_add_once(tmp_path: Path) -> None:
    directory = tmp_path / "ctr"
    directory.mkdir()
    (directory / "memory.events").write_text("oom 1\noom_kill 1\n")
    calls: list[str] = []

    async def scenario() -> None:
        async with OomWatcher(calls.append) as watcher:
            watcher.add("c2", Cgroup.v2(str(directory)))
            assert calls == []  # never from inside add()
            assert await _wait_until(lambda: calls == ["c2"], timeout=2)
            (directory / "memory.events").write_text("oom 1\noom_kill 1\n")
            await asyncio.sleep(0.1)
            watcher.remove("c2")
            assert watcher.watching == frozenset()

    asyncio.run(scenario())
    assert calls == ["c2"]


def test_watcher_rejects_cgroups_it_cannot_watch(tmp_path: Path) -> None:
    async def scenario() -> None:
        async with OomWatcher(lambda _: None) as watcher:
            with pytest.raises(NotFound):
                watcher.add("gone", Cgroup.v2(str(tmp_path / "missing")))
            with pytest.raises(FailedPrecondition):
                watcher.add("no-memory", Cgroup.v1({"cpu": str(tmp_path)}))
            with pytest.raises(FailedPrecondition):
                watcher.add("no-events", Cgroup.v2(str(tmp_path)))  # no memory.events
            assert watcher.watching == frozenset()

    asyncio.run(scenario())
    with pytest.raises(RuntimeError):
        OomWatcher(lambda _: None).add("x", Cgroup.v2(str(tmp_path)))
