"""Checkpoints across nodes through an OCI registry: what the registry costs, side by
side with the same node keeping its checkpoints to itself.

    python bench/across_nodes.py [--runs 5] [--warmup 1] [--mem-mib 1024] [--lazy-mib 4096]
                                 [--shared-dir] [--containerd 1.6|1.7|2.1]
                                 [--out results.json] [--keep]

``--shared-dir``: A and B share a directory (``registry`` = its path, see
checkpoint/remote/shared_dir.py) instead of the registry: the same push, pull and
checks, with no registry process on the host's CPUs.

Four containerds of this run share the host ("nodes": separate roots, stores, shims
and logs, the same disk): L without `registry`, A and B with `registry` set to one
real registry on loopback (Debian's docker-registry with TLS from a throwaway CA and
htpasswd auth, as tests/integration/test_across_nodes.py runs it, see _registry.py),
`registry_sync = before-exit`, and B-lazy, B's twin with `lazy_restore = true` (none
with `--lazy-mib 0`). The workload is bench/memhog.c with N MiB of touched memory (see
bench/checkpoint_restore.py for the image). Each run, under a label of its own, with
`sync` and a pause before every timed step and the order of the two sides of (a) and
of (b) swapped in odd runs:

(a) stop: `ctr task kill -s SIGTERM` until containerd reports the exit (Tasks.Wait,
    in flight before the kill). On A the exit comes after the push, so that is
    SIGTERM -> manifest visible; the tag list is read right at the exit to confirm
    the checkpoint's tag is there. On L: SIGTERM -> local commit. The shim's own log
    splits it up (runc checkpoint, committed, compacted, pushed).
(b) restore: `ctr run -d` of a new container of the label until it returns RUNNING,
    on B (an empty store: the checkpoint is pulled, verified, then restored) and on A
    (from its own store); both checked to have resumed (same nonce, heartbeat going
    on, memory checksum ok, RSS back).
(c) push throughput: stored bytes of the checkpoint / the push (from the shim's log:
    committed -> pushed: the push compacts on the way, each chunk sent as it is
    compressed); pull throughput: the size / seconds B's shim logs for the pull. The
    memory of the shim daemon serving the container on A (the container's parent):
    VmRSS before the kill against VmHWM at the exit (reset at the kill via
    /proc/PID/clear_refs) for the whole stop, and the highest VmRSS sampled every
    10 ms between its "committed" and "pushed" log lines for the push.
(d) the container restored on A rewrites one contiguous tenth of its memory
    (memhog's SIGUSR1) and is stopped again: bytes the registry's storage grew by in
    that second push / in the first one, and which blobs were new (from the two
    manifests in the registry).
(e) with `--lazy-mib N` (default 4096, issue 30's target 2): A runs a workload of N
    MiB and stops it (pushed before the exit); B-lazy runs the next container of its
    label: `ctr run -d` -> the workload's first heartbeat (time to first instruction),
    -> `ctr run` returns (every page is in), -> memhog's checksum of its memory
    verified (see lazy_across_nodes.py, whose steps it runs).

CPU (issue 30, target 4): during each of those steps, the CPU seconds the registry
process and each node's processes spend (CpuMeter: /proc/<pid>/stat, children reaped
included), per GiB of memory, beside the ratios. The summary ends with issue 30's
targets 1-3: 1 is (b), 2 is (e), 3 is (a).

No stop comes within LEFTOVERS_DELAY (+1.5 s) of its container's Create: the daemon's
leftovers sweep would race the stop's push (see Node.after_leftovers_sweep).

Longer than the ~500 lines a module aims at: one benchmark reads best as one file
(setup, probes, the run, the figures), as checkpoint_restore.py does, whose workload,
image and probes it imports rather than copies.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (
    Bench,
    Cleanup,
    Report,
    Summary,
    another_node,
    base_parser,
    ensure_venv,
    install_signal_handlers,
    load_average,
    print_table,
    private_containerd,
    ratio,
    require_root,
    summarize,
    verdict,
)

ensure_venv()

from _registry import Remote, shared_directory, start_registry  # noqa: E402
from cedana_shim.checkpoint.delivery import LEFTOVERS_DELAY  # noqa: E402
from checkpoint_restore import (  # noqa: E402
    CEDANA_CLI,
    MIB,
    NAMESPACE,
    RESTORE_GAP,
    BenchFailure,
    CedanaSide,
    TaskWaiter,
    build_image,
    build_memhog,
    check_resumed,
    read_beat,
    read_verify,
    run,
    wait_filled,
    wait_until,
)
from lazy_across_nodes import checkpoint_on_a, restore_on  # noqa: E402
from restore_scaling import room_for  # noqa: E402

TIME_TARGET = 1.5  # (a) and (b): registry side / local side
LAZY_TARGET_S = 1.5  # issue 30 target 2: ctr run -> first beat on B, lazy, 4 GiB
MEMORY_TARGET_MIB = 64.0
DELTA_TARGET = 0.15
MB = 1e6  # throughput in MB/s, as registries and networks count


# -- probes --------------------------------------------------------------------------------


def status_kib(pid: int, key: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{key}:"):
            return int(line.split()[1])
    raise BenchFailure(f"/proc/{pid}/status has no {key}")


def parent_pid(pid: int) -> int:
    return status_kib(pid, "PPid")


@dataclass
class ShimMemory:
    """The RSS of a shim daemon across a stop: before the kill, sampled every 10 ms,
    and its peak (VmHWM, reset at the kill)."""

    pid: int
    rss_before_kib: int = 0
    hwm_kib: int = 0
    samples: list[tuple[float, int]] = field(default_factory=list)  # (wall time, KiB)
    _done: threading.Event = field(default_factory=threading.Event)
    _thread: threading.Thread | None = None

    def start(self) -> None:
        self.rss_before_kib = status_kib(self.pid, "VmRSS")
        Path(f"/proc/{self.pid}/clear_refs").write_text("5\n")  # VmHWM := VmRSS
        self._thread = threading.Thread(target=self._sample, daemon=True)
        self._thread.start()

    def _sample(self) -> None:
        while not self._done.wait(0.01):
            with contextlib.suppress(OSError, BenchFailure):
                self.samples.append((time.time(), status_kib(self.pid, "VmRSS")))

    def stop(self) -> None:
        self.hwm_kib = status_kib(self.pid, "VmHWM")
        self._done.set()
        if self._thread is not None:
            self._thread.join()

    def timeline(self, t0_wall: float, step: float = 0.1) -> list[tuple[float, float]]:
        """(seconds after the kill, highest VmRSS in MiB) per `step` seconds."""
        buckets: dict[int, int] = {}
        for when, kib in self.samples:
            key = int((when - t0_wall) / step)
            buckets[key] = max(kib, buckets.get(key, 0))
        return [(round(k * step, 2), round(v / 1024, 1)) for k, v in sorted(buckets.items())]

    def peak_between(self, start: float, end: float) -> int | None:
        inside = [kib for when, kib in self.samples if start <= when <= end]
        return max(inside) if inside else None


def shim_log_offset(node: Bench) -> int:
    path: Path = node.containerd.shim_log_file
    return path.stat().st_size if path.exists() else 0


def shim_log_records(node: Bench, offset: int) -> list[dict[str, Any]]:
    """The JSON lines the node's shims wrote to their log file (node config log_file:
    it has what follows a task's deletion too) since `offset`."""
    path: Path = node.containerd.shim_log_file
    with path.open("rb") as f:
        if f.seek(0, os.SEEK_END) < offset:
            raise BenchFailure(f"{path} was rotated during the run: make it bigger")
        f.seek(offset)
        lines = f.read().decode(errors="replace").splitlines()
    records = []
    for line in lines:
        with contextlib.suppress(ValueError):
            records.append(json.loads(line))
    return records


