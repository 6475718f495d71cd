"""GPU checkpoint/restore through the cedana shim, on a node without a GPU.

Real containerd, runc, CRIU and busybox containers that ask for GPUs
(`NVIDIA_VISIBLE_DEVICES=all`); only the NVIDIA parts are fakes (`fakes/`): the shim
daemon imports a fake NVML (`fakes/pynvml`) and runs a fake `cuda-checkpoint`
(`CEDANA_GPU_BACKEND=cuda-checkpoint`, `CEDANA_CUDA_CHECKPOINT_PATH`). The test picks
which container processes are CUDA processes by writing their pids into the fakes'
shared state file; the fake tool enforces the driver's state machine and refuses to
touch a frozen or stopped process.

How the fake NVML gets in: containerd finds `containerd-shim-cedana-v2` on its PATH,
and this test puts first a launcher written by the shim's own `cedana_shim.launcher`
whose fixed `sys.path` starts with `fakes/` (the real launcher runs Python with `-sS`
and puts site-packages ahead of PYTHONPATH, so PYTHONPATH cannot shadow an installed
nvidia-ml-py). `CEDANA_FORKSERVER=0` makes `start` fork the daemon itself: a warm fork
server would hand out daemons with its own import path.

Order is read off one event log that every actor appends to with CLOCK_MONOTONIC
stamps: the fake tool (each call, with what it saw of the process), the fake NVML,
a hooks.d hook (`record-event`, in every checkpoint stage) and CRIU itself, which
runs `record-event` as its `action-script` (`CEDANA_CRIU_CONFIG_EXTRA`) at `pre-dump`,
`post-dump`, `pre-restore`, `post-resume`, ... together with a snapshot of every fake
CUDA process's state at that instant.

These tests always drive the cedana runtime (also under CEDANA_TEST_RUNTIME=runc: the
GPU steps have no runc counterpart).
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import subprocess
import uuid
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import pytest
from cedana_shim.checkpoint.store import Entry, Store, StoreConfig
from cedana_shim.gpu.driver_api import DriverApi
from cedana_shim.launcher import default_paths, write_launcher

from .harness import procs
from .harness.config import CEDANA, CTR_NAMESPACE, SHIM_BIN_DIR
from .harness.containerd import Containerd
from .harness.ctr import Ctr
from .harness.util import wait_for

NewId = Callable[[str], str]
Event = dict[str, Any]

FAKES = Path(__file__).resolve().parent / "fakes"
FAKE_CUDA_CHECKPOINT = FAKES / "cuda-checkpoint"
RECORDER = FAKES / "record-event"
CEDANA_CLI = SHIM_BIN_DIR / "cedana"

GIB = 1 << 30
H200_BYTES = 150_754_820_096
GPU0 = "GPU-5e1f0a11-0000-4000-8000-00000000a001"
GPU1 = "GPU-5e1f0a11-0000-4000-8000-00000000a002"
# The same model, other boards: "the node's GPUs were replaced".
NEW_GPU0 = "GPU-77c0ffee-0000-4000-8000-00000000b001"
NEW_GPU1 = "GPU-77c0ffee-0000-4000-8000-00000000b002"
DRIVER = "580.65.06"
LOCK_TIMEOUT_MS = 7000  # CEDANA_GPU_LOCK_TIMEOUT_MS: seen in every lock call


def h200(uuid_: str, pci: str) -> dict[str, Any]:
    return {"uuid": uuid_, "name": "NVIDIA H200", "memory": H200_BYTES, "pci": pci, "mig": False}


GPUS = [h200(GPU0, "00000000:19:00.0"), h200(GPU1, "00000000:3B:00.0")]
NEW_GPUS = [h200(NEW_GPU0, "00000000:19:00.0"), h200(NEW_GPU1, "00000000:3B:00.0")]

# Two long-lived "CUDA workers" (the test marks their pids) next to a counter in the
# container's init, whose value lives only in memory: a restored container goes on
# counting, a cold one starts again at 1. SIGTERM reaches the workload only when the
# shim delivers it instead of checkpointing: it then prints got-TERM.
WORKLOAD = (
    "trap 'echo got-TERM; exit 143' TERM\n"
    "sleep 100001 &\n"
    "sleep 100002 &\n"
    "i=0\n"
    "while :; do i=$((i+1)); echo tick $i; sleep 0.2; done\n"
)
WORKER_ARGV = (("sleep", "100001"), ("sleep", "100002"))

TEAM_KEY = "example.com/gpu-team"
COMMIT_TIMEOUT = 60


def ticks(lines: Sequence[str]) -> list[int]:
    return [int(line.split()[1]) for line in lines if line.startswith("tick ")]


# -- the node ------------------------------------------------------------------------------


@dataclass
class Workload:
    cid: str
    out: Path
    init: int = 0
    workers: tuple[int, int] = (0, 0)
    shim: int = 0

    def lines(self) -> list[str]:
        if not self.out.exists():
            return []
        text = self.out.read_text(errors="replace")
        return text[: text.rfind("\n") + 1].splitlines()


@dataclass
class GpuNode:
    """A containerd whose cedana shims see the fake GPU node."""

    containerd: Containerd
    ctr: Ctr
    state: Path
    events_file: Path
    logs: Path
    launcher: Path  # the containerd-shim-cedana-v2 containerd runs
    started: list[Workload] = field(default_factory=list)

    # -- the fakes' state ----------------------------------------------------------------

    @contextlib.contextmanager
    def edit(self) -> Iterator[dict[str, Any]]:
        """The fake state for a read-modify-write, under the fakes' lock."""
        with open(f"{self.state}.lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            data: dict[str, Any] = json.loads(self.state.read_text())
            yield data
            tmp = self.state.with_suffix(".test.tmp")
            tmp.write_text(json.dumps(data, indent=1))
            tmp.rename(self.state)

    def read(self) -> dict[str, Any]:
        data: dict[str, Any] = json.loads(self.state.read_text())
        return data

    def mark_cuda(self, w: Workload, memory: tuple[int, int] = (2 * GIB, 3 * GIB)) -> None:
        """The two workers become CUDA processes: one on each GPU."""
        with self.edit() as data:
            for pid, gpu, mem in zip(w.workers, (GPU0, GPU1), memory, strict=True):
                data["procs"][str(pid)] = {"state": "running", "gpus": [gpu], "memory": mem}

    def fail(self, call: str, pid: int, message: str, times: int = 1) -> None:
        """The next `times` `call`s on `pid` (or on the process restored from it) fail."""
        with self.edit() as data:
            data["fail"].append({"action": call, "pid": pid, "message": message, "times": times})

    def gpu_states(self) -> dict[int, str]:
        return {int(pid): rec["state"] for pid, rec in self.read()["procs"].items()}

    def events(self, since: int = 0) -> list[Event]:
        if not self.events_file.exists():
            return []
        lines = self.events_file.read_text().splitlines()
        return [json.loads(line) for line in lines[since:]]

    def mark(self) -> int:
        return len(self.events())

    # -- containers -------------------------------------------------------------------

    def run(
        self,
        cid: str,
        *,
        label: str | None = None,
        enable: bool = False,
        gpu: bool = True,
        annotations: dict[str, str] | None = None,
    ) -> Workload:
        """`ctr run -d` the workload; waits for its init and both workers."""
        w = Workload(cid, self.logs / f"{cid}.log")
        self.started.append(w)
        flags = ["-d", "--log-uri", f"file://{w.out}"]
        if gpu:
            flags += ["--env", "NVIDIA_VISIBLE_DEVICES=all"]
        if label is not None:
            flags += ["--env", f"CEDANA_CHECKPOINT={label}"]
        if enable:
            flags += ["--env", "CEDANA_ENABLE=1"]
        for key, value in (annotations or {}).items():
            flags += ["--annotation", f"{key}={value}"]
        image = self.containerd.images.busybox
        self.ctr(*self.ctr.run_args(image, cid, "sh", "-c", WORKLOAD, flags=tuple(flags)))
        row = self.ctr.wait_status(cid, "RUNNING")
        w.init = row.pid
        w.workers = self.find_workers(w)
        shims = self.containerd.shim_pids(CTR_NAMESPACE, cid)
        assert len(shims) == 1, f"{cid}: shim daemons serving its socket: {shims}"
        w.shim = shims.pop()
        argv = procs.read_argv(w.shim) or ()
        assert str(self.launcher) in argv, f"{cid}: the shim is not the test's launcher: {argv}"
        return w

    def find_workers(self, w: Workload) -> tuple[int, int]:
        def found() -> tuple[int, int] | None:
            by_argv = {
                procs.read_argv(pid): pid
                for pid in procs.descendants({w.init})
                if procs.pid_alive(pid)
            }
            pids = [by_argv.get(argv) for argv in WORKER_ARGV]
            return (pids[0], pids[1]) if pids[0] and pids[1] else None

        return wait_for(found, timeout=10, what=f"both workers of {w.cid}")

    def wait_ticks(self, w: Workload, count: int) -> list[int]:
        def enough() -> list[int] | None:
            seen = ticks(w.lines())
            return seen if len(seen) >= count else None

        return wait_for(enough, timeout=20, what=f"{count} ticks of {w.cid}")

    def stop(self, w: Workload) -> None:
        """`ctr task kill` (SIGTERM): checkpoint-on-stop for a labelled container."""
        self.ctr("task", "kill", w.cid)
        self.ctr.wait_status(w.cid, "STOPPED", timeout=30)

    def cedana_checkpoint(
        self, w: Workload, *, leave_running: bool
    ) -> subprocess.CompletedProcess[str]:
        argv = [str(CEDANA_CLI), "checkpoint", w.cid, "--namespace", CTR_NAMESPACE]
        argv += ["--containerd-state", str(self.containerd.state), "--json"]
        if leave_running:
            argv.append("--leave-running")
        return subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)

    def close(self) -> None:
        for w in self.started:
            self.ctr.remove(w.cid)

    # -- what happened ---------------------------------------------------------------

    def entries(self, label: str) -> list[Entry]:
        if not (self.containerd.store / "index.json").exists():
            return []
        return Store(StoreConfig(root=str(self.containerd.store))).catalog.list(
            scope=CTR_NAMESPACE, label=label
        )

    def wait_entry(self, label: str) -> Entry:
        found: list[Entry] = wait_for(
            lambda: self.entries(label),
            timeout=COMMIT_TIMEOUT,
            interval=0.1,
            what=f"a committed checkpoint of label {label}",
        )
        assert len(found) == 1, [e.id for e in found]
        return found[0]

    def ingest_leftovers(self) -> list[str]:
        ingest = self.containerd.store / "ingest"
        return sorted(os.listdir(ingest)) if ingest.is_dir() else []

    def shim_records(self, offset: int) -> list[dict[str, Any]]:
        """The shim's JSON log records in containerd's log since `offset`."""
        out = []
        for line in self.containerd.log_since(offset, limit=50_000_000).splitlines():
            if line.startswith("{"):
                with contextlib.suppress(ValueError):
                    record = json.loads(line)
                    if isinstance(record, dict) and "msg" in record:
                        out.append(record)
        return out

    def wait_record(self, offset: int, msg: str, **fields: object) -> dict[str, Any]:
        def find() -> dict[str, Any] | None:
            return next(
                (
                    r
                    for r in self.shim_records(offset)
                    if r["msg"] == msg and all(r.get(k) == v for k, v in fields.items())
                ),
                None,
            )

        return wait_for(find, timeout=30, interval=0.1, what=f"shim log {msg!r} {fields}")

    def explain(self, since: int = 0) -> str:
        """The event log, one line each, for assertion messages."""
        lines = []
        for e in self.events(since):
            what = {k: e.get(k) for k in ("call", "pid", "rc", "error", "violation") if e.get(k)}
            what |= {k: e[k] for k in ("action", "hook", "stage", "container") if e.get(k)}
            lines.append(f"{e['t']:.3f} {e['src']} {json.dumps(what)}")
        return "\n".join(lines)


