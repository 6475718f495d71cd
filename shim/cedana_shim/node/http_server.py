"""Small HTTP/1.1 servers: one asyncio thread holds every connection.

The node agent's API (agent_api.py) and the controller's (controller/server.py) use it.
:class:`BoundedServer` holds the connections for it and for the node agent's /metrics
(metrics_server.py), for the same reasons (a silent client must cost no thread and must
not keep a real request out):

* at most ``max_connections`` at once; one more closes the oldest that has not sent
  its whole request yet, or itself when all of them are being answered;
* ``read_timeout`` seconds from the accept to the end of the request (head of at
  most :data:`MAX_HEAD` bytes, body of at most ``max_body``); every answer closes
  the connection;
* the handler is plain synchronous code run on a small thread pool (a checkpoint
  takes seconds; it must not stop the loop), given ``handler_timeout`` seconds before
  the client is told 504 (the work itself goes on: it cannot be interrupted).
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import http
import json
import logging
import socket
import threading
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any, Final
from urllib.parse import parse_qs, unquote

MAX_HEAD: Final = 16384
MAX_BODY: Final = 1 << 20
_BACKLOG: Final = 128

log = logging.getLogger("cedana.http")


@dataclass(frozen=True)
class Request:
    method: str
    path: str  # decoded, without the query
    query: Mapping[str, str]  # the first value of each name
    headers: Mapping[str, str]  # names lower-cased
    body: bytes
    client: str  # the peer's address

    def bearer(self) -> str:
        """The token of an ``Authorization: Bearer`` header; "" when there is none."""
        scheme, _, token = self.headers.get("authorization", "").partition(" ")
        return token.strip() if scheme.lower() == "bearer" else ""


@dataclass(frozen=True)
class Response:
    status: int
    body: bytes = b""
    content_type: str = "application/json"
    headers: Mapping[str, str] = field(default_factory=dict)


Handler = Callable[[Request], Response]


class BoundedServer:
    """One asyncio thread holding every connection, at most ``max_connections`` of
    them (see the module doc). Bound at once (an address in use raises OSError here,
    not in the thread); serves from :meth:`start` until :meth:`close`. A subclass
    reads a request (:meth:`_read`, within ``read_timeout``) and answers it
    (:meth:`_answer`)."""

    def __init__(
        self,
        address: str,
        port: int,
        *,
        name: str,
        max_connections: int,
        read_timeout: float,
        max_head: int = MAX_HEAD,
    ) -> None:
        self._sock = _listen(address, port)
        self._max_head = max_head
        self.address: tuple[str, int] = self._sock.getsockname()[:2]
        self._max = max_connections
        self._read_timeout = read_timeout
        self._waiting: dict[asyncio.StreamWriter, None] = {}  # oldest first
        self._answering: set[asyncio.StreamWriter] = set()
        self._loop = asyncio.new_event_loop()
        self._stop = asyncio.Event()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)

    @property
    def base_url(self) -> str:
        host, port = self.address
        return f"http://{f'[{host}]' if ':' in host else host}:{port}"

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        if self._thread.is_alive():
            self._loop.call_soon_threadsafe(self._stop.set)
            self._thread.join()
        else:
            self._sock.close()
            self._loop.close()

    def _run(self) -> None:
        try:
            self._loop.run_until_complete(self._serve())
        finally:
            self._loop.close()

    async def _serve(self) -> None:
        server = await asyncio.start_server(
            self._connection, sock=self._sock, limit=self._max_head, backlog=_BACKLOG
        )
        await self._stop.wait()
        server.close()
        # Before wait_closed(): from Python 3.12 on it waits for every connection.
        for writer in [*self._waiting, *self._answering]:
            writer.transport.abort()
        await server.wait_closed()

    async def _connection(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if len(self._waiting) + len(self._answering) >= self._max:
            if not self._waiting:
                writer.transport.abort()
                return
            oldest = next(iter(self._waiting))
            del self._waiting[oldest]
            oldest.transport.abort()
        self._waiting[writer] = None
        try:
            async with asyncio.timeout(self._read_timeout):
                request = await self._read(reader, writer)
            if writer not in self._waiting:
                return  # closed for a newer connection while its request arrived
            del self._waiting[writer]
            self._answering.add(writer)
            answer = await self._answer(request)
            # drain() then returns only once the kernel has all of it.
            writer.transport.set_write_buffer_limits(high=0)
            writer.write(answer)
            async with asyncio.timeout(self._read_timeout):
                await writer.drain()
        except (
            TimeoutError,
            ConnectionError,
            asyncio.IncompleteReadError,
            asyncio.LimitOverrunError,
        ):
            pass
        finally:
            self._waiting.pop(writer, None)
            self._answering.discard(writer)
            writer.transport.abort()

    async def _read(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> Any:
        raise NotImplementedError

    async def _answer(self, request: Any) -> bytes:
        raise NotImplementedError


class HttpServer(BoundedServer):
    """JSON APIs: a synchronous ``handler`` per request, on a thread pool."""

    def __init__(
        self,
        handler: Handler,
        address: str,
        port: int,
        *,
        name: str = "http",
        max_connections: int = 32,
        workers: int = 8,
        read_timeout: float = 10.0,
        handler_timeout: float = 600.0,
        max_body: int = MAX_BODY,
    ) -> None:
        super().__init__(
            address, port, name=name, max_connections=max_connections, read_timeout=read_timeout
        )
        self._handler = handler
        self._handler_timeout = handler_timeout
        self._max_body = max_body
        self._pool = concurrent.futures.ThreadPoolExecutor(workers, thread_name_prefix=name)

    @property
    def url(self) -> str:
        return self.base_url

    def close(self) -> None:
        super().close()
        self._pool.shutdown(wait=False, cancel_futures=True)

    async def _read(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> Request | Response:
        head = await reader.readuntil(b"\r\n\r\n")
        parsed = _parse_head(head)
        if parsed is None:
            return _text(400, "a malformed HTTP request")
        method, target, headers = parsed
        try:
            length = int(headers.get("content-length", "0"))
        except ValueError:
            return _text(400, "Content-Length is not a number")
        if "transfer-encoding" in headers:
            return _text(411, "send the body with a Content-Length, not chunked")
        if length < 0 or length > self._max_body:
            return _text(413, f"a body of at most {self._max_body} bytes")
        body = await reader.readexactly(length) if length else b""
        raw_path, _, query = target.partition("?")
        peer = writer.get_extra_info("peername")
        return Request(
            method=method,
            path=unquote(raw_path),
            query={k: v[0] for k, v in parse_qs(query).items()},
            headers=headers,
            body=body,
            client=str(peer[0]) if peer else "",
        )

    async def _answer(self, request: Request | Response) -> bytes:
        if isinstance(request, Response):
            return _encode(request)  # refused while reading
        future = self._loop.run_in_executor(self._pool, self._handler, request)
        try:
            async with asyncio.timeout(self._handler_timeout):
                return _encode(await future)
        except TimeoutError:
            return _encode(
                _text(504, f"{request.method} {request.path} is still running; ask again")
            )
        except Exception:
            log.exception("answering %s %s failed", request.method, request.path)
            return _encode(_text(500, "the request failed unexpectedly; see the server's log"))


def _text(status: int, message: str) -> Response:
    """The server's own refusals, shaped as the APIs it serves answer theirs."""
    return Response(status, json.dumps({"error": message}).encode())


