#!/usr/bin/env python3
"""Real-GPU check of the shim's GPU layer: one script, under 3 minutes, never hangs.

    python3 tests/gpu/gpu_check.py [--gib 4] [--timeout 170] [--json PATH]

Exit status 0: every required check passed; 1: one failed; 77: skipped (no NVIDIA
GPU/driver, or neither PyTorch nor CuPy). Results go to ``$OUT/gpu_check.json``
when OUT is set (and to --json).

What it does, with worker processes it starts itself (PyTorch, else CuPy):

1. A bandwidth worker measures pinned host<->device copies (the hardware's bar).
2. Worker A holds ``--gib`` GiB of int32 tensors with a deterministic pattern, worker
   B 1 GiB. Their checksums are computed on the GPU.
3. For each available backend (CUDA driver API, cuda-checkpoint): lock -> checkpoint
   worker A (NVML must show its GPU memory freed) -> restore (with an identity device
   map on driver >= 580) -> unlock; A's checksum must match and it must compute on.
   GB/s is reported per direction, and its ratio to the pinned copy bandwidth.
4. Lock timeout: A runs a 3 s kernel, lock with a 300 ms timeout must fail as
   GpuDeadlineExceeded and leave A running (informational: it checks the shim's
   reading of the driver's error).
5. The orchestrator: freeze(A, B) in parallel, thaw, both checksums intact.

A watchdog kills everything and writes the results if the run outlasts --timeout.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import ctypes
import functools
import importlib
import importlib.util
import json
import os
import select
import signal
import subprocess
import sys
import threading
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent.parent
# The shim's own GPU layer is what is under test; it needs nothing outside the stdlib.
sys.path.insert(0, str(REPO / "shim"))
GIB = 1 << 30
# Tensors are built a chunk at a time (the int64 index is a temporary twice the size).
# The override exists for dry runs of this script against a CPU stand-in for torch.
CHUNK_BYTES = int(os.environ.get("CEDANA_GPU_CHECK_CHUNK_BYTES", 256 << 20))
MULT = 2654435761
MASK = 0xFFFFFFFF
SKIP = 77
STARTUP_TIMEOUT_S = 120.0
REPLY_TIMEOUT_S = 60.0


# -- the worker: a CUDA process with known GPU memory contents -------------------------


def chunk_offset(seed: int, k: int) -> int:
    return seed * 1000003 + k * 7919


def expected_value(seed: int, k: int, i: int) -> int:
    return ((i * MULT + chunk_offset(seed, k)) & MASK) - (1 << 31)


class TorchGpu:
    def __init__(self) -> None:
        torch: Any = importlib.import_module("torch")

        if not torch.cuda.is_available():
            raise RuntimeError("torch.cuda.is_available() is False")
        self.t = torch
        self.dev = torch.device("cuda:0")
        self.version = f"torch {torch.__version__} (CUDA {torch.version.cuda})"
        self.chunks: list[Any] = []
        self._cycles_per_ms = 0.0

    def sync(self) -> None:
        self.t.cuda.synchronize()

    def fill(self, nbytes: int, seed: int) -> None:
        t = self.t
        n = CHUNK_BYTES // 4
        for k in range(nbytes // CHUNK_BYTES):
            idx = t.arange(n, dtype=t.int64, device=self.dev)
            values = ((idx * MULT + chunk_offset(seed, k)) & MASK) - (1 << 31)
            self.chunks.append(values.to(t.int32))
            del idx, values
        self.sync()
        t.cuda.empty_cache()  # only the pattern stays on the GPU

    def chunk_sum(self, k: int) -> int:
        return int(self.chunks[k].sum(dtype=self.t.int64).item())

    def element(self, k: int, i: int) -> int:
        return int(self.chunks[k][i].item())

    def compute(self) -> tuple[int, float]:
        x = self.t.arange(1 << 20, dtype=self.t.int64, device=self.dev)
        a = self.t.ones((1024, 1024), dtype=self.t.float32, device=self.dev)
        return int((x * 3).sum().item()), float((a @ a)[0, 0].item())

    def spin(self, ms: float) -> None:
        if not self._cycles_per_ms:
            start = time.perf_counter()
            self.t.cuda._sleep(50_000_000)
            self.sync()
            self._cycles_per_ms = 50_000_000 / ((time.perf_counter() - start) * 1000)
        self.t.cuda._sleep(int(ms * self._cycles_per_ms))  # returns at once

    def _copy(self, dst: Any, src: Any) -> None:
        dst.copy_(src, non_blocking=True)
        self.sync()

    def bandwidth(self, nbytes: int) -> dict[str, float]:
        t = self.t
        host = t.empty(nbytes, dtype=t.uint8, pin_memory=True)
        dev = t.empty(nbytes, dtype=t.uint8, device=self.dev)
        host.fill_(7)
        self.sync()
        h2d = _best(functools.partial(self._copy, dev, host))
        d2h = _best(functools.partial(self._copy, host, dev))
        del host, dev
        t.cuda.empty_cache()
        return {"h2dGBps": nbytes / h2d / 1e9, "d2hGBps": nbytes / d2h / 1e9}


class CupyGpu:
    SPIN = r"""
    extern "C" __global__ void spin(long long cycles) {
        long long start = clock64();
        while (clock64() - start < cycles) { }
    }"""

    def __init__(self) -> None:
        cupy: Any = importlib.import_module("cupy")

        self.cp = cupy
        cupy.cuda.Device(0).use()
        self.version = f"cupy {cupy.__version__}"
        self.chunks: list[Any] = []
        self._kernel: Any = None
        self._cycles_per_ms = 0.0

    def sync(self) -> None:
        self.cp.cuda.Device().synchronize()

    def fill(self, nbytes: int, seed: int) -> None:
        cp = self.cp
        n = CHUNK_BYTES // 4
        for k in range(nbytes // CHUNK_BYTES):
            idx = cp.arange(n, dtype=cp.int64)
            values = ((idx * MULT + chunk_offset(seed, k)) & MASK) - (1 << 31)
            self.chunks.append(values.astype(cp.int32))
            del idx, values
        self.sync()
        cp.get_default_memory_pool().free_all_blocks()

    def chunk_sum(self, k: int) -> int:
        return int(self.chunks[k].sum(dtype=self.cp.int64))

    def element(self, k: int, i: int) -> int:
        return int(self.chunks[k][i])

    def compute(self) -> tuple[int, float]:
        cp = self.cp
        x = cp.arange(1 << 20, dtype=cp.int64)
        a = cp.ones((1024, 1024), dtype=cp.float32)
        return int((x * 3).sum()), float((a @ a)[0, 0])

    def spin(self, ms: float) -> None:
        if self._kernel is None:
            self._kernel = self.cp.RawKernel(self.SPIN, "spin")
            start = time.perf_counter()
            self._kernel((1,), (1,), (self.cp.int64(50_000_000),))
            self.sync()
            self._cycles_per_ms = 50_000_000 / ((time.perf_counter() - start) * 1000)
        self._kernel((1,), (1,), (self.cp.int64(int(ms * self._cycles_per_ms)),))

    def _upload(self, dev: Any, host: Any) -> None:
        dev.set(host)
        self.sync()

    def _download(self, host: Any, dev: Any) -> None:
        dev.get(out=host)
        self.sync()

    def bandwidth(self, nbytes: int) -> dict[str, float]:
        cupyx = importlib.import_module("cupyx")

        cp = self.cp
        host = cupyx.empty_pinned((nbytes,), dtype="uint8")
        host.fill(7)
        dev = cp.empty(nbytes, dtype=cp.uint8)
        h2d = _best(functools.partial(self._upload, dev, host))
        d2h = _best(functools.partial(self._download, host, dev))
        del host, dev
        cp.get_default_memory_pool().free_all_blocks()
        cp.get_default_pinned_memory_pool().free_all_blocks()
        return {"h2dGBps": nbytes / h2d / 1e9, "d2hGBps": nbytes / d2h / 1e9}


def _best(fn: Callable[[], Any], repeat: int = 3) -> float:
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return min(times)


def worker_main(args: argparse.Namespace) -> int:
    # Replies go to the original stdout only: whatever the libraries print lands on stderr.
    out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)

    def reply(**fields: Any) -> None:
        out.write(json.dumps(fields) + "\n")
        out.flush()

    try:
        gpu: Any = TorchGpu() if args.lib == "torch" else CupyGpu()
        if args.bandwidth:
            reply(ready=True, pid=os.getpid(), bandwidth=gpu.bandwidth(args.bandwidth))
            return 0
        nbytes = int(args.gib * GIB) // CHUNK_BYTES * CHUNK_BYTES
        start = time.perf_counter()
        gpu.fill(nbytes, args.seed)
        sums = [gpu.chunk_sum(k) for k in range(len(gpu.chunks))]
        reply(
            ready=True,
            pid=os.getpid(),
            version=gpu.version,
            patternBytes=nbytes,
            fillS=time.perf_counter() - start,
            sums=sums,
        )
    except Exception:
        reply(ready=False, error=traceback.format_exc())
        return 1
    n = CHUNK_BYTES // 4
    for line in sys.stdin:
        cmd = json.loads(line)["cmd"]
        try:
            if cmd == "verify":
                sums = [gpu.chunk_sum(k) for k in range(len(gpu.chunks))]
                samples = [(k, i) for k in range(len(gpu.chunks)) for i in (0, n // 2 + 1, n - 1)]
                bad = [
                    (k, i)
                    for k, i in samples
                    if gpu.element(k, i) != expected_value(args.seed, k, i)
                ]
                reply(sums=sums, badSamples=bad)
            elif cmd == "compute":
                total, dot = gpu.compute()
                n2 = 1 << 20
                reply(ok=total == 3 * n2 * (n2 - 1) // 2 and dot == 1024.0, total=total, dot=dot)
            elif cmd == "spin":
                gpu.spin(3000)
                reply(launched=True)
            elif cmd == "sync":
                gpu.sync()
                reply(ok=True)
            elif cmd == "exit":
                reply(bye=True)
                return 0
        except Exception:
            reply(error=traceback.format_exc())
    return 0


# -- the parent's side of a worker ---------------------------------------------------------


def _die_with_parent() -> None:
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG


class Worker:
    def __init__(self, lib: str, gib: float, seed: int, log_dir: Path, bandwidth: int = 0) -> None:
        self.log = log_dir / f"worker-{seed}.log"
        argv = [sys.executable, str(Path(__file__).resolve()), "--worker", "--lib", lib]
        argv += ["--gib", str(gib), "--seed", str(seed), "--bandwidth", str(bandwidth)]
        with open(self.log, "wb") as log:
            self.proc = subprocess.Popen(
                argv,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=log,
                preexec_fn=_die_with_parent,
            )
        self.pid = self.proc.pid
        self._buf = b""
        self.hello: dict[str, Any] = {}

    def read(self, timeout: float) -> dict[str, Any]:
        assert self.proc.stdout is not None
        fd = self.proc.stdout.fileno()
        deadline = time.monotonic() + timeout
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"worker {self.pid} did not answer within {timeout:g} s")
            ready, _, _ = select.select([fd], [], [], left)
            if ready:
                data = os.read(fd, 65536)
                if not data:
                    raise RuntimeError(f"worker {self.pid} exited: {self.stderr_tail()}")
                self._buf += data
        line, self._buf = self._buf.split(b"\n", 1)
        reply: dict[str, Any] = json.loads(line)
        if "error" in reply:
            raise RuntimeError(f"worker {self.pid} failed: {reply['error']}")
        return reply

    def ask(self, cmd: str, timeout: float = REPLY_TIMEOUT_S) -> dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write((json.dumps({"cmd": cmd}) + "\n").encode())
        self.proc.stdin.flush()
        return self.read(timeout)

    def started(self, timeout: float) -> dict[str, Any]:
        self.hello = self.read(timeout)
        if not self.hello.get("ready"):
            raise RuntimeError(f"worker {self.pid} failed to start: {self.hello}")
        return self.hello

    def stderr_tail(self, n: int = 3000) -> str:
        try:
            return self.log.read_bytes()[-n:].decode(errors="replace")
        except OSError:
            return ""

    def stop(self) -> None:
        if self.proc.poll() is None:
            with contextlib.suppress(Exception):
                self.ask("exit", timeout=5)
            try:
                self.proc.wait(5)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)


# -- GPU facts from NVML (the shim's inventory) or nvidia-smi --------------------------------


def gpu_processes(pids: list[int]) -> dict[int, tuple[int, list[str]]]:
    """pid -> (GPU memory bytes, GPU UUIDs) for those of ``pids`` on a GPU."""
    if importlib.util.find_spec("pynvml") is not None:
        from cedana_shim.gpu.inventory import cuda_processes

        return {p.pid: (p.memory_bytes, list(p.gpu_uuids)) for p in cuda_processes(pids)}
    out = subprocess.run(
        [
            "nvidia-smi",
            "--query-compute-apps=pid,gpu_uuid,used_memory",
            "--format=csv,noheader,nounits",
        ],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    ).stdout
    found: dict[int, tuple[int, list[str]]] = {}
    for line in out.splitlines():
        parts = [x.strip() for x in line.split(",")]
        if len(parts) == 3 and parts[0].isdigit() and int(parts[0]) in pids:
            pid, mem = int(parts[0]), int(parts[2]) if parts[2].isdigit() else 0
            old_mem, uuids = found.get(pid, (0, []))
            found[pid] = (old_mem + mem * (1 << 20), [*uuids, parts[1]])
    return found


def device_used() -> int:
    """Bytes in use on all GPUs: the fallback where NVML cannot see our pids (a
    container with its own pid namespace reports host pids)."""
    if importlib.util.find_spec("pynvml") is not None:
        from cedana_shim.gpu.inventory import nvml_session

        with nvml_session() as nv:
            return sum(
                int(nv.nvmlDeviceGetMemoryInfo(nv.nvmlDeviceGetHandleByIndex(i)).used)
                for i in range(nv.nvmlDeviceGetCount())
            )
    out = subprocess.run(
        ["nvidia-smi", "--query-gpu=memory.used", "--format=csv,noheader,nounits"],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    ).stdout
    return sum(int(x) for x in out.split() if x.isdigit()) * (1 << 20)


def node_facts() -> dict[str, Any]:
    if importlib.util.find_spec("pynvml") is not None:
        from cedana_shim.gpu.inventory import inventory

        inv = inventory()
        return {
            "source": "nvml",
            "driverVersion": inv.driver_version,
            "gpus": [d.to_dict() for d in inv.devices],
        }
    out = subprocess.run(
        ["nvidia-smi", "--query-gpu=index,uuid,name,driver_version", "--format=csv,noheader"],
        capture_output=True,
        text=True,
        timeout=30,
        check=True,
    ).stdout
    rows = [[x.strip() for x in line.split(",")] for line in out.splitlines() if line.strip()]
    return {
        "source": "nvidia-smi",
        "driverVersion": rows[0][3] if rows else "",
        "gpus": [{"index": int(r[0]), "uuid": r[1], "name": r[2]} for r in rows],
    }


def no_gpu_reason() -> str | None:
    """Why this machine cannot run the check, or None. Asks the driver in a child
    process, so a broken driver cannot hang or crash the caller."""
    probe = (
        "import ctypes, sys\n"
        "try:\n    lib = ctypes.CDLL('libcuda.so.1')\n"
        "except OSError as e:\n    print('cannot load libcuda.so.1 (%s)' % e); sys.exit(1)\n"
        "rc = lib.cuInit(0)\n"
        "n = ctypes.c_int(0)\n"
        "if rc or lib.cuDeviceGetCount(ctypes.byref(n)) or n.value < 1:\n"
        "    print('cuInit returned %d and %d devices were found' % (rc, n.value)); sys.exit(1)\n"
    )
    try:
        done = subprocess.run(
            [sys.executable, "-c", probe], capture_output=True, text=True, timeout=60
        )
    except subprocess.TimeoutExpired:
        return "the CUDA driver did not answer cuInit within 60 s"
    if done.returncode != 0:
        return (done.stdout + done.stderr).strip() or f"probe exit status {done.returncode}"
    return None


def pick_lib() -> str | None:
    for lib in ("torch", "cupy"):
        if importlib.util.find_spec(lib) is not None:
            return lib
    return None


# -- the checks ---------------------------------------------------------------------------


class Results:
    def __init__(self, paths: list[Path]) -> None:
        self.paths = paths
        self.data: dict[str, Any] = {"checks": [], "started": time.time()}
        self.lock = threading.Lock()

    def check(self, name: str, ok: bool, detail: Any = None, required: bool = True) -> bool:
        with self.lock:
            self.data["checks"].append(
                {"name": name, "ok": bool(ok), "required": required, "detail": detail}
            )
        mark = "ok  " if ok else ("FAIL" if required else "warn")
        print(f"  [{mark}] {name}" + (f": {detail}" if detail is not None and not ok else ""))
        return bool(ok)

    @property
    def ok(self) -> bool:
        checks = self.data["checks"]
        return bool(checks) and all(c["ok"] for c in checks if c["required"])

    def write(self) -> None:
        with self.lock:
            self.data["ok"] = self.ok
            self.data["wallS"] = round(time.time() - self.data["started"], 1)
            text = json.dumps(self.data, indent=2, default=str)
        for path in self.paths:
            with contextlib.suppress(OSError):
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(text)


def wait_until(predicate: Callable[[], bool], timeout: float, interval: float = 0.1) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(interval)
    return predicate()


def verify(results: Results, worker: Worker, label: str) -> None:
    reply = worker.ask("verify")
    results.check(
        f"{label}: GPU contents intact",
        reply["sums"] == worker.hello["sums"] and not reply["badSamples"],
        {"badSamples": reply["badSamples"][:5]},
    )
    compute = worker.ask("compute")
    results.check(f"{label}: the process computes on", compute["ok"], compute)


def rescue(driver: Any, pids: list[int]) -> None:
    """After a failed check: walk the workers back to RUNNING with the shim's own thaw."""
    from cedana_shim.gpu.orchestrator import thaw

    with contextlib.suppress(Exception):
        asyncio.run(thaw(driver, pids, container_id="gpu-check"))


