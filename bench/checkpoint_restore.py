"""Checkpoint and restore of a container holding 1 GiB of touched memory: the cedana
shim's checkpoint-on-stop / restore-on-start vs plain runc checkpoint/restore to a
local directory, interleaved, on the same disk.

    python bench/checkpoint_restore.py [--runs 5] [--warmup 1] [--mem-mib 1024]
                                       [--containerd 1.6|1.7|2.1] [--drop-caches]
                                       [--load N] [--out results.json]

The workload is bench/memhog.c, compiled here with `gcc -static -O2` and packed with
umoci into a one-file image (the same image feeds containerd and, unpacked, the runc
bundle): it fills N MiB, each page half pseudo-random and half a repeated pattern,
then beats a heartbeat file and re-verifies its whole buffer after a clock gap.

Each run does one full cycle per side (start, fill, checkpoint, restore, remove
everything it wrote), cedana's first in even runs and runc's first in odd runs, with
`sync` before every timed step; nothing else of the benchmark runs during a timed step.

(a) stop-with-checkpoint
    cedana: container started with `--env CEDANA_CHECKPOINT=<label>`; time from
            `ctr task kill -s SIGTERM` to the exit, as reported by containerd's
            Tasks.Wait (the call `ctr run` waits with; in flight before the kill). The
            shim freezes the container, dumps it, makes the checkpoint durable in the
            store (raw images fsynced and listed in index.json), then kills it; the
            compression goes on in the background. Reported too: the time until the
            checkpoint is listed (whether it already was at the exit) and until it is
            compressed.
    runc:   identical container run directly by `runc run -d` from a bundle; time
            of `runc checkpoint --image-path <dir>` (dump to local disk, then kill).
            Also reported: that time plus an fdatasync of every image file right after
            it, what plain runc needs for the durability the shim gives a stop.
(b) restore
    cedana: new container with the same label; time of `ctr run -d` (Create, where the
            shim verifies and unpacks the checkpoint, + Start, which restores) until it
            returns with the task RUNNING. The shim's own log splits it up.
    runc:   time of `runc restore -d --image-path <dir>` from the raw images.
    Both are then checked: same nonce, heartbeat counting on from its last value
    before the dump, the program's own checksum of its memory "ok", RSS back to N MiB
    (not part of the timing).
(d) kill -> resumed
    cedana: from `ctr task kill -s SIGTERM` of a restored container until the next
            container of the label, started as soon as the stop's checkpoint is listed
            in the store, is RUNNING (restored from it, checked as in (b)).
    runc:   `runc checkpoint` + `runc restore` of the same container, back to back;
            and once more with the images fdatasynced between the two (durable).
CRIU's own statistics (stats-dump / stats-restore in its work dir: freezing, frozen,
memory dump and memory write times, pages written) are reported for both sides, so a
difference shows per phase; the shim logs them with each checkpoint. `--load N` runs
N busy loops beside the whole benchmark (a second job on the node).
(c) bytes: stored bytes of the checkpoint (manifest + config + layer blobs, read from
    the store's index.json and manifest, and cross-checked with `cedana checkpoints
    list --json`) vs raw CRIU image bytes (apparent size of runc's images dir).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (
    Bench,
    Cleanup,
    Report,
    Summary,
    base_parser,
    ensure_venv,
    install_signal_handlers,
    print_table,
    private_containerd,
    ratio,
    remove_cgroup_tree,
    require_root,
    start_cpu_load,
    summarize,
    verdict,
)

NAMESPACE = "cedana-bench"
IMAGE_REF = "docker.io/cedana-bench/memhog:latest"
CEDANA = "io.containerd.cedana.v2"
TARGET_RATIO = 1.2
MEMHOG_SRC = Path(__file__).resolve().parent / "memhog.c"
MIB = 1024 * 1024
# runc finds CRIU on PATH: the same order the harness gives containerd.
RUNC_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
FILL_TIMEOUT = 180.0
VERIFY_TIMEOUT = 120.0
RESTORE_GAP = 1.5  # seconds from the end of a dump to its restore, at least


class BenchFailure(RuntimeError):
    pass


def run(argv: list[str], timeout: float = 300, env: dict[str, str] | None = None) -> str:
    proc = subprocess.run(
        argv,
        stdin=subprocess.DEVNULL,
        capture_output=True,
        text=True,
        timeout=timeout,
        env=env,
        check=False,
    )
    if proc.returncode != 0:
        raise BenchFailure(
            f"{' '.join(argv)} -> exit {proc.returncode}\nstdout: {proc.stdout}\n"
            f"stderr: {proc.stderr}"
        )
    return proc.stdout


def du_bytes(path: Path) -> int:
    """Apparent size of every regular file below `path`."""
    total = 0
    for dirpath, _dirs, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                st = os.lstat(os.path.join(dirpath, name))
                total += st.st_size
    return total


# -- workload and image ----------------------------------------------------------------


def fsync_tree(path: Path) -> float:
    """Seconds to fdatasync every file under ``path``, then the directories."""
    t0 = time.monotonic()
    for root, _, files in os.walk(path):
        for name in files:
            fd = os.open(os.path.join(root, name), os.O_RDONLY)
            try:
                os.fdatasync(fd)
            finally:
                os.close(fd)
        fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
    return time.monotonic() - t0


def build_memhog(workdir: Path) -> Path:
    out = workdir / "memhog"
    run(["gcc", "-static", "-O2", "-Wall", "-o", str(out), str(MEMHOG_SRC)], timeout=120)
    return out


def build_image(workdir: Path, memhog: Path, mib: int) -> tuple[Path, Path]:
    """A one-file image (the static memhog plus the dirs runc mounts on) as an OCI
    archive for `ctr images import`, and the same image unpacked as a runc bundle."""
    layout = workdir / "layout"
    bundle = workdir / "template-bundle"
    run(["umoci", "init", "--layout", str(layout)])
    run(["umoci", "new", "--image", f"{layout}:memhog"])
    run(["umoci", "unpack", "--image", f"{layout}:memhog", str(bundle)])
    rootfs = bundle / "rootfs"
    for d in ("dev", "proc", "sys", "tmp", "etc"):
        (rootfs / d).mkdir(exist_ok=True)
    shutil.copy2(memhog, rootfs / "memhog")
    run(["umoci", "repack", "--image", f"{layout}:memhog", str(bundle)])
    run(
        [
            "umoci",
            "config",
            "--image",
            f"{layout}:memhog",
            "--config.entrypoint",
            "/memhog",
            "--config.cmd",
            str(mib),
            "--config.workingdir",
            "/",
        ]
    )
    run(["umoci", "gc", "--layout", str(layout)])
    shutil.rmtree(bundle)
    # The runc bundle comes from the final image, so its args are the image's.
    run(["umoci", "unpack", "--image", f"{layout}:memhog", str(bundle)])
    index_path = layout / "index.json"
    index = json.loads(index_path.read_text())
    for desc in index["manifests"]:
        desc.setdefault("annotations", {})["io.containerd.image.name"] = IMAGE_REF
    index_path.write_text(json.dumps(index))
    archive = workdir / "memhog-image.tar"
    with tarfile.open(archive, "w") as tar:
        for entry in sorted(layout.iterdir()):
            tar.add(entry, arcname=entry.name)
    return archive, bundle


# -- probes ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Beat:
    nonce: str
    count: int


def read_beat(pid: int) -> Beat | None:
    try:
        text = Path(f"/proc/{pid}/root/hb").read_text().split()
    except OSError:
        return None
    if len(text) != 2:
        return None
    return Beat(text[0], int(text[1]))


def read_verify(pid: int) -> list[str]:
    try:
        return Path(f"/proc/{pid}/root/verify").read_text().splitlines()
    except OSError:
        return []


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def wait_until(what: str, predicate: Any, timeout: float, interval: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise BenchFailure(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)


def wait_filled(pid: int, what: str) -> Beat:
    """The program beats only once all its memory is written; wait for a few beats."""
    first: Beat = wait_until(f"{what} to fill its memory", lambda: read_beat(pid), FILL_TIMEOUT)
    beat: Beat = wait_until(
        f"{what} to beat",
        lambda: b if (b := read_beat(pid)) and b.count >= first.count + 3 else None,
        30,
    )
    return beat


def check_resumed(pid: int, before: Beat | None, mib: int, what: str) -> dict[str, Any]:
    """Same nonce, counter continuing from the last beat read before the dump, the
    program's own checksum of its memory ok, RSS back at the filled size."""
    if before is None:
        raise BenchFailure(f"{what}: no heartbeat was read before the checkpoint")

    def verified() -> str | None:
        lines = [x for x in read_verify(pid) if x.startswith("verify ")]
        return lines[-1] if lines else None

    line: str = wait_until(f"{what} to verify its memory", verified, VERIFY_TIMEOUT)
    beat = read_beat(pid)
    rss = rss_bytes(pid)
    problems = []
    if beat is None or beat.nonce != before.nonce:
        problems.append(f"nonce {beat.nonce if beat else None} != {before.nonce}: a cold start")
    elif beat.count < before.count:
        problems.append(f"heartbeat {beat.count} went back from {before.count}")
    if " ok " not in line:
        problems.append(f"memory checksum failed: {line!r}")
    if rss < mib * MIB * 0.9:
        problems.append(f"RSS {rss / MIB:.0f} MiB, expected ~{mib} MiB")
    if problems:
        raise BenchFailure(f"{what} did not resume correctly: " + "; ".join(problems))
    return {"verify": line, "beat_before": before.count, "rss_mib": round(rss / MIB, 1)}


