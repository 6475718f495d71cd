"""The cgroups of a protected job: the keeper's, the container's, and what is left of
them once the job ends (Slurm 22.05's cgroup plugins, checked against its source).

* **The keeper leaves the step's cgroups** for the root cgroup of every hierarchy
  (:func:`leave_for_root`), as slurmstepd itself moves to the root before it removes a
  step's cgroups (``cgroup_v1.c`` ``_remove_cg_subsystem``). With proctrack/cgroup,
  Slurm signals the pids in the step's own ``cgroup.procs`` (cgroup/v1: the step's
  freezer cgroup; cgroup/v2: its ``slurm`` and ``task_N`` cgroups): SIGTERM only to
  slurmstepd's direct children (the task process), SIGKILL at the end of KillWait to
  every one of them, again and again until they are gone (``proctrack_p_wait``). A
  keeper in there would die with the task process, before it could abandon a
  checkpoint. (linuxproc signals the task's process tree and pgid its process group:
  the keeper is outside both by its double fork and ``setsid``.)
* **The container's cgroup** is a child of the task's (job_spec.container_cgroup): the
  job's memory limit, cpuset and devices apply to it, and since Slurm reads no child
  cgroup's ``cgroup.procs``, Slurm's signals reach only the task process, which
  forwards them to the keeper.
* **Nothing stays.** runc creates the container's path in every hierarchy (``mkdir
  -p``) and removes only its leaf: the directories it had to create above it are
  removed after it (:class:`CreatedDirs`). And when the task process is killed first
  (KillWait's SIGKILL, ``scancel``), slurmstepd removes the step's cgroups while ours
  are still in them, fails (EBUSY) and leaves them: the keeper then finishes that
  removal once its own cgroups are gone (:func:`finish_slurm_removal`), with the
  same best effort and under the same lock as Slurm (``flock`` of the hierarchy's
  root, ``common_cgroup_lock``).
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import re
from collections.abc import Iterator
from dataclasses import dataclass

log = logging.getLogger(__name__)

CGROUP_ROOT = "/sys/fs/cgroup"


@dataclass(frozen=True, slots=True)
class Hierarchy:
    """One mounted cgroup hierarchy: ``key`` as /proc/PID/cgroup names it (``memory``,
    ``cpu,cpuacct``, ``name=systemd``; ``""`` for cgroup2)."""

    key: str
    mountpoint: str

    def path(self, cgroup: str) -> str:
        return os.path.join(self.mountpoint, cgroup.lstrip("/"))


def hierarchies(mountinfo: str | None = None) -> list[Hierarchy]:
    """The cgroup hierarchies mounted whole (mount root ``/``) in this mount namespace,
    each once: a hierarchy mounted from a subdirectory (a cgroup namespace, a
    container) is not one this node's Slurm manages."""
    if mountinfo is None:
        with open("/proc/self/mountinfo", encoding="utf-8", errors="surrogateescape") as f:
            mountinfo = f.read()
    found: dict[str, Hierarchy] = {}
    for line in mountinfo.splitlines():
        fields = line.split()
        if "-" not in fields[6:]:
            continue
        sep = fields.index("-", 6)
        fstype, options = fields[sep + 1], fields[sep + 3] if len(fields) > sep + 3 else ""
        if fields[3] != "/" or fstype not in ("cgroup", "cgroup2"):
            continue
        if fstype == "cgroup2":
            key = ""
        else:
            known = [o for o in options.split(",") if o not in _MOUNT_FLAGS]
            key = ",".join(known)
        found.setdefault(key, Hierarchy(key, fields[4]))
    return list(found.values())


_MOUNT_FLAGS = frozenset(
    {"rw", "ro", "nosuid", "nodev", "noexec", "relatime", "noatime", "clone_children",
     "xattr", "nsdelegate", "memory_recursiveprot", "memory_localevents", "noprefix"}
)  # fmt: skip


