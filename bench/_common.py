"""Shared plumbing for the benchmarks in bench/.

Every benchmark measures the cedana shim side by side with containerd's runc shim
(or plain runc) in one run, interleaved, and reports medians and ratios. This module
holds what they all need: running under the project venv, importing the integration
harness (read-only reuse), a private containerd built exactly as the integration
fixtures build one, statistics, host facts (load average) and crash-safe cleanup.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import importlib.util
import json
import os
import platform
import signal
import statistics
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from types import FrameType
from typing import Any

REPO_ROOT = Path(__file__).resolve().parents[1]
VENV_PYTHON = REPO_ROOT / ".venv" / "bin" / "python"
# Set in containerd's environment (which every shim, and the fork server a shim
# spawns, inherits) so that cleanup can find exactly the processes this run caused.
MARKER_ENV = "CEDANA_BENCH_RUN"
_MNT_DETACH = 2


def ensure_venv() -> None:
    """Re-exec under the project venv: the harness needs grpcio and cedana_shim."""
    if not all(importlib.util.find_spec(m) for m in ("grpc", "cedana_shim")):
        in_venv = Path(sys.prefix).resolve() == VENV_PYTHON.parent.parent.resolve()
        if in_venv or not VENV_PYTHON.exists():
            raise SystemExit(
                f"{VENV_PYTHON} cannot import grpc/cedana_shim: run `make setup` first"
            )
        os.execv(str(VENV_PYTHON), [str(VENV_PYTHON), *sys.argv])
    if str(REPO_ROOT) not in sys.path:
        sys.path.insert(0, str(REPO_ROOT))


def require_root() -> None:
    if os.geteuid() != 0:
        raise SystemExit("the benchmarks drive containerd, runc and CRIU: run them as root")


# -- signals: Ctrl-C and SIGTERM both unwind through `finally` -------------------------


class Interrupted(BaseException):
    pass


def install_signal_handlers() -> None:
    def on_signal(signum: int, frame: FrameType | None) -> None:
        raise Interrupted(f"interrupted by {signal.Signals(signum).name}")

    for sig in (signal.SIGTERM, signal.SIGHUP):
        signal.signal(sig, on_signal)
    # SIGINT already raises KeyboardInterrupt.


# -- host facts ----------------------------------------------------------------------


def load_average() -> tuple[float, float, float]:
    one, five, fifteen = os.getloadavg()
    return (round(one, 2), round(five, 2), round(fifteen, 2))


def git_revision() -> str:
    proc = subprocess.run(
        ["git", "-C", str(REPO_ROOT), "rev-parse", "--short", "HEAD"],
        capture_output=True,
        text=True,
        check=False,
    )
    dirty = subprocess.run(
        ["git", "-C", str(REPO_ROOT), "status", "--porcelain", "--untracked-files=no"],
        capture_output=True,
        text=True,
        check=False,
    ).stdout.strip()
    rev = proc.stdout.strip() or "unknown"
    return f"{rev}{' (+uncommitted changes)' if dirty else ''}"


def first_line(*argv: str) -> str:
    try:
        out = subprocess.run(argv, capture_output=True, text=True, check=False, timeout=10)
    except OSError as err:
        return f"unavailable ({err.strerror})"
    text = (out.stdout or out.stderr).strip()
    return text.splitlines()[0] if text else ""


def host_facts() -> dict[str, Any]:
    mem_kb = 0
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemTotal:"):
                mem_kb = int(line.split()[1])
    cpu = "unknown"
    with open("/proc/cpuinfo") as f:
        for line in f:
            if line.startswith("model name"):
                cpu = line.split(":", 1)[1].strip()
                break
    return {
        "hostname": platform.node(),
        "kernel": platform.release(),
        "cpus": os.cpu_count(),
        "cpu_model": cpu,
        "mem_total_mb": mem_kb // 1024,
        "python": platform.python_version(),
        "runc": first_line("runc", "--version"),
        "criu": first_line("/usr/local/sbin/criu", "--version"),
        "repo_revision": git_revision(),
    }


# -- statistics ----------------------------------------------------------------------


def percentile(samples: Sequence[float], q: float) -> float:
    """Linear-interpolated percentile (q in 0..100), as numpy's default."""
    if not samples:
        return float("nan")
    ordered = sorted(samples)
    pos = (len(ordered) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(ordered) - 1)
    return ordered[lo] + (ordered[hi] - ordered[lo]) * (pos - lo)