def cuda_calls(events: list[Event], pids: Sequence[int] | None = None) -> list[Event]:
    return [
        e
        for e in events
        if e["src"] == "cuda-checkpoint"
        and e.get("call") != "help"
        and (pids is None or e.get("pid") in pids)
    ]


def steps(events: list[Event], call: str, pids: Sequence[int] | None = None) -> list[Event]:
    return [e for e in cuda_calls(events, pids) if e.get("call") == call]


def hook_runs(events: list[Event], cid: str, hook: str = "order") -> dict[str, Event]:
    runs = [e for e in events if e["src"] == "hook" and e["container"] == cid and e["hook"] == hook]
    by_stage = {e["stage"]: e for e in runs}
    assert len(by_stage) == len(runs), f"a {hook} hook ran twice in one stage for {cid}: {runs}"
    return by_stage


def criu_actions(events: list[Event], cid: str, verb: str) -> dict[str, list[Event]]:
    """CRIU's action-script calls for `runc <verb> <cid>`, by action. (CRIU 4.1 runs a
    script named in runc's config file twice per action: every call is kept.)"""
    out: dict[str, list[Event]] = {}
    for e in events:
        if e["src"] == "criu" and e["container"] == cid and e["runc"] == verb:
            out.setdefault(e["action"], []).append(e)
    return out


