"""Shim memory: resident memory of the ONE shim daemon that serves a pod of three
containers, cedana vs containerd's runc shim, through the CRI (as kubelet drives it).

    python bench/shim_memory.py [--runs 5] [--containerd 1.6|1.7|2.1] [--out results.json]

Per run and runtime: RunPodSandbox, then CreateContainer + StartContainer of three
busybox `sleep` containers, a round of the status/stats calls kubelet makes, a short
settle, then /proc/<pid>/smaps_rollup of every process serving the pod's shim socket.
Runs alternate cedana, runc, cedana, ... and each pod is removed before the next.

Cedana daemons are forked from a warm fork server (shim/cedana_shim/cli/forkserver.py)
and share its pages copy-on-write, so RSS counts those shared pages in full in every
daemon; PSS divides them among the sharers and is the fair per-shim figure. Both are
reported, and USS (private pages only), plus the memory of the fork server and of its
spare (the child it forks ahead of the next pod, cli/spare.py: one per node).
"""

from __future__ import annotations

import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (
    Cleanup,
    Report,
    base_parser,
    ensure_venv,
    install_signal_handlers,
    is_fork_server,
    print_table,
    private_containerd,
    ratio,
    require_root,
    summarize,
    verdict,
)

TARGET_RSS_MB = 25.0
CRI_NAMESPACE = "k8s.io"
CONTAINERS = 3
SETTLE_S = 2.0
MB = 1024 * 1024


@dataclass(frozen=True)
class Mem:
    rss: int  # bytes
    pss: int
    uss: int  # Private_Clean + Private_Dirty

    def __add__(self, other: Mem) -> Mem:
        return Mem(self.rss + other.rss, self.pss + other.pss, self.uss + other.uss)


def smaps_rollup(pid: int) -> Mem:
    fields: dict[str, int] = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines()[1:]:
        key, _, rest = line.partition(":")
        parts = rest.split()
        if parts and parts[-1] == "kB":
            fields[key.strip()] = int(parts[0]) * 1024
    return Mem(
        rss=fields["Rss"],
        pss=fields["Pss"],
        uss=fields.get("Private_Clean", 0) + fields.get("Private_Dirty", 0),
    )


def cmdline(pid: int) -> str:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return "?"
    return " ".join(a.decode(errors="replace") for a in raw.split(b"\0") if a)


def spares_of(server: int) -> list[int]:
    """The fork server's spare (cli/spare.py): forked ahead of the next request."""
    from cedana_shim.cli.spare import SPARE_NAME

    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                named = (entry / "comm").read_text().strip() == SPARE_NAME
                if named and ppid_of(int(entry.name)) == server:
                    found.append(int(entry.name))
            except (OSError, ValueError):
                continue
    return found


def ppid_of(pid: int) -> int:
    stat = Path(f"/proc/{pid}/stat").read_text()
    return int(stat.rsplit(")", 1)[1].split()[1])


def measure_pod(b: Any, handler: str, run: int) -> dict[str, Any]:
    """Start a pod of three containers with `handler`, measure its shim, remove it."""
    from tests.integration.harness.cri import CriClient

    cri = CriClient(b.containerd.socket, handler)
    try:
        cri.wait_ready()
        log_dir = b.containerd.pod_logs / f"{handler}-{run}"
        with cri.pod(f"bench-mem-{handler}-{run}", log_dir, host_network=False) as pod:
            cids = []
            for n in range(CONTAINERS):
                cid = cri.create_container(pod, f"sleeper{n}", b.images.busybox, ["sleep", "3600"])
                cri.start_container(cid)
                cids.append(cid)
            # What kubelet does every few seconds: status and stats of everything.
            cri.pod_status(pod.id)
            for cid in cids:
                cri.container_status(cid)
                cri.container_stats(cid)
            time.sleep(SETTLE_S)
            tasks = [pod.id, *cids]
            daemons: set[int] = set()
            for tid in tasks:
                daemons |= b.containerd.shim_pids(CRI_NAMESPACE, tid)
            if not daemons:
                raise RuntimeError(f"{handler}: no process serves the shim socket of pod {pod.id}")
            per_pid = {pid: smaps_rollup(pid) for pid in sorted(daemons)}
            total = Mem(0, 0, 0)
            for m in per_pid.values():
                total = total + m
            parents = {pid: ppid_of(pid) for pid in daemons}
            forkserver: dict[str, Any] | None = None
            spare: dict[str, Any] | None = None
            for parent in set(parents.values()):
                if is_fork_server(parent):
                    fm = smaps_rollup(parent)
                    forkserver = {"pid": parent, "rss": fm.rss, "pss": fm.pss, "uss": fm.uss}
                    for child in spares_of(parent):
                        sm = smaps_rollup(child)
                        spare = {"pid": child, "rss": sm.rss, "pss": sm.pss, "uss": sm.uss}
            return {
                "pod": pod.id,
                "daemons": [
                    {
                        "pid": pid,
                        "ppid": parents[pid],
                        "cmdline": cmdline(pid),
                        "rss": m.rss,
                        "pss": m.pss,
                        "uss": m.uss,
                    }
                    for pid, m in per_pid.items()
                ],
                "rss": total.rss,
                "pss": total.pss,
                "uss": total.uss,
                "forkserver": forkserver,
                "spare": spare,
            }
    finally:
        cri.close()


