"""Starting a hook process, and learning how it exited, two ways.

Hooks are started with ``posix_spawn`` rather than ``Reaper.spawn`` (Popen):
the runtime spec gives a hook ``path`` and ``args`` separately (execv), and
``args[0]`` need not be ``path``. Popen cannot express that without
``executable=``, which the reaper does not pass on; multi-call binaries
(busybox) dispatch on ``argv[0]``. Each hook leads its own session, so a
timeout can kill everything it started with one ``killpg``.

* :func:`reaper_spawn` is for the shim daemon: the :class:`Reaper` owns
  SIGCHLD and ``waitpid(-1)``, so the exit must be collected through it
  (``Reaper.track``), or the reaper and we would race for it.
* :func:`pidfd_spawn` is for standalone use (tools, tests without a reaper):
  it waits on a pidfd and reaps that one pid itself.
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Protocol

from ..runtime.reaper import Child, Reaper, exit_status

log = logging.getLogger(__name__)

# Popen's restore_signals: Python ignores these, and ignored signals stay
# ignored across exec.
_DEFAULT_SIGNALS = (signal.SIGPIPE, signal.SIGXFSZ)


@dataclass(frozen=True, slots=True)
class Command:
    path: str
    argv: tuple[str, ...]
    env: Mapping[str, str]


class Running(Protocol):
    @property
    def pid(self) -> int: ...

    async def wait(self) -> int:
        """The exit status (128+signal for a signal death); safe to call again."""
        ...


class Spawn(Protocol):
    def __call__(self, command: Command, *, stdin: int, output: int) -> Running:
        """Start ``command`` in a new session with ``stdin`` as fd 0 and
        ``output`` as fds 1 and 2; raises ``OSError`` if it cannot be executed."""
        ...


def posix_spawn(command: Command, *, stdin: int, output: int) -> int:
    # Callers pass fds >= 3, so no dup2 below clobbers a later source.
    return os.posix_spawn(
        command.path,
        list(command.argv),
        dict(command.env),
        file_actions=[
            (os.POSIX_SPAWN_DUP2, stdin, 0),
            (os.POSIX_SPAWN_DUP2, output, 1),
            (os.POSIX_SPAWN_DUP2, output, 2),
        ],
        setsid=True,
        setsigmask=(),
        setsigdef=_DEFAULT_SIGNALS,
    )


@dataclass(eq=False)
class _Tracked:
    child: Child

    @property
    def pid(self) -> int:
        return self.child.pid

    async def wait(self) -> int:
        return (await self.child.wait()).status


def reaper_spawn(reaper: Reaper) -> Spawn:
    """A :class:`Spawn` whose exits the daemon's reaper collects."""

    def spawn(command: Command, *, stdin: int, output: int) -> Running:
        pid = posix_spawn(command, stdin=stdin, output=output)
        # Before any await: the reaper must know the pid before SIGCHLD is handled.
        return _Tracked(reaper.track(pid))

    return spawn


class _Pidfd:
    def __init__(self, pid: int) -> None:
        self._pid = pid
        self._fd: int | None = os.pidfd_open(pid)
        self._status: int | None = None

    @property
    def pid(self) -> int:
        return self._pid

    async def wait(self) -> int:
        if self._status is not None:
            return self._status
        assert self._fd is not None
        loop = asyncio.get_running_loop()
        exited: asyncio.Future[None] = loop.create_future()

        def readable() -> None:
            if not exited.done():
                exited.set_result(None)

        loop.add_reader(self._fd, readable)
        try:
            await exited
        finally:
            loop.remove_reader(self._fd)
        try:
            _, wait_status = os.waitpid(self._pid, 0)
            self._status = exit_status(wait_status)
        except ChildProcessError:
            # Someone else reaped it: a Reaper is installed and reaper_spawn was not used.
            log.warning("hook exit status lost to another reaper", extra={"pid": self._pid})
            self._status = 255
        os.close(self._fd)
        self._fd = None
        return self._status


def pidfd_spawn(command: Command, *, stdin: int, output: int) -> Running:
    """The standalone :class:`Spawn`: no reaper, the exit is awaited on a pidfd."""
    pid = posix_spawn(command, stdin=stdin, output=output)
    try:
        return _Pidfd(pid)
    except OSError:
        # No pidfd (fd limit): do not leave the child running unwatched.
        os.killpg(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        raise
