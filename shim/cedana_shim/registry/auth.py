"""Answering a registry's ``WWW-Authenticate`` challenges: Basic and Bearer tokens.

The flow is the docker token protocol: a request answered 401 carries a challenge;
for ``Basic`` the client resends with the user and password, for ``Bearer`` it asks
the challenge's ``realm`` for a token (GET with Basic credentials when it has any, or
an OAuth2 refresh-token POST when the auth file holds an ``identitytoken``), caches
it per scope until it expires, and resends with it. Once a host asked for Basic, or a
token for a scope is cached, later requests carry the header from the start, so a
chunk of an upload is not sent twice.

HTTP goes through a ``TokenFetch`` given by the transport, which maps connection
errors and bounds what it reads; this module only decides what to send.
"""

from __future__ import annotations

import base64
import threading
import time
import urllib.parse
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Final

from cedana_shim import untrusted_json
from cedana_shim.errors import DataLoss, PermissionDenied

from .credentials import Credentials
from .headers import Challenge, parse_challenges

__all__ = ["Authenticator", "TokenFetch", "scope_for"]

# (method, url, headers, body) -> (status, body); the body is read bounded.
TokenFetch = Callable[[str, str, Mapping[str, str], bytes | None], tuple[int, bytes]]

# The token spec's default lifetime when the server gives none.
_DEFAULT_TOKEN_SECONDS: Final = 60
# Renew this long before the expiry, so a token does not lapse in flight.
_EXPIRY_MARGIN_SECONDS: Final = 10
_CLIENT_ID: Final = "cedana-shim"


def scope_for(repository: str, actions: Iterable[str]) -> str:
    """``repository:<name>:<actions>``, the token scope of the docker token spec."""
    return f"repository:{repository}:{','.join(actions)}"


@dataclass(frozen=True)
class _Token:
    value: str
    expires_at: float


class Authenticator:
    """Authorization headers for one registry host (thread-safe)."""

    def __init__(
        self,
        host: str,
        credentials: Credentials | None,
        fetch: TokenFetch,
        *,
        credentials_source: str,
        allow_http_realm: bool = False,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._host = host
        self._credentials = credentials
        self._fetch = fetch
        self._source = credentials_source
        self._allow_http_realm = allow_http_realm
        self._clock = clock
        self._lock = threading.Lock()
        self._basic = False  # the host asked for Basic
        self._bearer: Challenge | None = None  # the host's last Bearer challenge
        self._tokens: dict[tuple[str, str, tuple[str, ...]], _Token] = {}

    def header_for(self, scopes: Iterable[str]) -> str | None:
        """The header to send up front, when an earlier challenge says which one."""
        with self._lock:
            if self._basic:
                return self._basic_header()
            bearer = self._bearer
        if bearer is None:
            return None
        token = self._cached(_scope_key(bearer, scopes))
        return f"Bearer {token}" if token is not None else None

    def answer(self, www_authenticate: str | None, scopes: Iterable[str]) -> str | None:
        """The header that answers a 401's challenge, or None when we cannot answer."""
        if not www_authenticate:
            return None
        try:
            challenges = parse_challenges(www_authenticate)
        except ValueError as err:
            raise DataLoss(
                f"registry {self._host}: unreadable WWW-Authenticate header: {err}"
            ) from None
        by_scheme = {c.scheme: c for c in challenges}
        if "bearer" in by_scheme:
            bearer = by_scheme["bearer"]
            with self._lock:
                self._bearer = bearer
            # A 401 means the token we sent, if any, is no good: always ask for a new one.
            return f"Bearer {self._fetch_token(_scope_key(bearer, scopes))}"
        if "basic" in by_scheme:
            with self._lock:
                self._basic = True
                return self._basic_header()
        return None

    def _basic_header(self) -> str | None:
        creds = self._credentials
        if creds is None or not (creds.username or creds.password):
            return None
        raw = f"{creds.username}:{creds.password}".encode()
        return "Basic " + base64.b64encode(raw).decode("ascii")

    def _cached(self, key: tuple[str, str, tuple[str, ...]]) -> str | None:
        with self._lock:
            token = self._tokens.get(key)
        if token is None or token.expires_at <= self._clock():
            return None
        return token.value

    def _fetch_token(self, key: tuple[str, str, tuple[str, ...]]) -> str:
        realm, service, scopes = key
        parsed = urllib.parse.urlsplit(realm)
        if parsed.scheme not in ("https", "http") or not parsed.netloc:
            raise DataLoss(f"registry {self._host}: token realm {realm!r} is not an http(s) URL")
        if parsed.scheme == "http" and not self._allow_http_realm:
            raise PermissionDenied(
                f"registry {self._host}: refusing to send credentials to the plain-HTTP token "
                f"realm {realm}; the registry must use an https realm"
            )
        status, body = self._request_token(realm, service, scopes)
        if status in (401, 403):
            raise PermissionDenied(
                f"registry {self._host}: token server {realm} refused the credentials "
                f"({self._source}): HTTP {status}; check the user and password in the auth file"
            )
        if status != 200:
            raise PermissionDenied(
                f"registry {self._host}: token server {realm} answered HTTP {status} "
                f"for scope {' '.join(scopes) or '(none)'}"
            )
        value, lifetime = self._parse_token(realm, body)
        expires_at = self._clock() + max(lifetime - _EXPIRY_MARGIN_SECONDS, 1)
        with self._lock:
            self._tokens[key] = _Token(value, expires_at)
        return value

    def _request_token(
        self, realm: str, service: str, scopes: tuple[str, ...]
    ) -> tuple[int, bytes]:
        creds = self._credentials
        if creds is not None and creds.identity_token:
            form = [
                ("grant_type", "refresh_token"),
                ("refresh_token", creds.identity_token),
                ("client_id", _CLIENT_ID),
            ]
            form += [("service", service)] if service else []
            form += [("scope", " ".join(scopes))] if scopes else []
            headers = {"Content-Type": "application/x-www-form-urlencoded"}
            return self._fetch("POST", realm, headers, urllib.parse.urlencode(form).encode())
        query = [("service", service)] if service else []
        query += [("scope", scope) for scope in scopes]
        url = realm + ("&" if "?" in realm else "?") + urllib.parse.urlencode(query)
        basic = self._basic_header()
        return self._fetch("GET", url, {"Authorization": basic} if basic else {}, None)

    def _parse_token(self, realm: str, body: bytes) -> tuple[str, float]:
        try:
            document = untrusted_json.loads(body)
        except ValueError:
            document = None
        if not isinstance(document, dict):
            raise DataLoss(f"registry {self._host}: token server {realm} sent no JSON object")
        value = document.get("token") or document.get("access_token")
        if (
            not isinstance(value, str)
            or not value
            or not value.isascii()
            or not value.isprintable()
        ):
            raise DataLoss(f"registry {self._host}: token server {realm} sent no usable token")
        lifetime = document.get("expires_in", _DEFAULT_TOKEN_SECONDS)
        if isinstance(lifetime, bool) or not isinstance(lifetime, int) or lifetime <= 0:
            lifetime = _DEFAULT_TOKEN_SECONDS
        return value, float(lifetime)


def _scope_key(bearer: Challenge, scopes: Iterable[str]) -> tuple[str, str, tuple[str, ...]]:
    wanted = set(scopes)
    if "scope" in bearer.params:
        wanted.update(bearer.params["scope"].split())
    return bearer.params.get("realm", ""), bearer.params.get("service", ""), tuple(sorted(wanted))