def shim_steps(records: list[dict[str, Any]], ids: set[str], t0_wall: float) -> list[str]:
    """The shim's own records about a container or checkpoint in `ids`, as
    "<seconds after t0> <message>": where the time went."""
    return [
        f"{seconds_after(r, t0_wall):.3f} {r.get('msg')}"
        for r in records
        if str(r.get("logger", "")).startswith("cedana_shim")
        and ids & {r.get("container"), r.get("container_id"), r.get("checkpoint")}
    ]


def seconds_after(record: dict[str, Any], t0_wall: float) -> float:
    return round(datetime.fromisoformat(str(record["time"])).timestamp() - t0_wall, 3)


def stop_timeline(records: list[dict[str, Any]], cid: str, t0_wall: float) -> dict[str, Any]:
    """The checkpoint a stop committed and its steps, in seconds after the kill."""
    committed = [
        r for r in records if r.get("msg") == "checkpoint committed" and r.get("container") == cid
    ]
    if len(committed) != 1:
        raise BenchFailure(f"{len(committed)} 'checkpoint committed' log lines for {cid}")
    checkpoint = str(committed[0]["checkpoint"])
    out: dict[str, Any] = {
        "checkpoint": checkpoint,
        "raw_bytes": committed[0].get("size"),
        "committed_after_s": seconds_after(committed[0], t0_wall),
        # CRIU's own figure (stats-dump): how long the container was frozen for it
        "criu_frozen_s": (committed[0].get("criu") or {}).get("frozen_s"),
    }
    for rec in records:
        if rec.get("runc_verb") == "checkpoint" and rec.get("container_id") == cid:
            out["runc_checkpoint_s"] = round(float(rec["duration_s"]), 3)
        elif rec.get("checkpoint") == checkpoint and rec.get("msg") in (
            "checkpoint compacted",
            "checkpoint pushed",
        ):
            key = f"{str(rec['msg']).split()[1]}_after_s"
            out.setdefault(key, seconds_after(rec, t0_wall))  # pushed: logged twice
            if rec["msg"] == "checkpoint compacted":
                out["stored_bytes"] = int(rec["size"])
    return out


def settle(gap: float = 0.5) -> None:
    """What earlier steps left dirty is written back before the next timed step."""
    t0 = time.monotonic()
    os.sync()
    time.sleep(max(0.0, gap - (time.monotonic() - t0)))


# -- one node ----------------------------------------------------------------------------


