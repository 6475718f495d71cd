"""The node agent's /metrics endpoint: one thread, a bounded number of connections.

prometheus_client's ``start_http_server`` is a ThreadingHTTPServer: a thread per
connection, held for as long as its client stays silent (800 idle connections made
803 threads). Here one asyncio loop in one thread holds every connection:

* at most ``max_connections`` at once; one more closes the oldest that has not sent
  its request yet (so a flood of idle connections cannot keep a real scrape out), or
  itself when all of them are being answered;
* each gets ``timeout`` seconds from its accept to the last byte of its answer, and a
  request head of at most :data:`MAX_HEAD` bytes; every answer closes the connection.

What a request gets is prometheus_client's own answer (its ASGI app: the text or
OpenMetrics format as the ``Accept`` header asks, gzip, ``name[]`` filters).

Not waitress (a WSGI server with a connection limit and idle timeout): at its limit
it stops accepting, so silent connections keep scrapes out until they time out. With
100 idle connections against connection_limit=16, channel_timeout=10, a scrape got
no answer in 60 s (waitress 3.0, measured here).
"""

from __future__ import annotations

import asyncio
import http
import logging
import socket
import threading
from typing import Any, Final
from urllib.parse import unquote

from prometheus_client import CollectorRegistry, make_asgi_app

MAX_CONNECTIONS: Final = 16
# Prometheus' default scrape_timeout: a scraper that needs longer has given up already.
TIMEOUT: Final = 10.0
MAX_HEAD: Final = 8192
_BACKLOG: Final = 128
_TEXT: Final = [(b"Content-Type", b"text/plain; charset=utf-8")]

log = logging.getLogger("cedana.node")


class MetricsServer:
    """Bound at once (an address in use raises OSError here, not in the thread);
    serves from :meth:`start` until :meth:`close`."""

    def __init__(
        self,
        registry: CollectorRegistry,
        address: str,
        port: int,
        *,
        max_connections: int = MAX_CONNECTIONS,
        timeout: float = TIMEOUT,
    ) -> None:
        self._app = make_asgi_app(registry)
        self._sock = _listen(address, port)
        self.address: tuple[str, int] = self._sock.getsockname()[:2]
        self._max = max_connections
        self._timeout = timeout
        # Connections that have not sent a whole request head yet, oldest first.
        self._waiting: dict[asyncio.StreamWriter, None] = {}
        self._answering: set[asyncio.StreamWriter] = set()
        self._loop = asyncio.new_event_loop()
        self._stop = asyncio.Event()
        self._thread = threading.Thread(target=self._run, name="metrics", daemon=True)

    @property
    def url(self) -> str:
        host, port = self.address
        return f"http://{f'[{host}]' if ':' in host else host}:{port}/metrics"

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
            self._connection, sock=self._sock, limit=MAX_HEAD, backlog=_BACKLOG
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
            async with asyncio.timeout(self._timeout):
                head = await reader.readuntil(b"\r\n\r\n")
                if writer not in self._waiting:
                    return  # closed for a newer connection while its request arrived
                del self._waiting[writer]
                self._answering.add(writer)
                answer = await self._answer(head, writer)
                # drain() then returns only once the kernel has all of it.
                writer.transport.set_write_buffer_limits(high=0)
                writer.write(answer)
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

    async def _answer(self, head: bytes, writer: asyncio.StreamWriter) -> bytes:
        scope = _scope(head, writer)
        if scope is None:
            return _response(400, _TEXT, b"a malformed HTTP request\n")
        start: dict[str, Any] = {}
        body = bytearray()

        async def receive() -> dict[str, Any]:
            return {"type": "http.request", "body": b"", "more_body": False}

        async def send(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                start.update(message)
            elif message["type"] == "http.response.body":
                body.extend(message.get("body", b""))

        try:
            await self._app(scope, receive, send)
        except UnicodeDecodeError:
            return _response(400, _TEXT, b"a header that is not UTF-8\n")
        except Exception:
            log.exception("metrics: answering %s failed", scope["path"])
            return _response(500, _TEXT, b"collecting the metrics failed; see the agent's log\n")
        return _response(int(start.get("status", 500)), start.get("headers", []), bytes(body))


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


def _scope(head: bytes, writer: asyncio.StreamWriter) -> dict[str, Any] | None:
    """The ASGI scope of a request head; None when it is not HTTP/1.x."""
    request_line, *header_lines = head[:-4].split(b"\r\n")
    parts = request_line.split(b" ")
    if len(parts) != 3 or not parts[2].startswith(b"HTTP/1."):
        return None
    method, target, version = parts
    headers = []
    for line in header_lines:
        name, colon, value = line.partition(b":")
        if not colon or not name or name != name.strip():
            return None
        headers.append((name.lower(), value.strip()))
    raw_path, _, query = target.partition(b"?")
    return {
        "type": "http",
        "asgi": {"version": "3.0"},
        "http_version": version[5:].decode("ascii", "replace"),
        "method": method.decode("ascii", "replace"),
        "scheme": "http",
        "path": unquote(raw_path.decode("latin-1")),
        "raw_path": raw_path,
        "query_string": query,
        "root_path": "",
        "headers": headers,
        "client": writer.get_extra_info("peername")[:2],  # an IPv6 one has 4 fields
        "server": writer.get_extra_info("sockname")[:2],
    }


def _response(status: int, headers: list[tuple[bytes, bytes]], body: bytes) -> bytes:
    try:
        reason = http.HTTPStatus(status).phrase
    except ValueError:
        reason = ""
    lines = [f"HTTP/1.1 {status} {reason}".encode()]
    lines += [name + b": " + value for name, value in headers]
    lines += [b"Content-Length: %d" % len(body), b"Connection: close", b"", b""]
    return b"\r\n".join(lines) + body
