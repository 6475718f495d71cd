"""The OCI bundle a Slurm job runs in: the host itself, seen from new PID and mount
namespaces, so that CRIU can restore the job with the same PIDs on a later run.

* Root: runc 1.1.5 bind-mounts the rootfs onto itself *recursively*, and CRIU then
  has to dump every host mount below it as the container's own (it refuses devpts,
  cgroup and bind mounts of host directories). So the root is a *non-recursive*
  bind of the host's ``/`` (made in the runner's private mount namespace, see
  :func:`bind_host_root`), and every other host mount is listed in the spec as a
  bind mount at its own path: runc marks spec bind mounts external for CRIU, which
  then records only their paths and binds them again at restore.
* ``/proc`` is the new PID namespace's own; network, IPC, UTS and the user
  namespace are the host's.
* The process is the job's: uid, gid, groups, cwd, environment, rlimits, umask and
  OOM score as Slurm gave them to the task process (read from /proc/PID of that
  process, :func:`task_facts`: the keeper that builds the spec may have been forked
  by a warm template elsewhere). Its init is :data:`INIT_SCRIPT` (see there).
* Its cgroup is a child of the task process's (the job's), named after the job step,
  so that runc's freeze and ``kill --all`` reach the job's processes only (see
  cgroups.py for how that sits with Slurm's own cgroups).
"""

from __future__ import annotations

import os
import resource
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Final

from ..errors import InvalidArgument
from ..runtime.mount import Mount, mount_all

# The container's pid 1. A process that is pid 1 of its namespace ignores every
# signal it has no handler for, and Slurm (proctrack/linuxproc) signals *every*
# process of a step: this init catches the signals the runner forwards and passes
# each to every other process of the job (kill -1 spares the sender), then exits
# with the job's own status (128+signal when a signal ended it), as the batch
# script would have under plain Slurm. The job's stdin is handed on explicitly: a
# non-interactive shell gives a background command /dev/null otherwise. A trapped
# signal cuts `wait` short with 128+signal, and the shell may reap the job before the
# next `kill -0` (dash did, for one signal in ~6 here): only a `wait` on a job already
# gone tells its own status (the shell keeps it), never the interrupted one.
INIT_SCRIPT: Final = (
    'for s in HUP INT QUIT USR1 USR2 ALRM TERM CONT; do trap "kill -$s -1" $s; done; '
    '"$@" <&0 & child=$!; '
    'while kill -0 "$child" 2>/dev/null; do wait "$child"; done; '
    'wait "$child"'
)
INIT_ARGV0: Final = "cedana-job-init"
SHELL: Final = "/bin/sh"

# Capability names runc 1.1 knows, in kernel bit order.
_CAPABILITIES: Final = [
    "CHOWN",
    "DAC_OVERRIDE",
    "DAC_READ_SEARCH",
    "FOWNER",
    "FSETID",
    "KILL",
    "SETGID",
    "SETUID",
    "SETPCAP",
    "LINUX_IMMUTABLE",
    "NET_BIND_SERVICE",
    "NET_BROADCAST",
    "NET_ADMIN",
    "NET_RAW",
    "IPC_LOCK",
    "IPC_OWNER",
    "SYS_MODULE",
    "SYS_RAWIO",
    "SYS_CHROOT",
    "SYS_PTRACE",
    "SYS_PACCT",
    "SYS_ADMIN",
    "SYS_BOOT",
    "SYS_NICE",
    "SYS_RESOURCE",
    "SYS_TIME",
    "SYS_TTY_CONFIG",
    "MKNOD",
    "LEASE",
    "AUDIT_WRITE",
    "AUDIT_CONTROL",
    "SETFCAP",
    "MAC_OVERRIDE",
    "MAC_ADMIN",
    "SYSLOG",
    "WAKE_ALARM",
    "BLOCK_SUSPEND",
    "AUDIT_READ",
    "PERFMON",
    "BPF",
    "CHECKPOINT_RESTORE",
]
_RLIMITS: Final = [
    "AS",
    "CORE",
    "CPU",
    "DATA",
    "FSIZE",
    "LOCKS",
    "MEMLOCK",
    "MSGQUEUE",
    "NICE",
    "NOFILE",
    "NPROC",
    "RSS",
    "RTPRIO",
    "RTTIME",
    "SIGPENDING",
    "STACK",
]
# Mounts the container gets from its own namespaces, never as a host bind.
_OWN_MOUNTS: Final = ("/proc",)
# Mounts that come and go with other software (container runtimes, login sessions,
# network namespaces, a user's FUSE mounts, other jobs' private /tmp mounts): a job
# does not see them, and its checkpoint does not need them on the node it resumes on.
_TRANSIENT_UNDER: Final = (
    "/tmp",
    "/var/tmp",
    "/run/user",
    "/run/containerd",
    "/run/docker",
    "/run/netns",
    "/run/cedana",
    "/var/lib/docker",
    "/var/lib/containerd",
    "/var/lib/kubelet",
)
_TRANSIENT_TYPES: Final = ("overlay", "nsfs", "fuse")