class Memory:
    """How much of the workers' GPU memory is on the GPU: per process where NVML sees
    our pids, else by the drop in the GPUs' used memory."""

    def __init__(self, pids: list[int]) -> None:
        self.pids = pids
        self.per_process = all(pid in gpu_processes(pids) for pid in pids)

    def on_gpu(self) -> int:
        if self.per_process:
            return sum(m for m, _ in gpu_processes(self.pids).values())
        return device_used()

    def wait_freed(self, before: int, expected: int) -> tuple[bool, int]:
        """Wait (10 s at most) until the workers' memory left the GPU; the bytes that left."""
        if self.per_process:
            ok = wait_until(lambda: self.on_gpu() == 0, 10)
        else:
            ok = wait_until(lambda: before - self.on_gpu() >= 0.9 * expected, 10)
        return ok, before - self.on_gpu()


def cycle(results: Results, driver: Any, worker: Worker, device_map: dict[str, str] | None) -> None:
    """lock -> checkpoint -> restore -> unlock of one worker through one backend."""
    from cedana_shim.gpu.driver import GpuError, ProcessState

    label, pid = driver.name, worker.pid
    memory = Memory([pid])
    before = memory.on_gpu()
    timings: dict[str, float] = {}
    entry: dict[str, Any] = {"timingsS": timings, "patternBytes": worker.hello["patternBytes"]}
    results.data.setdefault("backends", {})[label] = entry

    def step(name: str, fn: Callable[[], Any], want: ProcessState) -> None:
        start = time.perf_counter()
        fn()
        timings[name] = time.perf_counter() - start
        state = driver.state(pid)
        if state is not want:
            raise AssertionError(f"after {name} the process is {state}, not {want}")

    try:
        results.check(f"{label}: starts running", driver.state(pid) is ProcessState.RUNNING)
        step("lock", lambda: driver.lock(pid, 10_000), ProcessState.LOCKED)
        step("checkpoint", lambda: driver.checkpoint(pid), ProcessState.CHECKPOINTED)
        freed, moved = memory.wait_freed(before, worker.hello["patternBytes"])
        entry["movedBytes"] = moved
        entry["memorySource"] = "nvml per process" if memory.per_process else "device used"
        results.check(f"{label}: GPU memory freed while checkpointed", freed, moved)
        if device_map:
            try:
                step("restore", lambda: driver.restore(pid, device_map), ProcessState.LOCKED)
                results.check(f"{label}: restore with a device map", True, required=False)
            except GpuError as err:
                results.check(f"{label}: restore with a device map", False, str(err), False)
                step("restore", lambda: driver.restore(pid), ProcessState.LOCKED)
        else:
            step("restore", lambda: driver.restore(pid), ProcessState.LOCKED)
        step("unlock", lambda: driver.unlock(pid), ProcessState.RUNNING)
        results.check(f"{label}: lock/checkpoint/restore/unlock", True, timings)
    except Exception as err:
        results.check(f"{label}: lock/checkpoint/restore/unlock", False, repr(err))
        rescue(driver, [pid])
        return
    verify(results, worker, label)
    for name in ("checkpoint", "restore"):
        entry[f"{name}GBps"] = entry["movedBytes"] / timings[name] / 1e9
        entry[f"{name}PatternGBps"] = worker.hello["patternBytes"] / timings[name] / 1e9