def assert_before(first: list[Event], then: list[Event], what: str, log: str) -> None:
    """Every event of `first` ended before any event of `then` started."""
    assert first and then, f"{what}: nothing to compare ({first=}, {then=})\n{log}"
    end = max(float(e["t"]) for e in first)
    start = min(float(e["t0"] if "t0" in e else e["t"]) for e in then)
    assert end < start, f"{what}: {end:.4f} is not before {start:.4f}\n{log}"


def assert_clean(events: list[Event], log: str) -> None:
    """No call the fake tool refused as impossible, and no broken recorder."""
    bad = [e for e in events if e.get("violation") or e["src"] == "record-event"]
    assert not bad, f"the shim drove the fake driver wrongly: {bad}\n{log}"


def assert_runnable(calls: list[Event], log: str) -> None:
    """Each call found its process alive, not frozen, not stopped or traced."""
    for e in calls:
        seen = e["facts"]
        assert seen["exists"] and seen["frozen"] is False, (e, log)
        assert seen["state"] not in ("T", "t") and seen["tracer"] == 0, (e, log)


# -- fixtures ----------------------------------------------------------------------------


def hooks_file(path: Path, name: str, when: dict[str, Any], stages: list[str]) -> None:
    path.write_text(
        json.dumps(
            {
                "version": "1.0.0",
                "hook": {"path": str(RECORDER), "args": ["record-event", name], "timeout": 10},
                "when": when,
                "stages": stages,
            }
        )
    )


@pytest.fixture
def gpu_node(fresh_containerd: Containerd) -> Iterator[Callable[..., GpuNode]]:
    """A factory: configures the fresh containerd for the fake GPU node (extra env vars
    override the defaults) and restarts it, so its shims inherit that environment."""
    made: list[GpuNode] = []
    for tool in (
        FAKE_CUDA_CHECKPOINT,
        RECORDER,
        CEDANA_CLI,
        CEDANA.shim_path(fresh_containerd.version),
    ):
        assert os.access(tool, os.X_OK), f"{tool} is missing or not executable"

    def make(**env: str) -> GpuNode:
        assert not made, "one GPU node per test"
        base = fresh_containerd.base / "gpu"
        (base / "logs").mkdir(parents=True)
        state = base / "state.json"
        state.write_text(
            json.dumps({"driver": DRIVER, "cuda": 13000, "gpus": GPUS, "procs": {}, "fail": []})
        )
        # Two hooks.d directories: an "order" hook for every container and every stage,
        # and one per team, selected by the container's annotation.
        all_stages = ["precheckpoint", "postcheckpoint", "prerestore", "postrestore"]
        hooks_a, hooks_b = base / "hooks-a", base / "hooks-b"
        hooks_a.mkdir()
        hooks_b.mkdir()
        hooks_file(hooks_a / "10-order.json", "order", {"always": True}, all_stages)
        team = ["precheckpoint", "postcheckpoint"]
        hooks_file(
            hooks_a / "50-team-a.json", "team-a", {"annotations": {f"^{TEAM_KEY}$": "^a$"}}, team
        )
        hooks_file(
            hooks_b / "50-team-b.json", "team-b", {"annotations": {f"^{TEAM_KEY}$": "^b$"}}, team
        )
        # The shim, as `make venv` installs it, but importing fakes/ first.
        launcher = base / "bin" / CEDANA.shim_binary
        launcher.parent.mkdir()
        write_launcher(str(launcher), paths=[str(FAKES), *default_paths()])
        path = fresh_containerd._env()["PATH"]
        fresh_containerd.extra_env.update(
            {
                "PATH": f"{launcher.parent}:{path}",
                "CEDANA_FORKSERVER": "0",
                "CEDANA_FAKE_GPU_STATE": str(state),
                "CEDANA_GPU_BACKEND": "cuda-checkpoint",
                "CEDANA_CUDA_CHECKPOINT_PATH": str(FAKE_CUDA_CHECKPOINT),
                "CEDANA_GPU_LOCK_TIMEOUT_MS": str(LOCK_TIMEOUT_MS),
                "CEDANA_HOOKS_DIRS": f"{hooks_a}:{hooks_b}",
                "CEDANA_CRIU_CONFIG_EXTRA": f"action-script {RECORDER}",
                **env,
            }
        )
        fresh_containerd.restart()
        ctr = replace(fresh_containerd.ctr(CTR_NAMESPACE), runtime_type=CEDANA.runtime_type)
        node = GpuNode(fresh_containerd, ctr, state, base / "events.jsonl", base / "logs", launcher)
        made.append(node)
        return node

    try:
        yield make
    finally:
        for node in made:
            node.close()


