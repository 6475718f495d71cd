"""A Kubernetes checkpoint archive into the store, as a checkpoint of one namespace.

The archive is hostile input, read with the limits a registry pull has: members are
read by the strict tar reader of rootfs_diff (bounded headers; device nodes, FIFOs and
sparse files refused), and only regular files and directories are taken; any link is
refused, so is a name with ``..``, an absolute one, nesting below ``checkpoint/`` and a
member that appears twice. A compressed archive (gzip, zstd) is expanded into the
store's staging area, cut off where it would pass the store's free space (less a
reserve) or :data:`MAX_ARCHIVE_BYTES`; a plain one is read in place, after the sizes its
headers declare were checked against the free space. Everything is written inside the
checkpoint's ingest directory in the store, through descriptors that never follow a
link, and the CRIU images are checked (images.py) before the checkpoint is published:
a refused archive leaves nothing behind.
"""

from __future__ import annotations

import gzip
import os
import shutil
import stat
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, BinaryIO, Final

from cedana_shim import errors

from ...runtime.criu_stats import DUMP_FILE, dump_stats
from .. import cpu_fit
from ..layers import CRIU_LAYER, MEDIA_TYPES, ROOTFS_LAYER, SHM_LAYER
from ..rootfs_diff.plan import make_plan
from ..rootfs_diff.tar import DIR, REG, Member, read_members
from ..rootfs_diff.types import DEFAULT_LIMITS, ArchiveCorrupt, ArchiveRefused, Limits
from ..store import Store
from ..store.fsutil import free_bytes
from ..store.ingest import Ingest
from ..store.model import Entry
from . import documents, rootfs
from .images import IMAGE_NAME, check_images

__all__ = ["MAX_ARCHIVE_BYTES", "import_archive"]

MAX_ARCHIVE_BYTES: Final = 1 << 40
# Left free on the store's filesystem by an import: the node's own checkpoints come first.
FREE_RESERVE: Final = 256 << 20
CHECKPOINT_DIR: Final = "checkpoint"
DUMP_LOG: Final = "dump.log"
DEVSHM: Final = "devshm-checkpoint.tar"
ROOTFS_DIFF: Final = "rootfs-diff.tar"
MAX_LOG_BYTES: Final = 256 << 20
_GZIP: Final = b"\x1f\x8b"
_ZSTD: Final = b"\x28\xb5\x2f\xfd"
_COPY: Final = 1 << 20
# Top-level files an import reads; the engines' others (container.log, status,
# network.status, restore.log, …) are skipped.
_DOCUMENTS: Final = {
    documents.CONFIG_DUMP: documents.MAX_DOCUMENT_BYTES,
    documents.SPEC_DUMP: documents.MAX_DOCUMENT_BYTES,
    rootfs.DELETED_FILES: rootfs.MAX_DELETED_FILES_BYTES,
    DUMP_FILE: 4096,
}
# Archives are small in members (a CRIU dump has a few per process).
_LIMITS: Final = Limits(max_members=100_000, max_depth=8)

Progress = Callable[[str], None]


@dataclass
class _Layout:
    """The archive's members an import uses, by role."""

    images: list[tuple[str, Member]]
    documents: dict[str, Member]
    rootfs: Member | None = None
    devshm: Member | None = None
    dump_log: Member | None = None


def import_archive(
    store: Store,
    path: str,
    *,
    scope: str,
    label: str,
    progress: Progress | None = None,
) -> Entry:
    """Import the archive at ``path`` as a checkpoint of (``scope``, ``label``)."""
    say = progress or (lambda _what: None)
    name = f"checkpoint archive {path}"
    fd = _open_archive(path, name)
    with os.fdopen(fd, "rb") as source:
        head = source.read(4)
        source.seek(0)
        ingest = store.writer.begin(
            scope=scope, label=label, metadata={"reason": "import", "namespace": scope}
        )
        try:
            entry = _import(store, ingest, source, head, name, os.path.basename(path), say)
        except BaseException:
            store.writer.abort(ingest)
            raise
    return entry


def _open_archive(path: str, name: str) -> int:
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC)
    except OSError as err:
        raise errors.NotFound(f"{name}: {err.strerror}") from None
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise errors.InvalidArgument(f"{name} is not a regular file")
    return fd


def _room(store: Store) -> int:
    return max(0, free_bytes(store.root) - FREE_RESERVE)


