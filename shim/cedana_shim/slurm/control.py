"""The control socket of one job runner: ``/run/cedana-slurm/<jobid>.<step>.sock``.

One request per connection, one JSON object per line each way::

    {"op": "checkpoint"}  ->  {"ok": true, "checkpoint": "<id>", "label": ..., ...}
    {"op": "status"}      ->  {"ok": true, "job": "42", "step": "batch", ...}
    (any failure)         ->  {"ok": false, "kind": "FailedPrecondition", "error": "..."}

Who may ask: root and the job's owner (the runner passes both as ``allowed``),
decided on the caller's SO_PEERCRED credentials, not on anything the caller says.
This is the one cedana socket a user reaches, on purpose: a researcher asks for an
on-demand checkpoint of their own job (``cedana slurm checkpoint JOBID`` on the
job's node). So these sockets live in a directory of their own, ``/run/cedana-slurm``
(root's, 0711: enter, not list), outside the root-only ``/run/cedana`` that holds
the runner's bundles, runc's state and every other socket; each socket is 0666 and
the credential check is the access control. Listing the jobs (``cedana slurm jobs``)
needs root.

Anyone on the node can connect, so nothing a caller does may cost the runner more
than a few descriptors for a few seconds (a runner out of descriptors cannot
checkpoint or even signal its job):

* the credentials are checked the moment a connection is accepted, before anything
  is read: a stranger gets one line saying why (sent without waiting) and is closed
  at once, and so never holds a slot;
* at most ``MAX_PER_UID`` connections of one uid (root's too) and ``MAX_CONNECTIONS``
  in all are served at a time; one more is refused the same way;
* the request line must arrive whole, at most ``MAX_REQUEST`` bytes, within
  ``READ_TIMEOUT`` seconds of the accept (an idle connection is dropped then), and
  the answer must be taken within ``WRITE_TIMEOUT``;
* accepting is this module's own loop, not asyncio's server: out of descriptors,
  asyncio logs a traceback for every retry of ``accept()`` (thousands a second).
  Here a spare descriptor is given up to accept and close the waiting connection, so
  the backlog drains and the warning is one line (rate-limited in the log).
"""

from __future__ import annotations

import asyncio
import contextlib
import errno
import json
import logging
import os
import socket
import struct
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from typing import Any, Final

from .. import errors, untrusted_json

log = logging.getLogger(__name__)

RUN_DIR: Final = "/run/cedana/slurm"  # the runners' state: root only
SOCKET_DIR: Final = "/run/cedana-slurm"  # their control sockets (see above)
SOCKET_SUFFIX: Final = ".sock"
MAX_REQUEST: Final = 4096
MAX_PER_UID: Final = 4
MAX_CONNECTIONS: Final = 8
READ_TIMEOUT: Final = 5.0
WRITE_TIMEOUT: Final = 5.0
BACKLOG: Final = 128  # waiting connections cost the kernel, not our descriptors
ACCEPT_BATCH: Final = 16  # accepted per turn of the loop
CONNECT_TIMEOUT: Final = 30.0  # seconds a client retries a full backlog
ACCEPT_RETRY: Final = 1.0  # seconds without accepting when no descriptor is left at all
_OUT_OF_FDS: Final = frozenset({errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM})
# A checkpoint may take up to checkpoint_timeout (600 s by default) and its commit.
CLIENT_TIMEOUT: Final = 900.0

Handler = Callable[[dict[str, Any]], Awaitable[dict[str, Any]]]


def socket_path(name: str, base: str = SOCKET_DIR) -> str:
    """The socket of job step ``name`` (``<jobid>.<step>``)."""
    return os.path.join(base, name + SOCKET_SUFFIX)


def peer_uid(sock: socket.socket) -> int:
    creds = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    _pid, uid, _gid = struct.unpack("3i", creds)
    return int(uid)


def _failure(err: errors.ShimError) -> bytes:
    return json.dumps({"ok": False, "kind": type(err).__name__, "error": str(err)}).encode() + b"\n"