@dataclass
class Node:
    name: str
    bench: Bench
    side: CedanaSide
    remote: Remote | None = None
    created: dict[str, float] = field(default_factory=dict)  # container -> monotonic

    def start(self, cid: str, label: str) -> tuple[float, int, dict[str, float | None]]:
        self.created[cid] = time.monotonic()
        started: tuple[float, int, dict[str, float | None]] = self.side.start(cid, label)
        return started

    def start_filled(self, cid: str, label: str) -> int:
        _, pid, _ = self.start(cid, label)
        wait_filled(pid, f"{self.name}: container {cid}")
        return pid

    def after_leftovers_sweep(self, cid: str) -> None:
        """A shim daemon looks for leftovers of dead daemons (compactions, pushes)
        LEFTOVERS_DELAY after its Create. A stop while that sweep runs reports the exit
        before the push is done (the sweep holds the outbox record's claim, so the
        stop's own push returns at once: see bench/README.md); every stop waits it out."""
        time.sleep(max(0.0, self.created[cid] + LEFTOVERS_DELAY + 1.5 - time.monotonic()))

    def timed_stop(self, cid: str, pid: int) -> dict[str, Any]:
        """SIGTERM until the exit is reported; waits for the compaction afterwards, so
        that it does not run into the next timed step."""
        self.after_leftovers_sweep(cid)
        memory = ShimMemory(parent_pid(pid))
        stored_before = self.remote.stored_bytes() if self.remote else 0
        offset = shim_log_offset(self.bench)
        load_before = load_average()
        with TaskWaiter(self.bench.containerd.socket, NAMESPACE, cid) as waiter:
            time.sleep(0.3)
            if waiter.done():
                raise BenchFailure(f"{self.name}: Tasks.Wait {cid} returned before the kill")
            kill = self.side.ctr.argv("task", "kill", "-s", "SIGTERM", cid)
            memory.start()
            t0_wall, t0 = time.time(), time.perf_counter()
            subprocess.run(kill, stdin=subprocess.DEVNULL, capture_output=True, check=True)
            exit_status = waiter.result(timeout=900)
            seconds = time.perf_counter() - t0
            at_exit = set(self.remote.complete_tags()) if self.remote else set()
            memory.stop()
        load_after = load_average()
        if exit_status != 128 + signal.SIGTERM:
            raise BenchFailure(f"{self.name}: {cid} exited with {exit_status}")
        last_step = "pushed_after_s" if self.remote else "compacted_after_s"
        steps = wait_until(
            f"{self.name}: the checkpoint of {cid} {last_step.split('_')[0]}",
            lambda: (
                (s := stop_timeline(shim_log_records(self.bench, offset), cid, t0_wall))
                and last_step in s
                and s
            ),
            300,
            interval=0.05,
        )
        out = {
            "seconds": seconds,
            "load_before": load_before,
            "load_after": load_after,
            **steps,
            "shim_rss_before_mib": memory.rss_before_kib / 1024,
            "shim_rss_timeline_mib": memory.timeline(t0_wall),
            "shim_steps": shim_steps(
                shim_log_records(self.bench, offset), {cid, steps["checkpoint"]}, t0_wall
            ),
            "shim_peak_growth_mib": (memory.hwm_kib - memory.rss_before_kib) / 1024,
        }
        if self.remote is not None:
            out["tag_at_exit"] = steps["checkpoint"] in at_exit
            out["uploaded_bytes"] = self.remote.stored_bytes() - stored_before
            out["push_s"] = steps["pushed_after_s"] - steps["committed_after_s"]
        # The highest VmRSS sampled in each step (dump, compaction, push), and from the
        # commit to the push (the push compacts on the way: the two overlap).
        bounds = [0.0] + [steps.get(f"{k}_after_s") for k in ("committed", "compacted", "pushed")]
        windows = [*zip(("dump", "compact", "push"), bounds[:-1], bounds[1:], strict=True)]
        windows.append(("after_commit", bounds[1], bounds[3]))
        for name, start, end in windows:
            if start is not None and end is not None:
                peak = memory.peak_between(t0_wall + start, t0_wall + end)
                if peak is not None:
                    out[f"shim_{name}_growth_mib"] = (peak - memory.rss_before_kib) / 1024
        return out

    def timed_restore(self, cid: str, label: str, before: Any, mib: int) -> dict[str, Any]:
        offset = shim_log_offset(self.bench)
        load_before = load_average()
        t0_wall = time.time()
        seconds, pid, breakdown = self.start(cid, label)
        load_after = load_average()
        checked = check_resumed(pid, before, mib, f"{self.name}: container {cid}")
        out = {
            "seconds": seconds,
            "pid": pid,
            "load_before": load_before,
            "load_after": load_after,
            **breakdown,
            **checked,
        }
        records = shim_log_records(self.bench, offset)
        out["shim_steps"] = shim_steps(records, {cid}, t0_wall)
        for rec in records:
            if (
                rec.get("msg") == "pulled checkpoint from the registry"
                and rec.get("container") == cid
            ):
                out["pulled_bytes"] = int(rec["size"])
                out["pull_s"] = float(rec["seconds"])
        return out

    def forget(self, label: str) -> None:
        """Remove this node's checkpoints of `label` (not the registry's): the next
        run starts from an empty store, and the page cache is not filled with them."""
        store = str(self.bench.store)
        listing = run(
            [str(CEDANA_CLI), "--store", store, "checkpoints", "list", "-l", label, "--json"]
        )
        for entry in json.loads(listing):
            run([str(CEDANA_CLI), "--store", store, "checkpoints", "rm", entry["id"]])


# -- CPU accounting (issue 30, target 4) ------------------------------------------------------

CLK_TCK = os.sysconf("SC_CLK_TCK")
CPU_SAMPLE_S = 0.2  # a process that exits during a step loses at most this much (one
# sample costs ~5 ms of CPU: more often would load the 2 vCPUs it measures)


