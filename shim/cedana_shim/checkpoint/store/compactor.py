"""Compaction: a raw checkpoint becomes tar+zstd blobs (and chunks), in the background.

Sequence (each step a crash point, see COMPACT_STEPS): the checkpoint's
``raw/<id>`` dir is flock'ed (two compactions of one checkpoint never overlap);
each raw layer is compressed into a temp blob in a locked work dir under
``ingest/`` while its files are checked against their CRC-32s in the same read
(a mismatch is DataLoss and the checkpoint stays raw). A criu layer's page
images become chunk blobs beside its tar (chunks.py; ``chunk_size`` 0: all in
the tar). The new config (which keeps ``rawFiles``) and manifest follow. Then,
holding ``index.lock``: blobs are placed and the checkpoint's descriptor in
index.json is replaced by the compacted one, same id, same created, same
position: the commit marker again.
Last, the raw files are kept as the raw-image cache (the newest checkpoint of
its label, ``cache_raw`` on, only layers marked keep_raw, with a copy of their
file list beside them) or deleted. Runs in a thread of its own at nice 10.

A caller can be told of each chunk blob as soon as it is written (``on_blob``):
a push to a registry sends it while the next ones are being compressed, from the
work dir or, once the compaction has placed it, from the store.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import secrets
import threading
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import IO, Any, TypeAlias, TypeVar

from cedana_shim import errors

from . import fsutil, gc, priority
from .catalog import Catalog, newest_first
from .chunks import ChunkWriter, chunk_temp_name, pool_width, split_file_list, split_files_of
from .compress import WrittenBlob, compress_stream
from .core import StoreCore
from .filelist import CACHE_LIST_SUFFIX, FileList, RawFile
from .ingest import create_locked_dir
from .layout import (
    ANN_ID,
    ANN_TITLE,
    MEDIA_TYPE_CONFIG,
    MEDIA_TYPE_CRIU,
    MEDIA_TYPE_MANIFEST,
    Chunk,
    Descriptor,
    Index,
    SplitFile,
    check_checkpoint_id,
    dump_json,
    dump_manifest,
    parse_checkpoint_ref,
)
from .model import Entry
from .rawfiles import write_layer

__all__ = ["Compactor", "OnBlob", "OpenBlob"]

log = logging.getLogger(__name__)

NICE: int = 10
T = TypeVar("T")
OpenBlob: TypeAlias = Callable[[int], IO[bytes]]  # offset -> a stream positioned there
OnBlob: TypeAlias = Callable[[str, int, OpenBlob], None]  # (digest, size, open_at)


def run_niced(fn: Callable[[], T], nice: int = NICE) -> T:
    """``fn()`` in a thread of its own at nice >= ``nice``: compaction competes with
    workloads. A positive ``nice`` also counts as background work (see priority).

    A thread of its own, so the priority dies with it (a pool thread would keep
    it); zstd's workers, created from it, inherit it.
    """
    result: list[T] = []
    failure: list[BaseException] = []

    def run() -> None:
        tid = threading.get_native_id()
        with contextlib.suppress(OSError):
            current = os.getpriority(os.PRIO_PROCESS, tid)
            os.setpriority(os.PRIO_PROCESS, tid, max(current, nice))
        try:
            with priority.background() if nice > 0 else contextlib.nullcontext():
                result.append(fn())
        except BaseException as err:  # re-raised in the caller's thread
            failure.append(err)

    thread = threading.Thread(target=run, name="cedana-compact")
    thread.start()
    thread.join()
    if failure:
        raise failure[0]
    return result[0]


@dataclass(frozen=True)
class _Compressed:
    files: FileList
    file_list: bytes
    blob: WrittenBlob
    tmp: str
    # A split layer's page images (see chunks.py), and their temp blobs by digest.
    chunks: tuple[Chunk, ...] = ()
    split_files: tuple[SplitFile, ...] = ()
    chunk_temps: Mapping[str, str] = field(default_factory=dict)

    @property
    def size(self) -> int:
        return self.blob.size + sum(c.size for c in self.chunks)

    @property
    def raw_size(self) -> int:
        return self.blob.raw_size + sum(c.raw_size for c in self.chunks)


def _config_layer(c: _Compressed) -> dict[str, Any]:
    layer: dict[str, Any] = {
        "name": c.files.layer,
        "media_type": c.files.media_type,
        "digest": c.blob.digest,
        "size": c.blob.size,  # the blob's, as its descriptor in the manifest says
        "raw_size": c.raw_size,  # the whole layer's: its tar and its split files
    }
    if c.chunks or c.split_files:
        layer["split_files"] = [f.to_json() for f in c.split_files]
    return layer


class Compactor:
    """Compacts raw checkpoints (see the module doc)."""

    def __init__(self, core: StoreCore, catalog: Catalog) -> None:
        self._core = core
        self._catalog = catalog

    def compact(
        self, checkpoint_id: str, on_blob: OnBlob | None = None, *, niced: bool = True
    ) -> Entry | None:
        """Compact a raw checkpoint (see the module doc); blocking, idempotent.

        Returns the compacted entry (at once if it already was), or None if the
        checkpoint is gone (removed by retention or prune meanwhile). DataLoss
        when its raw files do not match their file lists: it stays raw.
        ``on_blob(digest, size, open_at)`` is called (from a compression thread;
        it must neither raise nor block) for each chunk blob once it is written;
        ``open_at(offset)`` opens it, where it is then, positioned at ``offset``.
        ``niced`` False: at the caller's priority (a stop's exit waits for it).
        """
        if (why := check_checkpoint_id(checkpoint_id)) is not None:
            raise errors.InvalidArgument(why)
        try:
            return run_niced(lambda: self._compact(checkpoint_id, on_blob), NICE if niced else 0)
        except OSError as err:
            raise self._core.os_error(err, f"compacting checkpoint {checkpoint_id}") from err

    def pending_compaction(self) -> list[str]:
        """Raw checkpoints nobody is compacting now, oldest first."""
        index = self._core.read_index()
        pending: list[str] = []
        for ref in reversed(newest_first(index.checkpoints)):
            entry = self._catalog.load_entry(ref)
            if entry.damage is not None or entry.state != "raw":
                continue
            try:
                with self._core.opened_dir("raw", ref.id) as fd:
                    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # being compacted
            except (OSError, errors.DataLoss) as err:
                log.warning(
                    "raw checkpoint cannot be compacted: %s", err, extra={"checkpoint": ref.id}
                )
                continue
            pending.append(ref.id)
        return pending

    def _find(self, checkpoint_id: str) -> Entry | None:
        for ref in self._catalog.index_repaired().checkpoints:
            if ref.id == checkpoint_id:
                return self._catalog.load_entry(ref)
        return None

    def _compact(self, checkpoint_id: str, on_blob: OnBlob | None) -> Entry | None:
        entry = self._find_raw(checkpoint_id)
        if entry is None or entry.state == "compacted":
            return entry
        try:
            with self._raw_locked(checkpoint_id) as raw_fd:
                self._core.step("compact-locked")
                # Again: a compaction that held the lock may have just finished.
                entry = self._find_raw(checkpoint_id)
                if entry is None or entry.state == "compacted":
                    return entry
                return self._compact_locked(entry, raw_fd, on_blob)
        except FileNotFoundError:
            if self._find(checkpoint_id) is None:
                return None
            path = self._catalog.raw_path(checkpoint_id)
            raise errors.DataLoss(
                f"checkpoint {checkpoint_id}: raw files {path} are missing"
            ) from None

    def _find_raw(self, checkpoint_id: str) -> Entry | None:
        """The checkpoint (None if gone); DataLoss if it cannot be read."""
        entry = self._find(checkpoint_id)
        if entry is not None and entry.damage is not None:
            raise errors.DataLoss(f"checkpoint {entry.id} is damaged: {entry.damage}")
        return entry

    @contextlib.contextmanager
    def _raw_locked(self, checkpoint_id: str) -> Iterator[int]:
        with self._core.opened_dir("raw", checkpoint_id) as fd:
            fcntl.flock(fd, fcntl.LOCK_EX)
            yield fd

    def _compact_locked(self, entry: Entry, raw_fd: int, on_blob: OnBlob | None) -> Entry | None:
        with self._core.opened_dir("ingest") as ingest_root:
            name, work_fd, lock_fd = create_locked_dir(
                ingest_root,
                lambda: f"compact-{entry.id}-{secrets.token_hex(4)}",
                {"compacting": entry.id},
            )
            announce = None if on_blob is None else self._announcer(name, on_blob)
            try:
                compressed = [
                    self._compress(entry, i, raw_fd, work_fd, announce)
                    for i in range(len(entry.layers))
                ]
                config, manifest = self._write_compacted(entry, compressed, work_fd)
                return self._swap(entry, compressed, work_fd, (config, manifest), raw_fd)
            finally:
                fsutil.remove_entry(ingest_root, name)  # while locked: gc keeps off
                os.close(work_fd)
                os.close(lock_fd)

    def _announcer(self, work_name: str, on_blob: OnBlob) -> Callable[[str, int], None]:
        """What a chunk writer calls for each chunk blob: ``on_blob`` with an opener that
        finds the blob in the work dir, or in blobs/sha256 once it was placed there."""

        def opener(digest: str) -> OpenBlob:
            tmp = chunk_temp_name(digest)
            what = f"chunk blob {digest}"

            def open_at(offset: int) -> IO[bytes]:
                try:
                    with self._core.opened_dir("ingest", work_name) as work_fd:
                        fd = fsutil.open_file(
                            work_fd, tmp, path=self._core.path("ingest", work_name)
                        )
                except FileNotFoundError:  # placed (renamed into the store) meanwhile
                    fd = self._core.open_blob_fd(digest, what)
                stream = os.fdopen(fd, "rb")
                stream.seek(offset)
                return stream

            return open_at

        return lambda digest, size: on_blob(digest, size, opener(digest))

    def _compress(
        self,
        entry: Entry,
        i: int,
        raw_fd: int,
        work_fd: int,
        announce: Callable[[str, int], None] | None,
    ) -> _Compressed:
        layer = entry.layers[i]
        what = f"checkpoint {entry.id}: layer {layer.name!r}"
        found = self._catalog.file_list_bytes(entry, layer.name)
        if found is None:
            raise errors.DataLoss(f"{what}: no file list")
        files, file_list = found
        path = self._catalog.raw_path(entry.id, layer.name)
        describe = f"{what} ({path})"
        in_tar: FileList = files
        split: tuple[RawFile, ...] = ()
        if self._splits(files):
            in_tar, split = split_file_list(files)
        with self._catalog.raw_layer(entry.id, layer.name, what, raw_fd) as layer_fd:
            tmp = f"layer-{i}"
            flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
            fd = os.open(tmp, flags, 0o600, dir_fd=work_fd)
            try:
                blob = compress_stream(
                    fd,
                    lambda out: write_layer(layer_fd, in_tar, out, path=path, describe=describe),
                    level=self._core.config.compression_level,
                    threads=self._core.config.threads,
                    on_first_write=lambda: self._core.step("layer-writing"),
                )
                os.fsync(fd)
            finally:
                os.close(fd)
            chunks: list[Chunk] = []
            temps: dict[str, str] = {}
            if split:
                chunks, temps = self._write_chunks(
                    entry, layer_fd, split, work_fd, (path, describe), announce
                )
        self._core.step("layer-written")
        if files.cache and self._core.config.cache_raw:
            # Beside the files it describes, for raw_images() once compacted.
            fsutil.write_file_atomic(raw_fd, layer.name + CACHE_LIST_SUFFIX, file_list)
        return _Compressed(files, file_list, blob, tmp, tuple(chunks), split_files_of(split), temps)

    def _splits(self, files: FileList) -> bool:
        """Whether compaction splits the layer's page images into chunks."""
        return (
            self._core.config.chunk_size > 0
            and files.kind == "dir"
            and files.media_type == MEDIA_TYPE_CRIU
        )

    def _write_chunks(
        self,
        entry: Entry,
        layer_fd: int,
        split: tuple[RawFile, ...],
        work_fd: int,
        names: tuple[str, str],  # (path, describe)
        announce: Callable[[str, int], None] | None,
    ) -> tuple[list[Chunk], dict[str, str]]:
        path, describe = names
        with self._core.opened_blobs() as blobs_fd:
            writer = ChunkWriter(
                work_fd,
                blobs_fd,
                level=self._core.config.compression_level,
                chunk_size=self._core.config.chunk_size,
                workers=pool_width(self._core.config.threads),
                on_chunk=announce,
            )
            chunks = writer.write(layer_fd, split, path=path, describe=describe)
        log.info(
            "page images split into chunks",
            extra={
                "checkpoint": entry.id,
                "chunks": len(chunks),
                "new_bytes": writer.written,
                "reused_bytes": writer.reused,
            },
        )
        return chunks, writer.temps

    def _write_compacted(
        self, entry: Entry, compressed: list[_Compressed], work_fd: int
    ) -> tuple[Descriptor, Descriptor]:
        config = {
            **entry.metadata,
            "sizes": {
                "raw": sum(c.raw_size for c in compressed),
                "stored": sum(c.size for c in compressed),
            },
            "layers": [_config_layer(c) for c in compressed],
        }
        config_bytes = dump_json(config)
        fsutil.create_file_at(work_fd, "config", config_bytes)
        config_desc = Descriptor(
            MEDIA_TYPE_CONFIG, fsutil.sha256_bytes(config_bytes), len(config_bytes)
        )
        self._core.step("compact-config-written")
        layers: list[Descriptor] = []
        for c in compressed:
            name = c.files.layer
            layers.append(
                Descriptor(c.files.media_type, c.blob.digest, c.blob.size, {ANN_TITLE: name})
            )
            layers.extend(chunk.descriptor(name) for chunk in c.chunks)
        annotations = self._annotations(entry)
        data = dump_manifest(annotations, config_desc, layers)
        fsutil.create_file_at(work_fd, "manifest", data)
        self._core.step("compact-manifest-written")
        manifest = Descriptor(
            MEDIA_TYPE_MANIFEST, fsutil.sha256_bytes(data), len(data), annotations
        )
        return config_desc, manifest

    def _annotations(self, entry: Entry) -> dict[str, str]:
        for ref in self._core.read_index().checkpoints:
            if ref.id == entry.id:
                return dict(ref.descriptor.annotations)
        raise errors.Internal(f"checkpoint {entry.id} vanished from {self._core.index_path}")

    def _swap(
        self,
        entry: Entry,
        compressed: list[_Compressed],
        work_fd: int,
        documents: tuple[Descriptor, Descriptor],
        raw_fd: int,
    ) -> Entry | None:
        """Place the blobs and swap the descriptor in index.json; then release the raw files."""
        with self._core.index_lock():
            self._core.step("compact-index-locked")
            index = self._catalog.index_for_write()
            position = self._position(index, entry.id)
            if position is None:
                return None  # removed meanwhile: the temp blobs go with the work dir
            current = index.descriptors[position]
            if current.digest != entry.manifest_digest:
                return self._catalog.load_entry(
                    parse_checkpoint_ref(current, position, "index.json")
                )
            new_index = self._commit_swap(index, position, compressed, work_fd, documents)
            self._release_raw(entry, new_index, raw_fd)
            self._core.step("raw-released")
            try:
                self._catalog.sweep_locked(new_index)
            except OSError as err:  # the checkpoint is compacted; gc can run again later
                log.warning("gc after compaction failed: %s", err)
            self._core.step("gc-done")
        desc = new_index.descriptors[position]
        return self._catalog.load_entry(parse_checkpoint_ref(desc, position, "index.json"))

    @staticmethod
    def _position(index: Index, checkpoint_id: str) -> int | None:
        for i, desc in enumerate(index.descriptors):
            if desc.annotations.get(ANN_ID) == checkpoint_id:
                return i
        return None

    def _commit_swap(
        self,
        index: Index,
        position: int,
        compressed: list[_Compressed],
        work_fd: int,
        documents: tuple[Descriptor, Descriptor],
    ) -> Index:
        config, manifest = documents
        old = index.descriptors[position]
        placed: list[str] = []
        committed = False
        try:
            with self._core.opened_blobs() as blobs:
                for c in compressed:
                    self._core.place(work_fd, c.tmp, blobs, c.blob.digest, placed)
                    for digest, tmp in c.chunk_temps.items():
                        self._core.place(work_fd, tmp, blobs, digest, placed)
                self._core.place(work_fd, "config", blobs, config.digest, placed)
                os.fsync(blobs)
                self._core.step("compact-blobs-placed")
                self._core.place(work_fd, "manifest", blobs, manifest.digest, placed)
                os.fsync(blobs)
                self._core.step("compact-manifest-placed")
            # Same annotations (id, created...) and unknown fields: only the manifest changes.
            descriptors = list(index.descriptors)
            descriptors[position] = Descriptor(
                MEDIA_TYPE_MANIFEST, manifest.digest, manifest.size, old.annotations, raw=old.raw
            )
            new_index = self._core.replace_index(index, descriptors, "compact-index-temp-written")
            committed = True
            self._core.step("compact-index-replaced")
            os.fsync(self._core.root_fd)
            self._core.step("compact-committed")
        except BaseException:
            if not committed:
                self._core.unplace(placed)
            raise
        return new_index

    def _release_raw(self, entry: Entry, index: Index, raw_fd: int) -> None:
        """Keep the raw files as the label's raw-image cache, or delete them."""
        group = [r for r in index.checkpoints if (r.scope, r.label) == (entry.scope, entry.label)]
        newest = newest_first(group)[0].id == entry.id
        with self._core.opened_dir("raw") as raw:
            if newest and self._core.config.cache_raw:
                gc.trim_cache(raw, entry.id)
            else:
                fsutil.remove_entry(raw, entry.id)