# -- the tests ----------------------------------------------------------------------------


@pytest.mark.ctrd_versions("1.6", "2.1")
def test_stop_freezes_gpus_before_the_dump_and_restore_thaws_after(
    gpu_node: Callable[..., GpuNode], new_id: NewId
) -> None:
    """Checkpoint on stop: lock every CUDA process, then checkpoint every one, all before
    CRIU starts the dump (CRIU's pre-dump sees them CHECKPOINTED; nothing was frozen while
    the driver worked); the processes are gone after it; the metadata records the GPUs and
    the processes. A new container of the label restores: CRIU first, then restore and
    unlock of the new pids (the same processes: their identity moved), and it runs on."""
    node = gpu_node()
    label = f"gpu-{uuid.uuid4().hex[:8]}"
    first = node.run(new_id("first"), label=label, annotations={TEAM_KEY: "a"})
    p1, p2 = first.workers
    node.mark_cuda(first)
    node.wait_ticks(first, 3)
    since, offset = node.mark(), node.containerd.log_offset()

    node.stop(first)
    entry = node.wait_entry(label)
    events = node.events(since)
    log = node.explain(since)
    assert_clean(events, log)

    # Who asked: the container's own shim daemon, with the fake NVML from PYTHONPATH.
    inits = [e for e in events if e["src"] == "nvml" and e["call"] == "init"]
    assert inits and {e["by"] for e in inits} == {first.shim}, log
    assert {e["module"] for e in inits} == {str(FAKES / "pynvml" / "__init__.py")}, inits
    listed = {
        p for e in events if e["src"] == "nvml" and e["call"] == "processes" for p in e["pids"]
    }
    assert {p1, p2} <= listed, (listed, log)
    assert {e["caller"] for e in cuda_calls(events)} == {first.shim}, log

    # Exactly: get-state, lock, checkpoint for each CUDA process; all of them succeed.
    for pid in (p1, p2):
        mine = [e["call"] for e in cuda_calls(events, [pid])]
        assert mine == ["get-state", "lock", "checkpoint"], (pid, mine, log)
    assert all(e["rc"] == 0 for e in cuda_calls(events, [p1, p2])), log
    assert {e["timeout_ms"] for e in steps(events, "lock")} == {LOCK_TIMEOUT_MS}, log
    locks, checkpoints = steps(events, "lock"), steps(events, "checkpoint")
    assert_runnable(locks + checkpoints, log)

    hooks = hook_runs(events, first.cid)
    dump = criu_actions(events, first.cid, "checkpoint")
    assert {"pre-dump", "post-dump"} <= set(dump), (sorted(dump), log)
    assert_before([hooks["precheckpoint"]], locks, "precheckpoint hook, then lock", log)
    assert_before(locks, checkpoints, "every lock before any checkpoint", log)
    assert_before(checkpoints, dump["pre-dump"], "GPU checkpoint before the CRIU dump", log)
    assert_before(dump["post-dump"], [hooks["postcheckpoint"]], "dump, then post hook", log)
    # At the instant CRIU starts, the driver holds both processes' GPU state in host memory.
    for moment in [*dump["pre-dump"], *dump["post-dump"], hooks["postcheckpoint"]]:
        assert {k: moment["gpu_states"][str(p)] for k, p in (("p1", p1), ("p2", p2))} == {
            "p1": "checkpointed",
            "p2": "checkpointed",
        }, (moment, log)
    assert hooks["postcheckpoint"]["outcome"] == "ok", hooks
    assert not [e for e in events if e["src"] == "hook" and e["hook"] == "team-b"], log

    # The dump ended them: the stop was a checkpoint, not a SIGTERM.
    assert not procs.pid_alive(p1) and not procs.pid_alive(p2), log
    assert "got-TERM" not in first.lines(), first.lines()[-5:]
    assert node.gpu_states() == {p1: "checkpointed", p2: "checkpointed"}
    before = ticks(first.lines())

    gpu = entry.metadata["gpu"]
    assert gpu["inventory"] == {
        "driverVersion": DRIVER,
        "cudaDriverVersion": 13000,
        "devices": [
            {
                "index": i,
                "uuid": g["uuid"],
                "name": "NVIDIA H200",
                "memoryTotalBytes": H200_BYTES,
                "pciBusId": g["pci"],
                "migEnabled": False,
            }
            for i, g in enumerate(GPUS)
        ],
    }
    assert gpu["visible"] == [GPU0, GPU1]
    assert gpu["processes"] == [
        {"pid": p1, "gpuUuids": [GPU0], "memoryBytes": 2 * GIB},
        {"pid": p2, "gpuUuids": [GPU1], "memoryBytes": 3 * GIB},
    ]
    freeze = gpu["freeze"]
    assert freeze["backend"] == "cuda-checkpoint" and freeze["bytes"] == 5 * GIB, freeze
    assert [p["pid"] for p in freeze["processes"]] == [p1, p2], freeze
    assert "thaw" not in gpu, gpu
    node.wait_record(offset, "checkpoint committed", container=first.cid, checkpoint=entry.id)

    # -- restore ----------------------------------------------------------------------
    since, offset = node.mark(), node.containerd.log_offset()
    second = node.run(new_id("second"), label=label)
    q1, q2 = second.workers
    node.wait_record(offset, "restored from checkpoint", container=second.cid, checkpoint=entry.id)
    events = node.events(since)
    log = node.explain(since)
    assert_clean(events, log)

    restores, unlocks = steps(events, "restore"), steps(events, "unlock")
    assert sorted(e["pid"] for e in restores) == sorted([q1, q2]), log
    assert sorted(e["pid"] for e in unlocks) == sorted([q1, q2]), log
    assert all(e["rc"] == 0 for e in restores + unlocks), log
    assert not steps(events, "lock") and not steps(events, "checkpoint"), log
    assert all("device-map" not in e["argv"] for e in restores), "same GPUs: no device map"
    # The new pids are the checkpointed processes: the first call about each adopted the
    # old pid's record (same pid in the container's namespace, same memory).
    adopted = {e["pid"]: e["adopted_from"] for e in cuda_calls(events) if e.get("adopted_from")}
    assert adopted == {q1: p1, q2: p2}, (adopted, log)
    assert_runnable(restores + unlocks, log)

    hooks = hook_runs(events, second.cid)
    criu = criu_actions(events, second.cid, "restore")
    assert "post-resume" in criu, (sorted(criu), log)
    criu_events = [e for calls in criu.values() for e in calls]
    assert_before([hooks["prerestore"]], criu_events, "prerestore hook, then CRIU", log)
    assert_before(criu_events, restores, "CRIU restore before the GPU restore", log)
    assert_before(restores, unlocks, "every restore before any unlock", log)
    assert_before(unlocks, [hooks["postrestore"]], "unlock, then postrestore hook", log)
    assert hooks["postrestore"]["outcome"] == "ok", hooks
    # While CRIU restored, the GPU state was still in host memory (nothing thawed early).
    for moment in criu_events:
        assert moment["gpu_states"] == {str(p1): "checkpointed", str(p2): "checkpointed"}, moment

    assert node.gpu_states() == {q1: "running", q2: "running"}
    assert node.ctr.wait_status(second.cid, "RUNNING").pid == second.init
    after = node.wait_ticks(second, 3)
    assert before[-1] < after[0] <= before[-1] + 3, f"not resumed: {before[-3:]} then {after[:3]}"
    assert procs.pid_alive(q1) and procs.pid_alive(q2)


