"""Helpers for the remote store's tests: real stores with real compacted checkpoints,
a real registry, and clients that count what they send and fetch."""

from __future__ import annotations

import contextlib
import os
import subprocess
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from cedana_shim.checkpoint.remote import RemoteStore
from cedana_shim.checkpoint.store import Entry, Store, StoreConfig
from cedana_shim.checkpoint.store.layout import MEDIA_TYPE_CRIU
from cedana_shim.registry import PushResult, RegistryClient, RegistryConfig

from .registry import PASSWORD, USER, Registry, TlsFiles, write_auth_file

MiB = 1 << 20
NODE = "node-a.example"
SCOPE = "team-a"


def open_store(root: Path, **config: Any) -> Store:
    return Store(StoreConfig(root=str(root), **config))


def commit_checkpoint(
    store: Store,
    files: dict[str, bytes],
    *,
    label: str = "trainer",
    scope: str = SCOPE,
    metadata: dict[str, Any] | None = None,
) -> Entry:
    """A committed, compacted checkpoint whose criu layer holds ``files``."""
    meta = metadata or {
        "container": "trainer",
        "pod": "trainer-0",
        "namespace": scope,
        "image": "docker.io/library/busybox:latest",
        "versions": {"shim": "0.1.0", "runc": "runc 1.2", "criu": "4.2", "arch": "x86_64"},
    }
    ingest = store.begin(scope=scope, label=label, metadata=meta)
    images = Path(ingest.dir("criu"))
    for name, data in files.items():
        (images / name).write_bytes(data)
    ingest.add_dir_layer("criu", str(images), MEDIA_TYPE_CRIU)
    entry = store.commit(ingest)
    assert entry.state == "compacted"
    return entry


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


def staging_dirs(store: Store) -> list[str]:
    return [n for n in os.listdir(os.path.join(store.root, "ingest")) if n.startswith("adopt-")]


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