@dataclass
class Summary:
    n: int
    median: float
    p10: float
    p90: float
    min: float
    max: float
    mean: float
    stdev: float

    def as_dict(self, digits: int = 4) -> dict[str, float | int]:
        return {k: (round(v, digits) if isinstance(v, float) else v) for k, v in vars(self).items()}


def summarize(samples: Sequence[float]) -> Summary:
    if not samples:
        nan = float("nan")
        return Summary(0, nan, nan, nan, nan, nan, nan, nan)
    return Summary(
        n=len(samples),
        median=statistics.median(samples),
        p10=percentile(samples, 10),
        p90=percentile(samples, 90),
        min=min(samples),
        max=max(samples),
        mean=statistics.fmean(samples),
        stdev=statistics.stdev(samples) if len(samples) > 1 else 0.0,
    )


def ratio(a: float, b: float) -> float:
    return a / b if b else float("nan")


def verdict(value: float, target: float) -> str:
    if value != value:  # NaN
        return "n/a"
    return "meets target" if value <= target else "MISSES target"


def print_table(headers: Sequence[str], rows: Sequence[Sequence[str]]) -> None:
    widths = [len(h) for h in headers]
    for row in rows:
        widths = [max(w, len(c)) for w, c in zip(widths, row, strict=True)]

    def fmt(cells: Sequence[str]) -> str:
        return "  ".join(
            c.ljust(w) if i == 0 else c.rjust(w)
            for i, (c, w) in enumerate(zip(cells, widths, strict=True))
        )

    print(fmt(headers))
    print("  ".join("-" * w for w in widths))
    for row in rows:
        print(fmt(row))


# -- results -------------------------------------------------------------------------


@dataclass
class Report:
    benchmark: str
    params: dict[str, Any]
    started: str = field(default_factory=lambda: datetime.now(UTC).isoformat(timespec="seconds"))
    load_start: tuple[float, float, float] = field(default_factory=load_average)
    host: dict[str, Any] = field(default_factory=host_facts)
    results: dict[str, Any] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)

    def finish(self) -> dict[str, Any]:
        return {
            "benchmark": self.benchmark,
            "started": self.started,
            "finished": datetime.now(UTC).isoformat(timespec="seconds"),
            "load_average_start": self.load_start,
            "load_average_end": load_average(),
            "host": self.host,
            "params": self.params,
            "results": self.results,
            "notes": self.notes,
        }

    def write(self, path: str | None) -> dict[str, Any]:
        doc = self.finish()
        print(
            f"\nload average (1/5/15 min): start {doc['load_average_start']}, "
            f"end {doc['load_average_end']}; {doc['host']['cpus']} CPUs"
        )
        for note in self.notes:
            print(f"note: {note}")
        if path:
            Path(path).write_text(json.dumps(doc, indent=2) + "\n")
            print(f"results written to {path}")
        return doc


# -- cleanup -------------------------------------------------------------------------


class Cleanup:
    """LIFO stack of cleanup actions that all run, whatever fails, and are reported."""

    def __init__(self) -> None:
        self._actions: list[tuple[str, Callable[[], object]]] = []

    def push(self, what: str, action: Callable[[], object]) -> None:
        self._actions.append((what, action))

    def run(self) -> None:
        # A second Ctrl-C during cleanup must not abandon the rest of it.
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
        try:
            while self._actions:
                what, action = self._actions.pop()
                try:
                    action()
                except BaseException as exc:
                    print(f"[cleanup] {what}: {exc!r}", file=sys.stderr)
        finally:
            signal.signal(signal.SIGINT, previous)


def is_fork_server(pid: int) -> bool:
    """A cedana fork server (the template daemons are forked from), by its process
    name (`ps` shows it as `containerd-shim-cedana-v2 template`)."""
    from cedana_shim.cli.forkserver import TEMPLATE_NAME

    try:
        return Path(f"/proc/{pid}/comm").read_text().strip() == TEMPLATE_NAME
    except OSError:
        return False


def marked_processes(marker: str) -> set[int]:
    """Processes whose environment carries MARKER_ENV=marker (shims, fork servers)."""
    needle = f"{MARKER_ENV}={marker}".encode()
    found: set[int] = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == os.getpid():
            continue
        try:
            env = Path(f"/proc/{entry}/environ").read_bytes()
        except OSError:
            continue
        if needle in env.split(b"\0"):
            found.add(int(entry))
    return found