@pytest.mark.ctrd_versions("1.6")
def test_leave_running_checkpoint_thaws_after_the_dump(
    gpu_node: Callable[..., GpuNode], new_id: NewId
) -> None:
    """`cedana checkpoint --leave-running`: lock, checkpoint, CRIU dump (of the paused
    container), and only once it is resumed restore and unlock; the same processes run
    on, RUNNING, and the checkpoint records both the freeze and the thaw."""
    node = gpu_node()
    w = node.run(new_id("lr"), enable=True)
    p1, p2 = w.workers
    node.mark_cuda(w)
    node.wait_ticks(w, 2)
    since = node.mark()

    done = node.cedana_checkpoint(w, leave_running=True)
    assert done.returncode == 0, (done.stdout, done.stderr, node.explain(since))
    checkpoint_id = json.loads(done.stdout)["id"]
    events = node.events(since)
    log = node.explain(since)
    assert_clean(events, log)

    for pid in (p1, p2):
        mine = [e["call"] for e in cuda_calls(events, [pid]) if e["call"] != "get-state"]
        assert mine == ["lock", "checkpoint", "restore", "unlock"], (pid, mine, log)
    assert all(e["rc"] == 0 for e in cuda_calls(events, [p1, p2])), log
    locks, checkpoints = steps(events, "lock"), steps(events, "checkpoint")
    restores, unlocks = steps(events, "restore"), steps(events, "unlock")
    assert_runnable(locks + checkpoints + restores + unlocks, log)
    hooks = hook_runs(events, w.cid)
    dump = criu_actions(events, w.cid, "checkpoint")
    assert {"pre-dump", "post-dump"} <= set(dump), (sorted(dump), log)
    assert_before([hooks["precheckpoint"]], locks, "precheckpoint hook, then lock", log)
    assert_before(locks, checkpoints, "every lock before any checkpoint", log)
    assert_before(checkpoints, dump["pre-dump"], "GPU checkpoint before the CRIU dump", log)
    assert_before(dump["post-dump"], restores, "CRIU dump before the GPU restore", log)
    assert_before(restores, unlocks, "every restore before any unlock", log)
    assert_before(unlocks, [hooks["postcheckpoint"]], "thaw before the post hook", log)
    for moment in dump["pre-dump"]:
        assert moment["gpu_states"] == {str(p1): "checkpointed", str(p2): "checkpointed"}

    assert node.gpu_states() == {p1: "running", p2: "running"}
    assert procs.pid_alive(p1) and procs.pid_alive(p2)
    assert node.find_workers(w) == (p1, p2)
    count = len(ticks(w.lines()))
    node.wait_ticks(w, count + 2)  # still counting
    assert node.ctr.task(w.cid) is not None and node.ctr.task(w.cid).status == "RUNNING"  # type: ignore[union-attr]

    (entry,) = node.entries(w.cid)
    assert entry.id == checkpoint_id and entry.metadata["reason"] == "manual"
    gpu = entry.metadata["gpu"]
    assert [p["pid"] for p in gpu["freeze"]["processes"]] == [p1, p2], gpu
    assert sorted(gpu["thaw"]["restored"]) == [p1, p2], gpu
    assert gpu["thaw"]["deviceMap"] == {}, gpu


