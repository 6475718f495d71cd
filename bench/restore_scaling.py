"""Restore time against memory size: how long a restored workload takes to run again
(its first heartbeat after the restore), at 1, 4 and 8 GiB, for the cedana shim with
lazy restore (node config `lazy_restore`) and without, and for plain runc, eager and
lazy (`criu lazy-pages` + `runc restore --lazy-pages`), interleaved.

    python bench/restore_scaling.py [--sizes 1024,4096,8192] [--runs 5] [--warmup 1]
        [--sides cedana-lazy,cedana-eager,runc-lazy,runc-eager]
        [--containerd 1.6|1.7|2.1] [--out results.json] [--keep]

The workload is bench/memhog.c (see bench/checkpoint_restore.py), N MiB touched; it
beats /hb every 100 ms and, after a clock jump (a restore), beats first and then
re-reads its whole buffer into /verify, so the first beat is the time to first
instruction and the verify line the time until every page was read.

Each sample is one full cycle of one side: start, fill, checkpoint, restore, check,
remove everything it wrote (container, images, checkpoint), so no two sides' memory
or images coexist (8 GiB twice would not fit this 24 GiB machine) and none inherits
another's page cache. Within a size, the sides take turns, the first one rotating from
run to run; `sync` and a 1.5 s pause come before every restore.

Measured from the start of the restore command:
    first beat      the workload's first heartbeat after the restore (time to first
                    instruction). cedana: from `ctr run -d` of the new container of
                    the label (its Create included: find, verify, unpack; the shim's
                    log gives when Create was done, reported as "from Start").
                    runc: from `runc restore -d`.
    returned        the restore command returned (cedana: the task is RUNNING, which
                    with lazy restore means every page is in and checked).
    all in          lazy runc: the lazy-pages daemon exited (every page copied).
    verified        memhog's own checksum of its whole memory, after the restore: "ok"
                    is required of every sample.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
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
    base_parser,
    ensure_venv,
    install_signal_handlers,
    load_average,
    print_table,
    private_containerd,
    require_root,
    summarize,
)
from checkpoint_restore import (
    CEDANA,
    IMAGE_REF,
    NAMESPACE,
    RUNC_PATH,
    BenchFailure,
    CedanaSide,
    RuncSide,
    cli_remove,
    memhog_sides,
    run,
    shim_breakdown,
    shim_log_excerpt,
    shim_records,
)

SIDES = ("cedana-lazy", "cedana-eager", "runc-lazy", "runc-eager")
TARGET_S = 1.0  # 4 GiB running again within a second (issue 15)
TARGET_MIB = 4096
FILL_TIMEOUT = 900.0  # memory never touched before is very slow on this VM
RESTORE_TIMEOUT = 600.0
VERIFY_TIMEOUT = 300.0  # memhog checks its memory (every page read) once it runs again
RESTORE_GAP = 1.5  # memhog re-verifies only after a clock jump of over a second
POLL = 0.002
MIB = 1 << 20


@dataclass(frozen=True)
class Beat:
    nonce: str
    count: int


def beat_at(path: Path) -> Beat | None:
    try:
        text = path.read_text().split()
    except OSError:
        return None
    return Beat(text[0], int(text[1])) if len(text) == 2 and text[1].isdigit() else None


def verify_lines(path: Path) -> list[str]:
    try:
        return [x for x in path.read_text().splitlines() if x.startswith("verify ")]
    except OSError:
        return []


def wait(what: str, predicate: Any, timeout: float, interval: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout
    while not (value := predicate()):
        if time.monotonic() > deadline:
            raise BenchFailure(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(interval)
    return value


def available_mib() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) // 1024
    return 0


def room_for(mib: int, what: str) -> None:
    """The workload and its images in the page cache, twice over at the restore (the
    restored memory and the images it came from), plus some room: else wait a while
    for other users of the machine, then give up rather than push it into OOM."""
    need = 2 * mib + 2048
    try:
        wait(
            f"{need} MiB available for {what} (the machine is shared)",
            lambda: available_mib() >= need,
            600,
            interval=5,
        )
    except BenchFailure as err:
        raise BenchFailure(f"{err}: only {available_mib()} MiB available") from None


class Timeline:
    """Polls the workload's /hb (and a process) from the restore command's start."""

    def __init__(self, hb: Path, verify: Path) -> None:
        self.hb = hb
        self.verify = verify
        self.t0 = time.perf_counter()

    def since(self) -> float:
        return round(time.perf_counter() - self.t0, 4)

    def follow(
        self, proc: subprocess.Popen[bytes], baseline: Beat | None, others: dict[str, Any]
    ) -> dict[str, Any]:
        """Until the first beat after `baseline` (the first one seen, if None), the
        command's exit and every process in `others` (name -> Popen) done; then until
        memhog's verify line."""
        out: dict[str, Any] = {}
        pending = dict(others)
        deadline = time.monotonic() + RESTORE_TIMEOUT
        while "first_beat_s" not in out or "returned_s" not in out or pending:
            now = beat_at(self.hb)
            if "first_beat_s" not in out and now is not None:
                if baseline is None:
                    baseline = now
                elif now.nonce == baseline.nonce and now.count > baseline.count:
                    out["first_beat_s"] = self.since()
                    out["beat_after"] = now.count
            if "returned_s" not in out and proc.poll() is not None:
                out["returned_s"] = self.since()
                if proc.returncode != 0:
                    raise BenchFailure(f"restore command exited {proc.returncode}")
            for name, other in list(pending.items()):
                if other.poll() is not None:
                    out[f"{name}_s"] = self.since()
                    out[f"{name}_exit"] = other.returncode
                    del pending[name]
            if time.monotonic() > deadline:
                raise BenchFailure(f"restore not done after {RESTORE_TIMEOUT:.0f}s: {out}")
            time.sleep(POLL)
        out["beat_before"] = baseline.count if baseline else None
        line = wait("memhog's verify line", lambda: verify_lines(self.verify), VERIFY_TIMEOUT)
        out["verified_s"] = self.since()
        out["verify"] = line[-1]
        if " ok " not in line[-1]:
            raise BenchFailure(f"memory came back different: {line[-1]!r}")
        return out


