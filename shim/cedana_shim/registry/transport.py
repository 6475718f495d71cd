"""HTTP to one registry: TLS, authentication, redirects, timeouts and error mapping.

Every request has a connect and a read timeout (a registry that accepts and never
answers fails the request, it never blocks the shim), no automatic retry (callers
decide: a blob upload resumes, a manifest read is cheap to repeat), and bodies are
streamed (``preload_content=False``) so the caller reads them in bounded pieces.

Errors a caller can meet are mapped here, once: unreachable, TLS and 5xx are
Unavailable, timeouts DeadlineExceeded, 401/403 PermissionDenied naming the registry,
the repository and where the credentials came from, 404 NotFound. Error bodies are
read bounded (64 KiB) and their ``errors[].code/message`` quoted.
"""

from __future__ import annotations

import contextlib
import ssl
import urllib.parse
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from typing import Final, NoReturn, TypeAlias

import urllib3
from urllib3.exceptions import (
    HTTPError,
    NewConnectionError,
    SSLError,
)
from urllib3.exceptions import (
    TimeoutError as Urllib3Timeout,
)

from cedana_shim import errors, untrusted_json
from cedana_shim.errors import DataLoss, PermissionDenied, ShimError

from .auth import Authenticator
from .credentials import Credentials

__all__ = ["Body", "Response", "Transport", "discard", "error_detail", "release"]

Body: TypeAlias = bytes | Iterable[bytes]
Response: TypeAlias = urllib3.BaseHTTPResponse

MAX_ERROR_BODY: Final = 64 << 10
MAX_TOKEN_BODY: Final = 1 << 20
MAX_REDIRECTS: Final = 5
_REDIRECTS: Final = frozenset({301, 302, 303, 307, 308})
_USER_AGENT: Final = "cedana-shim"