def lock_timeout(results: Results, driver: Any, worker: Worker) -> None:
    from cedana_shim.gpu.driver import GpuDeadlineExceeded, GpuError, ProcessState

    name = f"{driver.name}: lock times out while a kernel runs, process keeps running"
    worker.ask("spin")
    start = time.perf_counter()
    detail: dict[str, Any] = {}
    try:
        driver.lock(worker.pid, 300)
        detail["outcome"] = "lock succeeded while a 3 s kernel ran"
        driver.unlock(worker.pid)
        ok = False
    except GpuDeadlineExceeded as err:
        ok, detail["outcome"] = True, str(err)
    except GpuError as err:
        ok, detail["outcome"] = False, f"{type(err).__name__}: {err}"
    detail["waitedS"] = round(time.perf_counter() - start, 3)
    state = driver.state(worker.pid)
    detail["stateAfter"] = str(state)
    results.data["lockTimeout"] = detail
    results.check(name, ok and state is ProcessState.RUNNING, detail, required=False)
    if state is not ProcessState.RUNNING:
        rescue(driver, [worker.pid])
    worker.ask("sync", timeout=30)


def non_cuda(results: Results, driver: Any) -> None:
    """What the backend says about a process without CUDA: thaw after a CRIU restore
    asks it of every process in the container and must be able to skip those."""
    from cedana_shim.gpu.driver import GpuError, GpuNotFound

    sleeper = subprocess.Popen(["sleep", "30"])
    try:
        outcome = f"state {driver.state(sleeper.pid)}"
        ok = False
    except GpuNotFound as err:
        ok, outcome = True, str(err)
    except GpuError as err:
        ok, outcome = False, f"{type(err).__name__}: {err}"
    finally:
        sleeper.kill()
        sleeper.wait()
    results.check(f"{driver.name}: a process without CUDA is NotFound", ok, outcome, False)
    results.data.setdefault("nonCuda", {})[driver.name] = outcome