class ControlServer:
    def __init__(self, path: str, allowed: frozenset[int], handle: Handler) -> None:
        self.path = path
        self.allowed = allowed
        self._handle = handle
        self._sock: socket.socket | None = None
        self._spare = -1  # given up to accept (and close) when no descriptor is left
        self._serving: Counter[int] = Counter()  # uid -> connections being served
        self._tasks: set[asyncio.Task[None]] = set()  # held: the loop holds them weakly

    async def start(self) -> None:
        directory = os.path.dirname(self.path)
        os.makedirs(directory, mode=0o711, exist_ok=True)
        os.chmod(directory, 0o711)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)  # a runner killed earlier for the same step left it
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            sock.setblocking(False)
            sock.bind(self.path)
            os.chmod(self.path, 0o666)
            sock.listen(BACKLOG)
            self._spare = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
        except BaseException:
            sock.close()
            raise
        self._sock = sock
        asyncio.get_running_loop().add_reader(sock.fileno(), self._accept)

    async def close(self) -> None:
        """No new connection; those being served finish within their deadlines."""
        sock, self._sock = self._sock, None
        if sock is None:
            return
        asyncio.get_running_loop().remove_reader(sock.fileno())
        sock.close()
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        if self._spare >= 0:
            os.close(self._spare)
            self._spare = -1

    def _accept(self) -> None:
        sock = self._sock
        for _ in range(ACCEPT_BATCH):  # then the loop's other work gets its turn
            if sock is None:
                return
            try:
                conn, _ = sock.accept()
            except (BlockingIOError, InterruptedError):
                return
            except ConnectionAbortedError:
                continue
            except OSError as err:
                if err.errno in _OUT_OF_FDS:
                    self._shed(sock, err)
                else:
                    log.warning(
                        "control socket: accept failed",
                        extra={"path": self.path, "error": str(err)},
                    )
                return
            self._admit(conn)

    def _shed(self, sock: socket.socket, err: OSError) -> None:
        """Out of descriptors: the spare one takes the waiting connection, which is
        closed unserved, and is taken back; with none to spare, accepting pauses."""
        log.warning(
            "control socket: out of file descriptors; a connection was closed unserved",
            extra={"path": self.path, "error": str(err)},
        )
        if self._spare >= 0:
            os.close(self._spare)
            self._spare = -1
        with contextlib.suppress(OSError):
            conn, _ = sock.accept()
            conn.close()
        try:
            self._spare = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
        except OSError:
            loop = asyncio.get_running_loop()
            loop.remove_reader(sock.fileno())
            loop.call_later(ACCEPT_RETRY, self._resume, sock)

    def _resume(self, sock: socket.socket) -> None:
        if self._sock is sock:
            if self._spare < 0:
                with contextlib.suppress(OSError):
                    self._spare = os.open(os.devnull, os.O_RDONLY | os.O_CLOEXEC)
            asyncio.get_running_loop().add_reader(sock.fileno(), self._accept)

    def _admit(self, conn: socket.socket) -> None:
        """Serve ``conn``, or refuse it at once: nothing of a stranger's is read."""
        try:
            conn.setblocking(False)
            uid = peer_uid(conn)
        except OSError:
            conn.close()
            return
        refusal = self._refusal(uid)
        if refusal is not None:
            log.warning(
                "control socket: connection refused",
                extra={"path": self.path, "uid": uid, "error": str(refusal)},
            )
            with contextlib.suppress(OSError):  # never waits: the line or nothing
                conn.send(_failure(refusal), socket.MSG_DONTWAIT | socket.MSG_NOSIGNAL)
            conn.close()
            return
        self._serving[uid] += 1
        task = asyncio.get_running_loop().create_task(self._serve(conn, uid))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def _refusal(self, uid: int) -> errors.ShimError | None:
        if uid not in self.allowed:
            allowed = ", ".join(str(u) for u in sorted(self.allowed))
            return errors.PermissionDenied(
                f"uid {uid} may not control this job: only root and the job's owner "
                f"may (uids {allowed})"
            )
        if self._serving[uid] >= MAX_PER_UID or self._serving.total() >= MAX_CONNECTIONS:
            return errors.ResourceExhausted(
                f"this job's runner is already serving {self._serving[uid]} requests of "
                f"uid {uid} ({self._serving.total()} in all; at most {MAX_PER_UID} per "
                "user): try again once one has been answered"
            )
        return None

    async def _serve(self, conn: socket.socket, uid: int) -> None:
        loop = asyncio.get_running_loop()
        try:
            reply = await self._answer(conn)
            await asyncio.wait_for(loop.sock_sendall(conn, reply), WRITE_TIMEOUT)
        except (OSError, TimeoutError):
            pass  # the client went away; whatever it asked for has run or failed
        finally:
            conn.close()
            self._serving[uid] -= 1

    async def _answer(self, conn: socket.socket) -> bytes:
        try:
            try:
                line = await asyncio.wait_for(_read_line(conn), READ_TIMEOUT)
            except TimeoutError:
                raise errors.DeadlineExceeded(
                    f"no whole request line within {READ_TIMEOUT:g}s: connection dropped"
                ) from None
            try:
                request = untrusted_json.loads(line)
            except ValueError as err:
                raise errors.InvalidArgument(f"bad control request: {err}") from None
            if not isinstance(request, dict):
                raise errors.InvalidArgument("bad control request: not a JSON object")
            return json.dumps({"ok": True, **await self._handle(request)}).encode() + b"\n"
        except errors.ShimError as err:
            return _failure(err)


