"""The small JSON HTTP server of the agent's and the controller's APIs: silent
connections cannot keep a request out, oversized or malformed requests are refused
with a JSON error, a slow handler answers 504 instead of holding the client forever,
and a handler's crash is a 500 that says where to look."""

from __future__ import annotations

import json
import socket
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest
from cedana_shim.node.http_server import HttpServer, Request, Response
from support.sockets import closed_by_peer


def handler(request: Request) -> Response:
    if request.path == "/slow":
        time.sleep(2)
    if request.path == "/crash":
        raise RuntimeError("boom")
    doc = {"path": request.path, "query": dict(request.query), "body": request.body.decode(),
           "token": request.bearer()}  # fmt: skip
    return Response(200, json.dumps(doc).encode())


@pytest.fixture
def server() -> Iterator[HttpServer]:
    srv = HttpServer(
        handler, "127.0.0.1", 0, max_connections=4, read_timeout=5.0, handler_timeout=0.5,
        max_body=64,
    )  # fmt: skip
    srv.start()
    try:
        yield srv
    finally:
        srv.close()


def call(
    srv: HttpServer, path: str, body: bytes | None = None, **headers: str
) -> tuple[int, dict[str, Any]]:
    request = urllib.request.Request(srv.url + path, data=body, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=10) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def test_requests_are_answered_with_their_parts(server: HttpServer) -> None:
    status, doc = call(server, "/a%20b?x=1&x=2", b"{}", Authorization="Bearer tok")
    assert status == 200
    assert doc == {"path": "/a b", "query": {"x": "1"}, "body": "{}", "token": "tok"}


def test_silent_connections_do_not_keep_a_request_out(server: HttpServer) -> None:
    idle = [socket.create_connection(server.address) for _ in range(12)]
    try:
        status, _ = call(server, "/after-the-flood")
        assert status == 200
        time.sleep(0.2)
        assert sum(closed_by_peer(s) for s in idle) >= 12 - 4, "the oldest were dropped"
    finally:
        for s in idle:
            s.close()


def test_refusals_are_json_and_say_why(server: HttpServer) -> None:
    status, doc = call(server, "/x", b"y" * 65)
    assert status == 413 and "at most 64 bytes" in doc["error"]
    status, doc = call(server, "/slow")
    assert status == 504 and "still running" in doc["error"]
    status, doc = call(server, "/crash")
    assert status == 500 and "see the server's log" in doc["error"]
    with socket.create_connection(server.address) as s:
        s.sendall(b"NONSENSE\r\n\r\n")
        s.settimeout(5)
        answer = s.recv(4096)
    assert answer.startswith(b"HTTP/1.1 400") and b"malformed" in answer


def test_close_stops_serving(server: HttpServer) -> None:
    address = server.address
    done = threading.Event()
    threading.Thread(target=lambda: (server.close(), done.set()), daemon=True).start()
    assert done.wait(5)
    with pytest.raises(OSError):
        socket.create_connection(address, timeout=1)
