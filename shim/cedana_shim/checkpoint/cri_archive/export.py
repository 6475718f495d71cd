"""A stored checkpoint as a Kubernetes checkpoint archive.

The CRIU images are extracted (pages reassembled from their chunks, every blob checked
as it is read) into a private directory on the store's filesystem and written as plain
files under ``checkpoint/``; the JSON documents come from the metadata (documents.py),
``stats-dump`` is CRIU's statistics image rebuilt from the figures the checkpoint kept,
the writable layer goes out as ``rootfs-diff.tar`` + ``deleted.files`` (rootfs.py) and
the pod's ``/dev/shm`` as ``devshm-checkpoint.tar``. The archive is written to a
temporary file beside the target (mode 0600: it holds the process's memory) and
renamed into place once complete, so a failed export leaves nothing at the target.
CRIU's own dump log is not kept by the store: ``dump.log`` is the log an imported archive
brought, or otherwise says so and gives CRIU's figures.
"""

from __future__ import annotations

import json
import os
import shutil
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Final

from ...runtime.criu_stats import DUMP_FILE, encode_dump_stats
from ..layers import CRIU_LAYER, ROOTFS_LAYER, SHM_LAYER
from ..rootfs_diff.tar import DIR, REG, TarWriter
from ..store import Store
from ..store.fsutil import mkdtemp_private
from ..store.model import Entry
from . import documents, rootfs
from .importer import CHECKPOINT_DIR, DEVSHM, DUMP_LOG, ROOTFS_DIFF

__all__ = ["Exported", "export_archive"]

Progress = Callable[[str], None]
_EMPTY_TAR: Final = bytes(10240)


@dataclass(frozen=True)
class Exported:
    path: str
    size: int
    images: int


def export_archive(
    store: Store, entry: Entry, out_path: str, progress: Progress | None = None
) -> Exported:
    say = progress or (lambda _what: None)
    with _scratch(store) as scratch:
        say("extracting the CRIU images")
        images = os.path.join(scratch, "images")
        os.mkdir(images, 0o700)
        store.reader.extract_layer(entry, CRIU_LAYER, images)
        names = {layer.name for layer in entry.layers}
        deleted: list[str] = []
        diff = os.path.join(scratch, ROOTFS_DIFF)
        with open(diff, "xb") as out:
            if ROOTFS_LAYER in names:
                say("converting the rootfs changes")
                with store.reader.open_layer(entry, ROOTFS_LAYER) as layer:
                    deleted = rootfs.to_archive(layer, out)
            else:
                out.write(_EMPTY_TAR)
        shm = None
        if SHM_LAYER in names:
            shm = os.path.join(scratch, DEVSHM)
            with store.reader.open_layer(entry, SHM_LAYER) as layer, open(shm, "xb") as out:
                shutil.copyfileobj(layer, out, 1 << 20)
        say("writing the archive")
        return _write(entry, out_path, images, diff, deleted, shm)


@contextmanager
def _scratch(store: Store) -> Iterator[str]:
    path = mkdtemp_private(store.reader.spool_dir(), "export-")
    try:
        yield path
    finally:
        shutil.rmtree(path, ignore_errors=True)


def _write(
    entry: Entry,
    out_path: str,
    images: str,
    diff: str,
    deleted: list[str],
    shm: str | None,
) -> Exported:
    target = os.path.abspath(out_path)
    tmp = os.path.join(os.path.dirname(target), f".{os.path.basename(target)}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    now = time.time_ns()
    count = 0
    try:
        writer = TarWriter(fd)

        def add_bytes(name: str, data: bytes) -> None:
            writer.add(name.encode(), REG, mode=0o600, uid=0, gid=0, mtime_ns=now, size=len(data))
            src = _bytes_fd(data)
            try:
                writer.content(src, len(data))
            finally:
                os.close(src)

        def add_file(name: str, path: str) -> None:
            src = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            try:
                size = os.fstat(src).st_size
                writer.add(name.encode(), REG, mode=0o600, uid=0, gid=0, mtime_ns=now, size=size)
                writer.content(src, size)
            finally:
                os.close(src)

        add_bytes(documents.CONFIG_DUMP, _json(documents.config_dump(entry)))
        add_bytes(documents.SPEC_DUMP, _json(documents.spec_dump(entry)))
        add_bytes(documents.STATUS_DUMP, _json(documents.status_dump(entry)))
        writer.add(CHECKPOINT_DIR.encode(), DIR, mode=0o700, uid=0, gid=0, mtime_ns=now)
        log = None
        for name in sorted(os.listdir(images)):
            path = os.path.join(images, name)
            if name == DUMP_LOG:
                log = path
                continue
            add_file(f"{CHECKPOINT_DIR}/{name}", path)
            count += 1
        criu = (entry.metadata.get("timings") or {}).get("criu") or {}
        add_bytes(DUMP_FILE, encode_dump_stats(criu if isinstance(criu, dict) else {}))
        if log is not None:
            add_file(DUMP_LOG, log)
        else:
            add_bytes(DUMP_LOG, _no_log(entry, criu))
        add_file(ROOTFS_DIFF, diff)
        add_bytes(rootfs.DELETED_FILES, _json(deleted))
        if shm is not None:
            add_file(DEVSHM, shm)
        writer.close()
        os.fsync(fd)
        size = os.fstat(fd).st_size
    except BaseException:
        os.unlink(tmp)
        raise
    finally:
        os.close(fd)
    os.rename(tmp, target)
    return Exported(target, size, count)


def _json(doc: Any) -> bytes:
    return json.dumps(doc, indent=2).encode() + b"\n"


def _bytes_fd(data: bytes) -> int:
    """A memfd holding ``data``: TarWriter copies from descriptors."""
    fd = os.memfd_create("cedana-export", os.MFD_CLOEXEC)
    os.write(fd, data)
    return fd


def _no_log(entry: Entry, criu: Any) -> bytes:
    figures = json.dumps(criu, sort_keys=True) if criu else "none recorded"
    return (
        f"cedana-shim checkpoint {entry.id} (namespace {entry.scope}, label {entry.label}): "
        "the store keeps CRIU's statistics, not its dump log.\n"
        f"CRIU's figures for this dump: {figures}\n"
    ).encode()