# -- cedana side ---------------------------------------------------------------------------


def store_checkpoint(store: Path, label: str) -> dict[str, Any] | None:
    """The label's newest checkpoint as the store lists it: stored bytes of its blobs."""
    try:
        index = json.loads((store / "index.json").read_text())
    except (OSError, ValueError):
        return None
    found = [
        d
        for d in index.get("manifests", [])
        if (d.get("annotations") or {}).get("cedana.ai/checkpoint.label") == label
    ]
    if not found:
        return None
    desc = found[-1]
    algo, hexdigest = desc["digest"].split(":", 1)
    manifest = json.loads((store / "blobs" / algo / hexdigest).read_bytes())
    # A compacted criu layer's page images are chunks: descriptors of their own in
    # `layers`, without a title.
    layers: dict[str, int] = {}
    for layer in manifest.get("layers", []):
        title = (layer.get("annotations") or {}).get("org.opencontainers.image.title", "chunks")
        layers[title] = layers.get(title, 0) + int(layer["size"])
    total = desc["size"] + manifest["config"]["size"] + sum(layers.values())
    # Published checkpoints are raw (file lists of fsynced images) until compacted into
    # zstd blobs in the background.
    compacted = all(
        str(layer.get("mediaType", "")).endswith("+zstd") for layer in manifest.get("layers", [])
    )
    return {
        "id": desc["annotations"].get("cedana.ai/checkpoint.id"),
        "compacted": compacted,
        "stored_bytes": total,
        "layers": layers,
        "manifest_bytes": desc["size"],
        "config_bytes": manifest["config"]["size"],
    }


CEDANA_CLI = Path(sys.prefix) / "bin" / "cedana"


def cli_checkpoint(store: Path, label: str) -> dict[str, Any] | None:
    """`cedana checkpoints list --json` for the label (None when the CLI is missing)."""
    if not CEDANA_CLI.exists():
        return None
    argv = [str(CEDANA_CLI), "--store", str(store), "checkpoints", "list", "-l", label, "--json"]
    out = run(argv)
    items = json.loads(out)
    if not items:
        raise BenchFailure(f"`cedana checkpoints list -l {label}` lists nothing")
    item: dict[str, Any] = items[0]
    return item


