"""A private one-node Slurm cluster: munge, slurmctld and slurmd on private
sockets, ports and directories (nothing under /etc is read or written).

Partitions ``low`` (default, PriorityTier=1) and ``high`` (PriorityTier=2) with
``PreemptType=preempt/partition_prio`` and ``PreemptMode=REQUEUE``: an exclusive
job on ``high`` requeues an exclusive, requeueable job on ``low``.
``ProctrackType=proctrack/linuxproc`` and ``TaskPlugin=task/none`` (no cgroup
setup) by default; ``proctrack="cgroup"`` gives the most common site setup instead,
proctrack/cgroup and task/cgroup (cgroup/v1 here: Slurm's freezer, memory, cpuset
and devices cgroups per job, step and task; devices not constrained). Its
plugstack.conf mirrors Debian's (``include .../plugstack.conf.d/*.conf``) so the
installer's drop-in path is what the tests exercise; ``plugstack_inline`` gives one
without the include.
"""

from __future__ import annotations

import contextlib
import os
import pwd
import re
import resource
import shutil
import signal
import socket
import struct
import subprocess
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import datetime
from pathlib import Path

from cedana_shim.cli.fork_client import answers
from cedana_shim.cli.paths import code_fingerprint, forkserver_socket_path
from cedana_shim.cli.slurm_task import KIND

from .config import SHIM_BIN_DIR
from .util import WaitTimeout, wait_for

CLUSTER_NAME = "cedana-itest"
TEST_USERS = ("cedana-slurm-a", "cedana-slurm-b")
KILL_WAIT = 30


@dataclass(frozen=True)
class User:
    name: str
    uid: int
    gid: int
    home: Path


def ensure_user(name: str, home_parent: Path) -> User:
    """An unprivileged user for the jobs: created with useradd if it does not exist."""
    try:
        entry = pwd.getpwnam(name)
    except KeyError:
        subprocess.run(
            ["useradd", "--no-create-home", "--shell", "/bin/bash", "--user-group", name],
            check=True,
            capture_output=True,
        )
        entry = pwd.getpwnam(name)
    home = home_parent / name
    home.mkdir(mode=0o700, exist_ok=True)
    os.chown(home, entry.pw_uid, entry.pw_gid)
    return User(name, entry.pw_uid, entry.pw_gid, home)


