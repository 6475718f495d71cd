"""What CRIU is known not to dump, found before anything is frozen.

A dump that CRIU is bound to refuse would freeze the container (and lock its GPUs)
for nothing, and its reason would come out of CRIU's log. So before each dump the
container's process tree is read from /proc, the tree CRIU itself walks (from the
init process, through every thread's ``children``), for two things:

* a process of another user while CRIU lacks CAP_SYS_RESOURCE. CRIU reads every
  process's resource limits with prlimit(2), which the kernel refuses unless the
  caller has CAP_SYS_RESOURCE or the target's real, effective and saved uids and gids
  all equal the caller's real uid and gid (``Can't get rlimit 0: Operation not
  permitted``). CRIU runs as the shim's user (root), and as root it gets what the
  capability bounding set allows;
* an io_uring instance (an fd on ``anon_inode:[io_uring]``): CRIU has no support
  for io_uring at all.

Cheap enough for every dump (one status file, the children files and the fd links
per process: well under a millisecond per process), and before the freeze, so the
container runs meanwhile.
"""

from __future__ import annotations

import collections
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Final

from ..errors import FailedPrecondition

log = logging.getLogger(__name__)

CAP_SYS_RESOURCE: Final = 24
IO_URING: Final = "anon_inode:[io_uring]"


def bounding_set(pid: int | str = "self", proc: str = "/proc") -> int:
    """A process's capability bounding set (CapBnd): the shim's is what CRIU, which
    runs as root under it, may have."""
    path = os.path.join(proc, str(pid), "status")
    with open(path) as f:
        for line in f:
            if line.startswith("CapBnd:"):
                return int(line.split()[1], 16)
    raise OSError(f"no CapBnd in {path}")


def has_sys_resource(pid: int | str = "self", proc: str = "/proc") -> bool:
    return bool(bounding_set(pid, proc) >> CAP_SYS_RESOURCE & 1)


@dataclass(frozen=True, slots=True)
class Proc:
    """One process of the container, as its status file shows it."""

    pid: int  # as the shim sees it
    comm: str
    uids: tuple[int, ...]  # real, effective, saved
    gids: tuple[int, ...]
    ns_pid: int  # inside the container's pid namespace
    zombie: bool

    def describe(self) -> str:
        inside = f", pid {self.ns_pid} in the container" if self.ns_pid != self.pid else ""
        return f"process {self.pid} ({self.comm}{inside})"


def check(container_id: str, init_pid: int, *, proc: str = "/proc") -> None:
    """FailedPrecondition naming the first process of the tree under ``init_pid``
    that CRIU cannot dump, and why. What cannot be read is logged and left to CRIU:
    the check never fails a checkpoint by itself."""
    try:
        problem = _problem(init_pid, proc)
    except OSError as err:
        log.warning(
            "cannot check the container's processes before the dump; CRIU will tell",
            extra={"container": container_id, "error": str(err)},
        )
        return
    if problem:
        raise FailedPrecondition(
            f"checkpoint of container {container_id} refused, nothing was frozen: its {problem}"
        )


def _problem(init_pid: int, proc: str) -> str:
    sys_resource: bool | None = None  # read once, and only when a process needs it
    me = (os.getuid(), os.getgid())
    for process in _tree(init_pid, proc):
        if process.zombie:  # CRIU dumps no limits nor files of a zombie
            continue
        if any(u != me[0] for u in process.uids) or any(g != me[1] for g in process.gids):
            if sys_resource is None:
                sys_resource = has_sys_resource(proc=proc)
            if not sys_resource:
                ids = f"{_ids('uid', process.uids)}, {_ids('gid', process.gids)}"
                return (
                    f"{process.describe()} runs as {ids}, and CRIU (root) can read another "
                    "user's resource limits only with CAP_SYS_RESOURCE, which this node's "
                    "capability bounding set lacks (`cedana doctor` shows it); add "
                    "CAP_SYS_RESOURCE to the bounding set containerd runs with (systemd: "
                    "CapabilityBoundingSet= in its unit), or run the container's processes "
                    "as root"
                )
        fd = _io_uring_fd(process.pid, proc)
        if fd is not None:
            return (
                f"{process.describe()} has an io_uring instance (fd {fd}), and CRIU cannot "
                "checkpoint io_uring; have the application do its I/O without it (or turn "
                "io_uring off on the node, `sysctl kernel.io_uring_disabled=2`, for "
                "applications that fall back without it)"
            )
    return ""


def _ids(kind: str, ids: tuple[int, ...]) -> str:
    if len(set(ids)) == 1:
        return f"{kind} {ids[0]}"
    return f"{kind}s {', '.join(map(str, ids))} (real, effective, saved)"


def _tree(init_pid: int, proc: str) -> Iterator[Proc]:
    """The processes under ``init_pid``, parents first; ones gone meanwhile skipped."""
    todo = collections.deque([init_pid])
    seen: set[int] = set()
    while todo:
        pid = todo.popleft()
        if pid in seen:
            continue
        seen.add(pid)
        process = _read(pid, proc)
        if process is None:
            continue
        yield process
        todo.extend(_children(pid, proc))


def _read(pid: int, proc: str) -> Proc | None:
    fields: dict[str, str] = {}
    try:
        with open(os.path.join(proc, str(pid), "status")) as f:
            for line in f:
                key, _, value = line.partition(":")
                fields[key] = value.strip()
    except (FileNotFoundError, ProcessLookupError):
        return None
    try:
        return Proc(
            pid=pid,
            comm=fields["Name"],
            uids=tuple(int(v) for v in fields["Uid"].split()[:3]),
            gids=tuple(int(v) for v in fields["Gid"].split()[:3]),
            ns_pid=int(fields.get("NSpid", str(pid)).split()[-1]),
            zombie=fields.get("State", "").startswith("Z"),
        )
    except (KeyError, ValueError, IndexError) as err:
        raise OSError(f"cannot read {proc}/{pid}/status: {err}") from err


def _children(pid: int, proc: str) -> list[int]:
    out: list[int] = []
    try:
        tids = os.listdir(os.path.join(proc, str(pid), "task"))
    except (FileNotFoundError, ProcessLookupError):
        return out
    for tid in tids:
        try:
            with open(os.path.join(proc, str(pid), "task", tid, "children")) as f:
                out.extend(int(child) for child in f.read().split())
        except (FileNotFoundError, ProcessLookupError):
            continue
    return out


def _io_uring_fd(pid: int, proc: str) -> int | None:
    fd_dir = os.path.join(proc, str(pid), "fd")
    try:
        fds = os.listdir(fd_dir)
    except (FileNotFoundError, ProcessLookupError):
        return None
    for fd in fds:
        try:
            if os.readlink(os.path.join(fd_dir, fd)) == IO_URING:
                return int(fd)
        except (FileNotFoundError, ProcessLookupError):
            continue
    return None
