"""Answering WWW-Authenticate challenges: Basic, Bearer tokens and their cache."""

from __future__ import annotations

import base64
import json
import urllib.parse
from collections.abc import Mapping

import pytest
from cedana_shim.errors import DataLoss, PermissionDenied
from cedana_shim.registry.auth import Authenticator, scope_for
from cedana_shim.registry.credentials import Credentials

REALM = "https://auth.example.com/token"
CHALLENGE = f'Bearer realm="{REALM}",service="registry.example.com"'
PULL = scope_for("cedana/a", ["pull"])
PUSH = scope_for("cedana/a", ["pull", "push"])


class TokenServer:
    """A fake token endpoint: records requests, answers with a queued body."""

    def __init__(self, *answers: tuple[int, object]) -> None:
        self.answers = list(answers)
        self.requests: list[tuple[str, str, dict[str, str], bytes | None]] = []

    def __call__(
        self, method: str, url: str, headers: Mapping[str, str], body: bytes | None
    ) -> tuple[int, bytes]:
        self.requests.append((method, url, dict(headers), body))
        status, document = self.answers.pop(0)
        raw = document if isinstance(document, bytes) else json.dumps(document).encode()
        return status, raw


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def _auth(
    server: TokenServer, creds: Credentials | None, clock: Clock | None = None
) -> Authenticator:
    return Authenticator(
        "registry.example.com",
        creds,
        server,
        credentials_source="credentials from /etc/cedana/registry.json",
        clock=clock or Clock(),
    )


def test_bearer_token_fetched_with_basic_credentials_and_cached_per_scope() -> None:
    server = TokenServer((200, {"token": "t1", "expires_in": 300}), (200, {"access_token": "t2"}))
    clock = Clock()
    auth = _auth(server, Credentials(username="me", password="pw"), clock)
    assert auth.header_for([PULL]) is None
    assert auth.answer(CHALLENGE, [PULL]) == "Bearer t1"
    method, url, headers, _ = server.requests[0]
    query = urllib.parse.parse_qs(urllib.parse.urlsplit(url).query)
    assert method == "GET" and url.startswith(REALM + "?")
    assert query == {"service": ["registry.example.com"], "scope": [PULL]}
    assert headers["Authorization"] == "Basic " + base64.b64encode(b"me:pw").decode()

    assert auth.header_for([PULL]) == "Bearer t1"  # cached: no second request
    assert auth.header_for([PUSH]) is None  # another scope needs its own token
    assert auth.answer(CHALLENGE, [PUSH]) == "Bearer t2"  # `access_token` works too
    clock.now += 291  # within the 10 s renewal margin of t1's 300 s
    assert auth.header_for([PULL]) is None
    assert len(server.requests) == 2


def test_the_challenge_scope_is_requested_too() -> None:
    server = TokenServer((200, {"token": "t"}))
    auth = _auth(server, None)
    auth.answer(CHALLENGE + ',scope="repository:cedana/b:pull"', [PULL])
    _, url, headers, _ = server.requests[0]
    scopes = urllib.parse.parse_qs(urllib.parse.urlsplit(url).query)["scope"]
    assert sorted(scopes) == sorted([PULL, "repository:cedana/b:pull"])
    assert "Authorization" not in headers  # anonymous token


def test_identity_token_uses_the_oauth2_refresh_grant() -> None:
    server = TokenServer((200, {"access_token": "t"}))
    auth = _auth(server, Credentials(identity_token="refresh-me"))
    assert auth.answer(CHALLENGE, [PUSH]) == "Bearer t"
    method, url, headers, body = server.requests[0]
    assert (method, url) == ("POST", REALM)
    assert headers["Content-Type"] == "application/x-www-form-urlencoded"
    form = urllib.parse.parse_qs((body or b"").decode())
    assert form["grant_type"] == ["refresh_token"] and form["refresh_token"] == ["refresh-me"]
    assert form["scope"] == [PUSH]


def test_a_second_401_fetches_a_fresh_token() -> None:
    server = TokenServer((200, {"token": "old"}), (200, {"token": "new"}))
    auth = _auth(server, None)
    assert auth.answer(CHALLENGE, [PULL]) == "Bearer old"
    assert auth.answer(CHALLENGE + ',error="invalid_token"', [PULL]) == "Bearer new"


def test_basic_challenge_then_preemptive_basic() -> None:
    auth = _auth(TokenServer(), Credentials(username="me", password="pw"))
    expected = "Basic " + base64.b64encode(b"me:pw").decode()
    assert auth.answer('Basic realm="registry"', [PULL]) == expected
    assert auth.header_for([PUSH]) == expected


def test_basic_without_credentials_cannot_be_answered() -> None:
    auth = _auth(TokenServer(), None)
    assert auth.answer('Basic realm="registry"', [PULL]) is None
    assert auth.answer(None, [PULL]) is None
    assert auth.answer("Negotiate abc==", [PULL]) is None


def test_token_server_refusal_names_registry_and_credentials() -> None:
    auth = _auth(TokenServer((401, {"details": "bad"})), Credentials(username="me", password="x"))
    with pytest.raises(PermissionDenied) as caught:
        auth.answer(CHALLENGE, [PULL])
    message = str(caught.value)
    assert "registry.example.com" in message and "/etc/cedana/registry.json" in message


@pytest.mark.parametrize(
    "body",
    [
        b"not json",
        b"[]",
        json.dumps({"token": ""}).encode(),
        json.dumps({"token": 5}).encode(),
        json.dumps({"token": "a\nb"}).encode(),
    ],
)
def test_unusable_token_answers_are_data_loss(body: bytes) -> None:
    with pytest.raises(DataLoss, match=r"registry\.example\.com"):
        _auth(TokenServer((200, body)), None).answer(CHALLENGE, [PULL])


def test_a_plain_http_realm_gets_no_credentials() -> None:
    server = TokenServer()
    auth = _auth(server, Credentials(username="me", password="pw"))
    with pytest.raises(PermissionDenied, match="plain-HTTP token realm"):
        auth.answer('Bearer realm="http://auth.example.com/token"', [PULL])
    assert server.requests == []


def test_an_unreadable_challenge_is_data_loss() -> None:
    with pytest.raises(DataLoss, match="WWW-Authenticate"):
        _auth(TokenServer(), None).answer('Bearer realm="unterminated', [PULL])
