"""asyncio ttrpc server: requests from a :class:`~cedana_shim.ttrpc.transport.FrameReader`.

Behaviour follows containerd/ttrpc ``server.go``: every Request runs in its own task so
that a blocking ``Wait`` does not hold up ``State`` or ``Kill`` on the same connection;
responses go out in completion order through one writer lock; bad frames get a status
on their stream id and the connection keeps serving. Only an undecodable byte stream
(truncation at EOF) or a failed read/write ends a connection, and never another one.
"""

from __future__ import annotations

import asyncio
import errno
import logging
import os
import socket
import struct
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Generic, TypeVar

from google.protobuf.message import DecodeError, Message

from cedana_shim import errors
from cedana_shim.api.google_rpc.status_pb2 import Status
from cedana_shim.api.ttrpc.request_pb2 import Request, Response
from cedana_shim.errors import ShimError
from cedana_shim.ttrpc.codec import (
    MESSAGE_LENGTH_MAX,
    Frame,
    LocalProtocolError,
    MessageType,
    OversizedFrame,
    RemoteProtocolError,
    encode_frame,
)
from cedana_shim.ttrpc.status import status_from_exception
from cedana_shim.ttrpc.transport import AsyncioStream, FrameReader, Stream

__all__ = ["CallContext", "Method", "Server", "Services"]

logger = logging.getLogger(__name__)

# struct ucred from <sys/socket.h>: pid_t pid; uid_t uid; gid_t gid.
_UCRED: Final = struct.Struct("=iII")
# accept() failures that say nothing about the listening socket itself.
_ACCEPT_RETRY: Final = frozenset(
    {errno.ECONNABORTED, errno.EPROTO, errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM}
)


@dataclass(frozen=True)
class CallContext:
    service: str
    method: str
    # Keys may repeat on the wire (ttrpc ``MD``); all values are kept, in order.
    metadata: Mapping[str, Sequence[str]] = field(default_factory=dict)
    # Seconds, from ``timeout_nano``; None when the client set no deadline.
    timeout: float | None = None


ReqT = TypeVar("ReqT", bound=Message)


@dataclass(frozen=True)
class Method(Generic[ReqT]):
    """A unary method. Generic so a handler may take its concrete request type."""

    request_type: type[ReqT]
    handler: Callable[[ReqT, CallContext], Awaitable[Message]]


Services = Mapping[str, Mapping[str, Method[Any]]]


class Server:
    """Serves ``services`` on any number of connections.

    ``check_peer_uid`` applies to connections accepted by :meth:`serve_socket`: a peer
    whose SO_PEERCRED uid differs from our effective uid is dropped unanswered, as Go's
    ``UnixSocketRequireSameUser`` does.
    """

    def __init__(self, services: Services, *, check_peer_uid: bool = True) -> None:
        self._services = {name: dict(methods) for name, methods in services.items()}
        self._check_peer_uid = check_peer_uid
        self._closing = False
        self._closed = asyncio.Event()
        self._idle = asyncio.Event()
        self._idle.set()
        self._active = 0
        self._acceptors: set[asyncio.Task[None]] = set()
        self._connections: set[_Connection] = set()
        self._connection_tasks: set[asyncio.Task[None]] = set()

    async def serve_socket(self, sock: socket.socket) -> None:
        """Accept on an already-listening unix socket until :meth:`close`.

        The caller keeps ownership of ``sock``. Each accepted connection is served in
        its own task.
        """
        if self._closing:
            return
        acceptor = asyncio.create_task(self._accept_loop(sock), name="ttrpc accept")
        self._acceptors.add(acceptor)
        self._enter()
        try:
            # wait() instead of awaiting the task: close() cancels the acceptor, and that
            # must end this call normally rather than look like our own cancellation.
            await asyncio.wait({acceptor})
        finally:
            acceptor.cancel()
            self._acceptors.discard(acceptor)
            self._exit()
        if not acceptor.cancelled() and (exc := acceptor.exception()) is not None:
            raise exc

    async def serve_stream(self, stream: Stream) -> None:
        """Serve one connection until EOF, a fatal error or (after close()) idleness."""
        if self._closing:
            stream.close()
            return
        conn = _Connection(self._services, stream)
        self._connections.add(conn)
        self._enter()
        try:
            await conn.run()
        finally:
            self._connections.discard(conn)
            self._exit()

    def close(self) -> None:
        """Stop accepting connections and reading requests; in-flight calls finish."""
        if self._closing:
            return
        self._closing = True
        self._closed.set()
        for acceptor in self._acceptors:
            acceptor.cancel()
        for conn in self._connections:
            conn.drain()

    async def wait_closed(self) -> None:
        """Wait for :meth:`close` and then for every connection to finish."""
        await self._closed.wait()
        await self._idle.wait()

    def _enter(self) -> None:
        self._active += 1
        self._idle.clear()

    def _exit(self) -> None:
        self._active -= 1
        if self._active == 0:
            self._idle.set()

    async def _accept_loop(self, sock: socket.socket) -> None:
        loop = asyncio.get_running_loop()
        sock.setblocking(False)
        while True:
            try:
                conn, _ = await loop.sock_accept(sock)
            except OSError as exc:
                if exc.errno not in _ACCEPT_RETRY:
                    raise
                logger.warning("ttrpc: accept failed, retrying: %s", exc)
                await asyncio.sleep(0.1)
                continue
            if self._check_peer_uid and not _peer_uid_allowed(conn):
                conn.close()
                continue
            # Counted from here, not from inside the task, so wait_closed() cannot slip
            # between accept and the task's first step.
            self._enter()
            task = asyncio.create_task(self._serve_accepted(conn), name="ttrpc connection")
            self._connection_tasks.add(task)
            task.add_done_callback(self._connection_done)

    def _connection_done(self, task: asyncio.Task[None]) -> None:
        self._connection_tasks.discard(task)
        self._exit()

    async def _serve_accepted(self, conn: socket.socket) -> None:
        try:
            reader, writer = await asyncio.open_unix_connection(sock=conn)
        except Exception:
            logger.exception("ttrpc: cannot set up accepted connection")
            conn.close()
            return
        await self.serve_stream(AsyncioStream(reader, writer))


