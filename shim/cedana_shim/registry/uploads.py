"""Where unfinished blob uploads are remembered, so a later push resumes them.

A registry identifies an upload session by its URL (the ``Location`` of the last
answer). The client keeps that URL per (registry, repository, digest) in memory and,
when given a state directory, in a small JSON file there (0600, written by rename),
so a push that a new process retries also resumes instead of starting over. A file
that cannot be read or does not match is ignored: the upload then starts afresh,
which is always correct, only slower.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import threading
from dataclasses import dataclass
from typing import Final

from cedana_shim import untrusted_json

__all__ = ["UploadState", "UploadStates"]

_MAX_STATE_BYTES: Final = 64 << 10


@dataclass(frozen=True)
class UploadState:
    location: str  # absolute URL of the upload session
    offset: int  # bytes the registry had acknowledged when this was written


class UploadStates:
    """Unfinished uploads to one registry, by repository and digest (thread-safe)."""

    def __init__(self, registry: str, state_dir: str | None) -> None:
        self._registry = registry
        self._dir = state_dir
        self._memory: dict[tuple[str, str], UploadState] = {}
        self._lock = threading.Lock()

    def get(self, repo: str, digest: str) -> UploadState | None:
        with self._lock:
            state = self._memory.get((repo, digest))
        return state if state is not None else self._load(repo, digest)

    def put(self, repo: str, digest: str, state: UploadState) -> None:
        with self._lock:
            self._memory[(repo, digest)] = state
        if self._dir is None:
            return
        record = {
            "registry": self._registry,
            "repository": repo,
            "digest": digest,
            "location": state.location,
            "offset": state.offset,
        }
        os.makedirs(self._dir, mode=0o700, exist_ok=True)
        path = _state_path(self._dir, self._registry, repo, digest)
        tmp = f"{path}.{os.getpid()}.{threading.get_ident()}.tmp"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        with os.fdopen(fd, "w") as handle:
            json.dump(record, handle)
        os.replace(tmp, path)

    def drop(self, repo: str, digest: str) -> None:
        with self._lock:
            self._memory.pop((repo, digest), None)
        if self._dir is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(_state_path(self._dir, self._registry, repo, digest))

    def _load(self, repo: str, digest: str) -> UploadState | None:
        if self._dir is None:
            return None
        try:
            path = _state_path(self._dir, self._registry, repo, digest)
            fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
            with os.fdopen(fd, "rb") as handle:
                record = untrusted_json.loads(handle.read(_MAX_STATE_BYTES))
        except (OSError, ValueError):
            return None
        expected = {"registry": self._registry, "repository": repo, "digest": digest}
        if not isinstance(record, dict) or any(record.get(k) != v for k, v in expected.items()):
            return None
        location, offset = record.get("location"), record.get("offset")
        if not isinstance(location, str) or not isinstance(offset, int) or offset < 0:
            return None
        return UploadState(location=location, offset=offset)


def _state_path(state_dir: str, registry: str, repo: str, digest: str) -> str:
    key = hashlib.sha256(f"{registry}/{repo}@{digest}".encode()).hexdigest()[:40]
    return os.path.join(state_dir, f"upload-{key}.json")