def cli_remove(store: Path, checkpoint_id: str) -> None:
    """Drop a measured checkpoint, so that its blobs (and their page cache) do not
    weigh on the next steps; by hand from the index when the CLI is missing."""
    if CEDANA_CLI.exists():
        run([str(CEDANA_CLI), "--store", str(store), "checkpoints", "rm", checkpoint_id])


def shim_log_excerpt(b: Bench, offset: int, cids: list[str]) -> str:
    lines = b.containerd.log_since(offset).splitlines()
    keep = [
        x
        for x in lines
        if any(c in x for c in cids)
        or "level=error" in x
        or '"level":"error"' in x
        or '"level":"warning"' in x
        or "level=warning" in x
    ]
    return "\n".join(keep[-60:])


def shim_records(b: Bench, offset: int, cid: str) -> list[dict[str, Any]]:
    """The shim's JSON log lines about `cid` (containerd copies them into its log)."""
    records = []
    for line in b.containerd.log_since(offset, limit=20_000_000).splitlines():
        if not line.startswith("{"):
            continue
        try:
            rec = json.loads(line)
        except ValueError:
            continue
        if cid in (rec.get("container"), rec.get("container_id")):
            records.append(rec)
    return records


def shim_criu(b: Bench, offset: int, cid: str, msg: str) -> dict[str, Any]:
    """CRIU's statistics of the shim's dump or restore of `cid`, from its "checkpoint
    committed" or "restored from checkpoint" line (runtime/criu_stats.py)."""
    for rec in shim_records(b, offset, cid):
        if rec.get("msg") == msg and isinstance(rec.get("criu"), dict):
            return dict(rec["criu"])
    return {}


def shim_breakdown(b: Bench, offset: int, cid: str, t0_wall: float) -> dict[str, float | None]:
    """Where the time went inside the shim, from its own log: seconds from the timed
    command's start to the shim's `created` record, and the runc checkpoint/restore
    durations it logged."""
    out: dict[str, float | None] = {}
    for rec in shim_records(b, offset, cid):
        msg = str(rec.get("msg", ""))
        when = datetime.fromisoformat(str(rec["time"])).timestamp() if "time" in rec else None
        if msg == "created" and when is not None:
            out["shim_created_after_s"] = round(when - t0_wall, 3)
        elif rec.get("runc_verb") in ("checkpoint", "restore") and "duration_s" in rec:
            out[f"shim_runc_{rec['runc_verb']}_s"] = round(float(rec["duration_s"]), 3)
        elif msg in ("restored from checkpoint", "exited") and when is not None:
            out[f"shim_{msg.replace(' ', '_')}_after_s"] = round(when - t0_wall, 3)
    return out


class TaskWaiter:
    """containerd's Tasks.Wait RPC, in flight in the background. No bindings for
    containerd's services exist in the repo (see the harness's tasks_api.py), and the
    messages are tiny, so they are encoded by hand from api/services/tasks/v1/tasks.proto:
    WaitRequest {string container_id = 1; string exec_id = 2;},
    WaitResponse {uint32 exit_status = 1; google.protobuf.Timestamp exited_at = 2;}."""

    def __init__(self, socket: Path, namespace: str, cid: str) -> None:
        import grpc  # type: ignore[import-untyped]

        self._channel = grpc.insecure_channel(f"unix://{socket}")
        call = self._channel.unary_unary(
            "/containerd.services.tasks.v1.Tasks/Wait",
            request_serializer=lambda b: b,
            response_deserializer=lambda b: b,
        )
        name = cid.encode()
        if len(name) > 127:
            raise ValueError(f"container id {cid!r} too long for the one-byte length")
        request = bytes([0x0A, len(name)]) + name
        self._future = call.future(
            request, metadata=[("containerd-namespace", namespace)], timeout=900
        )

    def __enter__(self) -> TaskWaiter:
        return self

    def __exit__(self, *exc: object) -> None:
        self._future.cancel()
        self._channel.close()

    def done(self) -> bool:
        return bool(self._future.done())

    def result(self, timeout: float | None = None) -> int:
        """The exit status (field 1, a varint; absent when 0)."""
        data: bytes = self._future.result(timeout=timeout)
        if not data or data[0] != 0x08:
            return 0
        value, shift = 0, 0
        for byte in data[1:]:
            value |= (byte & 0x7F) << shift
            shift += 7
            if not byte & 0x80:
                break
        return value


