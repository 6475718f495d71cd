"""What the shared checkpoint store needs of a registry: one interface, two backends.

:class:`~cedana_shim.registry.RegistryClient` speaks the OCI distribution spec to a
registry; ``checkpoint.remote.shared_dir.SharedDirectory`` keeps the same blobs,
manifests and tags in a directory that every node mounts (NFS, Lustre, CephFS).
``checkpoint.remote`` (push, list, pull, prune, the in-flight markers) is written
against this protocol only, so both share every rule of the shared store.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import IO, Protocol

from .push import OpenSource, ProgressCallback, PushResult, Tap

__all__ = ["Registry"]


class Registry(Protocol):
    @property
    def host(self) -> str:
        """Where the registry is, for messages: ``host[:port]`` or the directory."""
        ...

    def repository_for(self, namespace: str) -> str: ...

    def push_blob(
        self,
        repo: str,
        digest: str,
        size: int,
        open_source: OpenSource,
        progress: ProgressCallback | None = None,
    ) -> PushResult: ...

    def push_blob_by_content(
        self,
        repo: str,
        key: str,
        size: int,
        open_source: OpenSource,
        progress: ProgressCallback | None = None,
        tap: Tap | None = None,
    ) -> PushResult:
        """A blob whose digest is learned as it is sent (``PushResult.digest``)."""
        ...

    def pull_blob(
        self,
        repo: str,
        digest: str,
        size: int,
        dest: IO[bytes],
        max_size: int,
        progress: ProgressCallback | None = None,
    ) -> None: ...

    def put_manifest(self, repo: str, ref: str, manifest: bytes, media_type: str) -> str: ...

    def get_manifest(
        self, repo: str, ref: str, *, max_size: int = ..., accept: Sequence[str] = ...
    ) -> tuple[bytes, str, str]: ...

    def delete_manifest(self, repo: str, digest: str) -> bool: ...

    def list_tags(
        self, repo: str, *, page_size: int = ..., max_tags: int = ...
    ) -> Iterator[str]: ...