def container_id_of(name: str) -> str:
    """The container of job step ``<jobid>.<step>``."""
    return f"slurm-{name}"


def batch_job_of(container_id: str) -> int | None:
    """The job whose batch step ``container_id`` is (None: not a batch step's)."""
    job, dot, step = container_id.removeprefix(container_id_of("")).partition(".")
    if container_id.startswith(container_id_of("")) and dot and step == "batch" and job.isdigit():
        return int(job)
    return None


@dataclass(frozen=True, slots=True)
class JobRequest:
    """What the SPANK plugin hands the runner for one job step."""

    job_id: str
    step_id: str
    uid: int
    gid: int
    gids: tuple[int, ...]
    cwd: str
    argv: tuple[str, ...]
    env: Mapping[str, str]
    umask: int = 0o022
    task_pid: int = 0  # the task process Slurm runs (0: this process)

    @property
    def name(self) -> str:
        """``<jobid>.<step>``: the control socket's and the container's name."""
        return f"{self.job_id}.{self.step_id}"

    @property
    def container_id(self) -> str:
        return container_id_of(self.name)


@dataclass(frozen=True, slots=True)
class HostMount:
    path: str
    options: tuple[str, ...]  # the per-mount flags that a bind keeps (ro, nosuid, ...)


_KEPT_FLAGS: Final = frozenset({"ro", "nosuid", "nodev", "noexec"})


def host_mounts(mountinfo: str | None = None) -> list[HostMount]:
    """The mount points of this mount namespace a job sees, parents first, each once
    (the topmost mount at a path is the one a bind takes): all but ``/``, ``/proc``
    and the transient ones (:data:`_TRANSIENT_UNDER`, :data:`_TRANSIENT_TYPES`)."""
    if mountinfo is None:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as f:
            mountinfo = f.read()
    seen: dict[str, HostMount] = {}
    for line in mountinfo.splitlines():
        fields = line.split()
        if len(fields) < 6 or "-" not in fields[6:]:
            continue
        path = _unescape(fields[4])
        fstype = fields[fields.index("-", 6) + 1]
        if (
            path == "/"
            or _under(path, _OWN_MOUNTS)
            or any(path.startswith(p + "/") for p in _TRANSIENT_UNDER)
            or fstype.split(".")[0] in _TRANSIENT_TYPES
        ):
            seen.pop(path, None)
            continue
        flags = tuple(o for o in fields[5].split(",") if o in _KEPT_FLAGS)
        seen.pop(path, None)  # a later mount at the same path covers the earlier one
        seen[path] = HostMount(path, flags)
    return sorted(seen.values(), key=lambda m: m.path.count("/"))


def _under(path: str, prefixes: Iterable[str]) -> bool:
    return any(path == p or path.startswith(p + "/") for p in prefixes)


def _unescape(field: str) -> str:
    r"""mountinfo writes space, tab, newline and backslash as \ooo."""
    if "\\" not in field:
        return field
    out, i = bytearray(), 0
    raw = field.encode("utf-8", "surrogateescape")
    while i < len(raw):
        if raw[i : i + 1] == b"\\" and raw[i + 1 : i + 4].isdigit():
            out.append(int(raw[i + 1 : i + 4], 8))
            i += 4
        else:
            out.append(raw[i])
            i += 1
    return out.decode("utf-8", "surrogateescape")