def _import(
    store: Store,
    ingest: Ingest,
    source: BinaryIO,
    head: bytes,
    name: str,
    basename: str,
    say: Progress,
) -> Entry:
    tar: BinaryIO = source
    if head[:2] == _GZIP or head == _ZSTD:
        say("expanding the archive")
        tar = _expand(source, head, os.path.join(ingest.path, "archive.tar"), store, name)
    try:
        layout = _layout(tar, name)
        needed = sum(m.size for _, m in layout.images) + sum(
            m.size for m in (layout.rootfs, layout.devshm, layout.dump_log) if m is not None
        )
        if needed > (room := _room(store)):
            raise errors.ResourceExhausted(
                f"{name} holds {needed} bytes, the store {store.root} has {room} free (less a "
                f"{FREE_RESERVE >> 20} MiB reserve); nothing was imported"
            )
        facts = documents.read_facts(
            _read(tar, layout.documents, documents.CONFIG_DUMP, name),
            _read(tar, layout.documents, documents.SPEC_DUMP, name),
            name,
        )
        say("copying the CRIU images")
        criu_dir = ingest.dir(CRIU_LAYER)
        dir_fd = os.open(criu_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            for image, member in layout.images:
                _copy_member(tar, member, image, dir_fd)
            check_images(dir_fd, name)
            if layout.dump_log is not None:
                _copy_member(tar, layout.dump_log, DUMP_LOG, dir_fd)
        finally:
            os.close(dir_fd)
        if layout.rootfs is not None:
            say("checking the rootfs changes")
            deleted = (
                rootfs.parse_deleted(_read(tar, layout.documents, rootfs.DELETED_FILES, name), name)
                if rootfs.DELETED_FILES in layout.documents
                else []
            )
            _add_rootfs(store, ingest, tar, layout.rootfs, deleted, name)
        if layout.devshm is not None:
            _add_devshm(store, ingest, tar, layout.devshm, name)
        metadata: dict[str, Any] = {
            **facts.metadata(),
            # Tool versions are not in the archive: nothing is held against it.
            "versions": {},
            "imported": {
                "archive": basename[:255],
                "engine": facts.engine,
                "namespace": facts.namespace,
                "containerId": facts.container_id,
            },
        }
        if DUMP_FILE in layout.documents:
            metadata["timings"] = {"criu": _stats(tar, layout.documents[DUMP_FILE], ingest)}
        cpuinfo = cpu_fit.record(criu_dir)
        if cpuinfo:
            metadata[cpu_fit.METADATA_KEY] = cpuinfo
        ingest.set_metadata(**metadata)
        ingest.add_dir_layer(CRIU_LAYER, criu_dir, MEDIA_TYPES[CRIU_LAYER])
    finally:
        if tar is not source:
            tar.close()
            os.unlink(os.path.join(ingest.path, "archive.tar"))
    say("committing")
    return store.writer.publish(ingest)


def _expand(source: BinaryIO, head: bytes, dest: str, store: Store, name: str) -> BinaryIO:
    """The decompressed archive, spooled to ``dest`` and cut off at the store's room."""
    reader: BinaryIO
    if head == _ZSTD:
        import zstandard

        reader = zstandard.ZstdDecompressor().stream_reader(source, read_across_frames=True)
    else:
        reader = gzip.GzipFile(fileobj=source, mode="rb")  # type: ignore[assignment]
    limit = min(_room(store), MAX_ARCHIVE_BYTES)
    out = open(dest, "x+b")  # noqa: SIM115 (returned open)
    os.chmod(dest, 0o600)
    try:
        written = 0
        while chunk := reader.read(_COPY):
            written += len(chunk)
            if written > limit:
                raise errors.InvalidArgument(
                    f"{name} expands past {limit} bytes (the store's free space less a "
                    "reserve, at most 1 TiB): a decompression bomb, or too large for this "
                    "store; nothing was imported"
                )
            out.write(chunk)
        out.flush()
        out.seek(0)
    except (OSError, EOFError, ValueError) as err:
        out.close()
        raise errors.InvalidArgument(f"{name}: cannot decompress it ({err})") from None
    except BaseException:
        out.close()
        raise
    finally:
        reader.close()
    return out


def _layout(tar: BinaryIO, name: str) -> _Layout:
    layout = _Layout(images=[], documents={})
    seen: set[bytes] = set()
    try:
        members = list(read_members(tar, _LIMITS))
    except (ArchiveRefused, ArchiveCorrupt) as err:
        raise errors.InvalidArgument(f"{name} refused, nothing imported: {err.detail}") from None
    for m in members:
        clean = m.name
        while clean.startswith(b"./"):
            clean = clean[2:]
        clean = clean.rstrip(b"/")
        if clean in (b"", b"."):
            continue
        shown = clean.decode("utf-8", "backslashreplace")
        if clean in seen:
            raise errors.InvalidArgument(f"{name} refused: {shown!r} appears twice")
        seen.add(clean)
        parts = clean.split(b"/")
        if clean.startswith(b"/") or any(p in (b"", b".", b"..") for p in parts):
            raise errors.InvalidArgument(
                f"{name} refused: member {shown!r} is absolute or leaves the archive"
            )
        if m.typeflag not in (REG, DIR):
            what = "a symlink" if m.typeflag == b"2" else "a hard link or special file"
            raise errors.InvalidArgument(
                f"{name} refused: member {shown!r} is {what}; a checkpoint archive holds "
                "only files and directories"
            )
        _place(layout, m, parts, shown, name)
    for required in (documents.SPEC_DUMP, documents.CONFIG_DUMP):
        if required not in layout.documents:
            raise errors.InvalidArgument(
                f"{name} refused: it has no {required}; not a container checkpoint archive "
                "(kubelet, crictl checkpoint, CRI-O, Podman or cedana checkpoints export)"
            )
    if not layout.images:
        raise errors.InvalidArgument(f"{name} refused: it has no {CHECKPOINT_DIR}/ images")
    return layout


def _place(layout: _Layout, m: Member, parts: list[bytes], shown: str, name: str) -> None:
    top = parts[0].decode("utf-8", "backslashreplace")
    if top == CHECKPOINT_DIR:
        if len(parts) == 1:
            if m.typeflag != DIR:
                raise errors.InvalidArgument(f"{name} refused: {CHECKPOINT_DIR} is not a directory")
            return
        image = parts[1].decode("utf-8", "backslashreplace")
        if len(parts) > 2 or m.typeflag != REG or not IMAGE_NAME.fullmatch(image):
            raise errors.InvalidArgument(
                f"{name} refused: {shown!r} is not a CRIU image ({CHECKPOINT_DIR}/ holds "
                "plain files with plain names, nothing nested)"
            )
        layout.images.append((image, m))
        return
    if len(parts) > 1 or m.typeflag != REG:
        return  # another engine's directory (volumes/, …): not ours to take
    limit = _DOCUMENTS.get(top)
    if limit is not None:
        if m.size > limit:
            raise errors.InvalidArgument(
                f"{name} refused: {top} is {m.size} bytes, over the {limit} it may be"
            )
        layout.documents[top] = m
    elif top == ROOTFS_DIFF:
        layout.rootfs = m
    elif top == DEVSHM:
        layout.devshm = m
    elif top == DUMP_LOG and m.size <= MAX_LOG_BYTES:
        layout.dump_log = m


def _read(tar: BinaryIO, docs: dict[str, Member], name: str, archive: str) -> bytes:
    m = docs[name]
    data = os.pread(tar.fileno(), m.size, m.offset)
    if len(data) != m.size:
        raise errors.InvalidArgument(f"{archive}: {name} is truncated")
    return data


def _copy_member(tar: BinaryIO, m: Member, name: str, dir_fd: int) -> None:
    out = os.open(
        name,
        os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
        0o600,
        dir_fd=dir_fd,
    )
    try:
        done = 0
        while done < m.size:
            n = os.copy_file_range(tar.fileno(), out, m.size - done, m.offset + done)
            if n == 0:
                raise errors.InvalidArgument(f"{name}: the archive ends inside it (truncated)")
            done += n
    finally:
        os.close(out)


def _inner_tar(store: Store, ingest: Ingest, tar: BinaryIO, m: Member, file: str, name: str) -> str:
    """A member tar of the archive as a file of its own in the ingest, decompressed
    (containerd's rootfs-diff.tar is gzip) and cut off at the store's room."""
    raw = os.path.join(ingest.path, f"{file}.in")
    dir_fd = os.open(ingest.path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        _copy_member(tar, m, f"{file}.in", dir_fd)
    finally:
        os.close(dir_fd)
    with open(raw, "rb") as f:
        head = f.read(4)
        if head[:2] != _GZIP and head != _ZSTD:
            return raw
        f.seek(0)
        out = _expand(f, head, os.path.join(ingest.path, file), store, f"{name}: {file}")
    out.close()
    os.unlink(raw)
    return os.path.join(ingest.path, file)


def _add_rootfs(
    store: Store, ingest: Ingest, tar: BinaryIO, m: Member, deleted: list[str], name: str
) -> None:
    staged = _inner_tar(store, ingest, tar, m, ROOTFS_DIFF, name)
    layer = os.path.join(ingest.path, "rootfs-diff.layer.tar")
    with open(staged, "rb") as src:
        rootfs.from_archive(src, deleted, layer, name)
    os.unlink(staged)
    ingest.add_file_layer(ROOTFS_LAYER, layer, MEDIA_TYPES[ROOTFS_LAYER])


def _add_devshm(store: Store, ingest: Ingest, tar: BinaryIO, m: Member, name: str) -> None:
    staged = _inner_tar(store, ingest, tar, m, DEVSHM, name)
    with open(staged, "rb") as src:
        try:
            make_plan(read_members(src, DEFAULT_LIMITS), DEFAULT_LIMITS, whiteouts=False)
        except (ArchiveRefused, ArchiveCorrupt) as err:
            raise errors.InvalidArgument(f"{name}: {DEVSHM} refused: {err.detail}") from None
    ingest.add_file_layer(SHM_LAYER, staged, MEDIA_TYPES[SHM_LAYER])


def _stats(tar: BinaryIO, m: Member, ingest: Ingest) -> dict[str, float | int]:
    """CRIU's figures from the archive's stats-dump (``{}`` when it is not one)."""
    scratch = os.path.join(ingest.path, "stats")
    os.mkdir(scratch, 0o700)
    try:
        dir_fd = os.open(scratch, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            _copy_member(tar, m, DUMP_FILE, dir_fd)
        finally:
            os.close(dir_fd)
        return dump_stats(scratch)
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
