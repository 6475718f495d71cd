"""Real stores holding real committed checkpoints, for the remote store's tests (unit
tests against a shared directory, integration tests against a registry)."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from cedana_shim.checkpoint.store import Entry, Store, StoreConfig
from cedana_shim.checkpoint.store.layout import MEDIA_TYPE_CRIU

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
    ingest = store.writer.begin(scope=scope, label=label, metadata=meta)
    images = Path(ingest.dir("criu"))
    for name, data in files.items():
        (images / name).write_bytes(data)
    ingest.add_dir_layer("criu", str(images), MEDIA_TYPE_CRIU)
    entry = store.commit(ingest)
    assert entry.state == "compacted"
    return entry


def staging_dirs(store: Store) -> list[str]:
    return [n for n in os.listdir(os.path.join(store.root, "ingest")) if n.startswith("adopt-")]