def job_cgroup(proc_cgroup: str | None = None) -> str:
    """The cgroup path of this process (v2's, else v1's memory controller's)."""
    if proc_cgroup is None:
        with open("/proc/self/cgroup", encoding="utf-8") as f:
            proc_cgroup = f.read()
    v1 = ""
    for line in proc_cgroup.splitlines():
        hierarchy, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if hierarchy == "0" and not controllers:
            unified = path
            if not v1:
                v1 = unified
        if "memory" in controllers.split(","):
            return path
    return v1 or "/"


def container_cgroup(parent: str, request: JobRequest) -> str:
    return os.path.join(parent, f"cedana-{request.container_id}")


@dataclass(frozen=True, slots=True)
class TaskFacts:
    """What Slurm set on the task process that the job's processes keep."""

    status: str  # /proc/PID/status (capabilities, umask)
    cgroup: str  # /proc/PID/cgroup
    rlimits: list[dict[str, Any]]
    oom_score_adj: int | None
    umask: int


def task_facts(pid: int = 0) -> TaskFacts:
    """The facts of process ``pid`` (0: this one); OSError when it is gone."""
    proc = f"/proc/{pid or os.getpid()}"
    with open(f"{proc}/status", encoding="utf-8") as f:
        status = f.read()
    with open(f"{proc}/cgroup", encoding="utf-8") as f:
        cgroup = f.read()
    try:
        with open(f"{proc}/oom_score_adj", encoding="ascii") as f:
            oom: int | None = int(f.read().strip())
    except (OSError, ValueError):
        oom = None
    umask = 0o022
    for line in status.splitlines():
        if line.startswith("Umask:"):
            umask = int(line.split()[1], 8)
    return TaskFacts(status, cgroup, rlimits_of(pid), oom, umask)


def parent_of(pid: int) -> int:
    """The parent pid of ``pid`` (0 when it is gone)."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return int(f.read().rsplit(b")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return 0


def rlimits_of(pid: int = 0) -> list[dict[str, Any]]:
    """The rlimits of process ``pid`` (0: this one), as Slurm set the task's."""
    out: list[dict[str, Any]] = []
    for name in _RLIMITS:
        number = getattr(resource, f"RLIMIT_{name}", None)
        if number is None:
            continue
        soft, hard = resource.prlimit(pid, number)
        out.append({"type": f"RLIMIT_{name}", "soft": _limit(soft), "hard": _limit(hard)})
    return out


def take_rlimits_of(*pids: int) -> list[str]:
    """Set this process's rlimits to the highest of those of ``pids``, as far as it may
    (raising a hard limit needs CAP_SYS_RESOURCE); the ones it could not set. The
    keeper takes slurmstepd's and the task's: its own would otherwise be those of
    whichever job's task process started the warm template, and runc and CRIU, its
    children, set the job's limits (the user's) and need to be allowed to."""
    failed = []
    for name in _RLIMITS:
        number = getattr(resource, f"RLIMIT_{name}", None)
        if number is None:
            continue
        try:
            limits = [resource.prlimit(pid, number) for pid in pids]
            resource.setrlimit(number, (_highest(lim[0] for lim in limits),
                                        _highest(lim[1] for lim in limits)))  # fmt: skip
        except (OSError, ValueError):
            failed.append(name)
    return failed


def _highest(values: Iterable[int]) -> int:
    seen = list(values)
    return resource.RLIM_INFINITY if resource.RLIM_INFINITY in seen else max(seen)


def _limit(value: int) -> int:
    # runc reads an unsigned 64-bit number; RLIM_INFINITY is -1 in Python.
    return (1 << 64) - 1 if value == resource.RLIM_INFINITY else value


def capabilities(uid: int, status: str | None = None) -> dict[str, list[str]]:
    """The task's own bounding set (the job may run setuid programs, as on the host;
    runc cannot grant more than it has); the other sets: this process's effective
    ones for root's jobs, nothing for anyone else's."""
    if status is None:
        with open("/proc/self/status", encoding="utf-8") as f:
            status = f.read()
    masks = {}
    for line in status.splitlines():
        key, _, value = line.partition(":")
        if key in ("CapBnd", "CapEff"):
            masks[key] = int(value.strip(), 16)
    bounding = _cap_names(masks.get("CapBnd", 0))
    granted = _cap_names(masks.get("CapEff", 0)) if uid == 0 else []
    return {
        "bounding": bounding,
        "effective": granted,
        "permitted": granted,
        "inheritable": granted,
        "ambient": [],
    }


