"""Protected Slurm jobs for the tests: a node installed with the real runner and a
private store (:class:`Protected`), what a job may leave behind once it ended
(:func:`job_leftovers`), and what another user on the node may do to its runner
(:class:`Stranger`, :func:`squeeze_descriptors`)."""

from __future__ import annotations

import json
import os
import resource
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from cedana_shim.slurm.control import RUN_DIR, request, socket_path
from cedana_shim.slurm.runner import scope_name

from .config import SHIM_BIN_DIR
from .slurm import CLUSTER_NAME, SlurmCluster, User, cedana, counter_script, counters
from .util import wait_for

RUNNER = SHIM_BIN_DIR / "cedana-slurm-task"
VICTIM_EXPORT = "CEDANA_ENABLE=1,CEDANA_CHECKPOINT=victim"


class Protected:
    """A node installed with the real runner and a private store."""

    def __init__(self, cluster: SlurmCluster, prefix: Path) -> None:
        self.cluster = cluster
        self.prefix = prefix
        self.store = cluster.dir / "store"
        self.config = cluster.dir / "shim.toml"
        self.hooks = cluster.dir / "hooks.d"
        self.hooks.mkdir(exist_ok=True)
        self.configure()

    def configure(self, store: Path | None = None, extra: str = "") -> None:
        """(Re)write the node config every job's runner reads when it starts."""
        self.store = store or self.store
        self.config.write_text(
            f'store_path = "{self.store}"\n'
            f'log_file = "{self.cluster.dir / "log" / "shim.log"}"\n'
            f'hooks_dirs = "{self.hooks}"\n{extra}'
        )

    def install(self) -> None:
        done = cedana(
            "slurm", "install", "--node-role", "worker", "--slurm-conf", str(self.cluster.conf),
            "--prefix", str(self.prefix), "--runner", str(RUNNER),
            "--shim-config", str(self.config),
        )  # fmt: skip
        assert done.returncode == 0, done.stderr

    def uninstall(self) -> None:
        done = cedana(
            "slurm", "uninstall", "--slurm-conf", str(self.cluster.conf),
            "--prefix", str(self.prefix),
        )  # fmt: skip
        assert done.returncode == 0, done.stderr

    def checkpoints(self, user: str, label: str) -> list[dict[str, object]]:
        scope = scope_name(CLUSTER_NAME, user)
        done = cedana(
            "checkpoints", "list", "--store", str(self.store), "--json",
            "--namespace", scope, "--label", label,
        )  # fmt: skip
        assert done.returncode == 0, done.stderr
        listed: list[dict[str, object]] = json.loads(done.stdout)
        return listed

    def wait_checkpoint(self, user: str, label: str) -> None:
        wait_for(
            lambda: self.checkpoints(user, label),
            timeout=self.cluster.kill_wait + 30,
            interval=0.5,
            what=f"a checkpoint of {user}'s {label}",
        )

    def victim(self, name: str, export: str = VICTIM_EXPORT) -> int:
        """Root's victim: CRIU must read the job's rlimits, which a root without
        CAP_SYS_RESOURCE (this test machine's bounding set lacks it) may do only
        for its own uid's processes."""
        script = self.cluster.write_script(
            f"{name}.sh",
            counter_script(f"{name}.out", export=export, options=("--exclusive", "--requeue")),
        )
        job_id = self.cluster.sbatch(script, "--partition=low")
        self.cluster.wait_state(job_id, "RUNNING", timeout=60)
        self.cluster.wait_output(f"{name}.out", r"^Counter: 3$", timeout=60)
        return job_id

    def requeued_and_resumed(self, job_id: int, name: str, before: int) -> list[int]:
        """Wait for the requeue, start the job again, and for it to count past
        ``before``; the counters printed since the restart."""
        fields = self.cluster.wait_state(job_id, "PENDING", timeout=self.cluster.kill_wait + 60)
        assert fields["Restarts"] == "1"
        wait_nothing_left(job_id)  # the first run's keeper cleaned up before the requeue
        self.cluster.release(job_id)
        self.cluster.wait_state(job_id, "RUNNING", timeout=60)
        text = self.cluster.wait_output(f"{name}.out", rf"^Counter: {before + 3}$", timeout=90)
        assert "\0" not in text, "the restored job wrote at its old offset into a truncated file"
        values = counters(text)
        restart = values.index(before) + 1 if before in values else 0
        return values[restart:]

    def preempted_and_resumed(self, name: str) -> None:
        """The issue's scenario: the victim on ``low``, a preemptor (no cedana
        variables) on ``high``; the victim is checkpointed, requeued and, started
        again, continues its count."""
        cluster = self.cluster
        victim = self.victim(name)
        preemptor = cluster.write_script(
            f"{name}-preemptor.sh",
            counter_script(f"{name}-preemptor.out", export=None, seconds=3,
                           options=("--exclusive",)),
        )  # fmt: skip
        pre_id = cluster.sbatch(preemptor, "--partition=high")
        cluster.wait_state(victim, "PENDING", "REQUEUED", "COMPLETING", timeout=60)
        before = max(counters(cluster.output(f"{name}.out")))
        self.wait_checkpoint("root", "victim")
        cluster.wait_state(pre_id, "COMPLETED", timeout=60)

        after = self.requeued_and_resumed(victim, name, before)
        assert after and 0 not in after and after[0] > before - 3, after
        assert cluster.job(victim)["Restarts"] == "1"