@pytest.mark.ctrd_versions("1.6")
def test_failed_gpu_checkpoint_on_stop_is_undone_and_the_container_stops_without_it(
    gpu_node: Callable[..., GpuNode], new_id: NewId
) -> None:
    """The driver fails the checkpoint of the second process: the first is restored and
    unlocked, the second unlocked, nothing is left locked, CRIU never runs, nothing is
    committed, and the stop falls back to delivering the SIGTERM."""
    node = gpu_node()
    label = f"gpu-{uuid.uuid4().hex[:8]}"
    w = node.run(new_id("fail"), label=label)
    p1, p2 = w.workers
    node.mark_cuda(w)
    node.fail("checkpoint", p2, "out of memory")
    node.wait_ticks(w, 2)
    since, offset = node.mark(), node.containerd.log_offset()

    node.stop(w)
    fallback = node.wait_record(offset, "checkpoint on stop failed; stopping without it")
    events = node.events(since)
    log = node.explain(since)
    assert_clean(events, log)
    assert fallback["container"] == w.cid, fallback
    assert "every process was returned to running" in fallback["error"], fallback
    assert "out of memory" in fallback["error"], fallback

    calls = {pid: [(e["call"], e["rc"]) for e in cuda_calls(events, [pid])] for pid in (p1, p2)}
    # p1: frozen, then walked back (state, restore, state, unlock, state: running).
    assert calls[p1][:3] == [("get-state", 0), ("lock", 0), ("checkpoint", 0)], (calls, log)
    assert ("restore", 0) in calls[p1] and ("unlock", 0) in calls[p1], (calls, log)
    assert calls[p1].index(("restore", 0)) < calls[p1].index(("unlock", 0)), (calls, log)
    # p2: its checkpoint failed (injected), it stayed LOCKED and was unlocked.
    assert calls[p2][:3] == [("get-state", 0), ("lock", 0), ("checkpoint", 1)], (calls, log)
    assert ("unlock", 0) in calls[p2] and ("restore", 0) not in calls[p2], (calls, log)
    injected = [e for e in cuda_calls(events) if e.get("injected")]
    assert [(e["call"], e["pid"]) for e in injected] == [("checkpoint", p2)], log
    assert node.gpu_states() == {p1: "running", p2: "running"}

    assert not [e for e in events if e["src"] == "criu"], f"CRIU ran after a failed freeze\n{log}"
    hooks = hook_runs(events, w.cid)
    assert hooks["postcheckpoint"]["outcome"] == "failed", hooks
    assert hooks["postcheckpoint"]["gpu_states"] == {str(p1): "running", str(p2): "running"}

    node.ctr.wait_status(w.cid, "STOPPED", timeout=30)
    wait_for(lambda: "got-TERM" in w.lines(), timeout=10, what="the workload's SIGTERM trap")
    assert not node.entries(label), "a failed GPU freeze committed a checkpoint"
    assert node.ingest_leftovers() == [], node.ingest_leftovers()


@pytest.mark.ctrd_versions("1.6")
def test_failed_gpu_freeze_on_manual_checkpoint_leaves_the_container_running(
    gpu_node: Callable[..., GpuNode], new_id: NewId
) -> None:
    """A failed lock (first process: its work did not finish in time) on `cedana
    checkpoint`, then a failed checkpoint (second process) on `--leave-running`: each
    attempt fails with the per-process story, leaves every process RUNNING and the
    container running, commits nothing; the next attempt succeeds."""
    node = gpu_node()
    w = node.run(new_id("manual"), enable=True)
    p1, p2 = w.workers
    node.mark_cuda(w)
    node.wait_ticks(w, 2)

    node.fail("lock", p1, "the wait operation has timed out")
    since = node.mark()
    done = node.cedana_checkpoint(w, leave_running=False)
    events = node.events(since)
    log = node.explain(since)
    assert done.returncode != 0, (done.stdout, log)
    assert "every process was returned to running" in done.stderr, done.stderr
    assert f"did not finish within {LOCK_TIMEOUT_MS} ms" in done.stderr, done.stderr
    assert_clean(events, log)
    assert [(e["call"], e["rc"]) for e in steps(events, "lock", [p1])] == [("lock", 1)], log
    assert [e["rc"] for e in steps(events, "lock", [p2])] == [0], log
    assert [e["pid"] for e in steps(events, "unlock")] == [p2], log
    assert not steps(events, "checkpoint") and not steps(events, "restore"), log
    assert not [e for e in events if e["src"] == "criu"], log
    assert node.gpu_states() == {p1: "running", p2: "running"}

    node.fail("checkpoint", p2, "out of memory")
    since = node.mark()
    done = node.cedana_checkpoint(w, leave_running=True)
    events = node.events(since)
    log = node.explain(since)
    assert done.returncode != 0, (done.stdout, log)
    assert "every process was returned to running" in done.stderr, done.stderr
    assert_clean(events, log)
    assert [e["rc"] for e in steps(events, "checkpoint", [p2])] == [1], log
    assert [e["pid"] for e in steps(events, "restore")] == [p1], log
    assert sorted(e["pid"] for e in steps(events, "unlock")) == sorted([p1, p2]), log
    assert not [e for e in events if e["src"] == "criu"], log
    assert node.gpu_states() == {p1: "running", p2: "running"}

    assert not node.entries(w.cid) and node.ingest_leftovers() == []
    assert node.find_workers(w) == (p1, p2)
    count = len(ticks(w.lines()))
    node.wait_ticks(w, count + 2)
    assert "got-TERM" not in w.lines()

    since = node.mark()
    done = node.cedana_checkpoint(w, leave_running=True)
    assert done.returncode == 0, (done.stderr, node.explain(since))
    assert_clean(node.events(since), node.explain(since))
    assert [e.id for e in node.entries(w.cid)] == [json.loads(done.stdout)["id"]]
    assert node.gpu_states() == {p1: "running", p2: "running"}


