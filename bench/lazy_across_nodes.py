"""Lazy restore on another node: time to first instruction on B when the checkpoint is
in the registry, with `lazy_restore` (CRIU's lazy-pages daemon fed from the registry
by the shim's page server) and, beside it, without (the whole checkpoint pulled first).

    python bench/lazy_across_nodes.py [--sizes 1024,4096] [--runs 3] [--warmup 0]
        [--sides lazy,eager] [--containerd 1.6|1.7|2.1] [--out results.json] [--keep]

Three containerds of this run share the host (see bench/across_nodes.py): A pushes
(`registry_sync = before-exit`), B restores with `lazy_restore = true`, E without; one
docker-registry on loopback (TLS, htpasswd). The workload is bench/memhog.c with N MiB
touched (see bench/restore_scaling.py: it beats /hb every 100 ms and, after a restore,
beats first and then re-checksums its whole memory into /verify). Per sample: A starts
the workload under a label of its own, waits for it to fill, stops it (the push done
before the exit), then B (or E) runs the next container of the label, with `sync` and
a pause before it. Measured from `ctr run -d` on B or E:

    first beat   the workload's first heartbeat after the restore (time to first
                 instruction: Create with its checks and the small pull included)
    returned     `ctr run -d` returned: RUNNING, which with lazy restore means every
                 page is in
    verified     memhog's checksum of its whole memory: "ok" is required

The restoring node's store is emptied after each sample (the next pulls again).
Indicative on a shared machine: the load average is reported with each sample.
"""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (
    Bench,
    Cleanup,
    Report,
    another_node,
    base_parser,
    ensure_venv,
    install_signal_handlers,
    load_average,
    print_table,
    private_containerd,
    require_root,
    summarize,
)

ensure_venv()

from _registry import start_registry  # noqa: E402
from checkpoint_restore import (  # noqa: E402
    NAMESPACE,
    BenchFailure,
    CedanaSide,
    build_image,
    build_memhog,
    cli_remove,
    run,
    shim_log_excerpt,
)
from restore_scaling import (  # noqa: E402
    FILL_TIMEOUT,
    RESTORE_GAP,
    _run_args,
    beat_at,
    print_sample,
    room_for,
    settle,
    timed_restore,
    wait,
)

SIDES = ("lazy", "eager")
TARGET_S = 1.5  # issue 30: 4 GiB running again on B within 1.5 s, flat in size


def checkpoint_on_a(a: CedanaSide, label: str, mib: int, tag: str) -> str:
    cid = f"lx-{tag}-a"
    a.cleanup.push(f"ctr remove {cid}", lambda: a.ctr.remove(cid))
    a.ctr(*_run_args(cid, label, mib), timeout=120)
    root = Path(f"/proc/{a.task_pid(cid)}/root")
    wait(f"A: {cid} to fill {mib} MiB", lambda: beat_at(root / "hb"), FILL_TIMEOUT)
    settle()
    stop = a.stop_with_checkpoint(cid, label)
    a.ctr.remove(cid)
    return str(stop["store"]["id"])


def restore_on(node: Bench, side: CedanaSide, label: str, mib: int, tag: str) -> dict[str, Any]:
    cid = f"lx-{tag}-r"
    offset = node.containerd.log_offset()
    try:
        return timed_restore(node, side, cid, label, mib, offset)
    except Exception as err:
        excerpt = shim_log_excerpt(node, offset, [cid, label])
        raise BenchFailure(f"{err}\n--- containerd log, about {cid} ---\n{excerpt}") from None
    finally:
        side.ctr.remove(cid)


def side_of(node: Bench, archive: Path, cleanup: Cleanup) -> CedanaSide:
    """The memhog image imported into ``node``'s containerd, and its cedana side."""
    ctr = node.containerd.ctr(NAMESPACE)
    ctr("images", "import", str(archive), timeout=120)
    node.store.mkdir(mode=0o700, parents=True, exist_ok=True)
    return CedanaSide(node, ctr, cleanup)