def parent_and_cpu(pid: int) -> tuple[int, float] | None:
    """(parent pid, utime + stime + cutime + cstime in seconds) from /proc/<pid>/stat:
    the children it reaped included (runc, and CRIU under it); None once it is gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    fields = stat[stat.rindex(")") + 2 :].split()  # after "pid (comm) "
    return int(fields[1]), sum(int(x) for x in fields[11:15]) / CLK_TCK


def node_processes(sockets: dict[str, bytes]) -> dict[int, str]:
    """pid -> node, for each node's shim daemons (their command line names the node's
    containerd socket: ``-address``) and everything under them (fork servers, runc,
    CRIU). Not by environment: a shim daemon is forked by a template process that
    another containerd, even another run's, may have started, and /proc/<pid>/environ
    shows that one's."""
    parents: dict[int, int] = {}
    found: dict[int, str] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        pid = int(entry)
        got = parent_and_cpu(pid)
        if got is None:
            continue
        parents[pid] = got[0]
        with contextlib.suppress(OSError):
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            for node, socket in sockets.items():
                if b"-address\0" + socket + b"\0" in cmdline:
                    found[pid] = node
    for pid in parents:  # descendants: walk up to a daemon found above
        chain: list[int] = []
        up = pid
        while up in parents and up not in found and len(chain) < 64:
            chain.append(up)
            up = parents[up]
        if up in found:
            found |= dict.fromkeys(chain, found[up])
    return found


def registry_process(remote: Remote) -> int | None:
    """The docker-registry serving this run (its config file on the command line)."""
    if remote.registry is None:
        return None
    needle = str(remote.registry.config_path).encode()
    for entry in os.listdir("/proc"):
        with contextlib.suppress(OSError):
            if entry.isdigit() and needle in Path(f"/proc/{entry}/cmdline").read_bytes():
                return int(entry)
    return None


class CpuMeter:
    """CPU seconds each side spends during one step: the registry process, and each
    node's processes (node_processes). Sampled every CPU_SAMPLE_S: a node's
    processes come and go (a shim per container), so each one counts from when
    it was first seen (0 for one born during the step) to its last sample, with the
    children it reaped. A child of a node process counts only if it is still there at
    the end: once reaped, its CPU is in its parent's (cutime), and would count twice."""

    def __init__(self, sockets: dict[str, bytes], registry: int | None) -> None:
        self._sockets = sockets
        self._registry = registry
        self._first: dict[int, float] = {}
        self._last: dict[int, tuple[str, int, float]] = {}  # pid -> (side, ppid, seconds)
        self._at_end: set[int] = set()
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def __enter__(self) -> CpuMeter:
        self._sample(first=True)
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._done.set()
        self._thread.join()
        self._at_end = self._sample()

    def _run(self) -> None:
        while not self._done.wait(CPU_SAMPLE_S):
            self._sample()

    def _sample(self, first: bool = False) -> set[int]:
        pids = node_processes(self._sockets)
        if self._registry is not None:
            pids[self._registry] = "registry"
        for pid, side in pids.items():
            got = parent_and_cpu(pid)
            if got is None:
                continue
            if pid not in self._first:
                self._first[pid] = got[1] if first else 0.0
            self._last[pid] = (side, got[0], got[1])
        return set(pids)

    def seconds(self) -> dict[str, float]:
        """CPU seconds per side: each node's name, and "registry" when there is one."""
        out = dict.fromkeys([*self._sockets, *(["registry"] if self._registry else [])], 0.0)
        for pid, (side, ppid, last) in self._last.items():
            reaped = pid not in self._at_end
            if side != "registry" and reaped and self._last.get(ppid, ("",))[0] == side:
                continue  # in its parent's cutime
            out[side] += last - self._first[pid]
        return {k: round(v, 3) for k, v in out.items()}


def with_cpu(step: Any, sockets: dict[str, bytes], registry: int | None) -> dict[str, Any]:
    """``step()``'s result with ``cpu_s``: the CPU seconds each side spent in it."""
    with CpuMeter(sockets, registry) as meter:
        out: dict[str, Any] = step()
    out["cpu_s"] = meter.seconds()
    return out


# -- one run ------------------------------------------------------------------------------


def rewrite_tenth(pid: int, what: str) -> str:
    """memhog's SIGUSR1: one contiguous tenth of its memory rewritten."""
    os.kill(pid, signal.SIGUSR1)

    def rewritten() -> str | None:
        lines = [x for x in read_verify(pid) if x.startswith("rewrote ")]
        return lines[-1] if lines else None

    line: str = wait_until(f"{what} to rewrite a tenth of its memory", rewritten, 60)
    return line