CAP_SYS_RESOURCE: Final = _CAPABILITIES.index("SYS_RESOURCE")


def checkpoint_obstacle(uid: int, status: str | None = None) -> str | None:
    """Why CRIU cannot checkpoint a job of ``uid`` run by this process (None when
    nothing is known against it): CRIU reads every task's rlimits (prlimit), which for
    another user's process needs CAP_SYS_RESOURCE ("Can't get rlimit 0: Operation not
    permitted" in its log); a root whose bounding set lacks it (some containers and
    sandboxes) can checkpoint root's jobs only."""
    if uid == 0:
        return None
    if status is None:
        with open("/proc/self/status", encoding="utf-8") as f:
            status = f.read()
    for line in status.splitlines():
        key, _, value = line.partition(":")
        if key == "CapEff" and not int(value.strip(), 16) >> CAP_SYS_RESOURCE & 1:
            return (
                f"this node cannot checkpoint jobs of uid {uid}: CRIU must read the job's "
                "rlimits, which needs CAP_SYS_RESOURCE, and the node's root lacks it "
                "(slurmd runs without it in its capability bounding set); only root's "
                "jobs can be checkpointed here: ask the node's administrator"
            )
    return None


def _cap_names(mask: int) -> list[str]:
    return [f"CAP_{name}" for bit, name in enumerate(_CAPABILITIES) if mask >> bit & 1]


def build_spec(
    request: JobRequest,
    *,
    rootfs: str,
    mounts: Sequence[HostMount],
    cgroup: str,
    rlimits: Iterable[Mapping[str, Any]],
    proc_status: str | None = None,
    oom_score_adj: int | None = None,
) -> dict[str, Any]:
    if not request.argv:
        raise InvalidArgument(f"slurm job {request.name}: no command to run")
    if not os.path.isabs(request.cwd):
        raise InvalidArgument(f"slurm job {request.name}: cwd {request.cwd!r} is not absolute")
    spec_mounts: list[dict[str, Any]] = [
        {"destination": "/proc", "type": "proc", "source": "proc", "options": []}
    ]
    for m in mounts:
        spec_mounts.append(
            {
                "destination": m.path,
                "type": "bind",
                "source": m.path,
                "options": ["bind", *m.options],
            }
        )
    user: dict[str, Any] = {"uid": request.uid, "gid": request.gid, "umask": request.umask}
    if request.gids:
        user["additionalGids"] = list(request.gids)
    process: dict[str, Any] = {
        "terminal": False,
        "user": user,
        "args": [SHELL, "-c", INIT_SCRIPT, INIT_ARGV0, *request.argv],
        "env": [f"{k}={v}" for k, v in request.env.items()],
        "cwd": request.cwd,
        "capabilities": capabilities(request.uid, proc_status),
        "rlimits": list(rlimits),
        "noNewPrivileges": False,
    }
    if oom_score_adj is not None:
        process["oomScoreAdj"] = oom_score_adj
    return {
        "ociVersion": "1.0.2",
        "process": process,
        "root": {"path": rootfs, "readonly": False},
        "hostname": "",
        "mounts": spec_mounts,
        "linux": {
            "namespaces": [{"type": "pid"}, {"type": "mount"}],
            "cgroupsPath": cgroup,
            "resources": {"devices": [{"allow": True, "access": "rwm"}]},
            "maskedPaths": [],
            "readonlyPaths": [],
        },
    }


def bind_host_root(rootfs: str) -> None:
    """``/`` at ``rootfs``, without the mounts below it, private (no host mount event
    propagates into it). Call it in the runner's own mount namespace only: the bind
    then disappears with the runner and never shows on the host."""
    os.makedirs(rootfs, mode=0o700, exist_ok=True)
    mount_all([Mount("bind", "/", options=("bind", "private"))], rootfs)


__all__ = [
    "INIT_SCRIPT",
    "HostMount",
    "JobRequest",
    "TaskFacts",
    "bind_host_root",
    "build_spec",
    "capabilities",
    "checkpoint_obstacle",
    "container_cgroup",
    "host_mounts",
    "job_cgroup",
    "parent_of",
    "rlimits_of",
    "take_rlimits_of",
    "task_facts",
]
