"""Helpers for the remote store's tests against a real registry: its settings and
clients that count what they send and fetch (the stores: tests/support/checkpoints.py)."""

from __future__ import annotations

import contextlib
import os
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from cedana_shim.checkpoint.remote import RemoteStore
from cedana_shim.checkpoint.store import Store
from cedana_shim.registry import PushResult, RegistryClient, RegistryConfig
from support.checkpoints import NODE, SCOPE, MiB, commit_checkpoint, open_store, staging_dirs

from .registry import PASSWORD, USER, Registry, TlsFiles, write_auth_file

__all__ = [
    "NODE",
    "SCOPE",
    "CountingClient",
    "MiB",
    "commit_checkpoint",
    "open_store",
    "registry_config",
    "remote_store",
    "staging_dirs",
    "tmpfs",
]


def registry_config(
    registry: Registry, tls: TlsFiles, workdir: Path, **extra: Any
) -> RegistryConfig:
    auth = write_auth_file(workdir / "auth.json", registry.host, USER, PASSWORD)
    return RegistryConfig(
        registry=f"{registry.host}/cedana", auth_file=str(auth), ca_file=str(tls.ca_cert), **extra
    )


class CountingClient(RegistryClient):
    """A real client that records each blob push's result and each blob download."""

    def __init__(self, config: RegistryConfig, **kw: Any) -> None:
        super().__init__(config, **kw)
        self.pushes: list[PushResult] = []
        self.pulled: list[str] = []
        self.manifest_reads = 0
        self._count_lock = threading.Lock()

    def push_blob(self, *args: Any, **kw: Any) -> PushResult:
        result = super().push_blob(*args, **kw)
        with self._count_lock:
            self.pushes.append(result)
        return result

    def push_blob_by_content(self, *args: Any, **kw: Any) -> PushResult:
        result = super().push_blob_by_content(*args, **kw)
        with self._count_lock:
            self.pushes.append(result)
        return result

    def pull_blob(self, repo: str, digest: str, *args: Any, **kw: Any) -> None:
        with self._count_lock:
            self.pulled.append(digest)
        super().pull_blob(repo, digest, *args, **kw)

    def get_manifest(self, *args: Any, **kw: Any) -> tuple[bytes, str, str]:
        with self._count_lock:
            self.manifest_reads += 1
        return super().get_manifest(*args, **kw)

    @property
    def sent(self) -> int:
        return sum(p.sent for p in self.pushes)


def remote_store(store: Store, config: RegistryConfig, node: str = NODE) -> RemoteStore:
    uploads = os.path.join(store.root, "outbox", "uploads")
    return RemoteStore(store, CountingClient(config, upload_state_dir=uploads), node)


@contextlib.contextmanager
def tmpfs(path: Path, size_mib: int) -> Iterator[Path]:
    """A small tmpfs at ``path`` (root only): a disk that fills up for real."""
    path.mkdir(mode=0o700, exist_ok=True)
    subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size_mib}m,mode=0700", "tmpfs", str(path)],
        check=True,
    )
    try:
        yield path
    finally:
        subprocess.run(["umount", "-l", str(path)], check=False)