def one_run(
    i: int, local: Node, a: Node, b: Node, mib: int, lazy: Node | None, lazy_mib: int
) -> dict[str, Any]:
    label = f"bench-xn-{a.bench.marker[:8]}-{i}"

    def cid(role: str) -> str:
        # This run's own ids: a run killed midway leaves its runc state behind.
        return f"xn-{a.bench.marker[:8]}-{i}-{role}"

    swap = i % 2 == 1
    out: dict[str, Any] = {"label": label, "first": "local" if swap else "registry"}
    before: dict[str, Any] = {}
    assert a.remote is not None
    registry = registry_process(a.remote)
    nodes = (local, a, b) if lazy is None else (local, a, b, lazy)
    sockets = {n.name: str(n.bench.containerd.socket).encode() for n in nodes}

    def cpu(step: Any) -> dict[str, Any]:
        return with_cpu(step, sockets, registry)

    def stop_on_a() -> None:
        pid = a.start_filled(cid("a"), label)
        settle()
        before["a"] = read_beat(pid)
        out["stop_registry"] = cpu(lambda: a.timed_stop(cid("a"), pid))
        a.side.ctr.remove(cid("a"))

    def stop_on_local() -> None:
        container, local_label = cid("l"), f"{label}-local"
        pid = local.start_filled(container, local_label)
        settle()
        out["stop_local"] = cpu(lambda: local.timed_stop(container, pid))
        local.side.ctr.remove(container)
        local.forget(local_label)

    for step in (stop_on_local, stop_on_a) if swap else (stop_on_a, stop_on_local):
        step()

    def restore_on_a() -> None:
        settle(RESTORE_GAP)
        out["restore_local"] = cpu(lambda: a.timed_restore(cid("ra"), label, before["a"], mib))

    def restore_on_b() -> None:
        settle(RESTORE_GAP)
        out["restore_pulled"] = cpu(lambda: b.timed_restore(cid("rb"), label, before["a"], mib))
        b.side.ctr.remove(cid("rb"))
        b.forget(label)

    for step in (restore_on_b, restore_on_a) if swap else (restore_on_a, restore_on_b):
        step()

    # (d): the container restored on A changes a tenth of its memory and stops again.
    pid = int(out["restore_local"].pop("pid"))
    out["restore_pulled"].pop("pid")
    out["rewrote"] = rewrite_tenth(pid, f"A: container {cid('ra')}")
    wait_until("a heartbeat after the rewrite", lambda: read_beat(pid), 10)
    settle()
    out["stop_after_rewrite"] = a.timed_stop(cid("ra"), pid)
    a.side.ctr.remove(cid("ra"))
    a.forget(label)
    first = out["stop_registry"]["uploaded_bytes"]
    out["delta_ratio"] = ratio(out["stop_after_rewrite"]["uploaded_bytes"], first)
    assert a.remote is not None
    before_blobs = a.remote.layers(out["stop_registry"]["checkpoint"])
    after_blobs = a.remote.layers(out["stop_after_rewrite"]["checkpoint"])
    out["new_blobs"] = {
        what: size for digest, (what, size) in after_blobs.items() if digest not in before_blobs
    }
    if lazy is not None:
        out["restore_pulled_lazy"] = lazy_restore_on_b(i, a, lazy, lazy_mib, cpu)
    return out


def lazy_restore_on_b(i: int, a: Node, lazy: Node, mib: int, cpu: Any) -> dict[str, Any]:
    """(e), target 2: A stops a workload of ``mib`` MiB (pushed before its exit); B with
    ``lazy_restore`` runs the next container of its label (lazy_across_nodes.restore_on:
    ctr run -> first beat, returned, memory verified). Each node's copy is removed after."""
    tag = f"{a.bench.marker[:6]}-{i}"
    label = f"bench-xl-{tag}"
    room_for(2 * mib, f"the lazy restore of {mib} MiB")
    checkpoint_on_a(a.side, label, mib, tag)
    settle(RESTORE_GAP)
    load = load_average()
    out: dict[str, Any] = cpu(lambda: restore_on(lazy.bench, lazy.side, label, mib, tag))
    if out["memory"] != "lazy":
        raise BenchFailure(f"{lazy.name}: {label} was restored {out['memory']!r}, not lazily")
    out["load_1m"] = load[0]
    lazy.forget(label)
    a.forget(label)
    return out


# -- figures -------------------------------------------------------------------------------

STOPS_WITH_PUSH = ("stop_registry", "stop_after_rewrite")
SIDES = ("stop_registry", "stop_local", "restore_pulled", "restore_local")


