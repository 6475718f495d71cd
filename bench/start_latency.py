"""Start latency: `ctr run --rm` of a trivial busybox container (`/bin/true`) with the
cedana runtime vs containerd's runc shim, interleaved, on one private containerd.

    python bench/start_latency.py [--runs 30] [--warmup 3] [--gap 0.5]
                                  [--containerd 1.6|1.7|2.1] [--out results.json]

Each sample is the wall time from spawning `ctr` to its exit: create the container
and snapshot, start the shim, create + start the task, wait for the exit, delete the
task, the shim and the container. Everything but the runtime is identical. A sample
starts `--gap` seconds after the previous one ended, so that what either runtime
does in the background after its `ctr` returned (a shim daemon exiting, the cedana
fork server forking its next spare, containerd's GC) does not run inside the other
runtime's sample.
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (
    Cleanup,
    Report,
    base_parser,
    ensure_venv,
    install_signal_handlers,
    is_fork_server,
    marked_processes,
    print_table,
    private_containerd,
    ratio,
    require_root,
    summarize,
    verdict,
)

NAMESPACE = "cedana-bench"
TARGET_RATIO = 1.25
RUNTIMES = {"cedana": "io.containerd.cedana.v2", "runc": "io.containerd.runc.v2"}


def forkservers(marker: str) -> set[int]:
    """The cedana fork servers this run's shims started (found by the env marker)."""
    return {pid for pid in marked_processes(marker) if is_fork_server(pid)}


def main() -> int:
    parser = base_parser(__doc__ or "", default_runs=30)
    parser.add_argument("--warmup", type=int, default=3, help="discarded runs per side")
    parser.add_argument(
        "--gap", type=float, default=0.5, help="idle seconds between samples (default 0.5)"
    )
    args = parser.parse_args()
    if args.runs < 1 or args.warmup < 0 or args.gap < 0:
        parser.error("--runs must be >= 1, --warmup and --gap >= 0")
    ensure_venv()
    require_root()
    install_signal_handlers()
    from tests.integration.harness.ctr import Ctr

    report = Report(
        "start_latency",
        {
            "runs_per_runtime": args.runs,
            "warmup_per_runtime": args.warmup,
            "containerd": args.containerd,
            "command": "ctr run --rm --runtime <type> busybox <id> /bin/true",
            "order": "interleaved: cedana, runc, cedana, runc, ...",
            "gap_s": args.gap,
        },
    )
    samples: dict[str, list[float]] = {name: [] for name in RUNTIMES}
    cold_forkserver_runs: list[int] = []
    cleanup = Cleanup()
    in_flight: list[tuple[Ctr, str]] = []
    try:
        with private_containerd(args.containerd, cleanup, (NAMESPACE,), keep=args.keep) as b:
            ctr: Ctr = b.containerd.ctr(NAMESPACE)
            report.params["containerd_full"] = b.version.full
            report.params["containerd_log"] = str(b.containerd.log_path)

            def remove_in_flight() -> None:
                for c, cid in in_flight:
                    c.remove(cid)

            cleanup.push("containers in flight", remove_in_flight)
            total = args.warmup + args.runs
            for i in range(total):
                for name, runtime_type in RUNTIMES.items():
                    cid = f"bench-start-{name}-{i}"
                    in_flight.append((ctr, cid))
                    before = forkservers(b.marker) if name == "cedana" else set()
                    argv = ctr.argv("run", "--rm", "--runtime", runtime_type)
                    argv += [b.images.busybox, cid, "/bin/true"]
                    t0 = time.perf_counter()
                    proc = subprocess.run(
                        argv, stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=60
                    )
                    elapsed = time.perf_counter() - t0
                    if proc.returncode != 0:
                        raise RuntimeError(
                            f"{' '.join(argv)} -> exit {proc.returncode}\n"
                            f"stdout: {proc.stdout}\nstderr: {proc.stderr}\n"
                            f"containerd log tail:\n{b.containerd.log_tail(40)}"
                        )
                    in_flight.remove((ctr, cid))
                    warm = i >= args.warmup
                    if name == "cedana" and forkservers(b.marker) - before:
                        cold_forkserver_runs.append(i)
                    if warm:
                        samples[name].append(elapsed)
                    tag = "" if warm else " (warm-up, discarded)"
                    print(f"run {i + 1:3d}/{total} {name:6s} {elapsed * 1000:7.1f} ms{tag}")
                    time.sleep(args.gap)
    finally:
        cleanup.run()

    stats = {name: summarize(s) for name, s in samples.items()}
    med_ratio = ratio(stats["cedana"].median, stats["runc"].median)
    p90_ratio = ratio(stats["cedana"].p90, stats["runc"].p90)
    print(f"\nctr run --rm /bin/true, containerd {args.containerd}, {args.runs} runs each")
    rows = []
    for name, st in stats.items():
        rows.append(
            [
                name,
                str(st.n),
                f"{st.median * 1000:.1f}",
                f"{st.p90 * 1000:.1f}",
                f"{st.min * 1000:.1f}",
                f"{st.max * 1000:.1f}",
                f"{st.stdev * 1000:.1f}",
            ]
        )
    print_table(["runtime", "n", "median ms", "p90 ms", "min ms", "max ms", "stdev ms"], rows)
    print(
        f"ratio cedana/runc: median {med_ratio:.3f}, p90 {p90_ratio:.3f} "
        f"(target <= {TARGET_RATIO}: {verdict(med_ratio, TARGET_RATIO)})"
    )
    report.results = {
        "unit": "seconds",
        "samples": {name: [round(x, 5) for x in s] for name, s in samples.items()},
        "summary": {name: st.as_dict(5) for name, st in stats.items()},
        "ratio_median": round(med_ratio, 4),
        "ratio_p90": round(p90_ratio, 4),
        "target_ratio": TARGET_RATIO,
        "meets_target": med_ratio <= TARGET_RATIO,
        "runs_that_started_a_fork_server": cold_forkserver_runs,
    }
    report.notes.append(
        f"{args.warmup} warm-up run(s) per runtime discarded (the first cedana start forks "
        "its daemon itself and spawns the warm fork server for the next ones)"
    )
    if any(i >= args.warmup for i in cold_forkserver_runs):
        report.notes.append(
            f"a new fork server was started during measured cedana runs {cold_forkserver_runs} "
            "(shim code changed on disk mid-run?): those runs took the cold path"
        )
    report.write(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
