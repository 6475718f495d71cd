"""The node agent's /metrics endpoint: one thread, a bounded number of connections.

prometheus_client's ``start_http_server`` is a ThreadingHTTPServer: a thread per
connection, held for as long as its client stays silent (800 idle connections made
803 threads). Here one asyncio loop in one thread holds every connection
(http_server.BoundedServer, which the node agent's API shares):

* at most ``max_connections`` at once; one more closes the oldest that has not sent
  its request yet (so a flood of idle connections cannot keep a real scrape out), or
  itself when all of them are being answered;
* each gets ``timeout`` seconds for its request (from its accept), as much to collect
  the answer and as much to send it, and a request head of at most :data:`MAX_HEAD`
  bytes; every answer closes the connection.

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
from typing import Any, Final
from urllib.parse import unquote

from prometheus_client import CollectorRegistry, make_asgi_app

from .http_server import BoundedServer

MAX_CONNECTIONS: Final = 16
# Prometheus' default scrape_timeout: a scraper that needs longer has given up already.
TIMEOUT: Final = 10.0
MAX_HEAD: Final = 8192
_TEXT: Final = [(b"Content-Type", b"text/plain; charset=utf-8")]

log = logging.getLogger("cedana.node")


class MetricsServer(BoundedServer):
    """prometheus_client's answers over :class:`BoundedServer`'s connections."""

    def __init__(
        self,
        registry: CollectorRegistry,
        address: str,
        port: int,
        *,
        max_connections: int = MAX_CONNECTIONS,
        timeout: float = TIMEOUT,
    ) -> None:
        super().__init__(
            address,
            port,
            name="metrics",
            max_connections=max_connections,
            read_timeout=timeout,
            max_head=MAX_HEAD,
        )
        self._app = make_asgi_app(registry)
        self._timeout = timeout

    @property
    def url(self) -> str:
        return f"{self.base_url}/metrics"

    async def _read(
        self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> tuple[bytes, asyncio.StreamWriter]:
        return await reader.readuntil(b"\r\n\r\n"), writer

    async def _answer(self, request: tuple[bytes, asyncio.StreamWriter]) -> bytes:
        async with asyncio.timeout(self._timeout):
            return await self._collect(*request)

    async def _collect(self, head: bytes, writer: asyncio.StreamWriter) -> bytes:
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