def settle(gap: float = 0.5) -> None:
    t0 = time.monotonic()
    os.sync()
    time.sleep(max(0.0, gap - (time.monotonic() - t0)))


# -- runc ----------------------------------------------------------------------------------


def runc_cycle(rc: RuncSide, rid: str, mib: int, lazy: bool) -> dict[str, Any]:
    bundle = rc.bundle(rid)
    config = json.loads((bundle / "config.json").read_text())
    config["process"]["args"] = ["/memhog", str(mib)]
    (bundle / "config.json").write_text(json.dumps(config))
    images, dump_work, restore_work = (rc.workdir / f"{x}-{rid}" for x in ("images", "dw", "rw"))
    hb, verify = bundle / "rootfs" / "hb", bundle / "rootfs" / "verify"
    try:
        rc.start(rid, bundle)
        wait(f"runc {rid} to fill {mib} MiB", lambda: beat_at(hb), FILL_TIMEOUT)
        settle()
        dump_s = rc.checkpoint(rid, images, dump_work)
        verify.unlink(missing_ok=True)  # only the restored process's lines count
        settle(RESTORE_GAP)
        restore_work.mkdir(parents=True)
        baseline = beat_at(hb)
        others: dict[str, Any] = {}
        log = rc.workdir / f"runc-{rid}.log"
        timeline = Timeline(hb, verify)
        if lazy:
            others["all_in"] = _lazy_pages_daemon(images, restore_work)
            out_ready = timeline.since()
        argv = rc.runc(
            "--log", str(log), "--log-format", "json", "restore", "-d",
            *(["--lazy-pages"] if lazy else []),
            "--image-path", str(images), "--work-path", str(restore_work),
            "--bundle", str(bundle), rid,
        )  # fmt: skip
        proc = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
            env={**os.environ, "PATH": RUNC_PATH},
        )
        try:
            out = timeline.follow(proc, baseline, others)
        except BenchFailure as err:
            text = log.read_text()[-3000:] if log.exists() else ""
            raise BenchFailure(f"runc {rid}: {err}\n{text}") from None
        if lazy:
            out["daemon_ready_s"] = out_ready
            if out.get("all_in_exit") != 0:
                raise BenchFailure(f"criu lazy-pages exited {out.get('all_in_exit')}")
        out["dump_s"] = round(dump_s, 4)
        return out
    finally:
        rc.remove(rid)
        for path in (bundle, images, dump_work, restore_work):
            shutil.rmtree(path, ignore_errors=True)