def kill_marked(marker: str) -> list[int]:
    pids = marked_processes(marker)
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
    return sorted(pids)


def work_root() -> Path:
    """On the root disk (ext4 here), not a tmpfs: checkpoint sizes and write times are
    meant to be what a node would see."""
    parent = Path(os.environ.get("CEDANA_BENCH_TMPDIR", "/var/tmp"))
    parent.mkdir(parents=True, exist_ok=True)
    return Path(tempfile.mkdtemp(prefix="cedana-bench-", dir=parent))


# -- a private containerd ------------------------------------------------------------


@dataclass
class Bench:
    """A private containerd with both runtimes registered (the integration harness's
    `Containerd`), plus this run's marker and checkpoint store."""

    containerd: Any  # tests.integration.harness.containerd.Containerd
    images: Any  # tests.integration.harness.images.TestImages
    root: Path
    store: Path
    marker: str
    version: Any  # tests.integration.harness.config.ContainerdVersion


def containerd_version(short: str) -> Any:
    from tests.integration.harness.config import CONTAINERD_VERSIONS

    for v in CONTAINERD_VERSIONS:
        if short in (v.short, v.full):
            return v
    known = ", ".join(v.short for v in CONTAINERD_VERSIONS)
    raise SystemExit(f"unknown containerd version {short!r} (known: {known})")


@contextlib.contextmanager
def private_containerd(
    version_short: str,
    cleanup: Cleanup,
    namespaces: Sequence[str],
    *,
    keep: bool = False,
) -> Iterator[Bench]:
    """Build the test images and start a containerd the way the integration fixtures
    do (`make_containerd`), with CEDANA_STORE_PATH pointing at a store of this run on
    the root disk. The shim inherits containerd's environment."""
    from tests.integration.harness.config import CEDANA
    from tests.integration.harness.containerd import make_containerd
    from tests.integration.harness.images import build_test_images

    version = containerd_version(version_short)
    root = work_root()
    marker = uuid.uuid4().hex

    def remove_root() -> None:
        # A runc/CRIU killed half-way (Ctrl-C during a restore) leaves mounts behind.
        detach_mounts_under(root)
        if not keep:
            subprocess.run(["rm", "-rf", "--one-file-system", str(root)], check=False)

    cleanup.push(f"remove {root}", remove_root)
    # Anything that still carries our marker once containerd is gone: fork servers
    # started by our shims (they idle for an hour otherwise), daemons that hung.
    cleanup.push("kill processes of this run", lambda: kill_marked(marker))
    # containerd's runc shim keeps per-namespace state under a host-global root; drop
    # the (empty) directories this run created there.
    runc_roots = [Path("/run/containerd/runc") / ns for ns in namespaces]
    created = [d for d in runc_roots if not d.exists()]

    def remove_runc_roots() -> None:
        # A shim that is still exiting may be removing its last state dir in there.
        deadline = time.monotonic() + 5
        for d in created:
            while d.exists():
                try:
                    d.rmdir()
                except OSError:
                    if time.monotonic() > deadline:
                        print(f"[cleanup] {d} not empty: left", file=sys.stderr)
                        break
                    time.sleep(0.1)

    cleanup.push("empty runc state roots", remove_runc_roots)
    store = root / "store"
    images_dir = root / "images"
    images_dir.mkdir()
    images = build_test_images(images_dir)
    saved = {k: os.environ.get(k) for k in ("CEDANA_STORE_PATH", MARKER_ENV)}
    os.environ["CEDANA_STORE_PATH"] = str(store)
    os.environ[MARKER_ENV] = marker
    try:
        instance = make_containerd(version, CEDANA, images, root, tuple(namespaces))
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v

    def stop_containerd() -> None:
        notes = instance.cleanup(keep_base=True)
        for note in notes:
            print(f"[cleanup containerd {version.full}] {note}", file=sys.stderr)

    cleanup.push(f"containerd {version.full} teardown", stop_containerd)
    # The harness may set its own store path (it did not always): the shim uses
    # whatever containerd's environment says, so read it from there.
    if instance.proc is None:
        raise RuntimeError("containerd is not running")
    env = process_environ(instance.proc.pid)
    if MARKER_ENV not in env:
        raise RuntimeError(f"containerd (pid {instance.proc.pid}) lacks {MARKER_ENV}")
    store = Path(env.get("CEDANA_STORE_PATH", "/var/lib/cedana/checkpoints"))
    yield Bench(instance, images, root, store, marker, version)