class Transport:
    """Requests to one registry ``scheme://host``, with its credentials."""

    def __init__(
        self,
        host: str,
        *,
        insecure: bool,
        ca_file: str,
        timeout: float,
        credentials: Credentials | None,
        credentials_source: str,
    ) -> None:
        self.host = host
        self.origin = f"{'http' if insecure else 'https'}://{host.lower()}"
        self._insecure = insecure
        self._timeout_seconds = timeout
        self._timeout = urllib3.Timeout(connect=timeout, read=timeout)
        self._source = credentials_source
        self._has_credentials = credentials is not None
        self._pool = urllib3.PoolManager(
            maxsize=8, ssl_context=_ssl_context(ca_file, host), retries=False
        )
        self._auth = Authenticator(
            host,
            credentials,
            self._fetch_token,
            credentials_source=credentials_source,
            allow_http_realm=insecure,
        )

    def url(self, path: str, query: Sequence[tuple[str, str]] = ()) -> str:
        """``origin + path`` with an encoded query."""
        suffix = "?" + urllib.parse.urlencode(query) if query else ""
        return self.origin + path + suffix

    def resolve(self, base: str, reference: str, what: str) -> str:
        """A Location or Link target, made absolute; it must stay on this registry."""
        absolute = urllib.parse.urljoin(base, reference)
        if _origin(absolute) != self.origin:
            raise DataLoss(
                f"registry {self.host}: {what}: the registry pointed to {absolute!r}, outside "
                f"{self.origin}; refusing to follow it"
            )
        return absolute

    def request(
        self,
        method: str,
        url: str,
        *,
        what: str,
        repo: str,
        scopes: Sequence[str],
        headers: Mapping[str, str] | None = None,
        body: Callable[[], Body] | None = None,
        follow_redirects: bool = False,
    ) -> Response:
        """Send a request, answering an auth challenge once; return the unread response.

        ``body`` makes the request body, and is called again for the authenticated
        retry. 401 and 403 raise PermissionDenied; other statuses are the caller's to
        check (``fail`` raises the right error for an unexpected one).
        """
        for _ in range(MAX_REDIRECTS + 1):
            if _origin(url) == self.origin:
                response = self._authenticated(method, url, what, repo, scopes, headers, body)
            else:  # a blob redirected to object storage: no registry credentials there
                response = self._send(method, url, what, _headers(headers, None), body)
            if not (follow_redirects and response.status in _REDIRECTS):
                return response
            location = response.headers.get("Location", "")
            release(response)
            url = self._redirect_target(url, location, what)
        raise errors.Unavailable(
            f"registry {self.host}: {what}: more than {MAX_REDIRECTS} redirects"
        )

    def fail(self, response: Response, what: str, *, detail: str | None = None) -> NoReturn:
        """Raise the error for an unexpected status, quoting the registry's message
        (``detail``: its ``error_detail``, when the caller has read it already)."""
        status = response.status
        if detail is None:
            detail = error_detail(response)
        message = f"registry {self.host}: {what}: HTTP {status}: {detail}"
        if status == 404:
            raise errors.NotFound(message)
        if status in (401, 403):
            raise PermissionDenied(message)
        if status == 413:
            raise errors.ResourceExhausted(message)
        if status in (408, 429) or status >= 500:
            raise errors.Unavailable(f"{message}; retry later")
        if "DIGEST_INVALID" in detail or "SIZE_INVALID" in detail:
            raise DataLoss(message)
        if "MANIFEST_BLOB_UNKNOWN" in detail:
            raise errors.FailedPrecondition(f"{message}; push the manifest's blobs first")
        if 400 <= status < 500:
            raise errors.InvalidArgument(message)
        raise errors.Internal(f"{message} (unexpected answer)")

    @contextlib.contextmanager
    def guard(self, what: str) -> Iterator[None]:
        """Map urllib3's exceptions, raised in the block, to the shim's errors."""
        try:
            yield
        except ShimError:
            raise
        except (HTTPError, OSError) as err:
            raise self._network_error(err, what) from err

    def read_limited(self, response: Response, limit: int, what: str) -> bytes | None:
        """The whole body if it is at most ``limit`` bytes, else None (body dropped)."""
        with self.guard(what):
            data = response.read(limit + 1, decode_content=False)
        if len(data) > limit:
            discard(response)
            return None
        response.release_conn()
        return data

    def _authenticated(
        self,
        method: str,
        url: str,
        what: str,
        repo: str,
        scopes: Sequence[str],
        headers: Mapping[str, str] | None,
        body: Callable[[], Body] | None,
    ) -> Response:
        sent = self._auth.header_for(scopes)
        response = self._send(method, url, what, _headers(headers, sent), body)
        if response.status == 401:
            challenge = response.headers.get("WWW-Authenticate")
            detail = error_detail(response)
            answer = self._auth.answer(challenge, scopes)
            if answer is None:
                self._deny(repo, what, detail, tried=False)
            response = self._send(method, url, what, _headers(headers, answer), body)
        if response.status in (401, 403):
            self._deny(repo, what, error_detail(response), tried=True)
        return response

    def _deny(self, repo: str, what: str, detail: str, *, tried: bool) -> NoReturn:
        if tried and self._has_credentials:
            raise PermissionDenied(
                f"registry {self.host}: authentication failed for {repo} ({self._source}): "
                f"{detail}; check the user and password for {self.host} in the auth file, "
                f"and that they may {what}"
            )
        raise PermissionDenied(
            f"registry {self.host}: {what} needs credentials for {repo} and there are none "
            f"({self._source}): {detail}; add an auths entry for {self.host} to the auth file "
            "(registry_auth_file)"
        )

    def _send(
        self,
        method: str,
        url: str,
        what: str,
        headers: dict[str, str],
        body: Callable[[], Body] | None,
    ) -> Response:
        with self.guard(what):
            return self._pool.urlopen(
                method,
                url,
                body=body() if body is not None else None,
                headers=headers,
                redirect=False,
                retries=False,
                preload_content=False,
                decode_content=False,
                timeout=self._timeout,
            )

    def _redirect_target(self, url: str, location: str, what: str) -> str:
        if not location:
            raise DataLoss(f"registry {self.host}: {what}: a redirect without a Location")
        target = urllib.parse.urljoin(url, location)
        scheme = urllib.parse.urlsplit(target).scheme
        if scheme != "https" and not (scheme == "http" and self._insecure):
            raise PermissionDenied(
                f"registry {self.host}: {what}: refusing a redirect to {scheme or 'no'}:// "
                f"({target.split('?', 1)[0]}); only https is followed"
            )
        return target

    def _fetch_token(
        self, method: str, url: str, headers: Mapping[str, str], body: bytes | None
    ) -> tuple[int, bytes]:
        what = "token request"
        response = self._send(method, url, what, _headers(headers, None), _const(body))
        data = self.read_limited(response, MAX_TOKEN_BODY, what)
        if data is None:
            raise DataLoss(
                f"registry {self.host}: the token server sent more than {MAX_TOKEN_BODY} bytes"
            )
        return response.status, data

    def _network_error(self, err: Exception, what: str) -> ShimError:
        if isinstance(err, SSLError | ssl.SSLError):
            hint = (
                "if the registry's certificate is signed by a private CA, set registry_ca to "
                "that CA's PEM file"
                if _certificate_refused(err)
                else "the connection broke during the TLS handshake; retry later"
            )
            return errors.Unavailable(f"registry {self.host}: {what}: TLS failed: {err}; {hint}")
        if isinstance(err, NewConnectionError):
            return errors.Unavailable(
                f"registry {self.host}: {what}: cannot connect: {err}; check that the registry "
                "is running and reachable from this node"
            )
        if isinstance(err, Urllib3Timeout | TimeoutError):
            return errors.DeadlineExceeded(
                f"registry {self.host}: {what}: no answer within {self._timeout_seconds:g}s; "
                "check that the registry is healthy (the next attempt resumes uploads)"
            )
        return errors.Unavailable(
            f"registry {self.host}: {what}: connection failed: {err}; retry later"
        )