def _lazy_pages_daemon(images: Path, work: Path) -> subprocess.Popen[bytes]:
    """`criu lazy-pages` serving `images` on its socket in `work`, once it listens."""
    ready_r, ready_w = os.pipe()
    daemon = subprocess.Popen(
        ["criu", "lazy-pages", "--images-dir", str(images), "--work-dir", str(work),
         "--log-file", "lazy-pages.log", "--status-fd", str(ready_w)],
        pass_fds=(ready_w,),
        stdin=subprocess.DEVNULL,
        env={**os.environ, "PATH": RUNC_PATH},
    )  # fmt: skip
    os.close(ready_w)
    try:
        if os.read(ready_r, 1) != b"\0":
            daemon.wait(10)
            raise BenchFailure(f"criu lazy-pages exited {daemon.returncode} before listening")
    finally:
        os.close(ready_r)
    return daemon


# -- cedana --------------------------------------------------------------------------------


def set_lazy(config: Path, lazy: bool) -> None:
    """The node config the shims read (CEDANA_CONFIG): each container's daemon reads it
    when it starts."""
    config.write_text(f"lazy_restore = {'true' if lazy else 'false'}\n")


def cedana_cycle(b: Bench, ced: CedanaSide, tag: str, mib: int) -> dict[str, Any]:
    label = f"scale-{b.marker[:8]}-{tag}"
    cid, cid_restored = f"scale-{tag}", f"scale-{tag}-restored"
    offset = b.containerd.log_offset()
    try:
        ced.cleanup.push(f"ctr remove {cid}", lambda: ced.ctr.remove(cid))
        ced.ctr(*_run_args(cid, label, mib), timeout=120)
        pid = ced.task_pid(cid)
        root = Path(f"/proc/{pid}/root")
        wait(f"cedana {cid} to fill {mib} MiB", lambda: beat_at(root / "hb"), FILL_TIMEOUT)
        settle()
        stop = ced.stop_with_checkpoint(cid, label)
        ced.ctr.remove(cid)
        settle(RESTORE_GAP)
        out = timed_restore(b, ced, cid_restored, label, mib, offset)
        created = out["shim"].get("shim_created_after_s")
        if created is not None:
            out["first_beat_after_create_s"] = round(out["first_beat_s"] - created, 4)
        out["dump_s"] = round(stop["seconds"], 4)
        out["checkpoint"] = stop["store"]["id"]
        return out
    except Exception as err:
        excerpt = shim_log_excerpt(b, offset, [cid, cid_restored, label])
        raise BenchFailure(f"{err}\n--- containerd log, about {cid} ---\n{excerpt}") from None
    finally:
        ced.ctr.remove(cid_restored)
        ced.ctr.remove(cid)
        listing = [str(Path(sys.prefix) / "bin" / "cedana"), "--store", str(b.store)]
        for entry in json.loads(run([*listing, "checkpoints", "list", "-l", label, "--json"])):
            cli_remove(b.store, entry["id"])