def orchestrated(results: Results, workers: list[Worker]) -> None:
    from cedana_shim.gpu.inventory import GpuProcess
    from cedana_shim.gpu.orchestrator import freeze, thaw
    from cedana_shim.gpu.select import choose_driver

    driver = choose_driver("gpu-check")
    pids = [w.pid for w in workers]
    facts = gpu_processes(pids)
    procs = [GpuProcess(p, tuple(facts.get(p, (0, []))[1]), facts.get(p, (0, []))[0]) for p in pids]
    memory = Memory(pids)
    before = memory.on_gpu()
    pattern = sum(w.hello["patternBytes"] for w in workers)
    entry: dict[str, Any] = {"backend": driver.name}
    results.data["orchestrator"] = entry
    try:
        frozen = asyncio.run(
            freeze(driver, procs, lock_timeout_ms=10_000, parallelism=4, container_id="gpu-check")
        )
        entry["freeze"] = frozen.to_dict()
        freed, moved = memory.wait_freed(before, pattern)
        results.check("orchestrator: freeze of 2 processes in parallel", frozen.pids == tuple(pids))
        results.check("orchestrator: GPU memory freed", freed, moved)
        thawed = asyncio.run(thaw(driver, frozen, total_bytes=moved))
        entry["thaw"] = thawed.to_dict()
        results.check("orchestrator: thaw", set(thawed.restored) == set(pids), thawed.to_dict())
        entry["movedBytes"] = moved
        entry["checkpointGBps"] = moved / frozen.checkpoint_s / 1e9
        entry["restoreGBps"] = moved / thawed.restore_s / 1e9
    except Exception as err:
        results.check("orchestrator: freeze/thaw", False, repr(err))
        rescue(driver, pids)
        return
    for w in workers:
        verify(results, w, f"orchestrator pid {w.pid}")


