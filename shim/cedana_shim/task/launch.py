"""Starting a process with its stdio: the console socket, the pipes, the logging binary.

runc's ``create``, ``exec`` and ``restore`` all start a process whose stdio the
shim provides; :func:`run_with_stdio` wraps any of them. A failed start closes
the stdio (the client waits for EOF on its FIFOs) and stops the logger.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
from collections.abc import Awaitable, Callable

from ..errors import InvalidArgument
from ..runtime.console import ConsoleSocket
from ..runtime.reaper import Child, Reaper
from ..runtime.runc import Stdio
from .stdio import LOGGER_READY_TIMEOUT, LOGGER_STOP_GRACE, ProcessIO

# (console socket path or None, stdio or None) -> the runc call
RuncCall = Callable[[str | None, Stdio | None], Awaitable[None]]


async def run_with_stdio(
    io: ProcessIO, call: RuncCall, *, reaper: Reaper, container_id: str, namespace: str
) -> Child | None:
    """Run a runc verb that starts a process with ``io`` as its stdio.

    Returns the logging binary's process when stdout is a ``binary://`` URI.
    """
    if io.config.terminal:
        try:
            async with ConsoleSocket() as console:
                await call(console.path, None)
                master = await console.receive_master()
        except BaseException:
            io.close()
            raise
        io.start(master)
        return None
    logger: Child | None = None
    try:
        stdin, stdout, stderr = io.prepare()
        logger = await _start_logger(io, reaper, container_id, namespace)
        await call(None, Stdio(stdin, stdout, stderr))
    except BaseException:
        io.close()
        if logger is not None:
            await logger.terminate(LOGGER_STOP_GRACE)
        raise
    io.start()
    return logger


async def _start_logger(
    io: ProcessIO, reaper: Reaper, container_id: str, namespace: str
) -> Child | None:
    plan = io.logger
    if plan is None:
        return None
    import fcntl

    devnull = os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC)
    # The logger wants its pipes at fds 3, 4, 5. Copies above those numbers
    # first, so no dup2 overwrites a source another one still needs.
    sources = (plan.stdout_r, plan.stderr_r, plan.ready_w)
    high = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 10) for fd in sources]
    try:
        pid = os.posix_spawn(
            plan.argv[0],
            list(plan.argv),
            {"CONTAINER_ID": container_id, "CONTAINER_NAMESPACE": namespace},
            file_actions=[
                *((os.POSIX_SPAWN_DUP2, devnull, fd) for fd in (0, 1, 2)),
                *((os.POSIX_SPAWN_DUP2, fd, 3 + i) for i, fd in enumerate(high)),
            ],
        )
    except OSError as err:
        raise InvalidArgument(f"start logging binary {plan.argv[0]}: {err}") from err
    finally:
        for fd in (devnull, *high):
            os.close(fd)
    child = reaper.track(pid)
    io.logger_spawned()
    loop = asyncio.get_running_loop()
    ready = loop.run_in_executor(None, os.read, plan.ready_r, 1)
    with contextlib.suppress(TimeoutError):
        await asyncio.wait_for(ready, LOGGER_READY_TIMEOUT)
    return child
