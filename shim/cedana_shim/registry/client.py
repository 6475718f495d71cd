"""The registry client: blobs, manifests and tags of one OCI distribution registry.

One :class:`RegistryClient` talks to one registry (``RegistryConfig.registry``:
``host[:port]/prefix``), is safe to share between threads, and holds no state that
matters across processes except unfinished uploads (kept in ``upload_state_dir``).
Everything the registry sends is untrusted: sizes are checked before bodies are read,
bodies are read in bounded pieces, digests are verified while streaming, and what is
not as the spec says is DataLoss naming the registry.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import IO, Final

from cedana_shim import errors, untrusted_json
from cedana_shim.errors import DataLoss, InvalidArgument

from .auth import scope_for
from .credentials import load_credentials
from .headers import next_link
from .push import (
    BLOCK_SIZE,
    BlobPush,
    OpenSource,
    ProgressCallback,
    PushResult,
    Tap,
    by_content_key,
)
from .reference import (
    RegistryLocation,
    check_digest,
    check_ref,
    check_repository,
    check_tag,
    parse_registry,
    repository_for,
)
from .transport import Response, Transport, discard, release
from .uploads import UploadStates

__all__ = [
    "DEFAULT_CHUNK_SIZE",
    "MANIFEST_MEDIA_TYPES",
    "MAX_MANIFEST_BYTES",
    "RegistryClient",
    "RegistryConfig",
]

MiB: Final = 1 << 20
DEFAULT_CHUNK_SIZE: Final = 16 * MiB
MAX_MANIFEST_BYTES: Final = 4 * MiB  # what registries accept
MAX_TAG_PAGE_BYTES: Final = 4 * MiB
DEFAULT_MAX_TAGS: Final = 100_000
MANIFEST_MEDIA_TYPES: Final = (
    "application/vnd.oci.image.manifest.v1+json",
    "application/vnd.oci.image.index.v1+json",
    "application/vnd.docker.distribution.manifest.v2+json",
    "application/vnd.docker.distribution.manifest.list.v2+json",
)
_CONTENT_LENGTH_RE: Final = re.compile(r"[0-9]{1,19}")
_MEDIA_TYPE_RE: Final = re.compile(
    r"[A-Za-z0-9][A-Za-z0-9!#$&^_.+-]{0,126}/[A-Za-z0-9][A-Za-z0-9!#$&^_.+-]{0,126}"
)


@dataclass(frozen=True)
class RegistryConfig:
    """How to reach the registry (the node config's ``registry*`` keys)."""

    registry: str  # "host[:port]/prefix"
    auth_file: str = ""  # docker config.json; "" = anonymous
    ca_file: str = ""  # PEM bundle trusted on top of the system's CAs
    insecure: bool = False  # plain HTTP (a loopback or lab registry only)
    timeout: float = 30.0  # connect and read timeout of every request, seconds
    chunk_size: int = DEFAULT_CHUNK_SIZE  # bytes per upload PATCH


class RegistryClient:
    """Blobs, manifests and tags in the registry named by a :class:`RegistryConfig`."""

    def __init__(self, config: RegistryConfig, *, upload_state_dir: str | None = None) -> None:
        if not 0 < config.timeout <= 3600:
            raise InvalidArgument(f"registry timeout {config.timeout!r}: give 0 < seconds <= 3600")
        if config.chunk_size < 64 << 10:
            raise InvalidArgument(f"registry chunk size {config.chunk_size}: give at least 64 KiB")
        self.location: RegistryLocation = parse_registry(config.registry)
        host = self.location.host
        credentials = load_credentials(config.auth_file, host) if config.auth_file else None
        if not config.auth_file:
            source = "no registry_auth_file configured"
        elif credentials is None:
            source = f"auth file {config.auth_file} has no entry for {host}"
        else:
            source = f"credentials from {config.auth_file}"
        self._chunk_size = config.chunk_size
        self._http = Transport(
            host,
            insecure=config.insecure,
            ca_file=config.ca_file,
            timeout=config.timeout,
            credentials=credentials,
            credentials_source=source,
        )
        self._uploads = UploadStates(host, upload_state_dir)

    @property
    def host(self) -> str:
        return self.location.host

    def repository_for(self, namespace: str) -> str:
        """The repository of a Kubernetes namespace: ``<prefix>/<namespace>``."""
        return repository_for(self.location.prefix, namespace)

    # -- blobs ----------------------------------------------------------------

    def blob_exists(self, repo: str, digest: str) -> int | None:
        """The blob's size if the repository has it, else None."""
        _check_blob(repo, digest)
        what = f"lookup of blob {digest} in {repo}"
        response = self._get(repo, "HEAD", f"/v2/{repo}/blobs/{digest}", what, redirects=True)
        if response.status == 404:
            release(response)
            return None
        if response.status != 200:
            self._http.fail(response, what)
        length = self._content_length(response, what)
        release(response)
        if length is None:
            raise DataLoss(f"registry {self.host}: {what}: no Content-Length in the answer")
        return length

    def mount_blob(self, repo: str, digest: str, from_repo: str) -> bool:
        """Link a blob of ``from_repo`` into ``repo`` without sending it.

        False when the registry cannot (it does not have the blob there, or does not
        mount across repositories); the upload session it opened instead is cancelled.
        """
        _check_blob(repo, digest)
        check_repository(from_repo)
        what = f"mount of blob {digest} from {from_repo} into {repo}"
        url = self._http.url(f"/v2/{repo}/blobs/uploads/", [("mount", digest), ("from", from_repo)])
        scopes = (scope_for(repo, ("pull", "push")), scope_for(from_repo, ("pull",)))
        response = self._http.request(
            "POST", url, what=what, repo=repo, scopes=scopes, headers={"Content-Length": "0"}
        )
        if response.status == 201:
            release(response)
            return True
        if response.status != 202:
            self._http.fail(response, what)
        location = response.headers.get("Location")
        release(response)
        if location:
            session = self._http.resolve(url, location, what)
            release(self._http.request("DELETE", session, what=what, repo=repo, scopes=scopes))
        return False

    def push_blob(
        self,
        repo: str,
        digest: str,
        size: int,
        open_source: OpenSource,
        progress: ProgressCallback | None = None,
    ) -> PushResult:
        """Upload a blob unless the repository has it; resume an interrupted upload.

        ``open_source(offset)`` returns a stream of the blob positioned at ``offset``
        (it is opened once per chunk and read in 1 MiB blocks). On failure the upload
        session is kept (in memory, and in ``upload_state_dir`` when given): calling
        push_blob again for the same digest sends only what the registry lacks.
        """
        _check_blob(repo, digest)
        if size < 0:
            raise InvalidArgument(f"blob {digest}: negative size {size}")
        present = self.blob_exists(repo, digest)
        if present is not None:
            if present != size:
                raise DataLoss(
                    f"registry {self.host}: blob {digest} in {repo} has {present} bytes, but "
                    f"it has {size} here: one of the two copies is damaged"
                )
            self._uploads.drop(repo, digest)
            return PushResult(existed=True, resumed_from=size, sent=0)
        push = BlobPush(
            self._http,
            self._uploads,
            repo=repo,
            digest=digest,
            size=size,
            open_source=open_source,
            chunk_size=self._chunk_size,
            progress=progress,
        )
        return push.run()

    def push_blob_by_content(
        self,
        repo: str,
        key: str,
        size: int,
        open_source: OpenSource,
        progress: ProgressCallback | None = None,
        tap: Tap | None = None,
    ) -> PushResult:
        """Upload a blob whose digest is learned as it streams (push.py's module doc):
        the bytes are read once, hashed (and fed to ``tap``) as they go, and committed
        under their sha256, which the result gives. ``key`` names the content (the same
        key, the same bytes): an interrupted push of it resumes under that key. No
        lookup first: the caller knows the registry lacks it, or cannot ask.
        """
        check_repository(repo)
        if size < 0:
            raise InvalidArgument(f"blob by content {key}: negative size {size}")
        push = BlobPush(
            self._http,
            self._uploads,
            repo=repo,
            digest=None,
            size=size,
            open_source=open_source,
            chunk_size=self._chunk_size,
            progress=progress,
            session_key=by_content_key(key),
            tap=tap,
        )
        return push.run()

    def pull_blob(
        self,
        repo: str,
        digest: str,
        size: int,
        dest: IO[bytes],
        max_size: int,
        progress: ProgressCallback | None = None,
    ) -> None:
        """Stream a blob into ``dest``, verifying its size and sha256 on the way.

        On any error ``dest`` may hold part of the blob, or bytes that fail the check:
        write to a temporary file and keep it only when this returns.
        """
        _check_blob(repo, digest)
        if size < 0:
            raise InvalidArgument(f"blob {digest}: negative size {size}")
        what = f"download of blob {digest} from {repo}"
        if size > max_size:
            raise errors.ResourceExhausted(
                f"registry {self.host}: {what}: it has {size} bytes, more than the "
                f"{max_size} allowed"
            )
        response = self._get(repo, "GET", f"/v2/{repo}/blobs/{digest}", what, redirects=True)
        if response.status != 200:
            self._http.fail(response, what)
        announced = self._content_length(response, what)
        if announced is not None and announced != size:
            discard(response)
            raise DataLoss(
                f"registry {self.host}: {what}: the registry announces {announced} bytes, "
                f"expected {size}; not downloaded"
            )
        hasher = hashlib.sha256()
        received = 0
        while True:
            with self._http.guard(what):
                block = response.read(min(BLOCK_SIZE, size - received + 1), decode_content=False)
            if not block:
                break
            received += len(block)
            if received > size:
                discard(response)
                raise DataLoss(f"registry {self.host}: {what}: more than the {size} bytes expected")
            hasher.update(block)
            dest.write(block)
            if progress is not None:
                progress(received)
        response.release_conn()
        if received != size:
            raise DataLoss(f"registry {self.host}: {what}: got {received} of {size} bytes")
        actual = "sha256:" + hasher.hexdigest()
        if actual != digest:
            raise DataLoss(
                f"registry {self.host}: {what}: the bytes hash to {actual}: the registry's copy "
                "is damaged; delete it there (or push it again from a node that has it)"
            )

    # -- manifests --------------------------------------------------------------

    def put_manifest(self, repo: str, ref: str, manifest: bytes, media_type: str) -> str:
        """Store a manifest under a tag (or its digest); return its digest."""
        check_repository(repo)
        check_ref(ref)
        if not _MEDIA_TYPE_RE.fullmatch(media_type):
            raise InvalidArgument(f"manifest media type {media_type!r} is not type/subtype")
        if len(manifest) > MAX_MANIFEST_BYTES:
            raise InvalidArgument(
                f"manifest for {repo}:{ref} has {len(manifest)} bytes; registries accept at "
                f"most {MAX_MANIFEST_BYTES}"
            )
        digest = "sha256:" + hashlib.sha256(manifest).hexdigest()
        if ref.startswith("sha256:") and ref != digest:
            raise InvalidArgument(f"manifest for {repo}@{ref} hashes to {digest}")
        what = f"push of manifest {repo}:{ref}"
        response = self._http.request(
            "PUT",
            self._http.url(f"/v2/{repo}/manifests/{ref}"),
            what=what,
            repo=repo,
            scopes=(scope_for(repo, ("pull", "push")),),
            headers={"Content-Type": media_type},
            body=lambda: manifest,
        )
        if response.status != 201:
            self._http.fail(response, what)
        stored = response.headers.get("Docker-Content-Digest")
        release(response)
        if stored is not None and stored != digest:
            raise DataLoss(f"registry {self.host}: {what}: stored as {stored}, expected {digest}")
        return digest

    def get_manifest(
        self,
        repo: str,
        ref: str,
        *,
        max_size: int = MAX_MANIFEST_BYTES,
        accept: Sequence[str] = MANIFEST_MEDIA_TYPES,
    ) -> tuple[bytes, str, str]:
        """A manifest by tag or digest: ``(bytes, media type, digest)``, all verified."""
        check_repository(repo)
        check_ref(ref)
        what = f"read of manifest {repo}:{ref}"
        response = self._get(
            repo, "GET", f"/v2/{repo}/manifests/{ref}", what, headers={"Accept": ", ".join(accept)}
        )
        if response.status != 200:
            self._http.fail(response, what)
        announced = self._content_length(response, what)
        if announced is not None and announced > max_size:
            discard(response)
            raise DataLoss(
                f"registry {self.host}: {what}: the registry announces {announced} bytes, "
                f"more than the {max_size} a manifest may have; not downloaded"
            )
        media_type = response.headers.get("Content-Type", "").split(";", 1)[0].strip()
        header_digest = response.headers.get("Docker-Content-Digest")
        body = self._http.read_limited(response, max_size, what)
        if body is None:
            raise DataLoss(f"registry {self.host}: {what}: more than {max_size} bytes")
        digest = "sha256:" + hashlib.sha256(body).hexdigest()
        if ref.startswith("sha256:") and digest != ref:
            raise DataLoss(f"registry {self.host}: {what}: the manifest hashes to {digest}")
        if header_digest is not None and header_digest != digest:
            raise DataLoss(
                f"registry {self.host}: {what}: Docker-Content-Digest says {header_digest}, "
                f"the manifest hashes to {digest}"
            )
        self._check_manifest_json(body, media_type, what)
        return body, media_type, digest

    def delete_manifest(self, repo: str, digest: str) -> bool:
        """Delete a manifest; False when the registry does not allow deletes."""
        _check_blob(repo, digest)
        what = f"delete of manifest {repo}@{digest}"
        response = self._http.request(
            "DELETE",
            self._http.url(f"/v2/{repo}/manifests/{digest}"),
            what=what,
            repo=repo,
            scopes=(scope_for(repo, ("delete",)),),
        )
        if response.status in (200, 202):
            release(response)
            return True
        if response.status == 405:
            release(response)
            return False
        self._http.fail(response, what)

    # -- tags -------------------------------------------------------------------

    def list_tags(
        self, repo: str, *, page_size: int = 1000, max_tags: int = DEFAULT_MAX_TAGS
    ) -> Iterator[str]:
        """The repository's tags, page by page (``Link: <...>; rel="next"``).

        More than ``max_tags`` tags is ResourceExhausted; a repository that does not
        exist is NotFound.
        """
        check_repository(repo)
        if not 0 < page_size <= 10_000:
            raise InvalidArgument(f"tag page size {page_size}: give 1 to 10000")
        url = self._http.url(f"/v2/{repo}/tags/list", [("n", str(page_size))])
        return self._tag_pages(repo, url, max_tags)

    def _tag_pages(self, repo: str, url: str, max_tags: int) -> Iterator[str]:
        what = f"tag list of {repo}"
        seen: set[str] = set()
        total = 0
        next_url: str | None = url
        while next_url is not None:
            url = next_url
            if url in seen:
                raise DataLoss(f"registry {self.host}: {what}: the pages link back to {url}")
            seen.add(url)
            response = self._http.request(
                "GET", url, what=what, repo=repo, scopes=(scope_for(repo, ("pull",)),)
            )
            if response.status != 200:
                self._http.fail(response, what)
            link = response.headers.get("Link")
            body = self._http.read_limited(response, MAX_TAG_PAGE_BYTES, what)
            if body is None:
                raise DataLoss(
                    f"registry {self.host}: {what}: a page over {MAX_TAG_PAGE_BYTES} bytes"
                )
            tags = self._parse_tag_page(body, what)
            next_url = self._next_page(url, link, what)
            if not tags and next_url is not None:
                raise DataLoss(f"registry {self.host}: {what}: an empty page that links onwards")
            total += len(tags)
            if total > max_tags:
                raise errors.ResourceExhausted(
                    f"registry {self.host}: {what}: more than {max_tags} tags"
                )
            yield from tags

    def _next_page(self, url: str, link: str | None, what: str) -> str | None:
        if not link:
            return None
        try:
            target = next_link(link)
        except ValueError as err:
            raise DataLoss(f"registry {self.host}: {what}: unreadable Link header: {err}") from None
        return None if target is None else self._http.resolve(url, target, what)

    def _parse_tag_page(self, body: bytes, what: str) -> list[str]:
        document = self._json_object(body, what)
        tags = document.get("tags")
        if tags is None:
            return []
        if not isinstance(tags, list) or not all(isinstance(t, str) for t in tags):
            raise DataLoss(f"registry {self.host}: {what}: 'tags' is not a list of strings")
        for tag in tags:
            try:
                check_tag(tag)
            except InvalidArgument as err:
                raise DataLoss(f"registry {self.host}: {what}: {err}") from None
        return tags

    # -- helpers ----------------------------------------------------------------

    def _get(
        self,
        repo: str,
        method: str,
        path: str,
        what: str,
        *,
        headers: dict[str, str] | None = None,
        redirects: bool = False,
    ) -> Response:
        return self._http.request(
            method,
            self._http.url(path),
            what=what,
            repo=repo,
            scopes=(scope_for(repo, ("pull",)),),
            headers=headers,
            follow_redirects=redirects,
        )

    def _content_length(self, response: Response, what: str) -> int | None:
        value = response.headers.get("Content-Length")
        if value is None:
            return None
        if not _CONTENT_LENGTH_RE.fullmatch(value.strip()):
            discard(response)
            raise DataLoss(f"registry {self.host}: {what}: bad Content-Length {value!r}")
        return int(value)

    def _json_object(self, body: bytes, what: str) -> dict[str, object]:
        try:
            document = untrusted_json.loads(body)
        except ValueError as err:
            raise DataLoss(f"registry {self.host}: {what}: not valid JSON: {err}") from None
        if not isinstance(document, dict):
            raise DataLoss(f"registry {self.host}: {what}: not a JSON object")
        return document

    def _check_manifest_json(self, body: bytes, media_type: str, what: str) -> None:
        document = self._json_object(body, what)
        declared = document.get("mediaType")
        if declared is not None and declared != media_type:
            raise DataLoss(
                f"registry {self.host}: {what}: served as {media_type!r} but declares "
                f"mediaType {declared!r}"
            )
        if not media_type:
            raise DataLoss(f"registry {self.host}: {what}: no Content-Type")


def _check_blob(repo: str, digest: str) -> None:
    check_repository(repo)
    check_digest(digest)
