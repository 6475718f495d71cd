"""The console socket through which runc hands over a terminal's pty master.

runc connects to the socket named by ``--console-socket`` during ``create``
(or ``exec``/``restore``) and sends the master fd with SCM_RIGHTS. The listen
backlog holds runc's connection, so the master can be received after runc has
returned, as containerd does.
"""

from __future__ import annotations

import array
import asyncio
import contextlib
import os
import socket
from types import TracebackType
from typing import Final

from cedana_shim import errors

__all__ = ["ConsoleSocket"]

_SOCKET_NAME: Final = "pty.sock"
_SUN_PATH_MAX: Final = 107  # sizeof(sun_path) less the terminating NUL
_FALLBACK_DIRS: Final = ("/run/cedana/pty", "/tmp")


def _base_dir() -> str:
    xdg = os.environ.get("XDG_RUNTIME_DIR")
    if xdg and os.path.isdir(xdg):
        return xdg
    for candidate in _FALLBACK_DIRS:
        try:
            os.makedirs(candidate, mode=0o700, exist_ok=True)
        except OSError:
            continue
        if os.access(candidate, os.W_OK | os.X_OK):
            return candidate
    raise errors.Internal("no writable directory for a console socket")


class ConsoleSocket:
    """``async with ConsoleSocket() as cs:`` pass ``cs.path`` to runc, then
    ``fd = await cs.receive_master()``. The caller owns (and closes) the fd."""

    def __init__(self, base_dir: str | None = None) -> None:
        self._base_dir = base_dir
        self._dir: str | None = None
        self._path: str | None = None
        self._sock: socket.socket | None = None

    @property
    def path(self) -> str:
        if self._path is None:
            raise errors.FailedPrecondition("console socket is not open")
        return self._path

    async def __aenter__(self) -> ConsoleSocket:
        self.open()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def open(self) -> None:
        import tempfile

        # A private 0700 directory: nobody else can connect and hand us an fd.
        directory = tempfile.mkdtemp(prefix="pty", dir=self._base_dir or _base_dir())
        path = os.path.join(directory, _SOCKET_NAME)
        if len(os.fsencode(path)) > _SUN_PATH_MAX:
            os.rmdir(directory)
            raise errors.Internal(f"console socket path {path} is too long for AF_UNIX")
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            sock.bind(path)
            sock.listen(1)
            sock.setblocking(False)
        except OSError as err:
            sock.close()
            with contextlib.suppress(OSError):
                os.unlink(path)
            os.rmdir(directory)
            raise errors.Internal(f"console socket {path}: {err}") from err
        self._dir, self._path, self._sock = directory, path, sock

    def close(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None
        if self._dir is not None:
            assert self._path is not None
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self._path)
            with contextlib.suppress(OSError):
                os.rmdir(self._dir)
            self._dir = self._path = None

    async def receive_master(self, timeout: float = 30.0) -> int:
        """Accept runc's connection and return the pty master it sends (CLOEXEC)."""
        if self._sock is None:
            raise errors.FailedPrecondition("console socket is not open")
        loop = asyncio.get_running_loop()
        try:
            async with asyncio.timeout(timeout):
                conn, _ = await loop.sock_accept(self._sock)
                with conn:
                    conn.setblocking(False)
                    return await _receive_fd(loop, conn)
        except TimeoutError as err:
            raise errors.DeadlineExceeded(
                f"runc sent no console on {self._path} within {timeout}s"
            ) from err


async def _receive_fd(loop: asyncio.AbstractEventLoop, conn: socket.socket) -> int:
    fds = array.array("i")
    while True:
        try:
            msg, ancdata, flags, _ = conn.recvmsg(
                1024, socket.CMSG_SPACE(4 * fds.itemsize), socket.MSG_CMSG_CLOEXEC
            )
            break
        except BlockingIOError:
            await _readable(loop, conn)
    for level, kind, data in ancdata:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(data[: len(data) - len(data) % fds.itemsize])
    if flags & socket.MSG_CTRUNC or len(fds) != 1:
        for fd in fds:
            os.close(fd)
        if not msg and not fds:
            raise errors.Internal("runc closed the console socket without sending a terminal")
        raise errors.Internal(f"runc sent {len(fds)} fds on the console socket, expected one")
    return fds[0]


async def _readable(loop: asyncio.AbstractEventLoop, conn: socket.socket) -> None:
    ready: asyncio.Future[None] = loop.create_future()

    def wake() -> None:
        if not ready.done():
            ready.set_result(None)

    loop.add_reader(conn.fileno(), wake)
    try:
        await ready
    finally:
        loop.remove_reader(conn.fileno())
