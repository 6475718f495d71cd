"""The registry client against small fake registries (plain HTTP on loopback): what a
real distribution 2.8 cannot be made to do (paginate tags, issue Bearer tokens,
redirect blobs, lie about sizes and digests, refuse a commit)."""

from __future__ import annotations

import base64
import contextlib
import hashlib
import http.server
import io
import json
import socket
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from cedana_shim.errors import DataLoss, InvalidArgument, PermissionDenied, Unavailable
from cedana_shim.registry import RegistryClient, RegistryConfig

REPO = "cedana/team-a"
OCI = "application/vnd.oci.image.manifest.v1+json"


@dataclass
class Request:
    method: str
    path: str
    query: dict[str, list[str]]
    headers: dict[str, str]


@dataclass
class Reply:
    status: int
    headers: dict[str, str] = field(default_factory=dict)
    body: bytes = b""
    hang_after_headers: bool = False  # send the headers, then nothing


Routes = Callable[[Request], Reply]


class FakeRegistry:
    def __init__(self, routes: Routes) -> None:
        self.requests: list[Request] = []
        self.release = threading.Event()
        owner = self

        class Handler(http.server.BaseHTTPRequestHandler):
            # Headers and body leave in two writes: with Nagle each reply would wait out
            # the client's delayed ACK (40 ms a request).
            disable_nagle_algorithm = True
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: object) -> None:
                pass

            def _serve(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                self.rfile.read(length)
                url = urllib.parse.urlsplit(self.path)
                request = Request(
                    self.command, url.path, urllib.parse.parse_qs(url.query), dict(self.headers)
                )
                owner.requests.append(request)
                reply = routes(request)
                self.send_response(reply.status)
                headers = {"Content-Length": str(len(reply.body)), **reply.headers}
                for name, value in headers.items():
                    self.send_header(name, value)
                self.end_headers()
                if reply.hang_after_headers:
                    self.wfile.flush()
                    owner.release.wait(30)
                    self.close_connection = True
                    return
                if self.command != "HEAD":
                    self.wfile.write(reply.body)

            do_GET = do_HEAD = do_PUT = do_POST = do_PATCH = do_DELETE = _serve

        class Server(http.server.ThreadingHTTPServer):
            daemon_threads = True

            def handle_error(self, request: object, client_address: object) -> None:
                pass  # the client hung up on purpose (a refused body): not news

        self._server = Server(("127.0.0.1", 0), Handler)
        self.host = f"127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True
        )
        self._thread.start()

    def close(self) -> None:
        self.release.set()
        self._server.shutdown()
        self._server.server_close()


@pytest.fixture
def serve() -> Iterator[Callable[[Routes], FakeRegistry]]:
    servers: list[FakeRegistry] = []

    def start(routes: Routes) -> FakeRegistry:
        servers.append(FakeRegistry(routes))
        return servers[-1]

    yield start
    for server in servers:
        server.close()


def _client(server: FakeRegistry, auth_file: Path | None = None) -> RegistryClient:
    config = RegistryConfig(
        registry=f"{server.host}/cedana",
        auth_file=str(auth_file or ""),
        insecure=True,
        timeout=5.0,
    )
    return RegistryClient(config)


def _json(document: object, **headers: str) -> Reply:
    return Reply(
        200, {"Content-Type": "application/json", **headers}, json.dumps(document).encode()
    )


def _digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


ALL_TAGS = [f"t{i:04d}" for i in range(3000)]


def _paginated_tags(request: Request) -> Reply:
    size = int(request.query["n"][0])
    last = request.query.get("last", [""])[0]
    start = ALL_TAGS.index(last) + 1 if last else 0
    page = ALL_TAGS[start : start + size]
    headers = {}
    if start + size < len(ALL_TAGS):
        headers["Link"] = f'</v2/{REPO}/tags/list?n={size}&last={page[-1]}>; rel="next"'
    return _json({"name": REPO, "tags": page}, **headers)