def figures(runs: list[dict[str, Any]]) -> dict[str, Summary]:
    def col(side: str, key: str, scale: float = 1.0) -> Summary:
        return summarize([float(v) / scale for r in runs if (v := r[side].get(key)) is not None])

    def over_pushes(key: str) -> Summary:
        return summarize(
            [float(r[s][key]) for r in runs for s in STOPS_WITH_PUSH if r[s].get(key) is not None]
        )

    out = {
        f"{side}.{key}": col(side, key)
        for side in SIDES
        for key in (
            "seconds", "runc_checkpoint_s", "committed_after_s", "compacted_after_s",
            "pushed_after_s", "pull_s", "shim_created_after_s", "shim_runc_restore_s",
        )
    }  # fmt: skip
    for side in SIDES:
        for when in ("load_before", "load_after"):
            out[f"{side}.{when}"] = summarize([float(r[side][when][0]) for r in runs])
    first = [r["stop_registry"] for r in runs]
    pulls = [r["restore_pulled"] for r in runs]
    out |= {
        "push_mb_s": summarize([p["stored_bytes"] / MB / p["push_s"] for p in first]),
        "pull_mb_s": summarize([p["pulled_bytes"] / MB / p["pull_s"] for p in pulls]),
        "stored_mib": summarize([p["stored_bytes"] / MIB for p in first]),
        "shim_growth_stop_mib": over_pushes("shim_peak_growth_mib"),
        "shim_growth_dump_mib": over_pushes("shim_dump_growth_mib"),
        "shim_growth_compact_mib": over_pushes("shim_compact_growth_mib"),
        "shim_growth_push_mib": over_pushes("shim_push_growth_mib"),
        "shim_growth_after_commit_mib": over_pushes("shim_after_commit_growth_mib"),
        "tag_at_exit": summarize(
            [float(r[s]["tag_at_exit"]) for r in runs for s in STOPS_WITH_PUSH]
        ),
        "new_chunks": summarize([sum("@" in w for w in r["new_blobs"]) for r in runs]),
        "uploaded_first_mib": col("stop_registry", "uploaded_bytes", MIB),
        "uploaded_second_mib": col("stop_after_rewrite", "uploaded_bytes", MIB),
        # Blobs are content-addressed: the 2nd checkpoint's new blobs are all it added to
        # A's store as well as to the registry.
        "new_blobs_second_mib": summarize([sum(r["new_blobs"].values()) / MIB for r in runs]),
        "frozen_first_s": col("stop_registry", "criu_frozen_s"),
        "frozen_second_s": col("stop_after_rewrite", "criu_frozen_s"),
        "delta_ratio": summarize([float(r["delta_ratio"]) for r in runs]),
    }
    lazy = [r["restore_pulled_lazy"] for r in runs if "restore_pulled_lazy" in r]
    for key in ("first_beat_s", "returned_s", "verified_s"):
        out[f"restore_pulled_lazy.{key}"] = summarize([float(x[key]) for x in lazy])
    return out


LAZY_NODE = "B-lazy"  # B's twin with lazy_restore = true: step (e)
CPU_STEPS = {  # the step, and whose CPU matters for it
    "stop_registry": ("A", "registry"),
    "stop_local": ("L",),
    "restore_pulled": ("B", "registry"),
    "restore_local": ("A",),
    "restore_pulled_lazy": (LAZY_NODE, "registry"),  # until every page is in
}


def cpu_figures(runs: list[dict[str, Any]], mib: int, lazy_mib: int) -> dict[str, Summary]:
    """CPU seconds per GiB of the workload's memory, per step and side (target 4)."""
    return {
        f"cpu.{step}.{who}": summarize(
            [
                r[step]["cpu_s"][who] / ((lazy_mib if step.endswith("_lazy") else mib) / 1024)
                for r in runs
                if who in r.get(step, {}).get("cpu_s", {})
            ]
        )
        for step, whose in CPU_STEPS.items()
        for who in whose
    }


def print_cpu(f: dict[str, Summary]) -> None:
    """Target 4: the CPU each side spends per GiB, beside the time ratios: on a cluster
    whose registry has CPUs of its own, only the node's column is on the node's CPUs."""
    rows = [
        ["(a) stop: A pushes / L commits", cell(f["cpu.stop_registry.A"]),
         cell(f["cpu.stop_registry.registry"]), cell(f["cpu.stop_local.L"])],
        ["(b) create -> running: B pulls / A", cell(f["cpu.restore_pulled.B"]),
         cell(f["cpu.restore_pulled.registry"]), cell(f["cpu.restore_local.A"])],
        ["(e) lazy restore on B, until every page is in",
         cell(f[f"cpu.restore_pulled_lazy.{LAZY_NODE}"]),
         cell(f["cpu.restore_pulled_lazy.registry"]), ""],
    ]  # fmt: skip
    print("\nCPU seconds per GiB of memory (target 4: /proc/<pid>/stat, children reaped included)")
    print_table(["step", "the node (A / B)", "registry", "the local side (L / A)"], rows)


def issue_targets(
    f: dict[str, Summary], verdicts: dict[str, tuple[float, float]], lazy_mib: int
) -> list[dict[str, Any]]:
    """Issue 30's targets 1-3 as this run measured them (target 2, set for 4 GiB, only
    when the run had step (e): ``--lazy-mib`` not 0)."""
    lazy = f["restore_pulled_lazy.first_beat_s"]
    rows: list[dict[str, Any]] = [
        {"target": 1, "what": "create -> running on B (pull) / A (local), eager",
         "value": verdicts["b"][0], "limit": TIME_TARGET},
        {"target": 2, "what": f"lazy restore on B, ctr run -> first beat, {lazy_mib} MiB (s)",
         "value": lazy.median if lazy.n else None, "limit": LAZY_TARGET_S},
        {"target": 3, "what": "SIGTERM -> exit, before-exit push (A) / local commit (L)",
         "value": verdicts["a"][0], "limit": TIME_TARGET},
    ]  # fmt: skip
    for row in rows:
        value = row["value"]
        row["meets_target"] = None if value is None else value <= row["limit"]
    return rows


def print_targets(rows: list[dict[str, Any]]) -> None:
    print("\nIssue 30 targets")
    print_table(
        ["target", "measure", "value", "target", "verdict"],
        [
            [str(r["target"]), r["what"], "n/a" if r["value"] is None else f"{r['value']:.3g}",
             f"<= {r['limit']:g}",
             "not measured by this run" if r["value"] is None
             else verdict(r["value"], r["limit"])]
            for r in rows
        ],
    )  # fmt: skip


def cell(s: Summary, unit: str = "s", digits: int = 2) -> str:
    if not s.n:
        return "n/a"
    f = f".{digits}f"
    return f"{s.median:{f}}{unit} ({s.min:{f}}-{s.max:{f}}, sd {s.stdev:{f}})"