def forget(node: Bench, label: str) -> None:
    listing = [str(Path(sys.prefix) / "bin" / "cedana"), "--store", str(node.store)]
    for entry in json.loads(run([*listing, "checkpoints", "list", "-l", label, "--json"])):
        cli_remove(node.store, entry["id"])


def main() -> int:
    parser = base_parser(__doc__ or "", default_runs=3)
    parser.add_argument("--sizes", default="1024,4096", help="MiB the workload fills")
    parser.add_argument("--sides", default=",".join(SIDES), help="lazy (B), eager (E)")
    parser.add_argument("--warmup", type=int, default=0, help="discarded runs first, per size")
    args = parser.parse_args()
    sizes = [int(x) for x in args.sizes.split(",") if x]
    sides = [x for x in args.sides.split(",") if x]
    if args.runs < 1 or args.warmup < 0 or not sizes or set(sides) - set(SIDES):
        parser.error("--runs >= 1, --warmup >= 0, sides from lazy,eager")
    require_root()
    install_signal_handlers()
    report = Report(
        "lazy_across_nodes",
        {"sizes_mib": sizes, "sides": sides, "runs": args.runs, "warmup_runs": args.warmup,
         "containerd": args.containerd,
         "registry": "docker-registry on 127.0.0.1, TLS, htpasswd"},
    )  # fmt: skip
    samples: dict[str, dict[str, list[dict[str, Any]]]] = {
        str(m): {s: [] for s in sides} for m in sizes
    }
    cleanup = Cleanup()
    try:
        with private_containerd(args.containerd, cleanup, (NAMESPACE,), keep=args.keep) as base:
            _, env = start_registry(base.root, cleanup)
            a = another_node(base, cleanup, (NAMESPACE,), env)
            lazy_env = {**env, "CEDANA_LAZY_RESTORE": "true"}
            restorers = {
                "lazy": another_node(base, cleanup, (NAMESPACE,), lazy_env),
                "eager": another_node(base, cleanup, (NAMESPACE,), env),
            }
            archive, _ = build_image(base.root, build_memhog(base.root), sizes[0])
            ced_a, ceds = side_of(a, archive, cleanup), {}
            for name, node in restorers.items():
                ceds[name] = side_of(node, archive, cleanup)
            report.params["containerd_full"] = base.version.full
            for mib in sizes:
                for i in range(args.warmup + args.runs):
                    for side in sides if i % 2 == 0 else sides[::-1]:
                        room_for(2 * mib, f"{side} at {mib} MiB")
                        tag = f"{a.marker[:6]}-{mib}-{i}-{side}"
                        label = f"bench-lx-{tag}"
                        load = load_average()
                        checkpoint_on_a(ced_a, label, mib, tag)
                        settle(RESTORE_GAP)
                        r = restore_on(restorers[side], ceds[side], label, mib, tag)
                        if r["memory"] != side:
                            raise BenchFailure(f"{side}: restored {r['memory']!r}, not {side}")
                        r["load_1m"] = load[0]
                        forget(restorers[side], label)
                        forget(a, label)
                        warm = i >= args.warmup
                        if warm:
                            samples[str(mib)][side].append(r)
                        print_sample(mib, i, side, warm, r)
    finally:
        cleanup.run()

    rows = []
    results: dict[str, Any] = {}
    for mib in sizes:
        for side in sides:
            runs = samples[str(mib)][side]
            beat = summarize([r["first_beat_s"] for r in runs])
            returned = summarize([r["returned_s"] for r in runs])
            results.setdefault(str(mib), {})[side] = {
                "first_beat_s": beat.as_dict(), "returned_s": returned.as_dict(), "runs": runs,
            }  # fmt: skip
            rows.append([f"{mib}", side, f"{beat.median:.3f}", f"{beat.min:.3f}-{beat.max:.3f}",
                         f"{returned.median:.3f}"])  # fmt: skip
    print_table(["MiB", "side", "first beat", "range", "returned"], rows)
    report.results = {"unit": "seconds from `ctr run -d` on the restoring node",
                      "target_s": TARGET_S, "sizes": results}  # fmt: skip
    report.write(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