@pytest.mark.ctrd_versions("1.6")
def test_failed_gpu_restore_after_criu_abandons_the_attempt_and_starts_cold(
    gpu_node: Callable[..., GpuNode], new_id: NewId
) -> None:
    """CRIU restored the processes, but the driver cannot give the second one its GPU
    memory back (its restore fails, and so does each retry): the restored processes are
    killed (they cannot run without their GPU state), the attempt is reported, and the
    container starts cold. The checkpoint stays in the store."""
    node = gpu_node()
    label = f"gpu-{uuid.uuid4().hex[:8]}"
    first = node.run(new_id("first"), label=label)
    p1, p2 = first.workers
    node.mark_cuda(first)
    node.wait_ticks(first, 2)
    node.stop(first)
    entry = node.wait_entry(label)
    before = ticks(first.lines())

    node.fail("restore", p2, "out of memory", times=3)
    since, offset = node.mark(), node.containerd.log_offset()
    second = node.run(new_id("second"), label=label)
    failed = node.wait_record(
        offset, "skipping checkpoint", container=second.cid, checkpoint=entry.id
    )
    cold = node.wait_record(offset, "starting cold", container=second.cid)
    events = node.events(since)
    log = node.explain(since)
    assert_clean(events, log)
    assert "could not be undone" in failed["error"], failed
    assert "out of memory" in failed["error"], failed
    assert f"{entry.id}: restore failed: " in cold["why"], cold

    restored = {e["adopted_from"]: e["pid"] for e in cuda_calls(events) if e.get("adopted_from")}
    assert set(restored) == {p1, p2}, (restored, log)
    q1, q2 = restored[p1], restored[p2]
    # q1 got its GPU state back; q2's restore failed, then both recovery retries.
    assert [e["rc"] for e in steps(events, "restore", [q1])] == [0], log
    assert [e["rc"] for e in steps(events, "unlock", [q1])] == [0], log
    assert [e["rc"] for e in steps(events, "restore", [q2])] == [1, 1, 1], log
    assert not steps(events, "unlock", [q2]), log
    assert node.gpu_states() == {q1: "running", q2: "checkpointed"}
    assert not procs.pid_alive(q1) and not procs.pid_alive(q2), "the failed attempt lives on"
    hooks = hook_runs(events, second.cid)
    assert hooks["postrestore"]["outcome"] == "failed", hooks

    # The container runs, cold: other processes, the counter from 1. (CRIU resumed the
    # restored processes before the GPU step failed: what they printed meanwhile, the
    # checkpointed counter going on, may come first in the log.)
    assert not {q1, q2} & set(second.workers), (second.workers, q1, q2)
    seen = node.wait_ticks(second, 3)
    start = len(seen) - 1 - seen[::-1].index(1) if 1 in seen else -1
    assert start >= 0 and seen[start:] == list(range(1, len(seen) - start + 1)), seen
    assert all(t > before[-1] for t in seen[:start]), (before[-3:], seen)
    assert node.ctr.wait_status(second.cid, "RUNNING").pid == second.init
    assert [e.id for e in node.entries(label)] == [entry.id]


@pytest.mark.ctrd_versions("1.6")
def test_gpu_container_without_a_backend_stops_without_a_checkpoint(
    gpu_node: Callable[..., GpuNode], new_id: NewId
) -> None:
    """No CUDA driver API here and no cuda-checkpoint where the config points: a GPU
    container with CUDA processes cannot be checkpointed, the log says why in one line,
    and it still stops (SIGTERM delivered). A GPU container without CUDA processes needs
    no backend: its checkpoint is taken."""
    available = DriverApi.available()
    assert not available, (
        f"this machine has the CUDA driver API ({available.detail}): "
        "the no-backend case cannot be shown here"
    )
    missing = "/nonexistent/cuda-checkpoint"
    node = gpu_node(CEDANA_GPU_BACKEND="auto", CEDANA_CUDA_CHECKPOINT_PATH=missing)
    label = f"gpu-{uuid.uuid4().hex[:8]}"
    w = node.run(new_id("nobackend"), label=label)
    node.mark_cuda(w)
    node.wait_ticks(w, 2)
    since, offset = node.mark(), node.containerd.log_offset()

    node.stop(w)
    fallback = node.wait_record(offset, "checkpoint on stop failed; stopping without it")
    assert fallback["container"] == w.cid, fallback
    error = fallback["error"]
    assert f"container {w.cid} needs GPU checkpoint/restore but neither" in error, error
    assert f"cuda-checkpoint: cannot run {missing} --help" in error, error
    node.ctr.wait_status(w.cid, "STOPPED", timeout=30)
    wait_for(lambda: "got-TERM" in w.lines(), timeout=10, what="the workload's SIGTERM trap")
    events = node.events(since)
    log = node.explain(since)
    assert not cuda_calls(events) and not [e for e in events if e["src"] == "criu"], log
    assert hook_runs(events, w.cid)["postcheckpoint"]["outcome"] == "failed", log
    assert node.gpu_states() == {p: "running" for p in w.workers}
    assert not node.entries(label) and node.ingest_leftovers() == []

    other = f"gpu-{uuid.uuid4().hex[:8]}"
    idle = node.run(new_id("idle"), label=other)  # asks for GPUs, runs no CUDA
    node.wait_ticks(idle, 2)
    node.stop(idle)
    entry = node.wait_entry(other)
    assert entry.metadata["gpu"]["processes"] == [] and "freeze" not in entry.metadata["gpu"]
    assert "got-TERM" not in idle.lines()