def test_tags_are_listed_across_pages(serve: Callable[[Routes], FakeRegistry]) -> None:
    server = serve(_paginated_tags)
    assert list(_client(server).list_tags(REPO, page_size=50)) == ALL_TAGS
    assert len(server.requests) == 60


@pytest.mark.parametrize(
    ("link", "complaint"),
    [
        ('<http://elsewhere.example.com/v2/x>; rel="next"', "outside"),
        (f'</v2/{REPO}/tags/list?n=1>; rel="next"', "link back"),
        ("<unterminated", "unreadable Link"),
    ],
)
def test_hostile_tag_pages_are_data_loss(
    serve: Callable[[Routes], FakeRegistry], link: str, complaint: str
) -> None:
    server = serve(lambda request: _json({"tags": ["a"]}, Link=link))
    with pytest.raises(DataLoss, match=complaint) as caught:
        list(_client(server).list_tags(REPO, page_size=1))
    assert server.host in str(caught.value)


@pytest.mark.parametrize(
    "body",
    [b"{", b"[]", b'{"tags": "a"}', b'{"tags": [1]}', b'{"tags": ["../x"]}', b"[" * 50_000],
)
def test_malformed_tag_lists_are_data_loss(
    serve: Callable[[Routes], FakeRegistry], body: bytes
) -> None:
    server = serve(lambda request: Reply(200, {}, body))
    with pytest.raises(DataLoss):
        list(_client(server).list_tags(REPO))


def test_a_huge_manifest_is_refused_before_its_body(
    serve: Callable[[Routes], FakeRegistry],
) -> None:
    huge = Reply(200, {"Content-Type": OCI, "Content-Length": str(10 << 30)}, b"{")
    huge.hang_after_headers = True
    server = serve(lambda request: huge)
    started = time.monotonic()
    with pytest.raises(DataLoss, match="announces 10737418240 bytes") as caught:
        _client(server).get_manifest(REPO, "latest")
    assert time.monotonic() - started < 4  # did not wait for a body that never comes
    assert server.host in str(caught.value)


MANIFEST = json.dumps({"schemaVersion": 2, "mediaType": OCI, "layers": []}).encode()
WRONG_DIGEST = {"Content-Type": OCI, "Docker-Content-Digest": "sha256:" + "1" * 64}


@pytest.mark.parametrize(
    ("reply", "ref", "complaint"),
    [
        (Reply(200, {"Content-Type": OCI}, MANIFEST), "sha256:" + "0" * 64, "hashes to"),
        (Reply(200, WRONG_DIGEST, MANIFEST), "latest", "Docker-Content-Digest"),
        (Reply(200, {"Content-Type": "application/vnd.x+json"}, MANIFEST), "latest", "declares"),
        (Reply(200, {"Content-Type": OCI}, b"not json"), "latest", "not valid JSON"),
        (Reply(200, {"Content-Type": OCI}, b"[" * 100_000), "latest", "not valid JSON"),
    ],
)  # fmt: skip
def test_manifests_that_do_not_check_out_are_data_loss(
    serve: Callable[[Routes], FakeRegistry], reply: Reply, ref: str, complaint: str
) -> None:
    server = serve(lambda request: reply)
    with pytest.raises(DataLoss, match=complaint):
        _client(server).get_manifest(REPO, ref)


DIGEST_INVALID = json.dumps(
    {"errors": [{"code": "DIGEST_INVALID", "message": "provided digest did not match"}]}
).encode()


def _uploads(commit: Reply) -> Routes:
    """A registry that takes every upload (sessions s1, s2, ...) and answers each
    commit with ``commit``."""
    sessions = 0

    def routes(request: Request) -> Reply:
        nonlocal sessions
        if request.method == "HEAD":
            return Reply(404)
        if request.method == "POST":
            sessions += 1
            return Reply(202, {"Location": f"/v2/{REPO}/blobs/uploads/s{sessions}"})
        if request.method == "PATCH":
            end = request.headers["Content-Range"].split("-")[1]
            return Reply(202, {"Location": request.path, "Range": f"0-{end}"})
        if request.method == "PUT":
            return commit
        return Reply(204)  # DELETE

    return routes