async def _read_line(conn: socket.socket) -> bytes:
    """One request line, at most MAX_REQUEST bytes; what follows it is ignored."""
    loop = asyncio.get_running_loop()
    data = b""
    while b"\n" not in data:
        if len(data) >= MAX_REQUEST:
            raise errors.InvalidArgument(
                f"bad control request: longer than {MAX_REQUEST} bytes without a newline"
            )
        chunk = await loop.sock_recv(conn, MAX_REQUEST - len(data))
        if not chunk:
            raise errors.InvalidArgument(
                "bad control request: the connection ended before a newline"
            )
        data += chunk
    return data[: data.index(b"\n") + 1]


def request(path: str, message: dict[str, Any], timeout: float = CLIENT_TIMEOUT) -> dict[str, Any]:
    """Ask the runner behind ``path``; its answer, or the error class it named."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(timeout)
        _connect(sock, path, min(timeout, CONNECT_TIMEOUT))
        # A refusal comes at once, maybe before the request is sent: read it anyway.
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            sock.sendall(json.dumps(message).encode() + b"\n")
        data = b""
        with contextlib.suppress(ConnectionResetError):
            while not data.endswith(b"\n"):
                chunk = sock.recv(65536)
                if not chunk:
                    break
                data += chunk
    except TimeoutError:
        raise errors.DeadlineExceeded(
            f"the job runner on {path} did not answer within {timeout:g}s"
        ) from None
    finally:
        sock.close()
    if not data:
        raise errors.Unavailable(
            f"the job runner on {path} closed the connection without answering: try again"
        )
    try:
        reply = json.loads(data)
    except ValueError:
        raise errors.Internal(f"the job runner on {path} answered {data[:200]!r}") from None
    if not isinstance(reply, dict):
        raise errors.Internal(f"the job runner on {path} answered {data[:200]!r}")
    if not reply.pop("ok", False):
        kind = getattr(errors, str(reply.get("kind")), errors.Internal)
        if not (isinstance(kind, type) and issubclass(kind, errors.ShimError)):
            kind = errors.Internal
        raise kind(str(reply.get("error", "the job runner failed without saying why")))
    return reply


def _connect(sock: socket.socket, path: str, timeout: float) -> None:
    """A full backlog (others connecting faster than the runner refuses them) fails a
    unix socket's connect at once, EAGAIN: retried until ``timeout``."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            sock.connect(path)
            return
        except (FileNotFoundError, ConnectionRefusedError):
            raise errors.NotFound(f"no cedana job runner listens on {path}") from None
        except PermissionError:
            raise errors.PermissionDenied(
                f"cannot reach {path}: only root and the job's owner may"
            ) from None
        except BlockingIOError:
            if time.monotonic() >= deadline:
                raise errors.Unavailable(
                    f"the job runner on {path} took no connection within {timeout:g}s: try again"
                ) from None
            time.sleep(0.01)


def list_sockets(base: str = SOCKET_DIR) -> list[str]:
    """Every runner's socket on this node (root only: the directory is not listable)."""
    try:
        names = os.listdir(base)
    except FileNotFoundError:
        return []
    except PermissionError:
        raise errors.PermissionDenied(
            f"cannot list {base}: listing the protected jobs needs root; the job's owner "
            "can ask one job: cedana slurm checkpoint JOBID"
        ) from None
    return sorted(os.path.join(base, n) for n in names if n.endswith(SOCKET_SUFFIX))


__all__ = [
    "CLIENT_TIMEOUT",
    "MAX_CONNECTIONS",
    "MAX_PER_UID",
    "MAX_REQUEST",
    "READ_TIMEOUT",
    "RUN_DIR",
    "SOCKET_DIR",
    "ControlServer",
    "list_sockets",
    "peer_uid",
    "request",
    "socket_path",
]