def timed_restore(
    b: Bench, ced: CedanaSide, cid: str, label: str, mib: int, offset: int
) -> dict[str, Any]:
    """`ctr run -d` of container ``cid`` of ``label`` (a restore), followed from the
    command's start (Timeline: first beat, returned, verified), with the shim's steps
    and the memory path it took from ``b``'s log since ``offset``."""
    state = b.containerd.state / "io.containerd.runtime.v2.task" / NAMESPACE
    ced.cleanup.push(f"ctr remove {cid}", lambda: ced.ctr.remove(cid))
    rootfs = state / cid / "rootfs"
    t0_wall = time.time()
    timeline = Timeline(rootfs / "hb", rootfs / "verify")
    proc = subprocess.Popen(
        ced.ctr.argv(*_run_args(cid, label, mib)),
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    out = timeline.follow(proc, None, {})
    out["shim"] = shim_breakdown(b, offset, cid, t0_wall)
    memory = [
        r.get("memory")
        for r in shim_records(b, offset, cid)
        if r.get("msg") == "restored from checkpoint"
    ]
    out["memory"] = memory[-1] if memory else None
    return out


def _run_args(cid: str, label: str, mib: int) -> list[str]:
    return [
        "run", "-d", "--runtime", CEDANA, "--env", f"CEDANA_CHECKPOINT={label}",
        IMAGE_REF, cid, "/memhog", str(mib),
    ]  # fmt: skip


# -- main ----------------------------------------------------------------------------------


def one_sample(
    side: str, b: Bench, ced: CedanaSide, rc: RuncSide, config: Path, mib: int, tag: str
) -> dict[str, Any]:
    room_for(mib, f"{side} at {mib} MiB")
    load = load_average()
    if side.startswith("cedana"):
        set_lazy(config, side == "cedana-lazy")
        out = cedana_cycle(b, ced, tag, mib)
        want = "lazy" if side == "cedana-lazy" else "eager"
        if out["memory"] != want:
            raise BenchFailure(f"{side}: the shim restored {out['memory']!r}, not {want}")
    else:
        out = runc_cycle(rc, f"scale-runc-{tag}", mib, lazy=side == "runc-lazy")
    out["load_1m"] = load[0]
    return out


def print_sample(mib: int, i: int, side: str, warm: bool, r: dict[str, Any]) -> None:
    """One sample's line, as it is taken."""
    print(
        f"{datetime.now():%H:%M:%S} {mib} MiB run {i + 1} {side}"
        f"{'' if warm else ' (warm-up)'}: first beat "
        f"{r['first_beat_s']:.3f}s, returned {r['returned_s']:.3f}s, "
        f"verified {r['verified_s']:.3f}s (load {r['load_1m']:.2f})",
        flush=True,
    )


def main() -> int:
    parser = base_parser(__doc__ or "", default_runs=5)
    parser.add_argument("--sizes", default="1024,4096,8192", help="MiB the workload fills")
    parser.add_argument("--sides", default=",".join(SIDES), help=f"any of {', '.join(SIDES)}")
    parser.add_argument("--warmup", type=int, default=1, help="discarded runs first, per size")
    args = parser.parse_args()
    sizes = [int(x) for x in args.sizes.split(",") if x]
    sides = [x for x in args.sides.split(",") if x]
    if args.runs < 1 or args.warmup < 0 or not sizes or min(sizes) < 1:
        parser.error("--runs >= 1, --warmup >= 0, sizes >= 1 MiB")
    if unknown := set(sides) - set(SIDES):
        parser.error(f"unknown sides {sorted(unknown)}: pick from {', '.join(SIDES)}")
    ensure_venv()
    require_root()
    install_signal_handlers()
    report = Report(
        "restore_scaling",
        {
            "sizes_mib": sizes,
            "sides": sides,
            "runs": args.runs,
            "warmup_runs": args.warmup,
            "containerd": args.containerd,
            "workload": "bench/memhog.c: N MiB touched, heartbeat every 100 ms, beats "
            "first after a restore, then re-checksums its whole memory",
            "order": "per size, per run, one full cycle per side (start, fill, "
            "checkpoint, restore, check, remove); the first side rotates by run",
        },
    )
    samples: dict[str, dict[str, list[dict[str, Any]]]] = {
        str(m): {s: [] for s in sides} for m in sizes
    }
    cleanup = Cleanup()
    config = Path(f"/var/tmp/cedana-bench-restore-scaling-{os.getpid()}.toml")
    cleanup.push(f"remove {config}", lambda: config.unlink(missing_ok=True))
    set_lazy(config, False)
    os.environ["CEDANA_CONFIG"] = str(config)  # containerd, and so every shim, inherits it
    try:
        with private_containerd(args.containerd, cleanup, (NAMESPACE,), keep=args.keep) as b:
            report.params["containerd_full"] = b.version.full
            rc, ced = memhog_sides(b, cleanup, sizes[0], "scale")
            for mib in sizes:
                for i in range(args.warmup + args.runs):
                    order = sides[i % len(sides) :] + sides[: i % len(sides)]
                    for side in order:
                        tag = f"{mib}-{i}-{side}"
                        r = one_sample(side, b, ced, rc, config, mib, tag)
                        warm = i >= args.warmup
                        if warm:
                            samples[str(mib)][side].append(r)
                        print_sample(mib, i, side, warm, r)
    finally:
        cleanup.run()
        os.environ.pop("CEDANA_CONFIG", None)

    results: dict[str, Any] = {}
    rows = []
    for mib in sizes:
        per: dict[str, Any] = {}
        for side in sides:
            got = samples[str(mib)][side]

            def col(key: str, got: list[dict[str, Any]] = got) -> list[float]:
                return [float(r[key]) for r in got if r.get(key) is not None]

            stats = {
                key: summarize(col(key)).as_dict()
                for key in (
                    "first_beat_s",
                    "first_beat_after_create_s",
                    "returned_s",
                    "all_in_s",
                    "verified_s",
                    "dump_s",
                    "load_1m",
                )
                if col(key)
            }
            per[side] = {"summary": stats, "samples": got}
            first = stats["first_beat_s"]
            rows.append(
                [
                    f"{mib} MiB",
                    side,
                    f"{first['median']:.3f} ({first['min']:.3f}-{first['max']:.3f})",
                    _cell(stats.get("first_beat_after_create_s")),
                    _cell(stats.get("returned_s")),
                    _cell(stats.get("verified_s")),
                    f"{stats['load_1m']['min']:.2f}-{stats['load_1m']['max']:.2f}",
                    str(first["n"]),
                ]
            )
        results[str(mib)] = per
    print()
    print_table(
        ["size", "side", "first beat s", "from Start", "returned", "verified", "load", "n"],
        rows,
    )
    target = results.get(str(TARGET_MIB), {}).get("cedana-lazy")
    if target:
        median = target["summary"]["first_beat_s"]["median"]
        verdict = "meets" if median <= TARGET_S else "MISSES"
        print(f"\n{TARGET_MIB} MiB, cedana-lazy: first beat {median:.3f}s median, {verdict} "
              f"the target of {TARGET_S:g}s")  # fmt: skip
        results["target"] = {"mib": TARGET_MIB, "seconds": TARGET_S, "median": median}
    report.results = results
    report.notes.append(
        "cedana's first beat is counted from `ctr run -d` (container create, shim start, "
        "the shim's Create: find, verify, unpack); 'from Start' subtracts the moment the "
        "shim logged its Create done"
    )
    report.write(args.out)
    return 0


def _cell(s: dict[str, Any] | None) -> str:
    return "-" if not s else f"{s['median']:.3f} ({s['min']:.3f}-{s['max']:.3f})"


if __name__ == "__main__":
    sys.exit(main())
