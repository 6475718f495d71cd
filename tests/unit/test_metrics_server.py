"""The node agent's /metrics server (node/metrics_server.py): prometheus_client's own
answers, one thread whatever the number of connections, idle connections dropped (the
oldest at once when a new one needs its place, the rest after the timeout), scrapes
answered meanwhile, and only the address it is given."""

from __future__ import annotations

import contextlib
import gzip
import socket
import threading
import time
import urllib.request
from collections.abc import Callable, Iterator

import pytest
from cedana_shim.node.metrics_server import MetricsServer
from prometheus_client import CollectorRegistry, Counter, generate_latest
from prometheus_client.openmetrics.exposition import CONTENT_TYPE_LATEST as OPENMETRICS
from support.sockets import closed_by_peer

MAX = 8


def wait_until(predicate: Callable[[], object], what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out after {timeout} s waiting for {what}"
        time.sleep(0.02)


@pytest.fixture
def registry() -> CollectorRegistry:
    registry = CollectorRegistry()
    Counter("cedana_things", "Things counted.", registry=registry).inc(3)
    return registry


@pytest.fixture
def server(registry: CollectorRegistry) -> Iterator[MetricsServer]:
    # 2 s: far above what a scrape takes here, even beside busy loops.
    server = MetricsServer(registry, "127.0.0.1", 0, max_connections=MAX, timeout=2.0)
    server.start()
    yield server
    server.close()


def get(url: str, **headers: str) -> tuple[dict[str, str], bytes]:
    request = urllib.request.Request(url, headers=headers)
    with urllib.request.urlopen(request, timeout=30) as resp:
        return dict(resp.headers), resp.read()


def test_a_scrape_gets_prometheus_clients_own_exposition(
    server: MetricsServer, registry: CollectorRegistry
) -> None:
    headers, body = get(server.url)
    assert body == generate_latest(registry)
    assert headers["Content-Type"].startswith("text/plain")
    assert headers["Connection"] == "close"
    headers, body = get(server.url, Accept=OPENMETRICS, **{"Accept-Encoding": "gzip"})
    assert headers["Content-Type"].startswith("application/openmetrics-text")
    assert b"cedana_things_total 3.0" in gzip.decompress(body)


def test_idle_connections_hold_no_thread_and_are_dropped_while_scrapes_go_on(
    server: MetricsServer, registry: CollectorRegistry
) -> None:
    threads = threading.active_count()
    idle = [socket.create_connection(server.address, timeout=30) for _ in range(300)]
    try:
        # Each one past MAX closed the oldest silent one as it came in.
        wait_until(lambda: all(map(closed_by_peer, idle[:-MAX])), "the older ones closed")
        assert threading.active_count() == threads
        assert get(server.url)[1] == generate_latest(registry)
        # The last MAX ones (the scrape took the place of one) after the timeout.
        wait_until(lambda: all(map(closed_by_peer, idle)), "the timeout of the rest")
        assert threading.active_count() == threads
    finally:
        for sock in idle:
            sock.close()


def test_a_connection_that_trickles_its_request_is_closed_at_the_timeout(
    server: MetricsServer,
) -> None:
    with socket.create_connection(server.address, timeout=30) as sock:
        sock.sendall(b"GET /metrics HTTP/1.1\r\n")
        sock.sendall(b"Host: x\r\n")
        assert sock.recv(1) == b""  # closed, no answer


@pytest.mark.parametrize(
    "request_head",
    [
        b"garbage\r\n\r\n",
        b"GET /metrics HTTP/2\r\n\r\n",
        b"GET /metrics HTTP/1.1\r\nno colon\r\n\r\n",
    ],
)
def test_a_malformed_request_gets_400(server: MetricsServer, request_head: bytes) -> None:
    with socket.create_connection(server.address, timeout=30) as sock:
        sock.sendall(request_head)
        answer = b""
        while chunk := sock.recv(4096):
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 400 Bad Request\r\n")


def test_a_request_head_over_the_limit_is_closed_unanswered(server: MetricsServer) -> None:
    # A reset instead of an end of file: closed with the rest of the head unread.
    with (
        socket.create_connection(server.address, timeout=30) as sock,
        contextlib.suppress(ConnectionResetError, BrokenPipeError),
    ):
        sock.sendall(b"GET /metrics HTTP/1.1\r\nX: " + b"a" * 20_000 + b"\r\n\r\n")
        assert sock.recv(4096) == b""


def test_only_the_given_address_is_served(registry: CollectorRegistry) -> None:
    # All of 127/8 is loopback: a server on all addresses would answer on 127.0.0.2.
    server = MetricsServer(registry, "127.0.0.1", 0)
    try:
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.2", server.address[1]), timeout=30)
    finally:
        server.close()
    server = MetricsServer(registry, "127.0.0.2", 0)
    server.start()
    try:
        assert server.url == f"http://127.0.0.2:{server.address[1]}/metrics"
        assert get(server.url)[1] == generate_latest(registry)
    finally:
        server.close()


def test_an_ipv6_address_is_served(registry: CollectorRegistry) -> None:
    # A pod's IP may be an IPv6 one.
    server = MetricsServer(registry, "::1", 0)
    server.start()
    try:
        assert server.url == f"http://[::1]:{server.address[1]}/metrics"
        assert get(server.url)[1] == generate_latest(registry)
    finally:
        server.close()


def test_a_port_in_use_fails_at_once(server: MetricsServer, registry: CollectorRegistry) -> None:
    with pytest.raises(OSError, match="in use"):
        MetricsServer(registry, "127.0.0.1", server.address[1])


def test_close_stops_serving(registry: CollectorRegistry) -> None:
    server = MetricsServer(registry, "127.0.0.1", 0)
    server.start()
    server.close()
    with pytest.raises(ConnectionRefusedError):
        socket.create_connection(server.address, timeout=30)