@dataclass
class CedanaSide:
    b: Bench
    ctr: Any  # harness Ctr
    cleanup: Cleanup

    def task_pid(self, cid: str) -> int:
        row = self.ctr.task(cid)
        if row is None or row.status != "RUNNING":
            raise BenchFailure(f"task {cid} is {row.status if row else 'missing'}, not RUNNING")
        return int(row.pid)

    def start(self, cid: str, label: str) -> tuple[float, int, dict[str, float | None]]:
        """`ctr run -d` with the label; returns (seconds until it returned, pid, the
        shim's own timings)."""
        self.cleanup.push(f"ctr remove {cid}", lambda: self.ctr.remove(cid))
        argv = self.ctr.argv(
            "run", "-d", "--runtime", CEDANA, "--env", f"CEDANA_CHECKPOINT={label}",
            IMAGE_REF, cid,
        )  # fmt: skip
        offset = self.b.containerd.log_offset()
        t0_wall = time.time()
        t0 = time.perf_counter()
        proc = subprocess.run(
            argv, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=600
        )
        elapsed = time.perf_counter() - t0
        if proc.returncode != 0:
            raise BenchFailure(f"{' '.join(argv)} -> exit {proc.returncode}\nstderr: {proc.stderr}")
        pid = self.task_pid(cid)
        return elapsed, pid, shim_breakdown(self.b, offset, cid, t0_wall)

    def criu_restore(self, cid: str, offset: int) -> dict[str, Any]:
        return shim_criu(self.b, offset, cid, "restored from checkpoint")

    def stop_with_checkpoint(self, cid: str, label: str) -> dict[str, Any]:
        # containerd's Tasks.Wait (what `ctr run` waits with; ctr has no `task wait`
        # command) is in flight before the kill and returns when the exit is reported.
        with TaskWaiter(self.b.containerd.socket, NAMESPACE, cid) as waiter:
            time.sleep(0.3)
            if waiter.done():
                raise BenchFailure(f"Tasks.Wait {cid} returned before the kill: {waiter.result()}")
            kill = self.ctr.argv("task", "kill", "-s", "SIGTERM", cid)
            offset = self.b.containerd.log_offset()
            t0_wall = time.time()
            t0 = time.perf_counter()
            subprocess.run(kill, stdin=subprocess.DEVNULL, capture_output=True, check=True)
            t_kill = time.perf_counter() - t0
            exit_status = waiter.result(timeout=600)
            t_exit = time.perf_counter() - t0
        listed_at_exit = store_checkpoint(self.b.store, label) is not None
        durable = wait_until(
            f"checkpoint {label} in the store",
            lambda: store_checkpoint(self.b.store, label),
            300,
            interval=0.01,
        )
        t_durable = time.perf_counter() - t0
        entry = wait_until(
            f"checkpoint {label} compacted",
            lambda: (e := store_checkpoint(self.b.store, label)) and e["compacted"] and e,
            300,
            interval=0.02,
        )
        t_compacted = time.perf_counter() - t0
        if durable["id"] != entry["id"]:
            raise BenchFailure(f"two checkpoints of {label}: {durable['id']}, {entry['id']}")
        status = self.ctr.task(cid)
        return {
            "seconds": t_exit,
            "kill_returned_s": t_kill,
            # listed in index.json (restorable): at the exit since the durable stop
            "committed_s": t_exit if listed_at_exit else t_durable,
            "committed_at_exit": listed_at_exit,
            "compacted_s": t_compacted,
            "exit_status": exit_status,
            "task_after": status.status if status else None,
            "store": entry,
            "criu": shim_criu(self.b, offset, cid, "checkpoint committed"),
            **shim_breakdown(self.b, offset, cid, t0_wall),
        }

    def kill_to_resumed(
        self, cid: str, cid_next: str, label: str, previous: str
    ) -> dict[str, float | None]:
        """From `ctr task kill -s SIGTERM` of a running container of the label until the
        next container of the label is RUNNING again from the stop's checkpoint: what a
        user waits for. The next container is started as soon as a new checkpoint of
        the label is restorable (at once when it was durable before the exit). Also
        where the time went: the exit, the checkpoint listed, and the next container's
        `ctr run` split by the shim's log."""
        with TaskWaiter(self.b.containerd.socket, NAMESPACE, cid) as waiter:
            time.sleep(0.3)
            kill = self.ctr.argv("task", "kill", "-s", "SIGTERM", cid)
            offset = self.b.containerd.log_offset()
            t0_wall = time.time()
            t0 = time.perf_counter()
            subprocess.run(kill, stdin=subprocess.DEVNULL, capture_output=True, check=True)
            waiter.result(timeout=600)
            t_exit = time.perf_counter() - t0
        wait_until(
            f"a new checkpoint of {label}",
            lambda: (e := store_checkpoint(self.b.store, label)) and e["id"] != previous,
            300,
            interval=0.005,
        )
        t_listed = time.perf_counter() - t0
        # A new container, as kubelet would start one; the clock stops when `ctr run`
        # returns with it RUNNING (start() then reads its pid and the log).
        t_run = time.perf_counter() - t0
        run_s, _, breakdown = self.start(cid_next, label)
        elapsed = t_run + run_s
        stop = shim_breakdown(self.b, offset, cid, t0_wall)
        frozen = shim_criu(self.b, offset, cid, "checkpoint committed").get("frozen_s")
        self.ctr.remove(cid)
        return {
            "seconds": elapsed,
            "exit_s": round(t_exit, 3),
            "listed_s": round(t_listed, 3),
            "stop_runc_checkpoint_s": stop.get("shim_runc_checkpoint_s"),
            "stop_criu_frozen_s": frozen,
            "next_run_s": round(run_s, 3),
            **breakdown,
        }


# -- runc side ---------------------------------------------------------------------------


@dataclass
class RuncSide:
    root: Path  # our own runc state root: nothing host-global
    template: Path
    workdir: Path
    cgroup_parent: str
    cleanup: Cleanup

    @property
    def env(self) -> dict[str, str]:
        return {**os.environ, "PATH": RUNC_PATH}

    def runc(self, *args: str) -> list[str]:
        return ["runc", "--root", str(self.root), *args]

    def bundle(self, rid: str) -> Path:
        bundle = self.workdir / f"bundle-{rid}"
        shutil.copytree(self.template, bundle, symlinks=True)
        config = json.loads((bundle / "config.json").read_text())
        config["process"]["terminal"] = False
        config["root"]["readonly"] = False
        config.setdefault("linux", {})["cgroupsPath"] = f"/{self.cgroup_parent}/{rid}"
        (bundle / "config.json").write_text(json.dumps(config))
        return bundle

    def timed(self, argv: list[str]) -> float:
        """Run a runc command with all stdio on /dev/null (for `run -d`/`restore -d`
        the container inherits it: a pipe or a host file would be an external fd for
        CRIU, and a pipe would never see EOF); errors go to runc's --log file."""
        log = self.workdir / "runc.log"
        log.unlink(missing_ok=True)
        argv = [argv[0], "--log", str(log), "--log-format", "json", *argv[1:]]
        t0 = time.perf_counter()
        proc = subprocess.run(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            timeout=600,
            env=self.env,
            check=False,
        )
        elapsed = time.perf_counter() - t0
        if proc.returncode != 0:
            text = log.read_text() if log.exists() else ""
            raise BenchFailure(f"{' '.join(argv)} -> exit {proc.returncode}:\n{text[-4000:]}")
        return elapsed

    def pid(self, rid: str) -> int:
        state = json.loads(run(self.runc("state", rid), env=self.env))
        if state.get("status") != "running":
            raise BenchFailure(f"runc container {rid} is {state.get('status')}")
        return int(state["pid"])

    def remove(self, rid: str) -> None:
        subprocess.run(self.runc("kill", rid, "KILL"), capture_output=True, check=False)
        time.sleep(0.1)
        subprocess.run(self.runc("delete", "--force", rid), capture_output=True, check=False)

    def start(self, rid: str, bundle: Path) -> tuple[float, int]:
        self.cleanup.push(f"runc delete {rid}", lambda: self.remove(rid))
        elapsed = self.timed(self.runc("run", "-d", "--bundle", str(bundle), rid))
        return elapsed, self.pid(rid)

    def checkpoint(self, rid: str, images: Path, work: Path) -> float:
        images.mkdir(parents=True)
        work.mkdir(parents=True)
        argv = self.runc("checkpoint", "--image-path", str(images), "--work-path", str(work), rid)
        return self.timed(argv)

    def restore(self, rid: str, bundle: Path, images: Path, work: Path) -> float:
        work.mkdir(parents=True)
        argv = self.runc(
            "restore", "-d", "--image-path", str(images), "--work-path", str(work),
            "--bundle", str(bundle), rid,
        )  # fmt: skip
        return self.timed(argv)

    def remove_cgroups(self) -> None:
        remove_cgroup_tree(self.cgroup_parent)


