"""Stopping the job when runc cannot run.

runc needs fork/exec, memfds and pipes, so free descriptors; it can also fail for
reasons of its own. A job's stop must not depend on either: a job that outlives its
Slurm job keeps the node's resources from the next one, and a requeued copy of it
may start beside it. So the keeper holds, from the job's start:

* :class:`InitHandle`: a pidfd of the container's init and a descriptor of its
  freezer (cgroup v1 ``freezer.state``, v2 ``cgroup.freeze``). Signalling the init
  and thawing need no new descriptor. SIGKILL to the init is SIGKILL to the whole
  job: the container has a PID namespace of its own, and the kernel kills every
  process of it when its init dies. The thaw lets a job frozen by a checkpoint take
  that SIGKILL (cgroup v1 leaves a frozen task's SIGKILL pending until it thaws).
* :class:`JobRunc`: the job's runc, whose ``kill`` and ``resume`` fall back to the
  InitHandle when runc fails for any reason but the container being gone. The stop
  (lifecycle/checkpointing.py) signals and kills through these two calls, so a stop whose
  checkpoint could not be made still delivers its signal, and one whose checkpoint
  is durable still kills.
* :class:`FdReserve`: descriptors held open and given back, most when a stop begins
  (its checkpoint can then run even if something used up the others), the rest when
  the job ends (for the cleanup after it).
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import signal
from typing import Any, Final

from ..errors import FailedPrecondition, NotFound, ShimError
from ..runtime.runc import Runc
from . import cgroups

log = logging.getLogger(__name__)

# A stop's checkpoint holds 2-5 descriptors more than the keeper at rest (sampled in
# three stops); the rest is margin. Of /dev/null, they cost nothing.
FD_FOR_STOP: Final = 64
# The end's cleanup (runc delete, unmounts, removing the bundle) after a stop that used
# the others.
FD_FOR_END: Final = 16


class InitHandle:
    """The container's init, reachable without runc and without a new descriptor."""

    def __init__(self, pid: int, pidfd: int, freezer: int = -1, thawed: bytes = b"") -> None:
        self.pid = pid
        self._pidfd = pidfd
        self._freezer = freezer
        self._thawed = thawed

    @classmethod
    def open(cls, pid: int, cgroup: str) -> InitHandle:
        """Opened while ``pid`` cannot have been reaped and reused yet (the caller
        checks that its exit was not seen before). The freezer is best effort."""
        pidfd = os.pidfd_open(pid)
        try:
            return cls(pid, pidfd, *_open_freezer(cgroup))
        except OSError:
            return cls(pid, pidfd)

    def deliver(self, sig: int) -> None:
        """``sig`` to the init; SIGKILL, or a signal that cannot be delivered, kills the
        job (thawed for it). NotFound: the init is gone."""
        if sig != signal.SIGKILL:
            try:
                self._send(sig)
                return
            except OSError as err:
                log.error(
                    "cannot signal the job's init; killing the job",
                    extra={"pid": self.pid, "signal": sig, "error": str(err)},
                )
        self.kill()

    def kill(self) -> None:
        """SIGKILL the whole job (see the module docstring), then thaw it."""
        try:
            self._send(signal.SIGKILL)
        finally:
            self.thaw()

    def thaw(self) -> None:
        if self._freezer >= 0:
            with contextlib.suppress(OSError):  # the cgroup is gone with the job
                os.write(self._freezer, self._thawed)

    def close(self) -> None:
        for fd in (self._pidfd, self._freezer):
            if fd >= 0:
                os.close(fd)
        self._pidfd = self._freezer = -1

    def _send(self, sig: int) -> None:
        try:
            signal.pidfd_send_signal(self._pidfd, sig)
        except OSError as err:
            if err.errno in (errno.ESRCH, errno.EBADF):
                raise NotFound(f"the job's init {self.pid} is gone") from None
            raise


def _open_freezer(cgroup: str) -> tuple[int, bytes]:
    """A descriptor of ``cgroup``'s freezer, and what thaws it."""
    mounted = {h.key: h for h in cgroups.hierarchies()}
    # cgroup v1's freezer first: on a hybrid node it is the one runc freezes.
    for key, name, thawed in (("freezer", "freezer.state", b"THAWED"), ("", "cgroup.freeze", b"0")):
        if key in mounted:
            with contextlib.suppress(OSError):
                path = os.path.join(mounted[key].path(cgroup), name)
                return os.open(path, os.O_WRONLY | os.O_CLOEXEC), thawed
    raise FileNotFoundError(f"no freezer of cgroup {cgroup}")


class JobRunc(Runc):
    """The job's runc; its kill and resume reach the job without runc (see above)
    once :attr:`init` is set."""

    def __init__(self, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self.init: InitHandle | None = None

    async def kill(self, id: str, signal: int, *, all: bool = False) -> None:
        """With the fallback, ``all`` reaches every process only for SIGKILL (through
        the PID namespace); another signal reaches the init, as runc's without it."""
        try:
            await super().kill(id, signal, all=all)
        except NotFound:
            raise
        except (ShimError, OSError) as err:
            if self.init is None:
                raise
            log.warning(
                "runc kill failed; signalling the job's init directly",
                extra={"container": id, "signal": int(signal), "error": str(err)},
            )
            self.init.deliver(signal)

    async def resume(self, id: str) -> None:
        try:
            await super().resume(id)
        except (NotFound, FailedPrecondition):
            raise  # gone, or not paused: nothing to thaw
        except (ShimError, OSError) as err:
            if self.init is None:
                raise
            log.warning(
                "runc resume failed; thawing the job's cgroup directly",
                extra={"container": id, "error": str(err)},
            )
            self.init.thaw()


class FdReserve:
    """``count`` descriptors (of /dev/null) held until released."""

    def __init__(self, count: int = FD_FOR_STOP + FD_FOR_END) -> None:
        self._fds: list[int] = []
        with contextlib.suppress(OSError):  # a smaller reserve is still one
            for _ in range(count):
                self._fds.append(os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC))

    def __len__(self) -> int:
        return len(self._fds)

    def release(self, count: int | None = None) -> None:
        """Give back ``count`` of them (None: all that are left)."""
        for _ in range(len(self._fds) if count is None else min(count, len(self._fds))):
            os.close(self._fds.pop())


__all__ = ["FD_FOR_END", "FD_FOR_STOP", "FdReserve", "InitHandle", "JobRunc"]