def _free_ports(count: int) -> list[int]:
    socks = [socket.socket() for _ in range(count)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


class SlurmCluster:
    def __init__(
        self,
        workdir: Path,
        *,
        plugstack_include: bool = True,
        kill_wait: int = KILL_WAIT,
        proctrack: str = "linuxproc",
        nofile: int | None = None,
    ) -> None:
        self.kill_wait = kill_wait
        self.nofile = nofile
        self.proctrack = proctrack
        self.dir = workdir
        self.etc = workdir / "etc"
        self.conf = self.etc / "slurm.conf"
        self.plugstack = self.etc / "plugstack.conf"
        self.plugstack_d = self.etc / "plugstack.conf.d"
        self.jobs = workdir / "jobs"  # scripts and outputs, world-readable
        self.node = socket.gethostname().split(".")[0]
        self.plugstack_include = plugstack_include
        self._procs: list[subprocess.Popen[bytes]] = []
        self._munged_pid = workdir / "munge" / "munged.pid"
        self.munge_socket = workdir / "munge" / "munge.socket"

    # -- lifecycle ------------------------------------------------------------------

    def start(self) -> None:
        os.chmod(self.dir, 0o755)
        for d in (self.etc, self.dir / "state", self.dir / "spool", self.dir / "log", self.jobs):
            d.mkdir(mode=0o755, exist_ok=True)
        os.chmod(self.jobs, 0o1777)
        self._start_munge()
        self._write_conf()
        self._spawn("slurmctld", ["slurmctld", "-D", "-i", "-f", str(self.conf)])
        self._spawn(
            "slurmd", ["slurmd", "-D", "-f", str(self.conf), "-N", self.node], nofile=self.nofile
        )
        wait_for(self._node_idle, timeout=60, interval=0.3, what=f"node {self.node} idle")

    def _start_munge(self) -> None:
        mdir = self.dir / "munge"
        mdir.mkdir(mode=0o755, exist_ok=True)
        keydir = self.dir / "munge-key"
        keydir.mkdir(mode=0o700, exist_ok=True)
        key = keydir / "munge.key"
        key.write_bytes(os.urandom(1024))
        os.chmod(key, 0o400)
        subprocess.run(
            [
                "munged",
                "--force",
                f"--key-file={key}",
                f"--socket={self.munge_socket}",
                f"--pid-file={self._munged_pid}",
                f"--log-file={self.dir / 'log' / 'munged.log'}",
                f"--seed-file={keydir / 'munged.seed'}",
            ],
            check=True,
            capture_output=True,
        )

    def _write_conf(self) -> None:
        ctld_port, slurmd_port = _free_ports(2)
        log = self.dir / "log"
        task_plugin = "task/cgroup" if self.proctrack == "cgroup" else "task/none"
        memory_mb = os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") >> 20
        if self.proctrack == "cgroup":
            (self.etc / "cgroup.conf").write_text(
                "CgroupPlugin=cgroup/v1\nCgroupMountpoint=/sys/fs/cgroup\n"
                "ConstrainCores=yes\nConstrainRAMSpace=yes\nConstrainDevices=no\n"
            )
        self.conf.write_text(
            f"""\
ClusterName={CLUSTER_NAME}
SlurmctldHost={self.node}
SlurmUser=root
SlurmctldPort={ctld_port}
SlurmdPort={slurmd_port}
AuthType=auth/munge
AuthInfo=socket={self.munge_socket}
CredType=cred/munge
StateSaveLocation={self.dir / "state"}
SlurmdSpoolDir={self.dir / "spool"}
SlurmctldPidFile={self.dir / "slurmctld.pid"}
SlurmdPidFile={self.dir / "slurmd.pid"}
SlurmctldLogFile={log / "slurmctld.log"}
SlurmdLogFile={log / "slurmd.log"}
SlurmdDebug=debug
PlugStackConfig={self.plugstack}
ProctrackType=proctrack/{self.proctrack}
TaskPlugin={task_plugin}
SelectType=select/cons_tres
SelectTypeParameters=CR_Core
SchedulerType=sched/backfill
JobRequeue=1
KillWait={self.kill_wait}
MpiDefault=none
ReturnToService=2
JobAcctGatherType=jobacct_gather/none
AccountingStorageType=accounting_storage/none
MailProg=/bin/true
PreemptType=preempt/partition_prio
PreemptMode=REQUEUE
NodeName={self.node} CPUs={os.cpu_count()} RealMemory={memory_mb // 2} State=UNKNOWN
PartitionName=low Nodes={self.node} Default=YES PriorityTier=1 MaxTime=INFINITE State=UP
PartitionName=high Nodes={self.node} PriorityTier=2 MaxTime=INFINITE State=UP
"""
        )
        self.plugstack_d.mkdir(exist_ok=True)
        if self.plugstack_include:
            self.plugstack.write_text(f"include {self.plugstack_d}/*.conf\n")
        else:
            self.plugstack.write_text("# site SPANK plugins\n")

    def _spawn(self, name: str, argv: list[str], nofile: int | None = None) -> None:
        out = open(self.dir / "log" / f"{name}.stderr", "ab")  # noqa: SIM115 (lives with the process)

        def limits() -> None:
            if nofile is not None:  # what slurmstepd, the task and the keeper inherit
                resource.setrlimit(resource.RLIMIT_NOFILE, (nofile, nofile))

        proc = subprocess.Popen(
            argv, stdout=out, stderr=out, env=self.env(), start_new_session=True, preexec_fn=limits
        )
        self._procs.append(proc)

    def stop(self) -> list[str]:
        """Cancel every job, stop the daemons and munge; returns what needed force."""
        notes: list[str] = []
        if self._procs:
            self.cancel_all()
        for proc in reversed(self._procs):
            proc.terminate()
            try:
                proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()
                notes.append(f"{proc.args!r} killed")
        self._procs.clear()
        notes += self._kill_stepds()
        stop_runner_template()
        if self.proctrack == "cgroup":
            # Slurm's own top cgroup (slurm_<node>), which Slurm never removes.
            for top in Path("/sys/fs/cgroup").glob(f"*/slurm_{self.node}"):
                with contextlib.suppress(OSError):
                    top.rmdir()
        if self._munged_pid.exists():
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(self._munged_pid.read_text()), signal.SIGTERM)
        return notes

    def _kill_stepds(self) -> list[str]:
        """slurmstepd of this cluster left behind (their spool dir is ours)."""
        notes = []
        spool = str(self.dir / "spool")
        for pid in os.listdir("/proc"):
            if not pid.isdigit():
                continue
            try:
                cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
                environ = Path(f"/proc/{pid}/environ").read_bytes()
            except OSError:
                continue
            if cmd and cmd[0].endswith(b"slurmstepd") and spool.encode() in environ + b"".join(cmd):
                os.kill(int(pid), signal.SIGKILL)
                notes.append(f"slurmstepd {pid} killed")
        return notes

    # -- commands -----------------------------------------------------------------------

    def env(self, **extra: str) -> dict[str, str]:
        return {**os.environ, "SLURM_CONF": str(self.conf), **extra}

    def scontrol(self, *args: str, check: bool = True) -> str:
        done = subprocess.run(
            ["scontrol", *args], env=self.env(), capture_output=True, text=True, check=False
        )
        if check and done.returncode != 0:
            raise AssertionError(f"scontrol {' '.join(args)}: {done.stderr.strip()}")
        return done.stdout

    def write_script(self, name: str, text: str, user: User | None = None) -> Path:
        path = self.jobs / name
        path.write_text(text)
        os.chmod(path, 0o755)
        if user is not None:
            os.chown(path, user.uid, user.gid)
        return path

    def sbatch(self, script: Path, *args: str, user: User | None = None) -> int:
        """Submit ``script`` (as ``user``, else root) from the jobs dir; the job id."""
        argv = ["sbatch", "--parsable", f"--chdir={self.jobs}", *args, str(script)]
        if user is not None:
            argv = ["setpriv", f"--reuid={user.uid}", f"--regid={user.gid}", "--init-groups", *argv]
        done = subprocess.run(argv, env=self.env(), capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise AssertionError(f"sbatch {script.name}: {done.stderr.strip()}")
        return int(done.stdout.strip().split(";")[0])

    def job(self, job_id: int) -> dict[str, str]:
        out = self.scontrol("show", "job", "-o", str(job_id))
        fields: dict[str, str] = {}
        for match in re.finditer(r"(\S+?)=(\S*)", out):
            fields.setdefault(match.group(1), match.group(2))
        return fields

    def state(self, job_id: int) -> str:
        return self.job(job_id).get("JobState", "")

    def wait_state(self, job_id: int, *states: str, timeout: float = 60) -> dict[str, str]:
        def reached() -> dict[str, str] | None:
            fields = self.job(job_id)
            return fields if fields.get("JobState") in states else None

        return wait_for(
            reached, timeout=timeout, interval=0.3, what=f"job {job_id} in {'/'.join(states)}"
        )

    def requeue(self, job_id: int) -> None:
        self.scontrol("requeue", str(job_id))

    def release(self, job_id: int) -> None:
        """A requeued job waits for its BeginTime (~2 min); start it now.

        Not in the second of the requeue: slurmd refuses a launch credential made in
        the second its previous run's was revoked (at the kill, at latest at the
        requeue, which Slurm records as SubmitTime), and slurmctld then ends the job
        ("Killing non-startable batch JobId=N: Job credential revoked", FAILED, no
        output). Slurm's own BeginTime keeps a requeued job far from that second."""
        submitted = datetime.strptime(self.job(job_id)["SubmitTime"], "%Y-%m-%dT%H:%M:%S")
        time.sleep(max(0.0, submitted.timestamp() + 1.05 - time.time()))
        self.scontrol("update", f"jobid={job_id}", "StartTime=now")

    def cancel(self, job_id: int, signal_name: str | None = None) -> None:
        argv = ["scancel", *([f"--signal={signal_name}"] if signal_name else []), str(job_id)]
        subprocess.run(argv, env=self.env(), check=True, capture_output=True)

    def cancel_all(self) -> None:
        """Cancel every job of the cluster (SIGKILL: a teardown does not wait for
        checkpoints)."""
        listed = subprocess.run(
            ["squeue", "--noheader", "--format=%i"],
            env=self.env(), capture_output=True, text=True, check=False,
        )  # fmt: skip
        jobs = listed.stdout.split()
        if jobs:
            subprocess.run(
                ["scancel", "--full", "--signal=KILL", *jobs],
                env=self.env(), capture_output=True, check=False,
            )  # fmt: skip
            subprocess.run(["scancel", *jobs], env=self.env(), capture_output=True, check=False)

    def output(self, name: str) -> str:
        path = self.jobs / name
        return path.read_text(errors="replace") if path.exists() else ""

    def wait_output(self, name: str, pattern: str, timeout: float = 60) -> str:
        regex = re.compile(pattern, re.M)
        try:
            return wait_for(
                lambda: self.output(name) if regex.search(self.output(name)) else None,
                timeout=timeout,
                interval=0.2,
                what=f"{pattern!r} in {name}",
            )
        except WaitTimeout as err:
            tail = "\n".join(self.output(name).splitlines()[-20:])
            raise WaitTimeout(
                f"{err}\n{name} ends with:\n{tail}\njobs:\n{self.queue()}\n"
                f"node: {self.scontrol('show', 'node', self.node, '-o', check=False)}\n"
                + "".join(
                    f"{log} ends with:\n{self.log_tail(log)}\n"
                    for log in ("slurmctld.log", "slurmd.log", "shim.log")
                )
            ) from err

    def queue(self) -> str:
        """Every job Slurm still lists, with its state and why it waits (%r)."""
        listed = subprocess.run(
            ["squeue", "--all", "--states=all", "--format=%i %T %r %S %N"],
            env=self.env(), capture_output=True, text=True, check=False,
        )  # fmt: skip
        return listed.stdout + listed.stderr

    def log_tail(self, name: str, lines: int = 30) -> str:
        return "\n".join(self.log(name).splitlines()[-lines:])

    def wait_idle(self, timeout: float = 60) -> None:
        """The node has finished with every job (no job COMPLETING on it)."""
        wait_for(self._node_idle, timeout=timeout, interval=0.3, what=f"node {self.node} idle")

    def _node_idle(self) -> bool:
        out = self.scontrol("show", "node", self.node, "-o", check=False)
        return "State=IDLE" in out

    def log(self, name: str) -> str:
        """One of the cluster's logs: slurmctld.log, slurmd.log, shim.log."""
        path = self.dir / "log" / name
        return path.read_text(errors="replace") if path.exists() else ""


def counter_script(
    output: str, *, export: str | None, seconds: int = 600, options: tuple[str, ...] = ()
) -> str:
    """The issue's batch script: a ``Counter: N`` line a second."""
    lines = [
        "#!/bin/bash",
        "#SBATCH --job-name=counter",
        f"#SBATCH --output={output}",
        "#SBATCH --nodes=1",
        "#SBATCH --ntasks=1",
        *(f"#SBATCH {option}" for option in options),
    ]
    if export is not None:
        lines.append(f"#SBATCH --export={export}")
    lines.append(f'for i in {{0..{seconds}}}; do echo "Counter: $i"; sleep 1; done')
    return "\n".join(lines) + "\n"


def counters(text: str) -> list[int]:
    """The ``Counter: N`` values of an output, in order."""
    return [int(n) for n in re.findall(r"^Counter: (\d+)$", text, re.M)]


def require_slurm() -> None:
    missing = [b for b in ("slurmctld", "slurmd", "munged", "sbatch", "gcc") if not shutil.which(b)]
    if missing:
        raise AssertionError(
            f"Slurm tests need {', '.join(missing)}: run scripts/setup-node-deps.sh"
        )


def runner_template() -> int | None:
    """The pid of the job runner's warm template serving this checkout (the fork
    server of kind slurm that the first protected job started), if one answers."""
    path = forkserver_socket_path(code_fingerprint(), KIND)
    if not answers(path):
        return None
    with contextlib.suppress(OSError), socket.socket(socket.AF_UNIX) as s:
        s.connect(path)
        creds = s.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
        pid: int = struct.unpack("3i", creds)[0]
        return pid
    return None


def stop_runner_template() -> None:
    """It would idle for an hour after the suite (the runner passes it no environment
    to shorten that): SIGTERM; it removes its socket."""
    pid = runner_template()
    if pid is not None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGTERM)