def memhog_sides(b: Bench, cleanup: Cleanup, mib: int, name: str) -> tuple[RuncSide, CedanaSide]:
    """The memhog image filling ``mib`` MiB, imported into the private containerd for
    the cedana side and unpacked as a bundle template for the runc side (its state,
    bundles and images under ``<work dir>/runc``, its cgroups under
    ``cedana-bench-<name>-*``, all removed by ``cleanup``)."""
    work = b.root / "runc"
    work.mkdir()
    memhog = build_memhog(b.root)
    archive, template = build_image(b.root, memhog, mib)
    ctr = b.containerd.ctr(NAMESPACE)
    ctr("images", "import", str(archive), timeout=120)
    rc = RuncSide(
        root=work / "state",
        template=template,
        workdir=work,
        cgroup_parent=f"cedana-bench-{name}-{b.marker[:8]}",
        cleanup=cleanup,
    )
    cleanup.push("runc cgroups", rc.remove_cgroups)
    b.store.mkdir(mode=0o700, parents=True, exist_ok=True)
    return rc, CedanaSide(b, ctr, cleanup)


# -- main ----------------------------------------------------------------------------------


def one_run(
    i: int, b: Bench, ced: CedanaSide, rc: RuncSide, mib: int, drop_caches: bool
) -> dict[str, Any]:
    """One full cycle per side (start, fill, checkpoint, restore, clean up), cedana's
    first in even runs and runc's first in odd runs. Each cycle removes what it wrote
    before the other starts, so neither inherits the other's page cache."""
    label = f"bench-{b.marker[:8]}-{i}"
    cid, cid_restored, rid = f"bench-cr-{i}", f"bench-cr-{i}-restored", f"bench-cr-runc-{i}"
    out: dict[str, Any] = {"label": label, "first": "cedana" if i % 2 == 0 else "runc"}

    def settle(gap: float = 0.5) -> None:
        """Flush what earlier steps left dirty, so that its writeback is not charged to
        the next timed step (and with --drop-caches, empty the page cache). Before a
        restore the gap is longer: memhog re-verifies its memory only after a clock
        jump of over a second."""
        t0 = time.monotonic()
        os.sync()
        if drop_caches:
            Path("/proc/sys/vm/drop_caches").write_text("3\n")
        time.sleep(max(0.0, gap - (time.monotonic() - t0)))

    def cedana_cycle() -> None:
        offset = b.containerd.log_offset()
        try:
            cold_s, pid, _ = ced.start(cid, label)
            out["cedana_cold_start_s"] = cold_s
            wait_filled(pid, f"cedana container {cid}")
            out["cedana_rss_before_mib"] = round(rss_bytes(pid) / MIB, 1)
            settle()
            before = read_beat(pid)
            out["cedana_stop"] = stop = ced.stop_with_checkpoint(cid, label)
            out["cedana_cli"] = cli_checkpoint(b.store, label)
            ced.ctr.remove(cid)
            settle(RESTORE_GAP)
            restore_offset = b.containerd.log_offset()
            restore_s, pid, breakdown = ced.start(cid_restored, label)
            out["cedana_restore"] = {
                "seconds": restore_s,
                "criu": ced.criu_restore(cid_restored, restore_offset),
                **breakdown,
                **check_resumed(pid, before, mib, f"cedana container {cid_restored}"),
            }
            before = read_beat(pid)
            settle()
            again = f"{cid}-again"
            resumed = ced.kill_to_resumed(cid_restored, again, label, stop["store"]["id"])
            out["cedana_kill_to_resumed"] = {
                **resumed,
                **check_resumed(ced.task_pid(again), before, mib, f"cedana container {again}"),
            }
            ced.ctr.remove(again)
            listing = [str(CEDANA_CLI), "--store", str(b.store), "checkpoints", "list"]
            for entry in json.loads(run([*listing, "-l", label, "--json"])):
                cli_remove(b.store, entry["id"])
        except Exception as err:
            excerpt = shim_log_excerpt(b, offset, [cid, cid_restored, f"{cid}-again", label])
            raise BenchFailure(
                f"{err}\n--- containerd log ({b.containerd.log_path}), lines about "
                f"{cid}/{cid_restored} and warnings/errors ---\n{excerpt}"
            ) from None

    def runc_cycle() -> None:
        # Imported here: the module is loaded before ensure_venv() re-executes under the
        # venv's Python, which has cedana_shim.
        from cedana_shim.runtime.criu_stats import dump_stats, restore_stats

        bundle = rc.bundle(rid)
        images = rc.workdir / f"images-{rid}"
        cold_s, pid = rc.start(rid, bundle)
        out["runc_cold_start_s"] = cold_s
        wait_filled(pid, f"runc container {rid}")
        out["runc_rss_before_mib"] = round(rss_bytes(pid) / MIB, 1)
        settle()
        before = read_beat(pid)
        dump_work = rc.workdir / f"dump-work-{rid}"
        out["runc_checkpoint"] = {
            "seconds": rc.checkpoint(rid, images, dump_work),
            # What a durable stop costs plain runc: its images fsynced right after it.
            "fsync_s": fsync_tree(images),
            "images_bytes": du_bytes(images),
            "criu": dump_stats(str(dump_work)),
        }
        settle(RESTORE_GAP)
        restore_work = rc.workdir / f"restore-work-{rid}"
        restore_s = rc.restore(rid, bundle, images, restore_work)
        out["runc_restore"] = {
            "seconds": restore_s,
            "criu": restore_stats(str(restore_work)),
            **check_resumed(rc.pid(rid), before, mib, f"runc container {rid}"),
        }
        before = read_beat(rc.pid(rid))
        settle()
        again = rc.workdir / f"images-{rid}-again"
        seconds = rc.checkpoint(rid, again, rc.workdir / f"dump-work-{rid}-again")
        seconds += rc.restore(rid, bundle, again, rc.workdir / f"restore-work-{rid}-again")
        out["runc_kill_to_resumed"] = {
            "seconds": seconds,
            **check_resumed(rc.pid(rid), before, mib, f"runc container {rid} again"),
        }
        # The same with the images made durable between the two, as the shim's are.
        before = read_beat(rc.pid(rid))
        settle()
        durable = rc.workdir / f"images-{rid}-durable"
        seconds = rc.checkpoint(rid, durable, rc.workdir / f"dump-work-{rid}-durable")
        seconds += fsync_tree(durable)
        seconds += rc.restore(rid, bundle, durable, rc.workdir / f"restore-work-{rid}-durable")
        out["runc_durable_kill_to_resumed"] = {
            "seconds": seconds,
            **check_resumed(rc.pid(rid), before, mib, f"runc container {rid} durable"),
        }
        rc.remove(rid)
        for path in (bundle, images, again, durable):
            shutil.rmtree(path, ignore_errors=True)

    for cycle in (cedana_cycle, runc_cycle) if i % 2 == 0 else (runc_cycle, cedana_cycle):
        cycle()
    return out