def run(args: argparse.Namespace, results: Results, workers: list[Worker]) -> None:
    from cedana_shim.gpu.doctor import readiness
    from cedana_shim.gpu.driver import GpuError
    from cedana_shim.gpu.driver_api import DriverApi
    from cedana_shim.gpu.driver_cli import CliDriver

    lib = args.lib
    log_dir = Path(args.log_dir)
    log_dir.mkdir(parents=True, exist_ok=True)
    pattern = int(args.gib * GIB) // CHUNK_BYTES * CHUNK_BYTES

    # Bandwidth first and alone, so no other GPU work skews it. It also finds out
    # whether the library can use the GPU (a CPU-only torch next to a CuPy).
    others = [x for x in ("torch", "cupy") if x != lib and importlib.util.find_spec(x)]
    while True:
        bw = Worker(lib, 0, 0, log_dir, bandwidth=pattern)
        workers.append(bw)
        try:
            bandwidth = bw.started(STARTUP_TIMEOUT_S)["bandwidth"]
            break
        except RuntimeError as err:
            if not others:
                raise
            results.data.setdefault("libFailures", {})[lib] = str(err)[-2000:]
            lib = others.pop(0)
    results.data["bandwidth"] = bandwidth
    a = Worker(lib, args.gib, 1, log_dir)
    b = Worker(lib, 1, 2, log_dir)
    workers += [a, b]
    results.data["node"] = node_facts()
    try:
        results.data["doctor"] = readiness()
    except Exception as err:  # informational: never worth losing the run for
        results.data["doctor"] = f"readiness() raised {err!r}"
    for w in (a, b):
        w.started(STARTUP_TIMEOUT_S)
    results.data["lib"] = a.hello["version"]
    print(
        f"  {a.hello['version']}; pinned copies of {pattern / GIB:.2f} GiB: "
        f"H2D {bandwidth['h2dGBps']:.1f} GB/s, D2H {bandwidth['d2hGBps']:.1f} GB/s"
    )
    memory = Memory([a.pid])
    held = memory.on_gpu()
    results.check(f"worker A holds >= {pattern / GIB:.2f} GiB on the GPU", held >= pattern, held)
    results.data["nvmlSeesWorkers"] = memory.per_process

    facts = gpu_processes([a.pid])
    uuids = facts.get(a.pid, (0, []))[1]
    gpus = results.data["node"].get("gpus", [])
    if not uuids and len(gpus) == 1:
        uuids = [gpus[0]["uuid"]]
    driver_version = str(results.data["node"].get("driverVersion", ""))
    major = driver_version.split(".")[0]
    remap = major.isdigit() and int(major) >= 580
    device_map = {u: u for u in uuids} if remap and uuids else None

    backends: list[Any] = []
    for make in (DriverApi, lambda: _probed(CliDriver())):
        try:
            backends.append(make())
        except GpuError as err:
            results.data.setdefault("unavailable", []).append(str(err))
    unavailable = results.data.get("unavailable")
    results.check("a GPU checkpoint backend is available", bool(backends), unavailable)
    for driver in backends:
        use_map = device_map
        if isinstance(driver, CliDriver) and not driver.probe().device_map:
            use_map = None
        cycle(results, driver, a, use_map)
        non_cuda(results, driver)
    if backends:
        lock_timeout(results, backends[0], a)
        orchestrated(results, [a, b])

    rows = list(results.data.get("backends", {}).items())
    if "orchestrator" in results.data:
        rows.append(("orchestrator", results.data["orchestrator"]))
    for name, entry in rows:
        if "checkpointGBps" not in entry:
            continue
        entry["checkpointVsD2H"] = entry["checkpointGBps"] / bandwidth["d2hGBps"]
        entry["restoreVsH2D"] = entry["restoreGBps"] / bandwidth["h2dGBps"]
        print(
            f"  {name:15s} {entry['movedBytes'] / GIB:5.2f} GiB: checkpoint "
            f"{entry['checkpointGBps']:6.2f} GB/s ({entry['checkpointVsD2H']:.2f} x D2H), "
            f"restore {entry['restoreGBps']:6.2f} GB/s ({entry['restoreVsH2D']:.2f} x H2D)"
        )


