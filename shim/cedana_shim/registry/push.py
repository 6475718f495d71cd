"""Pushing one blob: a chunked, resumable upload, committed under its digest.

The protocol is the distribution spec's chunked upload: POST opens a session, each
PATCH appends ``chunk_size`` bytes (with ``Content-Range``), and PUT ``?digest=``
commits. After every acknowledged chunk the session URL is recorded
(:class:`UploadStates`), so when a push fails half way (registry restarted, network
down, timeout) the next push of the same digest asks the registry how much it holds
(GET on the session: ``Range: 0-<last>``) and sends only the rest: at most the chunk
in flight is sent twice.

A blob whose digest is known (a compacted chunk is named by the sha256 the compactor
took as it wrote it) is not hashed again here: the registry hashes what it holds and
refuses a commit under another digest (the spec's ``DIGEST_INVALID``, HTTP 400), so a
source that changed underneath is never committed under the wrong name, and a resumed
push re-reads nothing of what the registry holds. On a node where CPU bounds the stop
a second sha256 of every byte sent competes with the compression for nothing; a
registry that skipped the check would still be caught at every pull, which checks
each blob's sha256 as it streams.

A blob whose digest is not known before it is sent (an encrypted layer: its
ciphertext is made while it streams) is pushed "by content": the digest is the hash
of what was sent, learned at the end and named by the commit (``PUT ?digest=``, as the
spec allows), so the bytes are produced once; the registry checks that what it holds
hashes to it and refuses the commit otherwise. Its session is remembered under a key
the caller chooses (one that names the content: the same key must mean the same
bytes), and a ``tap`` (e.g. an HMAC) sees the same bytes as the sha256; a resumed push
re-reads the prefix the registry holds, not sending it again, to carry both over.

A registry may drop a session it cannot resume (distribution 2.x discards one whose
stored size differs from the session's signed offset, e.g. after being killed in the
middle of a PATCH): the push then starts a new session, which is correct, only slower.
"""

from __future__ import annotations

import hashlib
import logging
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import IO, TYPE_CHECKING, Final, Protocol

from cedana_shim import errors
from cedana_shim.errors import DataLoss, ShimError

from .auth import scope_for
from .headers import upload_range_end
from .transport import Response, Transport, error_detail, release
from .uploads import UploadState, UploadStates

if TYPE_CHECKING:
    from hashlib import _Hash

__all__ = [
    "BLOCK_SIZE",
    "BlobPush",
    "OpenSource",
    "ProgressCallback",
    "PushResult",
    "Tap",
    "by_content_key",
]

logger = logging.getLogger(__name__)

BLOCK_SIZE: Final = 1 << 20  # the unit read from a source and handed to the socket
OpenSource = Callable[[int], IO[bytes]]  # offset -> a stream positioned there
ProgressCallback = Callable[[int], None]  # bytes of the blob the registry holds so far


class Tap(Protocol):
    """A hash fed the blob's bytes beside its sha256 (hashlib's or hmac's objects)."""

    def update(self, data: bytes, /) -> None: ...
    def copy(self) -> Tap: ...
    def digest(self) -> bytes: ...


@dataclass(frozen=True)
class PushResult:
    """What a push did: ``sent`` counts bytes put on the wire, retried chunks included."""

    existed: bool  # the registry had the blob already: nothing sent
    resumed_from: int  # bytes an earlier, interrupted push had left at the registry
    sent: int
    digest: str = ""  # what the blob was committed as ("" when it existed)
    tap: bytes = b""  # the tap's digest over the whole blob (a push by content)


def by_content_key(key: str) -> str:
    """The upload-state key of a push by content (never a digest's spelling)."""
    return "by-content:" + key


class _Hashes:
    """The blob's sha256 and the caller's tap, fed the same bytes."""

    def __init__(self, sha: _Hash, tap: Tap | None) -> None:
        self.sha = sha
        self.tap = tap

    def update(self, block: bytes) -> None:
        self.sha.update(block)
        if self.tap is not None:
            self.tap.update(block)

    def copy(self) -> _Hashes:
        return _Hashes(self.sha.copy(), self.tap.copy() if self.tap is not None else None)