@pytest.mark.ctrd_versions("1.6")
def test_restore_onto_other_gpus_maps_them_or_starts_cold(
    gpu_node: Callable[..., GpuNode], new_id: NewId
) -> None:
    """After the checkpoint the node's GPUs change. One GPU where there were two: the
    checkpoint does not fit, the container starts cold and the checkpoint stays. Two
    other H200s: the restore passes the device map, old UUID -> new, to every process."""
    node = gpu_node()
    label = f"gpu-{uuid.uuid4().hex[:8]}"
    first = node.run(new_id("first"), label=label)
    node.mark_cuda(first)
    node.wait_ticks(first, 3)
    node.stop(first)
    entry = node.wait_entry(label)
    before = ticks(first.lines())

    with node.edit() as data:
        data["gpus"] = NEW_GPUS[:1]
    since, offset = node.mark(), node.containerd.log_offset()
    cold = node.run(new_id("cold"), label=label)
    record = node.wait_record(offset, "starting cold", container=cold.cid)
    assert "the same GPU model and count are needed" in record["why"], record
    assert entry.id in record["why"], record
    assert node.wait_ticks(cold, 1)[0] == 1
    assert not steps(node.events(since), "restore"), node.explain(since)
    node.ctr.remove(cold.cid)  # SIGKILL: no checkpoint of the cold one
    assert [e.id for e in node.entries(label)] == [entry.id]

    with node.edit() as data:
        data["gpus"] = NEW_GPUS
    since, offset = node.mark(), node.containerd.log_offset()
    moved = node.run(new_id("moved"), label=label)
    q1, q2 = moved.workers
    node.wait_record(offset, "restored from checkpoint", container=moved.cid, checkpoint=entry.id)
    events = node.events(since)
    log = node.explain(since)
    assert_clean(events, log)
    restores = steps(events, "restore")
    assert sorted(e["pid"] for e in restores) == sorted([q1, q2]), log
    for e in restores:
        assert e["device_map"] == {GPU0: NEW_GPU0, GPU1: NEW_GPU1}, (e, log)
    assert node.gpu_states() == {q1: "running", q2: "running"}
    gpus = {int(pid): rec["gpus"] for pid, rec in node.read()["procs"].items()}
    assert gpus == {q1: [NEW_GPU0], q2: [NEW_GPU1]}, gpus
    after = node.wait_ticks(moved, 2)
    assert before[-1] < after[0] <= before[-1] + 3, f"not resumed: {before[-3:]} then {after[:3]}"


@pytest.mark.ctrd_versions("1.6")
def test_hooks_d_files_select_containers_by_annotation(
    gpu_node: Callable[..., GpuNode], new_id: NewId
) -> None:
    """Two hooks.d directories: team-a's file matches `example.com/gpu-team=a`, team-b's
    `=b`; each runs (pre and post) only for its container, the always-hook for all. A
    container that asks for no GPU never reaches NVML nor the GPU record."""
    node = gpu_node()
    a = node.run(new_id("a"), enable=True, annotations={TEAM_KEY: "a"})
    b = node.run(new_id("b"), enable=True, annotations={TEAM_KEY: "b"})
    cpu = node.run(new_id("cpu"), enable=True, gpu=False, annotations={"example.com/other": "a"})
    seen: dict[str, list[Event]] = {}
    for w in (a, b, cpu):
        since = node.mark()
        done = node.cedana_checkpoint(w, leave_running=True)
        assert done.returncode == 0, (w.cid, done.stderr, node.explain(since))
        seen[w.cid] = node.events(since)

    ran = {
        cid: sorted((e["hook"], e["stage"]) for e in events if e["src"] == "hook")
        for cid, events in seen.items()
    }
    both = [("order", "postcheckpoint"), ("order", "precheckpoint")]
    assert ran[a.cid] == sorted([*both, ("team-a", "precheckpoint"), ("team-a", "postcheckpoint")])
    assert ran[b.cid] == sorted([*both, ("team-b", "precheckpoint"), ("team-b", "postcheckpoint")])
    assert ran[cpu.cid] == both, ran
    assert all(
        e["container"] == cid for cid, events in seen.items() for e in events if e["src"] == "hook"
    )

    for w in (a, b):  # GPU containers without CUDA processes: NVML asked, no driver call
        assert [e for e in seen[w.cid] if e["src"] == "nvml"], w.cid
        assert not cuda_calls(seen[w.cid]), w.cid
        (entry,) = node.entries(w.cid)
        assert entry.metadata["gpu"]["processes"] == [], entry.metadata["gpu"]
    assert not [e for e in seen[cpu.cid] if e["src"] in ("nvml", "cuda-checkpoint")]
    (entry,) = node.entries(cpu.cid)
    assert "gpu" not in entry.metadata, entry.metadata