def main() -> int:
    parser = base_parser(__doc__ or "", default_runs=5)
    parser.add_argument(
        "--warmup", type=int, default=1, help="discarded pods per runtime (default 1)"
    )
    args = parser.parse_args()
    if args.runs < 1 or args.warmup < 0:
        parser.error("--runs must be >= 1 and --warmup >= 0")
    ensure_venv()
    require_root()
    install_signal_handlers()

    handlers = ("cedana", "runc")
    report = Report(
        "shim_memory",
        {
            "runs_per_runtime": args.runs,
            "warmup_per_runtime": args.warmup,
            "containerd": args.containerd,
            "pod": f"CRI pod (CNI bridge network) + {CONTAINERS} busybox `sleep 3600` containers",
            "settle_seconds": SETTLE_S,
            "order": "interleaved: cedana pod, runc pod, cedana pod, ...",
        },
    )
    measured: dict[str, list[dict[str, Any]]] = {h: [] for h in handlers}
    cleanup = Cleanup()
    try:
        with private_containerd(args.containerd, cleanup, (CRI_NAMESPACE,), keep=args.keep) as b:
            report.params["containerd_full"] = b.version.full
            report.params["containerd_log"] = str(b.containerd.log_path)
            total = args.warmup + args.runs
            for i in range(total):
                for handler in handlers:
                    m = measure_pod(b, handler, i)
                    warm = i >= args.warmup
                    if warm:
                        measured[handler].append(m)
                    fs = m["forkserver"]
                    fs_text = f", fork server RSS {fs['rss'] / MB:.1f} MB" if fs else ""
                    tag = "" if warm else " (warm-up, discarded)"
                    print(
                        f"run {i + 1}/{total} {handler:6s} {len(m['daemons'])} daemon(s): "
                        f"RSS {m['rss'] / MB:.1f} MB, PSS {m['pss'] / MB:.1f} MB, "
                        f"USS {m['uss'] / MB:.1f} MB{fs_text}{tag}"
                    )
    finally:
        cleanup.run()

    # A cedana daemon is forked either by the warm fork server (the steady state) or,
    # when none answers for this exact code (first start, or the package changed on
    # disk: the server's socket name carries a fingerprint of the code), by the
    # `start` process itself after importing everything cold. Each group is
    # summarised on its own.
    groups: dict[str, list[dict[str, Any]]] = {
        "cedana (fork-server path)": [m for m in measured["cedana"] if m["forkserver"]],
        "cedana (cold path)": [m for m in measured["cedana"] if not m["forkserver"]],
        "runc": measured["runc"],
    }
    groups = {k: v for k, v in groups.items() if v}
    rows = []
    summary: dict[str, Any] = {}
    for name, samples in groups.items():
        daemons = sorted({len(m["daemons"]) for m in samples})
        row: dict[str, Any] = {"pods": len(samples), "daemons_per_pod": daemons}
        for key in ("rss", "pss", "uss"):
            row[key + "_mb"] = summarize([m[key] / MB for m in samples]).as_dict(2)
        summary[name] = row

        def cell(key: str, row: dict[str, Any] = row) -> str:
            st = row[key + "_mb"]
            return f"{st['median']:.1f} ({st['min']:.1f}-{st['max']:.1f})"

        rows.append(
            [name, str(len(samples)), ",".join(map(str, daemons)), cell("rss"), cell("pss"),
             cell("uss")]
        )  # fmt: skip
    for key, name, label in (
        ("forkserver", "cedana fork server itself", "(cedana fork server itself)"),
        ("spare", "cedana fork server's spare", "(its spare, the next daemon)"),
    ):
        procs = [m[key] for m in measured["cedana"] if m.get(key)]
        if not procs:
            continue
        per = {k: summarize([f[k] / MB for f in procs]) for k in ("rss", "pss", "uss")}
        summary[name] = {k + "_mb": v.as_dict(2) for k, v in per.items()}
        rows.append(
            [label, str(len(procs)), "-",
             *(f"{per[k].median:.1f}" for k in ("rss", "pss", "uss"))]
        )  # fmt: skip
    if not any(m["forkserver"] for m in measured["cedana"]):
        report.notes.append("no cedana daemon was a child of a fork server: all took the cold path")
    cold = len(groups.get("cedana (cold path)", []))
    if cold:
        report.notes.append(
            f"{cold} of {len(measured['cedana'])} cedana pods got a daemon forked cold (no fork "
            "server answered for the current code, e.g. the package changed on disk mid-run)"
        )

    print(
        f"\nshim daemon memory for one pod of {CONTAINERS} containers, containerd "
        f"{args.containerd}, {args.runs} pods per runtime (median, min-max), MB = MiB"
    )
    print_table(["runtime", "pods", "daemons", "RSS MB", "PSS MB", "USS MB"], rows)
    runc_rss = summary["runc"]["rss_mb"]["median"]
    runc_pss = summary["runc"]["pss_mb"]["median"]
    verdicts: dict[str, Any] = {}
    for name in groups:
        if not name.startswith("cedana"):
            continue
        rss = summary[name]["rss_mb"]["median"]
        pss = summary[name]["pss_mb"]["median"]
        verdicts[name] = {
            "rss_mb": rss,
            "pss_mb": pss,
            "ratio_rss": round(ratio(rss, runc_rss), 3),
            "ratio_pss": round(ratio(pss, runc_pss), 3),
            "meets_target": rss <= TARGET_RSS_MB,
        }
        print(
            f"{name}: RSS {rss:.2f} MB ({verdict(rss, TARGET_RSS_MB)} <= {TARGET_RSS_MB:.0f} MB),"
            f" PSS {pss:.2f} MB; cedana/runc RSS {ratio(rss, runc_rss):.2f}, "
            f"PSS {ratio(pss, runc_pss):.2f}"
        )
    report.results = {
        "unit": "MiB",
        "summary": summary,
        "target_rss_mb": TARGET_RSS_MB,
        "verdicts": verdicts,
        "runs": measured,
    }
    report.notes.append(
        "RSS of a forked cedana daemon counts every page it shares copy-on-write with the "
        "fork server; PSS splits shared pages between the processes mapping them"
    )
    report.write(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