def summary(results: Results) -> None:
    """The facts the shim's classification of driver errors rests on, printed whole."""
    data = results.data
    print(f"  node: {data.get('node')}")
    print(f"  NVML sees the workers' pids: {data.get('nvmlSeesWorkers')}")
    for reason in data.get("unavailable", []):
        print(f"  unavailable: {reason}")
    if "lockTimeout" in data:
        print(f"  lock timeout: {data['lockTimeout']}")
    for name, outcome in data.get("nonCuda", {}).items():
        print(f"  get-state of a process without CUDA via {name}: {outcome}")


def _probed(cli: Any) -> Any:
    cli.probe()
    return cli


def start_watchdog(timeout: float, results: Results, workers: list[Worker]) -> threading.Timer:
    def fire() -> None:
        results.check("finished within the time limit", False, f"killed after {timeout:g} s")
        results.data["workerLogs"] = {w.pid: w.stderr_tail() for w in workers}
        results.write()
        for w in workers:
            with contextlib.suppress(Exception):
                w.proc.kill()
        print(f"FAIL: the check outlasted {timeout:g} s", flush=True)
        os._exit(1)

    timer = threading.Timer(timeout, fire)
    timer.daemon = True
    timer.start()
    return timer


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gib", type=float, default=4.0, help="GPU memory worker A holds")
    parser.add_argument("--timeout", type=float, default=170.0, help="whole-run limit (s)")
    parser.add_argument("--json", help="also write the results here")
    parser.add_argument("--log-dir", default="", help="worker stderr logs (default: a tmp dir)")
    parser.add_argument("--lib", choices=("torch", "cupy"), help="default: whichever imports")
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--seed", type=int, default=1, help=argparse.SUPPRESS)
    parser.add_argument("--bandwidth", type=int, default=0, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        return worker_main(args)

    paths = [Path(p) for p in (args.json,) if p]
    if os.environ.get("OUT"):
        paths.append(Path(os.environ["OUT"]) / "gpu_check.json")
    results = Results(paths)
    reason = no_gpu_reason()
    args.lib = args.lib or pick_lib()
    if reason is None and args.lib is None:
        reason = "neither PyTorch nor CuPy is installed"
    if reason is not None:
        results.data["skipped"] = f"no NVIDIA GPU/driver: {reason}"
        results.write()
        print(f"SKIP: no NVIDIA GPU/driver: {reason}")
        return SKIP

    if not args.log_dir:
        import tempfile

        args.log_dir = tempfile.mkdtemp(prefix="gpu-check-")
    print(f"GPU check: {args.gib:g} GiB with {args.lib}, limit {args.timeout:g} s")
    workers: list[Worker] = []
    watchdog = start_watchdog(args.timeout, results, workers)
    try:
        run(args, results, workers)
    except Exception:
        results.check("the check ran to the end", False, traceback.format_exc())
    finally:
        summary(results)
        if not results.ok:
            results.data["workerLogs"] = {w.pid: w.stderr_tail() for w in workers}
        for w in workers:
            w.stop()
        watchdog.cancel()
        results.write()
    print("PASS" if results.ok else "FAIL", f"({time.time() - results.data['started']:.0f} s)")
    return 0 if results.ok else 1


if __name__ == "__main__":
    sys.exit(main())
