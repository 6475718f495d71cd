"""The cuda-checkpoint backend, driven against a fake ``cuda-checkpoint``: a Python
script that keeps each pid's CUDA state in a JSON file, enforces the driver's
transitions and prints what the real tool prints (``Could not <action> on process
ID N: "<CUDA error string>"``)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import pytest
from cedana_shim.gpu.driver import (
    GpuDeadlineExceeded,
    GpuFailedPrecondition,
    GpuInternal,
    GpuInvalidArgument,
    GpuNotFound,
    GpuProcessExited,
    GpuUnavailable,
    GpuUnimplemented,
    ProcessState,
    Step,
)
from cedana_shim.gpu.driver_cli import CliDriver, classify, reaper_runner, subprocess_runner
from cedana_shim.gpu.orchestrator import freeze, thaw
from cedana_shim.runtime.reaper import Reaper

HELP_580 = """CUDA checkpoint and restore utility.
Version 580.65.06. Copyright (C) 2025 NVIDIA Corporation. All rights reserved.

Operations:
--get-state --pid <pid>
--action lock | checkpoint | restore | unlock --pid <pid> [--timeout <ms>] [--device-map <uuids>]
--toggle --pid <pid>
--get-restore-tid --pid <pid>
"""
HELP_570 = HELP_580.replace("580.65.06", "570.86.10").replace(" [--device-map <uuids>]", "")
HELP_550 = "CUDA checkpoint utility.\nVersion 550.54.15.\n--toggle --pid <pid>\n"

FAKE = r"""#!{python}
import fcntl, json, os, sys, time

HERE = {here!r}
args = sys.argv[1:]
with open(os.path.join(HERE, "calls.log"), "a") as f:
    f.write(json.dumps(args) + "\n")
try:
    with open(os.path.join(HERE, "control.json")) as f:
        control = json.load(f)
except FileNotFoundError:
    control = {{}}
if "--help" in args or "-h" in args:
    print(control.get("help", ""))
    sys.exit(0)

def flag(*names):
    for n in names:
        if n in args:
            return args[args.index(n) + 1]
    return None

pid = flag("--pid", "-p")
action = "get-state" if "--get-state" in args else flag("--action")
STATES = os.path.join(HERE, "states.json")
TRANSITIONS = {{("running", "lock"): "locked", ("locked", "checkpoint"): "checkpointed",
               ("checkpointed", "restore"): "locked", ("locked", "unlock"): "running"}}

def fail(message):
    verb = "get state of" if action == "get-state" else action + " on"
    print('Could not %s process ID %s: "%s"' % (verb, pid, message))
    sys.exit(1)

def locked_states(fn):
    with open(STATES + ".lock", "w") as lk:
        fcntl.flock(lk, fcntl.LOCK_EX)
        with open(STATES) as f:
            data = json.load(f)
        result = fn(data)
        with open(STATES, "w") as f:
            json.dump(data, f)
        return result

time.sleep(control.get("delay", 0))
rendezvous = control.get("rendezvous", 0)
if rendezvous and action in ("checkpoint", "restore"):
    # Every call of the action waits until all have started: only calls made in
    # parallel get through, however slow the machine (no clock in the verdict).
    open(os.path.join(HERE, "started-%s-%s" % (action, pid)), "w").close()
    deadline = time.monotonic() + 60
    while len([n for n in os.listdir(HERE) if n.startswith("started-" + action)]) < rendezvous:
        if time.monotonic() > deadline:
            fail("the calls were not made in parallel")
        time.sleep(0.01)
if control.get("hang") == action:
    time.sleep(60)
injected = control.get("fail", {{}}).get("%s:%s" % (pid, action))
if injected:
    fail(injected)
current = locked_states(lambda d: d["state"].get(pid))
if current is None:
    fail("invalid argument")
if action == "get-state":
    print(current)
    sys.exit(0)
if action == "lock":
    pending = control.get("pending_ms", {{}}).get(pid, 0)
    timeout = int(flag("--timeout", "-t") or 0)
    if timeout and pending > timeout:
        time.sleep(timeout / 1000)
        fail("the wait operation has timed out")
    time.sleep(pending / 1000)

def step(d):
    after = TRANSITIONS.get((d["state"][pid], action))
    if after is None:
        return False
    d["state"][pid] = after
    if action == "restore":
        d["maps"][pid] = flag("--device-map", "-d")
    return True

if not locked_states(step):
    fail("the operation cannot be performed in the present state")