def load_cell(f: dict[str, Summary], side: str) -> str:
    before, after = f[f"{side}.load_before"], f[f"{side}.load_after"]
    return f"{before.median:.2f} -> {after.median:.2f} (max {max(before.max, after.max):.2f})"


def print_figures(f: dict[str, Summary], verdicts: dict[str, tuple[float, float]]) -> None:
    def judged(key: str) -> list[str]:
        value, target = verdicts[key]
        return [f"{value:.3g}", f"<= {target:g}: {verdict(value, target)}"]

    def steps(key: str, note: str, local: str = "stop_local") -> list[str]:
        return [cell(f[f"stop_registry.{key}"]), cell(f[f"{local}.{key}"]), "", note, ""]

    rows = [
        ["(a) SIGTERM -> exit: A (registry) / L",
         cell(f["stop_registry.seconds"]), cell(f["stop_local.seconds"]), *judged("a"),
         load_cell(f, "stop_registry")],
        ["    L's load", "", "", "", "", load_cell(f, "stop_local")],
        ["    runc checkpoint", *steps("runc_checkpoint_s", "(shim log)")],
        ["    committed", *steps("committed_after_s", "(after the kill)")],
        ["    compacted", *steps("compacted_after_s", "(L: after its exit)")],
        ["    pushed", *steps("pushed_after_s", "(tag there at the exit: "
         f"{f['tag_at_exit'].mean * f['tag_at_exit'].n:.0f}/{f['tag_at_exit'].n} stops)")],
        ["(b) create -> running: B (pull) / A",
         cell(f["restore_pulled.seconds"]), cell(f["restore_local.seconds"]), *judged("b"),
         load_cell(f, "restore_pulled")],
        ["    A's load", "", "", "", "", load_cell(f, "restore_local")],
        ["    of which the pull", cell(f["restore_pulled.pull_s"]), "", "", "(B's shim log)", ""],
        ["    shim Create done", cell(f["restore_pulled.shim_created_after_s"]),
         cell(f["restore_local.shim_created_after_s"]), "", "(after ctr run)", ""],
        ["    runc restore", cell(f["restore_pulled.shim_runc_restore_s"]),
         cell(f["restore_local.shim_runc_restore_s"]), "", "(shim log)", ""],
        ["(c) push, MB/s of stored bytes", cell(f["push_mb_s"], "", 0),
         cell(f["stored_mib"], " MiB", 0), "", "(committed -> pushed; stored)", ""],
        ["    pull, MB/s", cell(f["pull_mb_s"], "", 0), "", "", "(B's shim log)", ""],
        ["    shim RSS growth, commit -> pushed",
         cell(f["shim_growth_after_commit_mib"], " MiB", 1), "", *judged("c"), ""],
        ["      after 'compacted' only", cell(f["shim_growth_push_mib"], " MiB", 1), "", "",
         "(the push's tail)", ""],
        ["    shim RSS growth, whole stop", cell(f["shim_growth_stop_mib"], " MiB", 1), "", "",
         "(VmHWM, reset at the kill)", ""],
        *(
            [f"      highest VmRSS in the {step}",
             cell(f[f"shim_growth_{step}_mib"], " MiB", 1), "", "", "(sampled every 10 ms)", ""]
            for step in ("dump", "compact")
        ),
        ["(d) uploaded: 2nd / 1st checkpoint", cell(f["delta_ratio"], "", 3), "", *judged("d"), ""],
        ["    uploaded MiB: 1st / 2nd", cell(f["uploaded_first_mib"], "", 0),
         cell(f["uploaded_second_mib"], "", 0), "", "", ""],
        ["    new page-image chunks in the 2nd", cell(f["new_chunks"], "", 0), "", "",
         "(per run: see its line)", ""],
        ["    new blobs of the 2nd (store, registry), MiB",
         cell(f["new_blobs_second_mib"], "", 1),
         "", "", "", ""],
        ["    CRIU frozen time: 1st / 2nd (no dirty tracking)", cell(f["frozen_first_s"], "s", 3),
         cell(f["frozen_second_s"], "s", 3), "", "", ""],
        ["(e) lazy restore on B: ctr run -> first beat",
         cell(f["restore_pulled_lazy.first_beat_s"], "s", 3), "", "", "(target 2)", ""],
        ["    -> every page in (ctr run returns)", cell(f["restore_pulled_lazy.returned_s"]),
         "", "", "", ""],
        ["    -> memory checksum verified", cell(f["restore_pulled_lazy.verified_s"]),
         "", "", "", ""],
    ]  # fmt: skip
    print_table(["measure", "registry side", "local side", "ratio", "target", "load 1m"], rows)


def lazy_line(r: dict[str, Any]) -> str:
    lazy = r.get("restore_pulled_lazy")
    if lazy is None:
        return ""
    return (
        f"; lazy on B: first beat {lazy['first_beat_s']:.3f}s, every page in "
        f"{lazy['returned_s']:.2f}s (load {lazy['load_1m']:.2f})"
    )


