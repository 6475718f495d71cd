"""Slurm: launch overhead of an opted-in batch job, SIGTERM -> checkpoint committed
for a 1 GiB job against KillWait, and the resume time on requeue, on a private
one-node cluster (the integration harness's).

    python bench/slurm_launch.py [--runs 5] [--runner PATH] [--out results.json]

launch: the same trivial job (``true``, with CEDANA_ENABLE=1 in its --export) on
the node with `cedana slurm install` and without it, interleaved (install, job,
uninstall, job, ...). Each sample is slurmstepd's own task time (its log lines
"task 0 started" to "task 0 exited", millisecond stamps): the runner's start,
container create/start/teardown, against Slurm's plain execve. Target <= 100 ms.
Three sides: not installed; installed, the keeper forked by the runner's warm
template (every job after a node's first); installed, cold (the template stopped
just before: the task process forks the keeper itself, imports included, and
starts a new template in the background, as on a node's first protected job).
resume launch: the same comparison for a job that resumes: a small job's
checkpoint (taken on demand, the job then cancelled) is restored by each sample
(CEDANA_RESTORE=<id>, as `cedana slurm restore` submits it); the restored job sees
a marker made after the checkpoint and exits at once (it polls every 20 ms). Its
task time against the same script's on the uninstalled node (marker there: exits
at once).
checkpoint: a job that holds 1 GiB of touched memory is requeued (`scontrol
requeue`: Slurm sends SIGTERM and, KillWait later, SIGKILL); the sample is the time
from the requeue to the checkpoint listed in the store, against KillWait.
resume: the requeued job is released; the sample is the time from slurmstepd's
task start to the job's next output line (the job prints every 0.1 s).
"""

from __future__ import annotations

import json
import re
import sys
import time
from datetime import datetime
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _common import (
    Report,
    base_parser,
    ensure_venv,
    install_signal_handlers,
    print_table,
    require_root,
    summarize,
    verdict,
)

TARGET_LAUNCH_S = 0.100
LAUNCH_SCRIPT = "#!/bin/bash\n#SBATCH --output=launch-%j.out\n#SBATCH --export=ALL,{export}\ntrue\n"
# Waits for the marker, then exits: checkpointed while waiting, restored once it exists.
# exec: a batch shell that stays holds Slurm's copy of its script open (spool/jobNNN/),
# which a restore into another job id does not find (see the README's Slurm limits).
RESUME_SCRIPT = """\
#!/bin/bash
#SBATCH --output=resume-%j.out
#SBATCH --export=ALL,{export}
exec /bin/sh -c 'while [ ! -e {marker} ]; do sleep 0.02; done'
"""
# 1 GiB touched, then a counter every 0.1 s: what a restore must bring back.
HOG_SCRIPT = """\
#!/bin/bash
#SBATCH --output=hog.out
#SBATCH --requeue
#SBATCH --export=ALL,CEDANA_CHECKPOINT=hog
exec python3 -u -c '
import time
hog = bytearray(1 << 30)
for i in range(0, len(hog), 4096):
    hog[i] = 1
i = 0
while True:
    print(f"tick {i}", flush=True)
    i += 1
    time.sleep(0.1)
'
"""
_TASK_LINE = re.compile(
    r"^\[(?P<ts>[0-9T:.-]+)\] \[(?P<job>\d+)\.batch\] task 0 \(\d+\) (?P<what>started|exited)",
    re.M,
)


def _stamp(text: str) -> float:
    return datetime.fromisoformat(text).timestamp()


def task_times(log: str, job_id: int) -> tuple[float, float] | None:
    """slurmstepd's task start and exit of a batch job, from slurmd's log."""
    seen: dict[str, float] = {}
    for m in _TASK_LINE.finditer(log):
        if int(m["job"]) == job_id:
            seen.setdefault(m["what"], _stamp(m["ts"]))
    if "started" in seen and "exited" in seen:
        return seen["started"], seen["exited"]
    return None