def main() -> int:
    parser = base_parser(__doc__ or "", default_runs=5)
    parser.add_argument("--mem-mib", type=int, default=1024, help="memory the workload fills")
    parser.add_argument(
        "--warmup", type=int, default=1, help="discarded full runs first (default 1)"
    )
    parser.add_argument(
        "--drop-caches",
        action="store_true",
        help="empty the page cache (whole machine!) before every timed step: restores "
        "then read their images from disk",
    )
    args = parser.parse_args()
    if args.runs < 1 or args.mem_mib < 1 or args.warmup < 0:
        parser.error("--runs and --mem-mib must be >= 1, --warmup >= 0")
    ensure_venv()
    require_root()
    install_signal_handlers()

    report = Report(
        "checkpoint_restore",
        {
            "runs": args.runs,
            "warmup_runs": args.warmup,
            "mem_mib": args.mem_mib,
            "drop_caches": args.drop_caches,
            "load_jobs": args.load,
            "containerd": args.containerd,
            "workload": "static C program: N MiB, each page half xorshift random, half a "
            "repeated 64-byte pattern; heartbeat every 100 ms",
            "order": "per run one full cycle per side (start, fill, checkpoint, restore, "
            "clean up); cedana's cycle first in even runs, runc's in odd runs; `sync` "
            "before each timed step",
        },
    )
    runs: list[dict[str, Any]] = []
    cleanup = Cleanup()
    try:
        with private_containerd(args.containerd, cleanup, (NAMESPACE,), keep=args.keep) as b:
            report.params["containerd_full"] = b.version.full
            if args.load:
                report.params["load_pids"] = start_cpu_load(args.load, cleanup)
            report.params["containerd_log"] = str(b.containerd.log_path)
            rc, ced = memhog_sides(b, cleanup, args.mem_mib, "runc")
            work = rc.workdir
            report.params["cedana_store"] = str(b.store)
            report.params["runc_images"] = str(work)
            fs = {
                side: run(["findmnt", "-n", "-o", "SOURCE,FSTYPE", "-T", str(path)]).strip()
                for side, path in (("cedana", b.store), ("runc", work))
            }
            report.params["filesystem"] = fs
            print(
                f"cedana store: {b.store} ({fs['cedana']})\n"
                f"runc images:  {work}/images-* ({fs['runc']})"
            )
            if fs["cedana"] != fs["runc"]:
                report.notes.append(f"store and runc images on different filesystems: {fs}")
            total = args.warmup + args.runs
            for i in range(total):
                r = one_run(i, b, ced, rc, args.mem_mib, args.drop_caches)
                warm = i >= args.warmup
                if warm:
                    runs.append(r)
                print(
                    f"run {i + 1}/{total} ({r['first']} first"
                    f"{'' if warm else ', warm-up, discarded'}): stop+checkpoint cedana "
                    f"{r['cedana_stop']['seconds']:.2f}s (committed "
                    f"{r['cedana_stop']['committed_s']:.2f}s, compacted "
                    f"{r['cedana_stop']['compacted_s']:.2f}s) / runc "
                    f"{r['runc_checkpoint']['seconds']:.2f}s; restore cedana "
                    f"{r['cedana_restore']['seconds']:.2f}s / runc "
                    f"{r['runc_restore']['seconds']:.2f}s; kill->resumed cedana "
                    f"{r['cedana_kill_to_resumed']['seconds']:.2f}s / runc "
                    f"{r['runc_kill_to_resumed']['seconds']:.2f}s; bytes cedana "
                    f"{r['cedana_stop']['store']['stored_bytes'] / MIB:.0f} MiB / raw "
                    f"{r['runc_checkpoint']['images_bytes'] / MIB:.0f} MiB"
                )
    finally:
        cleanup.run()

    def col(path: tuple[str, str]) -> list[float]:
        return [float(r[path[0]][path[1]]) for r in runs]

    ckpt_c, ckpt_r = (
        summarize(col(("cedana_stop", "seconds"))),
        summarize(col(("runc_checkpoint", "seconds"))),
    )
    durable_r = summarize(
        [r["runc_checkpoint"]["seconds"] + r["runc_checkpoint"]["fsync_s"] for r in runs]
    )
    durable_ratio = ratio(ckpt_c.median, durable_r.median)
    commit_c = summarize(col(("cedana_stop", "committed_s")))
    compact_c = summarize(col(("cedana_stop", "compacted_s")))
    resumed_c, resumed_r = (
        summarize(col(("cedana_kill_to_resumed", "seconds"))),
        summarize(col(("runc_kill_to_resumed", "seconds"))),
    )
    resumed_ratio = ratio(resumed_c.median, resumed_r.median)
    resumed_d = summarize(col(("runc_durable_kill_to_resumed", "seconds")))
    resumed_d_ratio = ratio(resumed_c.median, resumed_d.median)
    at_exit = sum(1 for r in runs if r["cedana_stop"].get("committed_at_exit"))
    rest_c, rest_r = (
        summarize(col(("cedana_restore", "seconds"))),
        summarize(col(("runc_restore", "seconds"))),
    )

    def shim(side: str, key: str) -> Summary:
        return summarize([float(v) for r in runs if (v := r[side].get(key)) is not None])

    def criu(side: str, key: str) -> Summary:
        return summarize(
            [float(v) for r in runs if (v := (r[side].get("criu") or {}).get(key)) is not None]
        )

    # Where (d)'s time goes: the kill -> exit, -> the checkpoint listed, the next
    # container's `ctr run`, and inside it the shim's Create and its runc restore.
    resumed_split = {
        key: shim("cedana_kill_to_resumed", key)
        for key in (
            "exit_s", "stop_runc_checkpoint_s", "stop_criu_frozen_s", "listed_s",
            "next_run_s", "shim_created_after_s", "shim_runc_restore_s",
        )
    }  # fmt: skip
    criu_keys = ("freezing_s", "frozen_s", "memdump_s", "memwrite_s", "pages_written")
    criu_dump = {key: (criu("cedana_stop", key), criu("runc_checkpoint", key)) for key in criu_keys}
    criu_restore_keys = ("forking_s", "restore_s", "pages_restored")
    criu_restore = {
        key: (criu("cedana_restore", key), criu("runc_restore", key)) for key in criu_restore_keys
    }

    # Inside the shim, from its own log: the runc/CRIU part of each operation, and for
    # the restore how long Create took (checkpoint verified, CRIU images unpacked).
    shim_dump = shim("cedana_stop", "shim_runc_checkpoint_s")
    shim_created = shim("cedana_restore", "shim_created_after_s")
    shim_restore = shim("cedana_restore", "shim_runc_restore_s")
    cold_c = summarize([float(r["cedana_cold_start_s"]) for r in runs])
    cold_r = summarize([float(r["runc_cold_start_s"]) for r in runs])
    stored = summarize([r["cedana_stop"]["store"]["stored_bytes"] / MIB for r in runs])
    raw = summarize([r["runc_checkpoint"]["images_bytes"] / MIB for r in runs])
    ckpt_ratio = ratio(ckpt_c.median, ckpt_r.median)
    rest_ratio = ratio(rest_c.median, rest_r.median)
    bytes_ratio = ratio(stored.median, raw.median)
    # Cross-check with the admin CLI, when it exists: its size, and the criu layer's
    # uncompressed (tar) size next to its stored size.
    cli = [r["cedana_cli"] for r in runs if r.get("cedana_cli")]
    cli_size = summarize([float(c["size"]) / MIB for c in cli])
    criu_raw = summarize(
        [float(x["rawSize"]) / MIB for c in cli for x in c["layers"] if x["name"] == "criu"]
    )

    print(
        f"\n{args.mem_mib} MiB workload, containerd {args.containerd}, {args.runs} runs "
        "(median, min-max)"
    )

    def cell(s: Any, unit: str = "s", digits: int = 2) -> str:
        return f"{s.median:.{digits}f}{unit} ({s.min:.{digits}f}-{s.max:.{digits}f})"

    def criu_cell(key: str, s: Summary) -> str:
        return cell(s, "", 0) if key.startswith("pages") else cell(s, "s", 3)

    def criu_rows(stats: dict[str, tuple[Summary, Summary]], source: str) -> list[list[str]]:
        """One row per CRIU figure both sides reported."""
        return [
            [
                f"    CRIU {key.removesuffix('_s').replace('_', ' ')}",
                criu_cell(key, c),
                criu_cell(key, r),
                f"{ratio(c.median, r.median):.2f}" if r.median else "",
                f"({source})",
            ]
            for key, (c, r) in stats.items()
            if c.n and r.n
        ]

    print_table(
        ["measure", "cedana", "runc", "cedana/runc", "target"],
        [
            [
                "(a) stop with checkpoint",
                cell(ckpt_c),
                cell(ckpt_r),
                f"{ckpt_ratio:.2f}",
                f"<= {TARGET_RATIO}: {verdict(ckpt_ratio, TARGET_RATIO)}",
            ],
            [
                "    of which runc checkpoint",
                cell(shim_dump),
                cell(ckpt_r),
                f"{ratio(shim_dump.median, ckpt_r.median):.2f}",
                "(shim log: its runc call)",
            ],
            *criu_rows(criu_dump, "stats-dump"),
            [
                "    against runc + fsync",
                cell(ckpt_c),
                cell(durable_r),
                f"{durable_ratio:.2f}",
                "(runc's images made durable after it)",
            ],
            [
                "    until committed",
                cell(commit_c),
                "n/a",
                "",
                f"(restorable at the exit in {at_exit}/{len(runs)} runs)",
            ],
            ["    until compacted", cell(compact_c), "n/a", "", "(background, after exit)"],
            [
                "(b) restore",
                cell(rest_c),
                cell(rest_r),
                f"{rest_ratio:.2f}",
                f"<= {TARGET_RATIO}: {verdict(rest_ratio, TARGET_RATIO)}",
            ],
            *criu_rows(criu_restore, "stats-restore"),
            [
                "    until shim Create done",
                cell(shim_created),
                "n/a",
                "",
                "(verify + unpack checkpoint)",
            ],
            [
                "    of which runc restore",
                cell(shim_restore),
                cell(rest_r),
                f"{ratio(shim_restore.median, rest_r.median):.2f}",
                "(shim log: its runc call)",
            ],
            [
                "    context: cold start",
                cell(cold_c),
                cell(cold_r),
                f"{ratio(cold_c.median, cold_r.median):.2f}",
                "(ctr run -d / runc run -d)",
            ],
            [
                "(d) kill -> resumed",
                cell(resumed_c),
                cell(resumed_r),
                f"{resumed_ratio:.2f}",
                f"<= {TARGET_RATIO}: {verdict(resumed_ratio, TARGET_RATIO)}",
            ],
            [
                "    against runc + fsync",
                cell(resumed_c),
                cell(resumed_d),
                f"{resumed_d_ratio:.2f}",
                "(checkpoint, fsync, restore)",
            ],
            *[
                [f"    cedana {key.removesuffix('_s').replace('_', ' ')}", cell(s), "", "", ""]
                for key, s in resumed_split.items()
                if s.n
            ],
            [
                "(c) checkpoint bytes",
                cell(stored, " MiB", 0),
                cell(raw, " MiB", 0),
                f"{bytes_ratio:.2f}",
                "(reported)",
            ],
            [
                "    per `cedana checkpoints`",
                cell(cli_size, " MiB", 0) if cli else "CLI missing",
                "",
                "",
                f"(criu layer uncompressed {criu_raw.median:.0f} MiB)" if cli else "",
            ],
        ],
    )
    report.results = {
        "unit": "seconds; bytes in MiB",
        "stop_with_checkpoint": {
            "cedana": ckpt_c.as_dict(),
            "runc": ckpt_r.as_dict(),
            "ratio_median": round(ckpt_ratio, 3),
            "meets_target": ckpt_ratio <= TARGET_RATIO,
            "runc_then_fsync": {
                "what": "runc checkpoint, then fdatasync of every image file (what a "
                "durable stop costs plain runc; the writeback does not overlap the dump)",
                "runc": durable_r.as_dict(),
                "ratio_median": round(durable_ratio, 3),
            },
            "cedana_until_committed": commit_c.as_dict(),
            "cedana_committed_at_exit_runs": at_exit,
            "cedana_until_compacted": compact_c.as_dict(),
            "cedana_shim_runc_checkpoint": shim_dump.as_dict(),
            "criu_stats_dump": {
                key: {"cedana": c.as_dict(), "runc": r.as_dict()}
                for key, (c, r) in criu_dump.items()
                if c.n and r.n
            },
        },
        "restore": {
            "cedana": rest_c.as_dict(),
            "runc": rest_r.as_dict(),
            "ratio_median": round(rest_ratio, 3),
            "meets_target": rest_ratio <= TARGET_RATIO,
            "cedana_until_shim_created": shim_created.as_dict(),
            "cedana_shim_runc_restore": shim_restore.as_dict(),
            "criu_stats_restore": {
                key: {"cedana": c.as_dict(), "runc": r.as_dict()}
                for key, (c, r) in criu_restore.items()
                if c.n and r.n
            },
        },
        "kill_to_resumed": {
            "what": "cedana: `ctr task kill -s SIGTERM` until the next container of the label "
            "is RUNNING from the stop's checkpoint (started as soon as that checkpoint is "
            "listed); runc: `runc checkpoint` + `runc restore` of the same container",
            "cedana": resumed_c.as_dict(),
            "runc": resumed_r.as_dict(),
            "ratio_median": round(resumed_ratio, 3),
            "meets_target": resumed_ratio <= TARGET_RATIO,
            "cedana_split": {key: s.as_dict() for key, s in resumed_split.items() if s.n},
            "runc_then_fsync": {
                "what": "runc checkpoint, fdatasync of every image file, runc restore",
                "runc": resumed_d.as_dict(),
                "ratio_median": round(resumed_d_ratio, 3),
            },
        },
        "cold_start_context": {
            "what": "cedana: `ctr run -d` of the same container before any checkpoint of its "
            "label exists; runc: `runc run -d` of the bundle",
            "cedana": cold_c.as_dict(),
            "runc": cold_r.as_dict(),
        },
        "bytes": {
            "cedana_stored_mib": stored.as_dict(1),
            "runc_raw_images_mib": raw.as_dict(1),
            "ratio_median": round(bytes_ratio, 3),
            "cedana_cli_size_mib": cli_size.as_dict(1) if cli else None,
            "cedana_criu_layer_uncompressed_mib": criu_raw.as_dict(1) if cli else None,
        },
        "target_ratio": TARGET_RATIO,
        "runs": runs,
    }
    report.notes.append(
        "both sides write to the same ext4 filesystem; runc's images are plain files "
        "(page cache, no fsync); the cedana store fsyncs the raw images before the exit "
        "(durable stop) and compresses them after it"
    )
    report.notes.append(
        "--drop-caches: the page cache was emptied before every timed step, so restores "
        "read their images from disk"
        if args.drop_caches
        else "restores read from a warm page cache on both sides (images/blobs just written)"
    )
    report.write(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