class BlobPush:
    """One push of one blob (not reusable)."""

    def __init__(
        self,
        http: Transport,
        uploads: UploadStates,
        *,
        repo: str,
        digest: str | None,
        size: int,
        open_source: OpenSource,
        chunk_size: int,
        progress: ProgressCallback | None,
        session_key: str | None = None,
        tap: Tap | None = None,
    ) -> None:
        """``digest`` None: a push by content (the module doc), its upload state kept
        under ``session_key``; ``tap`` is fed the blob's bytes as the sha256 is."""
        if digest is None and session_key is None:
            raise errors.Internal("a push by content needs the key of its upload state")
        if digest is not None and tap is not None:
            raise errors.Internal("only a push by content hashes its bytes for a tap")
        self._http = http
        self._uploads = uploads
        self._repo = repo
        self._digest = digest
        self._key = session_key if session_key is not None else str(digest)
        self._tap = tap
        self._size = size
        self._open_source = open_source
        self._chunk_size = chunk_size
        self._progress = progress
        self._scopes = (scope_for(repo, ("pull", "push")),)
        self._what = f"push of blob {digest or 'by content'} to {repo}"
        self._sent = 0

    def run(self) -> PushResult:
        location, offset = self._resume_or_start()
        resumed_from = offset
        hasher = None
        if self._digest is None:
            hasher = _Hashes(hashlib.sha256(), self._tap)
            for _ in self._source_blocks(0, offset, hasher):
                pass  # the bytes the registry holds: hash them, do not send them again
        if self._progress is not None and offset:
            self._progress(offset)
        while offset < self._size:
            length = min(self._chunk_size, self._size - offset)
            location, hasher = self._send_chunk(location, offset, length, hasher)
            offset += length
            self._uploads.put(self._repo, self._key, UploadState(location, offset))
            if self._progress is not None:
                self._progress(offset)
        if hasher is None:
            digest = str(self._digest)
            tap = b""
        else:
            digest = "sha256:" + hasher.sha.hexdigest()
            tap = hasher.tap.digest() if hasher.tap is not None else b""
        self._commit(location, digest)
        return PushResult(
            existed=False, resumed_from=resumed_from, sent=self._sent, digest=digest, tap=tap
        )

    def _resume_or_start(self) -> tuple[str, int]:
        state = self._uploads.get(self._repo, self._key)
        if state is not None:
            resumed = self._upload_status(state)
            if resumed is not None:
                logger.info("%s: resuming at byte %d of %d", self._what, resumed[1], self._size)
                return resumed
            self._uploads.drop(self._repo, self._key)
        location = self._start()
        self._uploads.put(self._repo, self._key, UploadState(location, 0))
        return location, 0

    def _start(self) -> str:
        url = self._http.url(f"/v2/{self._repo}/blobs/uploads/")
        response = self._request("POST", url, {"Content-Length": "0"})
        if response.status != 202:
            self._http.fail(response, self._what)
        location = self._location(response, url)
        release(response)
        return location

    def _upload_status(self, state: UploadState) -> tuple[str, int] | None:
        """Where the registry's session stands, or None when it cannot be resumed."""
        try:
            location = self._http.resolve(self._http.origin + "/", state.location, self._what)
        except DataLoss:
            return None  # a state file naming another host: never follow it
        response = self._request("GET", location, {})
        if response.status in (400, 404, 416):
            release(response)  # the registry dropped or invalidated the session
            return None
        if response.status not in (200, 204):
            self._http.fail(response, self._what)
        offset = _resume_offset(response.headers.get("Range", ""), state.offset)
        location = (
            self._location(response, location) if "Location" in response.headers else location
        )
        release(response)
        if not 0 <= offset <= self._size:
            self._cancel(location)
            return None
        return location, offset

    def _send_chunk(
        self, location: str, offset: int, length: int, hasher: _Hashes | None
    ) -> tuple[str, _Hashes | None]:
        attempts: list[_Hashes | None] = []

        def body() -> Iterator[bytes]:
            # A retried attempt hashes the same bytes afresh.
            attempt = hasher.copy() if hasher is not None else None
            attempts.append(attempt)
            return self._source_blocks(offset, length, attempt, count_sent=True)

        headers = {
            "Content-Type": "application/octet-stream",
            "Content-Range": f"{offset}-{offset + length - 1}",
            "Content-Length": str(length),
        }
        response = self._request("PATCH", location, headers, body)
        if response.status != 202:
            if response.status in (400, 404, 416):
                self._uploads.drop(self._repo, self._key)
            self._http.fail(response, self._what)
        acknowledged = response.headers.get("Range")
        next_location = self._location(response, location)
        release(response)
        if acknowledged is not None and _range_end(acknowledged) != offset + length - 1:
            raise errors.Unavailable(
                f"registry {self._http.host}: {self._what}: sent bytes up to {offset + length} "
                f"but the registry acknowledged {acknowledged!r}; retry to resume"
            )
        return next_location, attempts[-1]

    def _commit(self, location: str, digest: str) -> None:
        url = location + ("&" if "?" in location else "?") + f"digest={digest}"
        what = f"{self._what} (commit as {digest})"
        response = self._request("PUT", url, {"Content-Length": "0"})
        if response.status != 201:
            detail = error_detail(response)
            if response.status in (400, 404):
                # Refused (DIGEST_INVALID: what it holds does not hash to the digest) or
                # gone: the next push starts a new session.
                self._uploads.drop(self._repo, self._key)
            mismatch = response.status == 400 and "DIGEST_INVALID" in detail
            if mismatch and self._digest is not None:
                # The digest was taken as the data was written: bytes that do not hash
                # to it were read (now or by the push that left the session) since.
                self._cancel(location)
                raise DataLoss(
                    f"registry {self._http.host}: {what}: the registry finds that the bytes "
                    f"sent do not hash to it (HTTP 400: {detail}): the local data changed or "
                    "is damaged since it was written; nothing was committed"
                )
            self._http.fail(response, what, detail=detail)
        stored = response.headers.get("Docker-Content-Digest")
        release(response)
        self._uploads.drop(self._repo, self._key)
        if stored is not None and stored != digest:
            raise DataLoss(
                f"registry {self._http.host}: {self._what}: the registry stored it as {stored}"
            )

    def _cancel(self, location: str) -> None:
        """Abandon the session (best effort: the registry purges stale ones anyway)."""
        self._uploads.drop(self._repo, self._key)
        try:
            release(self._request("DELETE", location, {}))
        except ShimError as err:
            logger.warning("%s: could not cancel the upload session: %s", self._what, err)

    def _request(
        self,
        method: str,
        url: str,
        headers: dict[str, str],
        body: Callable[[], Iterator[bytes]] | None = None,
    ) -> Response:
        return self._http.request(
            method, url, what=self._what, repo=self._repo, scopes=self._scopes,
            headers=headers, body=body,
        )  # fmt: skip

    def _location(self, response: Response, base: str) -> str:
        location = response.headers.get("Location")
        if not location:
            raise DataLoss(
                f"registry {self._http.host}: {self._what}: HTTP {response.status} without "
                "the upload's Location"
            )
        return self._http.resolve(base, location, self._what)

    def _source_blocks(
        self, offset: int, length: int, hasher: _Hashes | None, *, count_sent: bool = False
    ) -> Iterator[bytes]:
        """``length`` bytes of the source from ``offset`` in bounded blocks, fed to
        ``hasher`` when there is one."""
        if length == 0:
            return
        position = offset
        try:
            with self._open_source(offset) as stream:
                while position < offset + length:
                    block = stream.read(min(BLOCK_SIZE, offset + length - position))
                    if not block:
                        raise DataLoss(
                            f"{self._what}: the local data ends at byte {position}, before its "
                            f"size {self._size}: it was truncated since it was written"
                        )
                    if hasher is not None:
                        hasher.update(block)
                    position += len(block)
                    if count_sent:
                        self._sent += len(block)
                    yield block
        except OSError as err:
            raise DataLoss(
                f"{self._what}: reading the local data at byte {position}: {err}"
            ) from err


def _range_end(range_header: str) -> int | None:
    try:
        return upload_range_end(range_header)
    except ValueError:
        return None


def _resume_offset(range_header: str, recorded: int) -> int:
    """Where to go on from, given the session's Range and the offset we recorded; -1
    when unknown. ``0-0`` is 0 or 1 byte: only our record can tell which."""
    end = _range_end(range_header)
    if end is None:
        return -1
    if end == 0:
        return recorded if recorded in (0, 1) else -1
    return end + 1