def test_a_known_digest_the_registry_refuses_is_local_data_loss(
    serve: Callable[[Routes], FakeRegistry],
) -> None:
    """Nothing hashes a blob of known digest here: the registry's DIGEST_INVALID is
    what tells that the local data no longer matches, and the session is forgotten."""
    server = serve(_uploads(Reply(400, {"Content-Type": "application/json"}, DIGEST_INVALID)))
    client = _client(server)
    data = b"x" * 300
    for _ in range(2):
        with pytest.raises(DataLoss) as caught:
            client.push_blob(REPO, _digest(data), len(data), lambda offset: io.BytesIO(data))
        message = str(caught.value)
        assert "changed or is damaged since it was written" in message
        assert "nothing was committed" in message and "DIGEST_INVALID" in message
    calls = [(r.method, r.path.rsplit("/", 1)[-1]) for r in server.requests]
    assert calls == [
        ("HEAD", _digest(data)), ("POST", ""), ("PATCH", "s1"), ("PUT", "s1"), ("DELETE", "s1"),
        ("HEAD", _digest(data)), ("POST", ""), ("PATCH", "s2"), ("PUT", "s2"), ("DELETE", "s2"),
    ]  # fmt: skip
    assert server.requests[3].query["digest"] == [_digest(data)]


def test_a_push_by_content_the_registry_refuses_names_the_digest_it_hashed(
    serve: Callable[[Routes], FakeRegistry],
) -> None:
    server = serve(_uploads(Reply(400, {"Content-Type": "application/json"}, DIGEST_INVALID)))
    data = b"y" * 300
    with pytest.raises(DataLoss, match="DIGEST_INVALID") as caught:
        _client(server).push_blob_by_content(REPO, "k", len(data), lambda o: io.BytesIO(data))
    assert f"commit as {_digest(data)}" in str(caught.value)
    assert "changed or is damaged" not in str(caught.value)


def test_a_commit_refused_for_another_reason_is_not_called_data_loss(
    serve: Callable[[Routes], FakeRegistry],
) -> None:
    server = serve(_uploads(Reply(400, {}, b"bad request")))
    data = b"z" * 300
    with pytest.raises(InvalidArgument, match="HTTP 400: bad request"):
        _client(server).push_blob(REPO, _digest(data), len(data), lambda o: io.BytesIO(data))


def _auth_file(tmp_path: Path, host: str) -> Path:
    path = tmp_path / "config.json"
    auth = base64.b64encode(b"me:pw").decode()
    path.write_text(json.dumps({"auths": {host: {"auth": auth}}}))
    path.chmod(0o600)
    return path


def test_bearer_tokens_are_fetched_once_and_sent(
    serve: Callable[[Routes], FakeRegistry], tmp_path: Path
) -> None:
    basic = "Basic " + base64.b64encode(b"me:pw").decode()
    host: list[str] = []

    def routes(request: Request) -> Reply:
        if request.path == "/token":
            if request.headers.get("Authorization") != basic:
                return Reply(401)
            return _json({"token": "tok-" + request.query["scope"][0]})
        if request.headers.get("Authorization") != f"Bearer tok-repository:{REPO}:pull":
            challenge = f'Bearer realm="http://{host[0]}/token",service="fake"'
            return Reply(401, {"WWW-Authenticate": challenge})
        return Reply(404)

    server = serve(routes)
    host.append(server.host)
    client = _client(server, _auth_file(tmp_path, server.host))
    assert client.blob_exists(REPO, _digest(b"a")) is None
    assert client.blob_exists(REPO, _digest(b"b")) is None
    statuses = [(r.path, r.headers.get("Authorization", "")[:6]) for r in server.requests]
    assert statuses == [
        (f"/v2/{REPO}/blobs/{_digest(b'a')}", ""),
        ("/token", "Basic "),
        (f"/v2/{REPO}/blobs/{_digest(b'a')}", "Bearer"),
        (f"/v2/{REPO}/blobs/{_digest(b'b')}", "Bearer"),
    ]