def _certificate_refused(err: BaseException) -> bool:
    """Whether a TLS error is this node refusing the registry's certificate (rather
    than a connection cut mid-handshake, where registry_ca is not the cure)."""
    seen: set[int] = set()
    todo: list[object] = [err]
    while todo:
        e = todo.pop()
        if not isinstance(e, BaseException) or id(e) in seen:
            continue
        seen.add(id(e))
        if isinstance(e, ssl.SSLCertVerificationError):
            return True
        todo += [*e.args, e.__cause__, e.__context__]
    return "CERTIFICATE_VERIFY_FAILED" in str(err)


def discard(response: Response) -> None:
    """Give up on a response whose body is not (fully) read: drop its connection."""
    response.close()
    response.release_conn()


def release(response: Response) -> bytes:
    """Finish a response with a small body (at most 64 KiB, the rest is dropped with the
    connection) and return the connection to the pool; return the body."""
    try:
        data = response.read(MAX_ERROR_BODY + 1, decode_content=False)
    except (HTTPError, OSError):
        discard(response)
        return b""
    if len(data) > MAX_ERROR_BODY:
        discard(response)
        return data[:MAX_ERROR_BODY]
    response.release_conn()
    return data


def error_detail(response: Response) -> str:
    """The registry's error message: ``CODE: message`` of its JSON, bounded."""
    data = release(response)
    try:
        document = untrusted_json.loads(data)
    except ValueError:
        document = None
    if isinstance(document, dict) and isinstance(document.get("errors"), list):
        parts = [
            f"{item.get('code', '?')}: {item.get('message', '')}"
            for item in document["errors"][:4]
            if isinstance(item, dict)
        ]
        if parts:
            return _printable("; ".join(parts))
    text = data.decode("utf-8", "replace").strip()
    return _printable(text) if text else "(no message)"


def _printable(text: str, limit: int = 300) -> str:
    cleaned = "".join(c if c.isprintable() else " " for c in text)
    return cleaned if len(cleaned) <= limit else cleaned[:limit] + "..."


def _headers(extra: Mapping[str, str] | None, authorization: str | None) -> dict[str, str]:
    headers = {"User-Agent": _USER_AGENT}
    headers.update(extra or {})
    if authorization:
        headers["Authorization"] = authorization
    return headers


def _const(body: bytes | None) -> Callable[[], Body] | None:
    return None if body is None else lambda: body


def _origin(url: str) -> str:
    parts = urllib.parse.urlsplit(url)
    return f"{parts.scheme.lower()}://{parts.netloc.lower()}"


def _ssl_context(ca_file: str, host: str) -> ssl.SSLContext:
    context = ssl.create_default_context()
    if ca_file:
        try:
            context.load_verify_locations(cafile=ca_file)
        except (OSError, ssl.SSLError) as err:
            raise errors.FailedPrecondition(
                f"registry {host}: cannot load the CA bundle registry_ca={ca_file}: {err}; "
                "give a readable PEM file"
            ) from None
    return context