def leave_for_root() -> list[str]:
    """Move this process into the root cgroup of every hierarchy it is not at the root
    of already (a move costs ~1 ms per hierarchy: the kernel syncs RCU); what could not
    be moved (a hierarchy this process may not write), for the log."""
    with open("/proc/self/cgroup", encoding="utf-8") as f:
        current = dict(line.split(":", 2)[1:] for line in f.read().splitlines() if line)
    problems = []
    for h in hierarchies():
        if current.get(h.key, "/") == "/":
            continue
        try:
            with open(os.path.join(h.mountpoint, "cgroup.procs"), "w") as f:
                f.write(str(os.getpid()))
        except OSError as err:
            problems.append(f"{h.mountpoint}: {err.strerror}")
    return problems


def _ancestors(path: str, top: str) -> list[str]:
    """The directories from ``top`` (excluded) down to ``path`` (included)."""
    out = []
    while path != top and path.startswith(top + "/"):
        out.append(path)
        path = os.path.dirname(path)
    return list(reversed(out))


class CreatedDirs:
    """The directories above the container's cgroup that runc will create (``mkdir
    -p`` in every hierarchy) because they are missing now; :meth:`remove` takes away
    those that are empty once the container is deleted, deepest first.

    A parent shared with another job's container (no Slurm cgroup plugin: every job's
    container sits below slurmd's own cgroup) stays while that container is in it.
    """

    def __init__(self, cgroup: str, found: list[Hierarchy] | None = None) -> None:
        parent = os.path.dirname(cgroup.rstrip("/"))
        self.missing: list[str] = []
        for h in hierarchies() if found is None else found:
            for d in _ancestors(h.path(parent), h.mountpoint.rstrip("/")):
                if not os.path.isdir(d):
                    self.missing.append(d)

    def remove(self) -> None:
        for d in sorted(self.missing, key=lambda p: p.count("/"), reverse=True):
            with contextlib.suppress(OSError):
                os.rmdir(d)


# The names Slurm 22.05 gives the cgroups of one job: cgroup/v1
# slurm/uid_U/job_J/step_S/task_T, cgroup/v2 .../job_J/step_S/{slurm,user/task_T}.
_STEP_LEVEL = re.compile(r"task_[0-9]+|task_special|user|step_[A-Za-z0-9_]+")


def slurm_dirs_of_job(parent: str, job_id: str, uid: int) -> list[str]:
    """The directories of ``parent`` (a cgroup path) that Slurm made for this job,
    deepest first: everything below ``job_<id>``, that directory, and ``uid_<uid>``
    above it (cgroup/v1). Nothing when the path is not under this job's."""
    parts = parent.strip("/").split("/")
    try:
        at = parts.index(f"job_{job_id}")
    except ValueError:
        return []
    if not all(_STEP_LEVEL.fullmatch(p) for p in parts[at + 1 :]):
        return []
    first = at - 1 if at > 0 and parts[at - 1] == f"uid_{uid}" else at
    return ["/" + "/".join(parts[: i + 1]) for i in range(len(parts) - 1, first - 1, -1)]


def finish_slurm_removal(cgroup: str, job_id: str, uid: int) -> list[str]:
    """After the container's cgroup is gone: remove the empty cgroups of this job that
    Slurm could not remove while ours were in them (Slurm's own best effort: stop at
    the first that is busy, ENOENT is done). What was removed."""
    parent = os.path.dirname(cgroup.rstrip("/"))
    dirs = slurm_dirs_of_job(parent, job_id, uid)
    removed: list[str] = []
    if not dirs:
        return removed
    for h in hierarchies():
        with _slurm_lock(h.mountpoint):
            for d in dirs:
                full = h.path(d)
                try:
                    os.rmdir(full)
                except FileNotFoundError:
                    continue
                except OSError as err:
                    if err.errno not in (errno.EBUSY, errno.ENOTEMPTY):
                        log.warning("cannot remove a cgroup of the job",
                                    extra={"path": full, "error": err.strerror})  # fmt: skip
                    break
                removed.append(full)
    return removed


@contextlib.contextmanager
def _slurm_lock(mountpoint: str) -> Iterator[None]:
    """The lock slurmstepd takes around creating and removing a job's cgroups."""
    try:
        fd = os.open(mountpoint, os.O_RDONLY | os.O_DIRECTORY)
    except OSError:
        yield
        return
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


__all__ = [
    "CreatedDirs",
    "Hierarchy",
    "finish_slurm_removal",
    "hierarchies",
    "leave_for_root",
    "slurm_dirs_of_job",
]
