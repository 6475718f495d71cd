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
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import socket
import struct
from collections.abc import Awaitable, Callable
from typing import Any, Final

from .. import errors, untrusted_json

RUN_DIR: Final = "/run/cedana/slurm"  # the runners' state: root only
SOCKET_DIR: Final = "/run/cedana-slurm"  # their control sockets (see above)
SOCKET_SUFFIX: Final = ".sock"
MAX_REQUEST: Final = 4096
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


class ControlServer:
    def __init__(self, path: str, allowed: frozenset[int], handle: Handler) -> None:
        self.path = path
        self.allowed = allowed
        self._handle = handle
        self._server: asyncio.Server | None = None

    async def start(self) -> None:
        directory = os.path.dirname(self.path)
        os.makedirs(directory, mode=0o711, exist_ok=True)
        os.chmod(directory, 0o711)
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)  # a runner killed earlier for the same step left it
        self._server = await asyncio.start_unix_server(
            self._serve, path=self.path, limit=MAX_REQUEST
        )
        os.chmod(self.path, 0o666)

    async def close(self) -> None:
        if self._server is not None:
            self._server.close()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
            self._server = None

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            reply = await self._answer(reader, writer.get_extra_info("socket"))
            writer.write(json.dumps(reply).encode() + b"\n")
            await writer.drain()
        except (OSError, asyncio.IncompleteReadError):
            pass  # the client went away; whatever it asked for has run or failed
        finally:
            writer.close()
            with contextlib.suppress(OSError):
                await writer.wait_closed()

    async def _answer(self, reader: asyncio.StreamReader, sock: socket.socket) -> dict[str, Any]:
        try:
            # Read before any refusal: the refused client then still reads the answer.
            try:
                line = await reader.readuntil(b"\n")
            except asyncio.LimitOverrunError as err:
                raise errors.InvalidArgument(f"bad control request: {err}") from None
            uid = peer_uid(sock)
            if uid not in self.allowed:
                allowed = ", ".join(str(u) for u in sorted(self.allowed))
                raise errors.PermissionDenied(
                    f"uid {uid} may not control this job: only root and the job's owner "
                    f"may (uids {allowed})"
                )
            try:
                request = untrusted_json.loads(line)
            except ValueError as err:
                raise errors.InvalidArgument(f"bad control request: {err}") from None
            if not isinstance(request, dict):
                raise errors.InvalidArgument("bad control request: not a JSON object")
            return {"ok": True, **await self._handle(request)}
        except errors.ShimError as err:
            return {"ok": False, "kind": type(err).__name__, "error": str(err)}


def request(path: str, message: dict[str, Any], timeout: float = CLIENT_TIMEOUT) -> dict[str, Any]:
    """Ask the runner behind ``path``; its answer, or the error class it named."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        sock.settimeout(timeout)
        try:
            sock.connect(path)
        except (FileNotFoundError, ConnectionRefusedError):
            raise errors.NotFound(f"no cedana job runner listens on {path}") from None
        except PermissionError:
            raise errors.PermissionDenied(
                f"cannot reach {path}: only root and the job's owner may"
            ) from None
        sock.sendall(json.dumps(message).encode() + b"\n")
        data = b""
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
    "RUN_DIR",
    "SOCKET_DIR",
    "ControlServer",
    "list_sockets",
    "peer_uid",
    "request",
    "socket_path",
]