"""


class FakeTool:
    def __init__(self, tmp_path: Path, pids: Sequence[int], help_text: str = HELP_580) -> None:
        self.dir = tmp_path
        self.path = tmp_path / "cuda-checkpoint"
        self.path.write_text(FAKE.format(python=sys.executable, here=str(tmp_path)))
        self.path.chmod(0o755)
        self.write("states.json", {"state": dict.fromkeys(map(str, pids), "running"), "maps": {}})
        self.control({"help": help_text})

    def write(self, name: str, data: Any) -> None:
        (self.dir / name).write_text(json.dumps(data))

    def control(self, data: dict[str, Any]) -> None:
        current = {}
        if (self.dir / "control.json").exists():
            current = json.loads((self.dir / "control.json").read_text())
        self.write("control.json", {**current, **data})

    def states(self) -> dict[int, str]:
        data = json.loads((self.dir / "states.json").read_text())
        return {int(pid): state for pid, state in data["state"].items()}

    def maps(self) -> dict[int, str | None]:
        data = json.loads((self.dir / "states.json").read_text())
        return {int(pid): m for pid, m in data["maps"].items()}

    def calls(self) -> list[list[str]]:
        log = self.dir / "calls.log"
        return [json.loads(line) for line in log.read_text().splitlines()] if log.exists() else []


@pytest.fixture
def pids() -> Iterator[list[int]]:
    """Live processes to stand in for CUDA processes (the backend checks /proc)."""
    sleepers = [subprocess.Popen(["sleep", "60"]) for _ in range(3)]
    yield [p.pid for p in sleepers]
    for p in sleepers:
        p.kill()
        p.wait()


def test_the_full_cycle_through_the_tool(tmp_path: Path, pids: list[int]) -> None:
    tool = FakeTool(tmp_path, pids)
    cli = CliDriver(str(tool.path))
    pid = pids[0]
    assert cli.state(pid) is ProcessState.RUNNING
    cli.lock(pid, 1500)
    cli.checkpoint(pid)
    assert cli.state(pid) is ProcessState.CHECKPOINTED
    cli.restore(pid)
    cli.unlock(pid)
    assert tool.states()[pid] == "running"
    calls = tool.calls()
    assert ["--action", "lock", "--pid", str(pid), "--timeout", "1500"] in calls
    assert ["--action", "restore", "--pid", str(pid)] in calls
    assert ["--get-state", "--pid", str(pid)] in calls


def test_a_wrong_transition_is_failed_precondition(tmp_path: Path, pids: list[int]) -> None:
    FakeTool(tmp_path, pids)
    cli = CliDriver(str(tmp_path / "cuda-checkpoint"))
    with pytest.raises(GpuFailedPrecondition) as info:
        cli.checkpoint(pids[0])
    text = str(info.value)
    assert text.startswith(f"GPU checkpoint of pid {pids[0]}: wrong state for checkpoint")
    assert "present state" in text


def test_a_lock_timeout_is_deadline_exceeded(tmp_path: Path, pids: list[int]) -> None:
    tool = FakeTool(tmp_path, pids)
    tool.control({"pending_ms": {str(pids[0]): 2000}})
    with pytest.raises(GpuDeadlineExceeded, match="within 50 ms"):
        CliDriver(str(tool.path)).lock(pids[0], 50)
    assert tool.states()[pids[0]] == "running"


def test_device_map_goes_on_the_command_line(tmp_path: Path, pids: list[int]) -> None:
    tool = FakeTool(tmp_path, pids)
    tool.write("states.json", {"state": {str(pids[0]): "checkpointed"}, "maps": {}})
    cli = CliDriver(str(tool.path))
    cli.restore(pids[0], {"GPU-a": "GPU-b", "GPU-c": "GPU-d"})
    assert tool.maps()[pids[0]] == "GPU-a=GPU-b,GPU-c=GPU-d"
    assert cli.probe().version == "580.65.06" and cli.probe().device_map


def test_device_map_without_580_is_refused_before_the_call(tmp_path: Path, pids: list[int]) -> None:
    tool = FakeTool(tmp_path, pids, HELP_570)
    tool.write("states.json", {"state": {str(pids[0]): "checkpointed"}, "maps": {}})
    with pytest.raises(GpuUnimplemented, match=r"570\.86\.10\) has no --device-map"):
        CliDriver(str(tool.path)).restore(pids[0], {"GPU-a": "GPU-b"})
    assert tool.states()[pids[0]] == "checkpointed"


def test_a_pid_without_cuda_is_not_found(tmp_path: Path, pids: list[int]) -> None:
    tool = FakeTool(tmp_path, pids[:1])
    with pytest.raises(GpuNotFound, match="not a CUDA process") as info:
        CliDriver(str(tool.path)).state(pids[1])
    assert not isinstance(info.value, GpuProcessExited)


def test_a_gone_pid_is_process_exited(tmp_path: Path, pids: list[int]) -> None:
    tool = FakeTool(tmp_path, pids)
    with pytest.raises(GpuProcessExited):
        CliDriver(str(tool.path)).state(2**22 + 7)


def test_a_hung_tool_is_killed_at_the_deadline(tmp_path: Path, pids: list[int]) -> None:
    tool = FakeTool(tmp_path, pids)
    tool.control({"hang": "checkpoint"})
    tool.write("states.json", {"state": {str(pids[0]): "locked"}, "maps": {}})
    cli = CliDriver(str(tool.path), action_timeout_s=0.5)
    with pytest.raises(GpuDeadlineExceeded, match=r"within 0\.5 s and was killed"):
        cli.checkpoint(pids[0])


def test_probe_and_availability(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tool = FakeTool(tmp_path, [])
    monkeypatch.setenv("PATH", f"{tmp_path}{os.pathsep}{os.environ['PATH']}")
    info = CliDriver().probe()
    assert (info.path, info.version, info.device_map) == (str(tool.path), "580.65.06", True)
    assert CliDriver.available().detail == f"{tool.path} version 580.65.06"

    tool.control({"help": HELP_550})
    availability = CliDriver.available()
    assert not availability and "does not offer --action" in availability.detail

    monkeypatch.setenv("PATH", str(tmp_path / "nowhere"))
    with pytest.raises(GpuUnavailable, match="cuda-checkpoint is not on PATH"):
        CliDriver()


def test_an_unknown_state_word_is_internal(tmp_path: Path) -> None:
    def run(argv: Sequence[str], *, timeout: float) -> tuple[int, str, str]:
        return 0, "sleeping\n", ""

    with pytest.raises(GpuInternal, match="unknown state 'sleeping'"):
        CliDriver(str(tmp_path / "x"), run=run).state(os.getpid())


def test_a_tool_that_cannot_start_is_unavailable(tmp_path: Path) -> None:
    with pytest.raises(GpuUnavailable, match="cannot run"):
        CliDriver(str(tmp_path / "missing")).unlock(os.getpid())


@pytest.mark.parametrize(
    ("step", "message", "device_map", "cls"),
    [
        (Step.LOCK, '"the operation cannot be performed in the present state"', False,
         GpuFailedPrecondition),
        (Step.LOCK, '"the wait operation has timed out"', False, GpuDeadlineExceeded),
        (Step.LOCK, '"device not ready"', False, GpuDeadlineExceeded),
        (Step.CHECKPOINT, '"operation not supported"', False, GpuUnimplemented),
        (Step.RESTORE, '"invalid argument"', True, GpuInvalidArgument),
        (Step.RESTORE, '"invalid argument"', False, GpuInternal),
        (Step.STATE, '"invalid argument"', False, GpuNotFound),
        (Step.STATE, '"operation not supported"', False, GpuNotFound),
        (Step.UNLOCK, '"initialization error"', False, GpuUnavailable),
        (Step.CHECKPOINT, '"out of memory"', False, GpuInternal),
    ],
)  # fmt: skip
def test_classify(step: Step, message: str, device_map: bool, cls: type) -> None:
    text = f"Could not {step} on process ID {os.getpid()}: {message}"
    err = classify(step, os.getpid(), 1, text, timeout_ms=10, device_map=device_map)
    assert type(err) is cls
    assert f"pid {os.getpid()}" in str(err) and f"GPU {step}" in str(err)
    assert message in str(err)


def test_freeze_and_thaw_through_the_reaper(tmp_path: Path, pids: list[int]) -> None:
    """The daemon's path: cuda-checkpoint started by the one reaper, from worker threads,
    every process in parallel."""
    tool = FakeTool(tmp_path, pids)
    tool.control({"rendezvous": len(pids)})

    async def body() -> None:
        loop = asyncio.get_running_loop()
        reaper = Reaper()
        reaper.install()
        try:
            cli = CliDriver(str(tool.path), run=reaper_runner(reaper, loop))
            frozen = await freeze(cli, pids, lock_timeout_ms=5000, container_id="c1")
            assert set(tool.states().values()) == {"checkpointed"}
            thawed = await thaw(cli, frozen, {"GPU-a": "GPU-b"})
            with pytest.raises(RuntimeError, match="worker thread"):
                cli.state(pids[0])  # on the loop thread it would deadlock
            assert sorted(thawed.restored) == sorted(frozen.pids)
        finally:
            reaper.close()

    asyncio.run(body())
    assert set(tool.states().values()) == {"running"}
    assert set(tool.maps().values()) == {"GPU-a=GPU-b"}
    # Each checkpoint and restore call waited at the tool until all of them had started.
    started = sorted(n for n in os.listdir(tmp_path) if n.startswith("started-"))
    assert started == sorted(f"started-{a}-{p}" for a in ("checkpoint", "restore") for p in pids)


def test_subprocess_runner_timeout() -> None:
    with pytest.raises(TimeoutError, match=r"within 0\.2 s"):
        subprocess_runner(["sleep", "5"], timeout=0.2)
    assert subprocess_runner(["sh", "-c", "echo out; echo err >&2; exit 3"], timeout=5) == (
        3,
        "out\n",
        "err\n",
    )
