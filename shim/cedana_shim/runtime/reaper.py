"""The one owner of SIGCHLD and ``waitpid(-1)`` in the shim daemon.

The daemon is a child subreaper: container processes re-parent to it when runc
exits. Every exit, of runc itself or of a container process, is collected
here, once, and handed out from here, so no exit status is ever lost to a racing
``waitpid`` (CPython's own child watcher would report 255 for those).

* :meth:`Reaper.spawn` starts a helper command and returns a :class:`Child`
  whose exit the reaper resolves; the pid is registered before control returns
  to the event loop, so the exit cannot be missed.
* :meth:`Reaper.subscribe` registers a callback for every other exit (the
  container processes); :meth:`Reaper.collect` records exits during a window,
  for processes whose pid is learnt only after they may already have died
  (containerd's ``preStart``).
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import IO

PR_SET_CHILD_SUBREAPER = 36
KILL_GRACE_SECONDS = 5.0


@dataclass(frozen=True, slots=True)
class Exit:
    pid: int
    status: int  # exit code, or 128 + signal for a signal death
    timestamp: float  # time.time() when reaped


def exit_status(wait_status: int) -> int:
    """Decode a ``waitpid`` status the way containerd reports it."""
    if os.WIFSIGNALED(wait_status):
        return 128 + os.WTERMSIG(wait_status)
    if os.WIFEXITED(wait_status):
        return os.WEXITSTATUS(wait_status)
    return 255


def set_child_subreaper() -> None:
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_CHILD_SUBREAPER)")


@dataclass(eq=False)
class Child:
    """A process started through the reaper; await :meth:`wait` for its exit."""

    pid: int
    popen: subprocess.Popen[bytes] | None  # None for a pid handed in through track()
    exited: asyncio.Future[Exit]

    async def wait(self) -> Exit:
        return await asyncio.shield(self.exited)

    async def terminate(self, grace: float = KILL_GRACE_SECONDS) -> Exit:
        """SIGTERM, wait ``grace`` seconds, SIGKILL; always waits for the exit."""
        if not self.exited.done():
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGTERM)
            try:
                return await asyncio.wait_for(asyncio.shield(self.exited), grace)
            except TimeoutError:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(self.pid, signal.SIGKILL)
        return await asyncio.shield(self.exited)


@dataclass(eq=False)
class _Window:
    exits: dict[int, Exit] = field(default_factory=dict)


class Reaper:
    def __init__(self, loop: asyncio.AbstractEventLoop | None = None) -> None:
        self._loop = loop or asyncio.get_running_loop()
        self._children: dict[int, Child] = {}
        self._subscribers: list[Callable[[Exit], None]] = []
        self._windows: list[_Window] = []
        self._installed = False

    def install(self) -> None:
        """Take over SIGCHLD; reap anything that exited before we did."""
        self._loop.add_signal_handler(signal.SIGCHLD, self.reap)
        self._installed = True
        self.reap()

    def close(self) -> None:
        if self._installed:
            self._loop.remove_signal_handler(signal.SIGCHLD)
            self._installed = False

    def spawn(
        self,
        argv: Sequence[str],
        *,
        stdin: int | IO[bytes] | None = subprocess.DEVNULL,
        stdout: int | IO[bytes] | None = subprocess.DEVNULL,
        stderr: int | IO[bytes] | None = subprocess.DEVNULL,
        pass_fds: Sequence[int] = (),
        cwd: str | None = None,
        env: Mapping[str, str] | None = None,
        start_new_session: bool = False,
        process_group: int | None = None,
    ) -> Child:
        # Runs on the loop thread, so SIGCHLD (delivered through the loop) cannot
        # be handled between fork and the registration below.
        popen = subprocess.Popen(
            list(argv),
            stdin=stdin,
            stdout=stdout,
            stderr=stderr,
            pass_fds=tuple(pass_fds),
            cwd=cwd,
            env=None if env is None else dict(env),
            start_new_session=start_new_session,
            process_group=process_group,
            close_fds=True,
        )
        child = Child(popen.pid, popen, self._loop.create_future())
        self._children[popen.pid] = child
        return child

    def track(self, pid: int) -> Child:
        """Take over a child started by other means (``os.posix_spawn``).

        Call it on the loop thread right after the spawn, before awaiting
        anything, so the exit cannot be reaped unclaimed in between.
        """
        child = Child(pid, None, self._loop.create_future())
        self._children[pid] = child
        return child

    def subscribe(self, callback: Callable[[Exit], None]) -> Callable[[], None]:
        """Call ``callback`` for every exit not of a spawned child; returns an unsubscribe."""
        self._subscribers.append(callback)
        return lambda: self._subscribers.remove(callback)

    @contextlib.contextmanager
    def collect(self) -> Iterator[Mapping[int, Exit]]:
        """Record, for the duration, every exit of a process we did not spawn."""
        window = _Window()
        self._windows.append(window)
        try:
            yield window.exits
        finally:
            self._windows.remove(window)

    def reap(self) -> None:
        while True:
            try:
                pid, wait_status = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                return
            self._deliver(Exit(pid, exit_status(wait_status), time.time()))

    def _deliver(self, ex: Exit) -> None:
        child = self._children.pop(ex.pid, None)
        if child is not None:
            if child.popen is not None:
                # Popen must never wait for (and so never steal) this pid itself.
                child.popen.returncode = ex.status
            if not child.exited.done():
                child.exited.set_result(ex)
            return
        for window in self._windows:
            window.exits[ex.pid] = ex
        for callback in list(self._subscribers):
            callback(ex)