def main() -> int:
    parser = base_parser(__doc__ or "", default_runs=5)
    parser.add_argument("--mem-mib", type=int, default=1024, help="memory the workload fills")
    parser.add_argument("--warmup", type=int, default=1, help="discarded runs first (default 1)")
    parser.add_argument(
        "--lazy-mib",
        type=int,
        default=4096,
        help="memory of step (e), the lazy restore on B (target 2: 4096); 0 = no step (e)",
    )
    parser.add_argument(
        "--shared-dir",
        action="store_true",
        help="a directory (registry = its path) instead of a registry: no registry process",
    )
    args = parser.parse_args()
    if args.runs < 1 or args.mem_mib < 1 or args.warmup < 0 or args.lazy_mib < 0:
        parser.error("--runs and --mem-mib must be >= 1, --warmup and --lazy-mib >= 0")
    require_root()
    install_signal_handlers()
    report = Report(
        "across_nodes",
        {
            "runs": args.runs,
            "warmup_runs": args.warmup,
            "mem_mib": args.mem_mib,
            "lazy_mib": args.lazy_mib,
            "containerd": args.containerd,
            "registry": "a shared directory on the same disk (registry = its path)"
            if args.shared_dir
            else "docker-registry (distribution 2.8) on 127.0.0.1, TLS, htpasswd",
            "registry_sync": "before-exit",
            "order": "per run: (a) on A and on L, (b) on A and on B, swapped in odd runs; "
            "then (d) on A; `sync` and a pause before each timed step",
        },
    )
    runs: list[dict[str, Any]] = []
    cleanup = Cleanup()
    try:
        with private_containerd(args.containerd, cleanup, (NAMESPACE,), keep=args.keep) as base:
            remote, env = (
                shared_directory(base.root)
                if args.shared_dir
                else start_registry(base.root, cleanup)
            )
            nodes = {"L": base}
            nodes |= {name: another_node(base, cleanup, (NAMESPACE,), env) for name in "AB"}
            if args.lazy_mib:
                lazy_env = {**env, "CEDANA_LAZY_RESTORE": "true"}
                nodes[LAZY_NODE] = another_node(base, cleanup, (NAMESPACE,), lazy_env)
            archive, _ = build_image(base.root, build_memhog(base.root), args.mem_mib)
            made = {}
            for name, bench in nodes.items():
                ctr = bench.containerd.ctr(NAMESPACE)
                ctr("images", "import", str(archive), timeout=120)
                node_remote = remote if name != "L" else None
                made[name] = Node(name, bench, CedanaSide(bench, ctr, cleanup), node_remote)
            report.params["containerd_full"] = base.version.full
            report.params["stores"] = {n: str(x.store) for n, x in nodes.items()}
            report.params["registry_storage"] = str(remote.blobs)
            total = args.warmup + args.runs
            for i in range(total):
                r = one_run(
                    i, made["L"], made["A"], made["B"], args.mem_mib,
                    made.get(LAZY_NODE), args.lazy_mib,
                )  # fmt: skip
                warm = i >= args.warmup
                if warm:
                    runs.append(r)
                print(
                    f"run {i + 1}/{total}{'' if warm else ' (warm-up, discarded)'}: "
                    f"stop A {r['stop_registry']['seconds']:.2f}s / L "
                    f"{r['stop_local']['seconds']:.2f}s; restore B "
                    f"{r['restore_pulled']['seconds']:.2f}s / A "
                    f"{r['restore_local']['seconds']:.2f}s; uploaded "
                    f"{r['stop_registry']['uploaded_bytes'] / MIB:.0f} MiB then "
                    f"{r['stop_after_rewrite']['uploaded_bytes'] / MIB:.0f} MiB; new blobs "
                    + ", ".join(f"{w} ({n / MIB:.1f} MiB)" for w, n in r["new_blobs"].items())
                    + lazy_line(r),
                    flush=True,
                )
    finally:
        cleanup.run()

    f = figures(runs)
    verdicts = {
        "a": (
            ratio(f["stop_registry.seconds"].median, f["stop_local.seconds"].median),
            TIME_TARGET,
        ),
        "b": (
            ratio(f["restore_pulled.seconds"].median, f["restore_local.seconds"].median),
            TIME_TARGET,
        ),
        "c": (f["shim_growth_after_commit_mib"].max, MEMORY_TARGET_MIB),
        "d": (f["delta_ratio"].median, DELTA_TARGET),
    }
    print(
        f"\n{args.mem_mib} MiB workload, containerd {args.containerd}, {args.runs} runs "
        "(median (min-max, sd))"
    )
    print_figures(f, verdicts)
    cpu = cpu_figures(runs, args.mem_mib, args.lazy_mib)
    print_cpu(cpu)
    targets = issue_targets(f, verdicts, args.lazy_mib)
    print_targets(targets)
    report.results = {
        "unit": "seconds; MiB; MB/s (10^6 bytes); load: 1-minute load average",
        "figures": {k: v.as_dict() for k, v in f.items()},
        "verdicts": {
            k: {"value": round(v, 4), "target": t, "meets_target": v <= t}
            for k, (v, t) in verdicts.items()
        },
        "cpu_per_gib": {k: v.as_dict() for k, v in cpu.items()},
        "issue_30_targets": targets,
        "runs": runs,
    }
    report.notes.append(
        "memory target judged on the push, which compacts on the way: the highest VmRSS "
        "sampled (every 10 ms) between the shim's 'checkpoint committed' and 'checkpoint "
        "pushed' log lines, highest of all pushes; the whole stop's peak (VmHWM reset at "
        "the kill) is reported beside it, and the peaks of the compaction and of the "
        "push's tail after it"
    )
    report.write(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