@contextlib.contextmanager
def running_cluster(
    *,
    plugstack_include: bool = True,
    kill_wait: int = KILL_WAIT,
    proctrack: str = "linuxproc",
    nofile: int | None = None,
) -> Iterator[SlurmCluster]:
    """A started cluster in a fresh directory, stopped and removed afterwards."""
    require_slurm()
    parent = os.environ.get("CEDANA_TEST_TMPDIR", "/tmp")
    cluster = SlurmCluster(
        Path(tempfile.mkdtemp(prefix="cedana-slurm-", dir=parent)),
        plugstack_include=plugstack_include,
        kill_wait=kill_wait,
        proctrack=proctrack,
        nofile=nofile,
    )
    try:
        cluster.start()
        yield cluster
    finally:
        notes = cluster.stop()
        if notes:
            print(f"\n[slurm teardown] {'; '.join(notes)}")
        if not os.environ.get("CEDANA_TEST_KEEP"):
            shutil.rmtree(cluster.dir, ignore_errors=True)


def cedana(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """The ``cedana`` admin CLI of the environment under test."""
    return subprocess.run(
        [str(SHIM_BIN_DIR / "cedana"), *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
        check=False,
    )


# A stand-in for the job runner: records how the plugin started it, then runs the
# job as its user (what the real runner does inside a container).
FAKE_RUNNER = """\
#!/bin/bash
# As the real runner: the job's environment comes on --env-fd, not as our own.
args=("$@")
while [ "$1" != "--" ]; do
  case $1 in --job-id) j=$2;; --uid) u=$2;; --gid) g=$2;; --cwd) c=$2;; --env-fd) fd=$2;; esac
  shift
done
shift
readarray -d '' jobenv < "/proc/self/fd/$fd"
task_pid=$(printf '%s\\n' "${jobenv[@]}" | sed -n 's/^SLURM_TASK_PID=//p')
{
  echo "uid=$(id -u) caps=$(awk '/^CapEff/ {print $2}' /proc/self/status)"
  echo "pid=$$ task_pid=$task_pid cedana_slurm=$CEDANA_SLURM cwd=$(pwd)"
  echo "own_env=$(env | grep -c '^SLURM_') env_fd=$fd"
  printf 'argv='; printf '%s|' "${args[@]}"; echo
} > "@RECORDS@/runner.$j"
cd "$c" && exec env -i "${jobenv[@]}" setpriv --reuid="$u" --regid="$g" --init-groups "$@"
"""


def write_fake_runner(path: Path, records: Path) -> Path:
    """The fake runner at ``path``, writing ``records/runner.JOBID`` for each job."""
    path.write_text(FAKE_RUNNER.replace("@RECORDS@", str(records)))
    os.chmod(path, 0o755)
    return path


def runner_record(records: Path, job_id: int) -> dict[str, str]:
    """What the fake runner recorded: uid, caps, pid, task_pid, cedana_slurm, cwd,
    own_env (how many SLURM_* variables its own environment had), argv."""
    path = records / f"runner.{job_id}"
    if not path.exists():
        return {}
    fields: dict[str, str] = {}
    for line in path.read_text().splitlines():
        if line.startswith("argv="):
            fields["argv"] = line[len("argv=") :]
            continue
        for word in line.split():
            key, _, value = word.partition("=")
            fields[key] = value
    return fields
