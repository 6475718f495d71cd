"""Helpers shared by the checkpoint store's tests (tests/unit/test_store_*.py)."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
import tarfile
import textwrap
from pathlib import Path

from cedana_shim.checkpoint.store import Entry, Ingest, Store, StoreConfig
from cedana_shim.checkpoint.store.layout import MEDIA_TYPE_CRIU, MEDIA_TYPE_ROOTFS_DIFF

CRIU_FILES = {
    "pages-1.img": os.urandom(200_000),
    "core-1.img": b"core" * 100,
    "inventory.img": b"inv",
}

CHILD_PRELUDE = """
import os, signal, sys, time
from pathlib import Path
from cedana_shim.checkpoint.store import Store, StoreConfig
from cedana_shim.checkpoint.store.layout import MEDIA_TYPE_CRIU

def begin(store, scope, label, data):
    ing = store.writer.begin(scope=scope, label=label, metadata={"container": "c"})
    Path(ing.dir("criu"), "pages-1.img").write_bytes(data)
    ing.add_dir_layer("criu", ing.dir("criu"), MEDIA_TYPE_CRIU)
    ing.keep_raw("criu")
    return ing
"""


def make_store(tmp_path: Path, **kw: object) -> Store:
    return Store(StoreConfig(root=str(tmp_path / "store"), **kw))  # type: ignore[arg-type]


def tar_bytes(files: dict[str, bytes]) -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for name, data in files.items():
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return out.getvalue()


def stage(
    store: Store,
    label: str = "app",
    *,
    files: dict[str, bytes] | None = None,
    diff: bytes | None = None,
    scope: str = "ns",
) -> Ingest:
    """An ingest as the pipeline fills it: CRIU's images 0644, a rootfs-diff tar beside."""
    ing = store.writer.begin(scope=scope, label=label, metadata={"container": "c1"})
    images = Path(ing.dir("criu"))
    for name, data in (files or CRIU_FILES).items():
        (images / name).write_bytes(data)
        (images / name).chmod(0o644)
    ing.add_dir_layer("criu", str(images), MEDIA_TYPE_CRIU)
    ing.keep_raw("criu")
    if diff is not None:
        tar = Path(ing.path, "rootfs-diff.tar")
        tar.write_bytes(diff)
        ing.add_file_layer("rootfs-diff", str(tar), MEDIA_TYPE_ROOTFS_DIFF)
    return ing


def publish(store: Store, label: str = "app", **kw: object) -> Entry:
    return store.writer.publish(stage(store, label, **kw))  # type: ignore[arg-type]


def blob_names(store: Store) -> set[str]:
    return set(os.listdir(os.path.join(store.root, "blobs", "sha256")))


def read_blob(store: Store, digest: str) -> bytes:
    return Path(store.root, "blobs", "sha256", digest.removeprefix("sha256:")).read_bytes()


def referenced_blobs(store: Store) -> set[str]:
    out: set[str] = set()
    for e in store.catalog.list():
        out.add(e.manifest_digest.removeprefix("sha256:"))
        manifest = json.loads(read_blob(store, e.manifest_digest))
        out.add(manifest["config"]["digest"].removeprefix("sha256:"))
        out.update(x.digest.removeprefix("sha256:") for x in e.layers)
        out.update(c.digest.removeprefix("sha256:") for x in e.layers for c in x.chunks)
    return out


def index_manifests(store: Store) -> list[dict[str, object]]:
    doc = json.loads(Path(store.root, "index.json").read_text())
    manifests: list[dict[str, object]] = doc["manifests"]
    return manifests


def run_child(code: str, *args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(CHILD_PRELUDE + code), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def start_child(code: str, *args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(CHILD_PRELUDE + code), *args],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
