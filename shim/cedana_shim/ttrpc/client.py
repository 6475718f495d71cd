"""asyncio ttrpc client, compatible with containerd's ttrpc server.

Like Go's ``ttrpc.Client``: unary calls are multiplexed on one connection with odd
stream ids (1, 3, 5, ...), one reader task hands each Response to the call waiting on
its stream id, and a call that gives up simply forgets its id (a late answer is
dropped). When the connection goes, every pending and later call raises
:class:`~cedana_shim.errors.Unavailable`; callers reconnect with :meth:`Client.connect`.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from types import TracebackType
from typing import TypeVar

from google.protobuf.message import DecodeError, Message

from cedana_shim import errors
from cedana_shim.api.ttrpc.request_pb2 import KeyValue, Request, Response
from cedana_shim.ttrpc.codec import (
    MESSAGE_LENGTH_MAX,
    STREAM_ID_MAX,
    Frame,
    LocalProtocolError,
    MessageType,
    OversizedFrame,
    RemoteProtocolError,
    encode_frame,
)
from cedana_shim.ttrpc.status import error_from_status
from cedana_shim.ttrpc.transport import AsyncioStream, FrameReader, Stream

__all__ = ["Client"]

logger = logging.getLogger(__name__)

M = TypeVar("M", bound=Message)


class Client:
    """One ttrpc connection. Construct inside a running event loop (it starts a task)."""

    def __init__(self, stream: Stream) -> None:
        self._stream = stream
        self._pending: dict[int, asyncio.Future[Response]] = {}
        self._next_stream_id = 1
        self._write_lock = asyncio.Lock()
        self._closed = False
        self._close_reason = "connection closed by peer"
        self._reader = asyncio.create_task(self._read_loop(), name="ttrpc client reader")

    @classmethod
    async def connect(cls, path: str, timeout: float = 5.0) -> Client:
        """Dial a unix socket; ``path`` may carry a ``unix://`` prefix, ``@`` is abstract."""
        target = path.removeprefix("unix://")
        if target.startswith("@"):
            target = "\0" + target[1:]
        try:
            async with asyncio.timeout(timeout):
                reader, writer = await asyncio.open_unix_connection(target)
        except OSError as exc:  # TimeoutError included
            reason = str(exc) or f"timed out after {timeout:g}s"
            raise errors.Unavailable(f"ttrpc: dial {path}: {reason}") from exc
        return cls(AsyncioStream(reader, writer))

    @property
    def closed(self) -> bool:
        return self._closed

    async def call(
        self,
        service: str,
        method: str,
        request: Message,
        response_type: type[M],
        *,
        timeout: float | None = None,
        metadata: Mapping[str, str] | None = None,
    ) -> M:
        """One unary call. A non-OK status raises the matching :mod:`errors` class."""
        if timeout is not None and timeout <= 0:
            raise errors.DeadlineExceeded(f"ttrpc: {service}/{method}: no time left")
        envelope = Request(
            service=service,
            method=method,
            payload=request.SerializeToString(),
            # The server derives its handler deadline from this, as Go's client does.
            timeout_nano=max(1, int(timeout * 1e9)) if timeout is not None else 0,
            metadata=[KeyValue(key=k, value=v) for k, v in (metadata or {}).items()],
        )
        if self._closed:
            raise errors.Unavailable(f"ttrpc: {self._close_reason}")
        stream_id = self._next_stream_id
        if stream_id > STREAM_ID_MAX:
            raise errors.Unavailable("ttrpc: stream ids exhausted on this connection")
        try:
            data = encode_frame(
                Frame(stream_id, MessageType.REQUEST, 0, envelope.SerializeToString())
            )
        except LocalProtocolError as exc:
            raise errors.ResourceExhausted(f"ttrpc: {service}/{method}: {exc}") from exc
        self._next_stream_id += 2

        future: asyncio.Future[Response] = asyncio.get_running_loop().create_future()
        self._pending[stream_id] = future
        deadline = asyncio.timeout(timeout)
        try:
            async with deadline:
                await self._write(data)
                response = await future
        except TimeoutError as exc:
            if not deadline.expired():
                raise
            raise errors.DeadlineExceeded(
                f"ttrpc: {service}/{method}: deadline of {timeout:g}s exceeded"
            ) from exc
        finally:
            self._pending.pop(stream_id, None)

        # Go's client: a missing status and code 0 both mean success.
        if response.HasField("status") and response.status.code != 0:
            raise error_from_status(response.status)
        try:
            return response_type.FromString(response.payload)
        except DecodeError as exc:
            raise errors.Internal(f"ttrpc: {service}/{method}: bad response: {exc}") from exc

    async def close(self) -> None:
        """Close the connection; pending calls raise Unavailable."""
        if not self._closed:
            self._closed = True
            self._close_reason = "client closed"
        self._reader.cancel()
        await asyncio.wait({self._reader})

    async def __aenter__(self) -> Client:
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        await self.close()

    async def _write(self, data: bytes) -> None:
        async with self._write_lock:
            if self._closed:
                # The reader's teardown fails our future; nothing to send.
                return
            try:
                await self._stream.write(data)
            except OSError as exc:
                self._close_reason = f"write failed: {exc}"
                self._closed = True
                self._reader.cancel()

    async def _read_loop(self) -> None:
        try:
            async for event in FrameReader(self._stream):
                if isinstance(event, OversizedFrame):
                    self._fail(
                        event.stream_id,
                        errors.ResourceExhausted(
                            f"ttrpc: response length {event.length} exceeds maximum message "
                            f"size of {MESSAGE_LENGTH_MAX}"
                        ),
                    )
                elif event.type == MessageType.RESPONSE:
                    self._on_response(event)
                else:
                    logger.debug("ttrpc: ignoring frame type %d", event.type)
        except RemoteProtocolError as exc:
            self._close_reason = str(exc)
        except OSError as exc:
            self._close_reason = str(exc) or type(exc).__name__
        except Exception:
            logger.exception("ttrpc: client reader failed")
            self._close_reason = "client reader failed"
        finally:
            self._closed = True
            self._stream.close()
            for stream_id in list(self._pending):
                self._fail(stream_id, errors.Unavailable(f"ttrpc: {self._close_reason}"))

    def _on_response(self, frame: Frame) -> None:
        future = self._pending.get(frame.stream_id)
        if future is None or future.done():
            logger.debug("ttrpc: response on inactive stream %d dropped", frame.stream_id)
            return
        try:
            response = Response.FromString(frame.payload)
        except DecodeError as exc:
            future.set_exception(errors.Internal(f"ttrpc: bad response envelope: {exc}"))
            return
        future.set_result(response)

    def _fail(self, stream_id: int, exc: errors.ShimError) -> None:
        future = self._pending.get(stream_id)
        if future is not None and not future.done():
            future.set_exception(exc)