def test_a_token_the_registry_still_refuses_is_permission_denied(
    serve: Callable[[Routes], FakeRegistry], tmp_path: Path
) -> None:
    host: list[str] = []

    def routes(request: Request) -> Reply:
        if request.path == "/token":
            return _json({"token": "useless"})
        body = json.dumps({"errors": [{"code": "DENIED", "message": "no push for you"}]})
        challenge = f'Bearer realm="http://{host[0]}/token"'
        return Reply(401, {"WWW-Authenticate": challenge}, body.encode())

    server = serve(routes)
    host.append(server.host)
    auth_file = _auth_file(tmp_path, server.host)
    with pytest.raises(PermissionDenied) as caught:
        _client(server, auth_file).get_manifest(REPO, "latest")
    message = str(caught.value)
    assert server.host in message and REPO in message and str(auth_file) in message
    assert "DENIED: no push for you" in message


def test_a_blob_redirect_to_another_host_carries_no_credentials(
    serve: Callable[[Routes], FakeRegistry], tmp_path: Path
) -> None:
    blob = b"blob bytes" * 1000
    storage = serve(lambda request: Reply(200, {}, blob))
    basic = "Basic " + base64.b64encode(b"me:pw").decode()

    def registry_routes(request: Request) -> Reply:
        if request.headers.get("Authorization") != basic:
            return Reply(401, {"WWW-Authenticate": 'Basic realm="fake"'})
        return Reply(307, {"Location": f"http://{storage.host}/bucket/blob?sig=1"})

    registry = serve(registry_routes)
    client = _client(registry, _auth_file(tmp_path, registry.host))
    out = io.BytesIO()
    client.pull_blob(REPO, _digest(blob), len(blob), out, max_size=1 << 20)
    assert out.getvalue() == blob
    (fetched,) = storage.requests
    assert fetched.path == "/bucket/blob" and "Authorization" not in fetched.headers


def test_a_redirect_to_a_non_http_scheme_is_refused(
    serve: Callable[[Routes], FakeRegistry],
) -> None:
    server = serve(lambda request: Reply(302, {"Location": "file:///etc/passwd"}))
    with pytest.raises(PermissionDenied, match="refusing a redirect"):
        _client(server).pull_blob(REPO, _digest(b"x"), 1, io.BytesIO(), max_size=10)


def test_a_blob_longer_than_announced_is_data_loss(
    serve: Callable[[Routes], FakeRegistry],
) -> None:
    server = serve(lambda request: Reply(200, {"Content-Length": "20"}, b"x" * 20))
    with pytest.raises(DataLoss, match="announces 20 bytes, expected 10"):
        _client(server).pull_blob(REPO, _digest(b"x" * 10), 10, io.BytesIO(), max_size=100)


def test_server_errors_are_unavailable_with_a_bounded_message(
    serve: Callable[[Routes], FakeRegistry],
) -> None:
    server = serve(lambda request: Reply(503, {}, b"overloaded " * 100_000))
    with pytest.raises(Unavailable, match="retry later") as caught:
        _client(server).blob_exists(REPO, _digest(b"x"))
    assert server.host in str(caught.value)
    assert len(str(caught.value)) < 1000


def test_a_tls_handshake_cut_short_does_not_blame_the_ca() -> None:
    """A registry (or a proxy) that drops the connection mid-handshake is a network
    failure: the hint to set registry_ca is for a certificate this node refused."""
    listener = socket.create_server(("127.0.0.1", 0))
    host = f"127.0.0.1:{listener.getsockname()[1]}"

    def hang_up() -> None:
        with contextlib.suppress(OSError):
            while True:
                conn, _ = listener.accept()
                conn.recv(1024)  # the ClientHello
                conn.close()

    threading.Thread(target=hang_up, daemon=True).start()
    try:
        client = RegistryClient(RegistryConfig(registry=f"{host}/cedana", timeout=5.0))
        with pytest.raises(Unavailable, match="TLS handshake") as caught:
            client.blob_exists(REPO, _digest(b"x"))
        assert "registry_ca" not in str(caught.value)
        assert host in str(caught.value)
    finally:
        listener.close()