def job_leftovers(job_id: int, step: str = "batch") -> list[str]:
    """Everything of job step ``job_id.step`` that outlives it: processes (its keeper,
    the job's own), cgroup directories (Slurm's of the job, the container's), the
    runner's bundle, root bind point, runc state and control socket."""
    name = f"{job_id}.{step}"
    found = []
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes()
            cgroup = Path(f"/proc/{pid}/cgroup").read_text()
        except OSError:
            continue
        keeper = f"keeper\0{name}".encode() in cmdline
        if keeper or f"/cedana-slurm-{name}" in cgroup or f"/job_{job_id}/" in cgroup:
            shown = cmdline.replace(b"\0", b" ")[:100]
            found.append(f"process {pid}: {shown!r}")
    for root, dirs, _ in os.walk("/sys/fs/cgroup"):
        for d in dirs:
            if d in (f"job_{job_id}", f"cedana-slurm-{name}"):
                found.append(f"cgroup {os.path.join(root, d)}")
    for path in (
        f"{RUN_DIR}/bundles/{name}",
        f"{RUN_DIR}/roots/{name}",
        f"{RUN_DIR}/runc/slurm-{name}",
        socket_path(name),
    ):
        if os.path.lexists(path):
            found.append(path)
    return found


def wait_nothing_left(job_id: int, timeout: float = 30) -> None:
    """The job step's keeper finished: nothing of it is left (see job_leftovers)."""
    left: list[str] = []

    def gone() -> bool:
        left[:] = job_leftovers(job_id)
        return not left

    try:
        wait_for(gone, timeout=timeout, interval=0.3, what=f"job {job_id} to leave nothing")
    except AssertionError:
        raise AssertionError(f"job {job_id} left: {left}") from None


def keeper_pid(job_id: int, step: str = "batch") -> int:
    """The pid of the job step's keeper, as its runner says (root may ask)."""
    pid: int = request(socket_path(f"{job_id}.{step}"), {"op": "status"}, timeout=30)["runner_pid"]
    return pid


def squeeze_descriptors(pid: int) -> int:
    """Lower the open-files limit of process ``pid`` (soft and hard) to its lowest free
    descriptor number: from now on it can open no descriptor, nor raise the limit
    again without CAP_SYS_RESOURCE, and its children start with that limit too.
    Returns the limit."""
    used = {int(fd) for fd in os.listdir(f"/proc/{pid}/fd")}
    lowest = min(set(range(len(used) + 1)) - used)
    resource.prlimit(pid, resource.RLIMIT_NOFILE, (lowest, lowest))
    return lowest


# What the review's attacker did, as another user: COUNT idle connections (one byte
# each, no newline) to a job's control socket, held until killed. Prints one JSON line
# once every connection was answered or closed by the runner, or after 15 s.
ATTACKER = """
import json, select, socket, sys, time
path, count = sys.argv[1], int(sys.argv[2])
held, deadline = {}, time.monotonic() + 30
while len(held) < count and time.monotonic() < deadline:
    sock = socket.socket(socket.AF_UNIX)
    sock.setblocking(False)
    try:
        sock.connect(path)
    except BlockingIOError:  # a full backlog: the runner has not taken them yet
        sock.close()
        time.sleep(0.01)
        continue
    try:
        sock.send(b"x")
    except OSError:
        pass  # refused and closed already
    held[sock.fileno()] = sock
refusals, closed = [], 0
poll = select.poll()
for fd in held:
    poll.register(fd, select.POLLIN)
deadline = time.monotonic() + 15
while len(refusals) + closed < len(held) and time.monotonic() < deadline:
    for fd, _ in poll.poll(200):
        poll.unregister(fd)
        try:
            data = held[fd].recv(4096)
        except OSError:
            data = b""
        if data.endswith(b"\\n"):
            refusals.append(json.loads(data))
        else:
            closed += 1
print(json.dumps({"connected": len(held), "refused": len(refusals), "closed": closed,
                  "first": refusals[0].get("error", "") if refusals else ""}), flush=True)
time.sleep(3600)
"""


@contextmanager
def stranger(user: User, path: str, count: int) -> Iterator[dict[str, Any]]:
    """``user`` attacks the control socket ``path`` with ``count`` idle connections
    (see ATTACKER) for as long as the block runs; yields the attacker's report."""
    attacker = subprocess.Popen(
        ["setpriv", f"--reuid={user.uid}", f"--regid={user.gid}", "--init-groups",
         sys.executable, "-c", ATTACKER, path, str(count)],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert attacker.stdout is not None
        line = attacker.stdout.readline()
        assert line, f"the attacker ended without a report (exit {attacker.wait()})"
        report: dict[str, Any] = json.loads(line)
        yield report
    finally:
        attacker.kill()
        attacker.wait()