def another_node(
    b: Bench, cleanup: Cleanup, namespaces: Sequence[str], env: Mapping[str, str]
) -> Bench:
    """One more containerd beside `b`'s (a second "node": its own root, checkpoint
    store, shims and logs; the same test images and run marker), with `env` added to
    its environment (node config keys as CEDANA_<KEY>), torn down by `cleanup`."""
    from tests.integration.harness.config import CEDANA
    from tests.integration.harness.containerd import make_containerd

    instance = make_containerd(
        b.version, CEDANA, b.images, b.root, tuple(namespaces), {**env, MARKER_ENV: b.marker}
    )

    def stop_containerd() -> None:
        for note in instance.cleanup(keep_base=True):
            print(f"[cleanup containerd {instance.base}] {note}", file=sys.stderr)

    cleanup.push(f"containerd {instance.base} teardown", stop_containerd)
    return Bench(instance, b.images, b.root, instance.store, b.marker, b.version)


def detach_mounts_under(path: Path) -> None:
    from tests.integration.harness.procs import mounts_under

    libc = ctypes.CDLL(None, use_errno=True)
    for point in mounts_under(path):
        if libc.umount2(point.encode(), _MNT_DETACH) != 0:
            print(f"[cleanup] umount {point}: errno {ctypes.get_errno()}", file=sys.stderr)


def remove_cgroup_tree(name: str, timeout: float = 5.0) -> None:
    """rmdir /sys/fs/cgroup/<controller>/<name> and everything below, deepest first,
    retrying while a killed process is still leaving them. Whatever still runs in
    there is this run's own (e.g. a process CRIU restored before its runc was killed)
    and is SIGKILLed."""
    deadline = time.monotonic() + timeout
    while True:
        for procs in Path("/sys/fs/cgroup").glob(f"*/{name}/**/cgroup.procs"):
            with contextlib.suppress(OSError, ValueError):
                for pid in procs.read_text().split():
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(int(pid), signal.SIGKILL)
        left = []
        for controller in Path("/sys/fs/cgroup").iterdir():
            base = controller / name
            if not base.is_dir():
                continue
            for dirpath, _dirs, _files in sorted(
                os.walk(base), key=lambda t: t[0].count("/"), reverse=True
            ):
                try:
                    os.rmdir(dirpath)
                except OSError:
                    left.append(dirpath)
        if not left:
            return
        if time.monotonic() > deadline:
            print(f"[cleanup] cgroups not removed: {left}", file=sys.stderr)
            return
        time.sleep(0.2)


def process_environ(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    pairs = (item.decode(errors="replace").partition("=") for item in raw.split(b"\0") if item)
    return {k: v for k, _, v in pairs}


def wall(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _end(proc: subprocess.Popen[bytes]) -> None:
    proc.kill()
    proc.wait()


def start_cpu_load(jobs: int, cleanup: Cleanup) -> list[int]:
    """``jobs`` busy loops at normal priority for the rest of the run (a second job on
    the node); stopped by ``cleanup``. Their pids."""
    pids = []
    for _ in range(jobs):
        proc = subprocess.Popen(
            [sys.executable, "-c", "while True: pass"],
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        cleanup.push(f"cpu load {proc.pid}", functools.partial(_end, proc))
        pids.append(proc.pid)
    return pids


def base_parser(description: str, default_runs: int) -> Any:
    import argparse

    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--runs", type=int, default=default_runs, help="measured runs per side")
    parser.add_argument("--out", default=None, help="write the results as JSON here")
    parser.add_argument(
        "--containerd",
        default="1.6",
        help="containerd version to drive: 1.6 (default, /usr/bin), 1.7 or 2.1",
    )
    parser.add_argument(
        "--keep", action="store_true", help="keep the work dir (logs, configs) afterwards"
    )
    parser.add_argument(
        "--load",
        type=int,
        default=0,
        metavar="N",
        help="run N busy loops beside the benchmark for its whole run (default 0)",
    )
    return parser