def _listen(address: str, port: int) -> socket.socket:
    family, kind, proto, _, sockaddr = socket.getaddrinfo(
        address, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE | socket.AI_NUMERICSERV
    )[0]
    sock = socket.socket(family, kind, proto)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind(sockaddr)
        sock.listen(_BACKLOG)
        sock.setblocking(False)
    except OSError:
        sock.close()
        raise
    return sock


def _parse_head(head: bytes) -> tuple[str, str, dict[str, str]] | None:
    """(method, target, headers) of a request head; None when it is not HTTP/1.x."""
    try:
        text = head[:-4].decode("latin-1")
    except UnicodeDecodeError:  # pragma: no cover - latin-1 decodes every byte
        return None
    request_line, *header_lines = text.split("\r\n")
    parts = request_line.split(" ")
    if len(parts) != 3 or not parts[2].startswith("HTTP/1."):
        return None
    headers: dict[str, str] = {}
    for line in header_lines:
        name, colon, value = line.partition(":")
        if not colon or not name or name != name.strip():
            return None
        headers[name.lower()] = value.strip()
    return parts[0], parts[1], headers


def _encode(response: Response) -> bytes:
    try:
        reason = http.HTTPStatus(response.status).phrase
    except ValueError:
        reason = ""
    lines = [f"HTTP/1.1 {response.status} {reason}".encode()]
    headers = {
        "Content-Type": response.content_type,
        "Cache-Control": "no-store",
        "X-Content-Type-Options": "nosniff",
        **response.headers,
    }
    lines += [f"{name}: {value}".encode("latin-1") for name, value in headers.items()]
    lines += [b"Content-Length: %d" % len(response.body), b"Connection: close", b"", b""]
    return b"\r\n".join(lines) + response.body