def _peer_uid_allowed(conn: socket.socket) -> bool:
    try:
        creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, _UCRED.size)
    except OSError as exc:
        logger.warning("ttrpc: cannot read peer credentials, dropping connection: %s", exc)
        return False
    pid, uid, _gid = _UCRED.unpack(creds)
    ours = os.geteuid()
    if uid != ours:
        logger.warning("ttrpc: dropping connection from pid %d: uid %d is not %d", pid, uid, ours)
        return False
    return True


class _Connection:
    def __init__(self, services: Mapping[str, Mapping[str, Method[Any]]], stream: Stream) -> None:
        self._services = services
        self._stream = stream
        self._write_lock = asyncio.Lock()
        self._calls: set[asyncio.Task[None]] = set()
        self._last_stream_id = 0
        self._reader: asyncio.Task[None] | None = None
        self._draining = False
        self._broken = False

    async def run(self) -> None:
        reader = self._reader = asyncio.create_task(self._read_loop(), name="ttrpc reader")
        try:
            if self._draining:
                reader.cancel()
            await asyncio.wait({reader})
            if self._draining and self._calls:
                await asyncio.wait(set(self._calls))
        finally:
            # On EOF or error the client cannot receive answers any more: cancel its calls
            # (Go cancels their contexts). A draining connection got here with none left.
            self._broken = True
            reader.cancel()
            pending = {reader, *self._calls}
            for task in self._calls:
                task.cancel()
            self._stream.close()
            await asyncio.wait(pending)

    def drain(self) -> None:
        """Stop reading requests; run() returns once the calls in flight are answered."""
        self._draining = True
        if self._reader is not None:
            self._reader.cancel()

    async def _read_loop(self) -> None:
        try:
            async for event in FrameReader(self._stream):
                if isinstance(event, OversizedFrame):
                    await self._send_error(
                        event.stream_id,
                        errors.ResourceExhausted(
                            f"message length {event.length} exceed maximum message size of "
                            f"{MESSAGE_LENGTH_MAX}"
                        ),
                    )
                else:
                    await self._on_frame(event)
        except RemoteProtocolError as exc:
            logger.warning("ttrpc: closing connection: %s", exc)
        except OSError as exc:
            logger.debug("ttrpc: connection failed: %s", exc)
        except Exception:
            logger.exception("ttrpc: closing connection after an unexpected error")

    async def _on_frame(self, frame: Frame) -> None:
        if frame.type != MessageType.REQUEST:
            # Data frames only matter for streaming methods, which the shim API has none
            # of; the 1.6 server ignored unknown types "for future compat".
            logger.debug("ttrpc: ignoring frame type %d on stream %d", frame.type, frame.stream_id)
            return
        stream_id = frame.stream_id
        if stream_id % 2 != 1:
            await self._send_error(
                stream_id,
                errors.InvalidArgument("StreamID must be odd for client initiated streams"),
            )
            return
        if stream_id <= self._last_stream_id:
            await self._send_error(
                stream_id, errors.InvalidArgument("StreamID cannot be re-used and must increment")
            )
            return
        self._last_stream_id = stream_id

        try:
            request = Request.FromString(frame.payload)
        except DecodeError as exc:
            await self._send_error(stream_id, errors.InvalidArgument(f"bad request: {exc}"))
            return
        methods = self._services.get(request.service)
        if methods is None:
            await self._send_error(stream_id, errors.Unimplemented(f"service {request.service}"))
            return
        method = methods.get(request.method)
        if method is None:
            await self._send_error(stream_id, errors.Unimplemented(f"method {request.method}"))
            return

        metadata: dict[str, list[str]] = {}
        for kv in request.metadata:
            metadata.setdefault(kv.key, []).append(kv.value)
        ctx = CallContext(
            service=request.service,
            method=request.method,
            metadata={key: tuple(values) for key, values in metadata.items()},
            timeout=request.timeout_nano / 1e9 if request.timeout_nano > 0 else None,
        )
        task = asyncio.create_task(
            self._call(stream_id, method, request.payload, ctx),
            name=f"ttrpc {request.service}/{request.method} #{stream_id}",
        )
        self._calls.add(task)
        task.add_done_callback(self._calls.discard)

    async def _call(
        self, stream_id: int, method: Method[Any], payload: bytes, ctx: CallContext
    ) -> None:
        try:
            result = await _invoke(method, payload, ctx)
            response = Response(status=Status(), payload=result.SerializeToString())
        except asyncio.CancelledError:
            task = asyncio.current_task()
            if task is not None and task.cancelling():
                raise
            # The handler let a CancelledError out that was not aimed at this call.
            response = Response(status=status_from_exception(errors.Cancelled("call cancelled")))
        except Exception as exc:
            if isinstance(exc, ShimError):
                logger.debug("ttrpc: %s/%s: %s: %s", ctx.service, ctx.method, exc.code.name, exc)
            else:
                logger.exception("ttrpc: %s/%s failed", ctx.service, ctx.method)
            response = Response(status=status_from_exception(exc))
        await self._send_response(stream_id, response)

    async def _send_error(self, stream_id: int, exc: ShimError) -> None:
        logger.debug("ttrpc: stream %d: %s: %s", stream_id, exc.code.name, exc)
        await self._send_response(stream_id, Response(status=status_from_exception(exc)))

    async def _send_response(self, stream_id: int, response: Response) -> None:
        try:
            data = encode_frame(
                Frame(stream_id, MessageType.RESPONSE, 0, response.SerializeToString())
            )
        except LocalProtocolError as exc:
            # As Go's server: a response too large to send becomes RESOURCE_EXHAUSTED.
            status = status_from_exception(errors.ResourceExhausted(str(exc)))
            data = encode_frame(
                Frame(
                    stream_id,
                    MessageType.RESPONSE,
                    0,
                    Response(status=status).SerializeToString(),
                )
            )
        async with self._write_lock:
            if self._broken:
                logger.debug("ttrpc: connection gone, dropping response on stream %d", stream_id)
                return
            try:
                await self._stream.write(data)
            except OSError as exc:
                # The peer is gone or not reading; like Go, give up on the connection.
                logger.debug("ttrpc: write failed, closing connection: %s", exc)
                self._broken = True
                if self._reader is not None:
                    self._reader.cancel()


async def _invoke(method: Method[Any], payload: bytes, ctx: CallContext) -> Message:
    try:
        request = method.request_type.FromString(payload)
    except DecodeError as exc:
        raise errors.InvalidArgument(f"bad {ctx.service}/{ctx.method} request: {exc}") from exc
    if ctx.timeout is None:
        return await method.handler(request, ctx)
    deadline = asyncio.timeout(ctx.timeout)
    try:
        async with deadline:
            return await method.handler(request, ctx)
    except TimeoutError as exc:
        if not deadline.expired():
            raise
        raise errors.DeadlineExceeded(
            f"{ctx.service}/{ctx.method}: deadline of {ctx.timeout:g}s exceeded"
        ) from exc