def main() -> int:
    parser = base_parser(__doc__ or "", default_runs=5)
    parser.add_argument("--runner", help="the job runner (default: .venv/bin/cedana-slurm-task)")
    args = parser.parse_args()
    if args.runs < 5:
        parser.error("--runs must be >= 5")
    ensure_venv()
    require_root()
    install_signal_handlers()
    from tests.integration.harness.config import SHIM_BIN_DIR
    from tests.integration.harness.slurm import (
        cedana,
        runner_template,
        running_cluster,
        stop_runner_template,
    )
    from tests.integration.harness.util import wait_for

    runner = args.runner or str(SHIM_BIN_DIR / "cedana-slurm-task")
    report = Report("slurm_launch", {"runs_per_side": args.runs, "runner": runner})
    with running_cluster() as cluster:
        store = cluster.dir / "store"
        config = cluster.dir / "shim.toml"
        config.write_text(f'store_path = "{store}"\n')
        prefix = cluster.dir / "prefix"
        report.params["kill_wait_s"] = cluster.kill_wait

        def install() -> None:
            done = cedana(
                "slurm", "install", "--node-role", "worker", "--slurm-conf", str(cluster.conf),
                "--prefix", str(prefix), "--runner", runner, "--shim-config", str(config),
            )  # fmt: skip
            if done.returncode != 0:
                raise SystemExit(f"cedana slurm install: {done.stderr.strip()}")

        def uninstall() -> None:
            done = cedana(
                "slurm", "uninstall", "--slurm-conf", str(cluster.conf), "--prefix", str(prefix)
            )
            if done.returncode != 0:
                raise SystemExit(f"cedana slurm uninstall: {done.stderr.strip()}")

        last_job = [0]

        def task_time(script: Path) -> float:
            job_id = last_job[0] = cluster.sbatch(script)
            fields = cluster.wait_state(job_id, "COMPLETED", "FAILED", timeout=60)
            if fields["JobState"] != "COMPLETED":
                raise SystemExit(f"job {job_id} ({script.name}) failed: {fields.get('ExitCode')}")
            times = wait_for(
                lambda: task_times(cluster.log("slurmd.log"), job_id), timeout=10, what="task lines"
            )
            return times[1] - times[0]

        launch = cluster.write_script("launch.sh", LAUNCH_SCRIPT.format(export="CEDANA_ENABLE=1"))
        sides = ("not installed", "installed (warm template)", "installed (cold)")
        samples: dict[str, list[float]] = {side: [] for side in sides}
        install()
        task_time(launch)  # the node's first protected job: it starts the template
        for _ in range(args.runs):
            samples[sides[1]].append(task_time(launch))
            stop_runner_template()
            wait_for(lambda: runner_template() is None, timeout=10, what="template gone")
            samples[sides[2]].append(task_time(launch))
            uninstall()
            samples[sides[0]].append(task_time(launch))
            install()
            wait_for(lambda: runner_template() is not None, timeout=30, what="the template")
        launch_s = {side: summarize(values) for side, values in samples.items()}
        overhead = launch_s[sides[1]].median - launch_s[sides[0]].median
        cold_overhead = launch_s[sides[2]].median - launch_s[sides[0]].median
        report.results["launch_s"] = {side: s.as_dict() for side, s in launch_s.items()}
        report.results["launch_overhead_s"] = round(overhead, 4)
        report.results["launch_overhead_cold_s"] = round(cold_overhead, 4)

        # A job that resumes: one small checkpoint, restored by every sample.
        marker = cluster.jobs / "resume-marker"
        first = cluster.sbatch(
            cluster.write_script(
                "resume-first.sh", RESUME_SCRIPT.format(export="CEDANA_ENABLE=1", marker=marker)
            )
        )
        cluster.wait_state(first, "RUNNING", timeout=60)
        asked = wait_for(lambda: (lambda d: d if d.returncode == 0 else None)(
            cedana("slurm", "checkpoint", str(first), "--json")), timeout=30,
            what="an on-demand checkpoint")  # fmt: skip
        checkpoint = json.loads(asked.stdout)["checkpoint"]
        cluster.cancel(first)
        cluster.wait_state(first, "CANCELLED", "COMPLETED", "FAILED", timeout=60)
        marker.touch()
        resume = cluster.write_script("resume.sh", RESUME_SCRIPT.format(
            export=f"CEDANA_ENABLE=1,CEDANA_RESTORE={checkpoint}", marker=marker))  # fmt: skip
        resumed: dict[str, list[float]] = {"not installed": [], "installed (resumes)": []}
        for _ in range(args.runs):
            resumed["installed (resumes)"].append(task_time(resume))
            out = cluster.jobs / f"resume-{last_job[0]}.out"
            if f"restored from {checkpoint}" not in out.read_text(errors="replace"):
                raise SystemExit(f"the resume sample did not restore: {out.read_text()[:300]}")
            uninstall()
            resumed["not installed"].append(task_time(resume))
            install()
        resume_launch = {side: summarize(values) for side, values in resumed.items()}
        resume_overhead = (
            resume_launch["installed (resumes)"].median - resume_launch["not installed"].median
        )
        report.results["resume_launch_s"] = {side: s.as_dict() for side, s in resume_launch.items()}
        report.results["resume_launch_overhead_s"] = round(resume_overhead, 4)

        hog = cluster.write_script("hog.sh", HOG_SCRIPT)
        job_id = cluster.sbatch(hog)
        cluster.wait_state(job_id, "RUNNING", timeout=60)
        cluster.wait_output("hog.out", r"^tick 5$", timeout=120)
        t0 = time.monotonic()
        cluster.requeue(job_id)

        def committed() -> bool:
            done = cedana("checkpoints", "list", "--store", str(store), "--json", "--label", "hog")
            return done.returncode == 0 and bool(json.loads(done.stdout or "[]"))

        wait_for(committed, timeout=cluster.kill_wait + 30, interval=0.2, what="checkpoint")
        commit_s = time.monotonic() - t0
        report.results["sigterm_to_committed_s"] = round(commit_s, 3)
        last_tick = max(
            int(n) for n in re.findall(r"^tick (\d+)$", cluster.output("hog.out"), re.M)
        )

        cluster.wait_state(job_id, "PENDING", timeout=cluster.kill_wait + 60)
        log_offset = len(cluster.log("slurmd.log"))
        cluster.release(job_id)
        ticked = re.compile(rf"^tick {last_tick + 1}$", re.M)
        wait_for(lambda: ticked.search(cluster.output("hog.out")), timeout=120, interval=0.05,
                 what="the resumed job's output")  # fmt: skip
        resumed_at = time.time()
        started = re.search(rf"\[([0-9T:.-]+)\] \[{job_id}\.batch\] task 0 \(\d+\) started",
                            cluster.log("slurmd.log")[log_offset:])  # fmt: skip
        resume_s = resumed_at - _stamp(started.group(1)) if started else float("nan")
        report.results["resume_s"] = round(resume_s, 3)
        cluster.cancel(job_id)
        uninstall()

    rows = [
        [side, f"{s.median * 1000:.0f}", f"{s.min * 1000:.0f}-{s.max * 1000:.0f}", str(s.n)]
        for side, s in [*launch_s.items(), *resume_launch.items()]
    ]
    print_table(["task time (launch, then resume)", "median ms", "min-max ms", "n"], rows)
    print(f"launch overhead: {overhead * 1000:.0f} ms ({verdict(overhead, TARGET_LAUNCH_S)} "
          f"<= {TARGET_LAUNCH_S * 1000:.0f} ms); cold (no template): "
          f"{cold_overhead * 1000:.0f} ms")  # fmt: skip
    print(f"launch overhead of a job that resumes (small checkpoint): "
          f"{resume_overhead * 1000:.0f} ms")  # fmt: skip
    print(f"SIGTERM -> checkpoint committed (1 GiB): {commit_s:.1f} s "
          f"({verdict(commit_s, cluster.kill_wait)} KillWait {cluster.kill_wait} s)")  # fmt: skip
    print(f"resume on requeue (task start -> next output line): {resume_s:.2f} s")
    report.notes.append(
        "checkpoint commit time is polled with `cedana checkpoints list` (~0.3 s resolution)"
    )
    report.write(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
