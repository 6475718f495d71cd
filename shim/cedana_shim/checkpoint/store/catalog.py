"""What the store holds: entries read back from index.json, manifests and configs.

Listing and looking up checkpoints (``list``, ``get``) is this part's own job; the
rest of its methods serve the other parts (store.py). Loading an entry checks,
before anything else, that the index, the manifest and the config agree on which
checkpoint this is (a disagreement is the damage reported, not a missing field).
Checking an entry verifies blob sizes and digests, or a raw checkpoint's files
against their file lists. The sweep that follows every write lives here too, and
the repair of a damaged index that every write path falls back to.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Iterable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from types import MappingProxyType
from typing import Any, TypeAlias

from cedana_shim import errors

from . import fsutil, gc
from .chunks import pool_width
from .compress import hash_fd
from .core import INDEX, StoreCore
from .failures import FailureRecords, failed_last, sweep_failures
from .filelist import CACHE_LIST_SUFFIX, MAX_FILE_LIST_BYTES, FileList, parse_file_list
from .layout import (
    ANN_CREATED,
    ANN_ID,
    ANN_LABEL,
    ANN_SCOPE,
    ANN_TITLE,
    LAYOUT_VERSION,
    MAX_CONFIG_BYTES,
    MAX_MANIFEST_BYTES,
    MEDIA_TYPE_FILE_LIST,
    MEDIA_TYPE_INDEX,
    CheckpointRef,
    Chunk,
    ConfigLayer,
    Descriptor,
    Index,
    Manifest,
    check_checkpoint_id,
    dump_json,
    match_split_files,
    parse_config,
    parse_manifest,
)
from .model import Entry, LayerInfo, RepairReport, State
from .rawfiles import verify_files
from .repair import rebuild
from .restores import sweep_records

__all__ = ["Catalog", "newest_first"]

log = logging.getLogger(__name__)

# `list` is a method name below, so the class body cannot say list[...].
_Entries: TypeAlias = list[Entry]


def newest_first(refs: Iterable[CheckpointRef]) -> list[CheckpointRef]:
    # created is when the dump happened; index position (commit order) breaks ties.
    return sorted(refs, key=lambda r: (r.created_at, r.position), reverse=True)


def manifest_state(manifest: Manifest, where: str) -> State:
    raw = {d.media_type == MEDIA_TYPE_FILE_LIST for d in manifest.layers}
    if raw == {True, False} or (True in raw and manifest.chunks):
        raise errors.DataLoss(f"{where}: manifest mixes raw and compacted layers")
    return "raw" if True in raw else "compacted"


def _check_manifest_identity(manifest: Manifest, ref: CheckpointRef, where: str) -> None:
    ann = manifest.annotations
    for key, expected in (
        (ANN_ID, ref.id),
        (ANN_SCOPE, ref.scope),
        (ANN_LABEL, ref.label),
        (ANN_CREATED, ref.created),
    ):
        if key in ann and ann[key] != expected:
            raise errors.DataLoss(
                f"{where}: manifest annotation {key} is {ann[key]!r} but index.json says "
                f"{expected!r}"
            )


def _layer_info(c: ConfigLayer, chunks: tuple[Chunk, ...], raw: bool) -> LayerInfo:
    if raw:
        return LayerInfo(c.name, c.media_type, c.digest, c.raw_size, c.raw_size)
    return LayerInfo(
        c.name,
        c.media_type,
        c.digest,
        c.size + sum(x.size for x in chunks),
        c.raw_size,
        chunks,
        c.split_files,
    )


class Catalog:
    """The checkpoints of an opened store (see the module doc); sets up a new store's
    index.json, or rebuilds a missing one, as it is built."""

    def __init__(self, core: StoreCore, failures: FailureRecords) -> None:
        self._core = core
        self._failures = failures  # the sweep keeps the cache of the one tried first
        # The last repair of index.json this Store made (automatic ones included).
        self.last_repair: RepairReport | None = None
        try:
            self._init_index()
        except OSError as err:
            raise self._core.os_error(err, f"opening checkpoint store {self._core.root}") from err

    def _init_index(self) -> None:
        names = set(os.listdir(self._core.root_fd))
        if {"oci-layout", INDEX} <= names:
            return  # initialised; no need to wait for the lock behind a commit
        with self._core.index_lock():
            try:
                os.lstat(INDEX, dir_fd=self._core.root_fd)
            except FileNotFoundError:
                with self._core.opened_blobs() as blobs, self._core.opened_dir("raw") as raw:
                    held = os.listdir(blobs) or os.listdir(raw)
                if held:
                    # An empty index over existing blobs would make gc delete them all.
                    self.repair_locked(f"{self._core.index_path} is missing")
                else:
                    empty = {"schemaVersion": 2, "mediaType": MEDIA_TYPE_INDEX, "manifests": []}
                    fsutil.write_file_atomic(self._core.root_fd, INDEX, dump_json(empty))
            # Written last: its presence says the layout was fully initialised.
            if "oci-layout" not in names:
                fsutil.write_file_atomic(
                    self._core.root_fd,
                    "oci-layout",
                    dump_json({"imageLayoutVersion": LAYOUT_VERSION}),
                )

    # -- listing and lookup ------------------------------------------------------

    def list(self, *, scope: str | None = None, label: str | None = None) -> _Entries:
        """Published checkpoints, newest first, optionally of one scope and/or label."""
        index = self._core.read_index()
        refs = newest_first(
            r
            for r in index.checkpoints
            if (scope is None or r.scope == scope) and (label is None or r.label == label)
        )
        entries = [self.load_entry(r) for r in refs]
        if any(e.damage for e in entries):
            # A blob may have been deleted by a concurrent remove/retention (or a
            # compaction) after we read the index: such entries are gone (or
            # compacted), not damaged.
            now = {r.id: r for r in self._core.read_index().checkpoints}
            entries = [
                self.load_entry(now[e.id])
                if e.damage and now[e.id].descriptor.digest != e.manifest_digest
                else e
                for e in entries
                if e.id in now
            ]
        return entries

    def get(self, checkpoint_id: str) -> Entry:
        """The checkpoint of that id; NotFound when the store has none."""
        if (why := check_checkpoint_id(checkpoint_id)) is not None:
            raise errors.InvalidArgument(why)
        for ref in self._core.read_index().checkpoints:
            if ref.id == checkpoint_id:
                return self.load_entry(ref)
        raise errors.NotFound(f"checkpoint {checkpoint_id} not found in {self._core.root}")

    # -- the index on write paths ----------------------------------------------

    def index_for_write(self) -> Index:
        """The index, repaired first if damaged; the caller holds the index lock."""
        try:
            return self._core.load_index()
        except errors.DataLoss as err:
            self.repair_locked(str(err))
        return self._core.load_index()

    def index_repaired(self) -> Index:
        """The index, repaired first (under the lock) if it is damaged."""
        try:
            return self._core.load_index()
        except errors.DataLoss:
            with self._core.index_lock():
                return self.index_for_write()

    def repair_locked(self, reason: str) -> RepairReport:
        """Rebuild index.json (repair.py), logged; the caller holds the index lock."""
        report = self.last_repair = rebuild(self._core, self, reason)
        log.warning(
            "checkpoint store index rebuilt",
            extra={
                "store": self._core.root,
                "reason": reason,
                "damaged_copy": report.damaged_copy,
                "recovered": [cid for cid, _ in report.recovered],
                "dropped": [f"{what}: {why}" for what, why in report.dropped],
            },
        )
        return report

    # -- entries ----------------------------------------------------------------

    def load_entry(self, ref: CheckpointRef) -> Entry:
        """The checkpoint an index entry names; what is wrong with it in ``damage``."""
        desc = ref.descriptor
        where = f"checkpoint {ref.id}"
        try:
            manifest = parse_manifest(
                self._core.read_blob(
                    desc.digest, MAX_MANIFEST_BYTES, f"{where}: manifest", desc.size
                ),
                f"{where}: manifest {desc.digest}",
            )
            _check_manifest_identity(manifest, ref, where)
            cdesc = manifest.config
            config = parse_config(
                self._core.read_blob(
                    cdesc.digest, MAX_CONFIG_BYTES, f"{where}: config", cdesc.size
                ),
                f"{where}: config {cdesc.digest}",
                ref,
            )
            got = [
                (d.annotations[ANN_TITLE], d.media_type, d.digest, d.size) for d in manifest.layers
            ]
            want = [(c.name, c.media_type, c.digest, c.size) for c in config.layers]
            if got != want:
                raise errors.DataLoss(f"{where}: manifest and config disagree about the layers")
            for c in config.layers:
                chunks = manifest.chunks.get(c.name, ())
                match_split_files(chunks, c.split_files, f"{where}: layer {c.name!r}")
            state = manifest_state(manifest, where)
            if state == "raw" and dict(config.raw_files) != {
                c.name: c.digest for c in config.layers
            }:
                raise errors.DataLoss(f"{where}: config rawFiles disagree with the manifest")
        except errors.DataLoss as err:
            return Entry(
                ref.id, ref.scope, ref.label, ref.created, desc.digest, desc.size,
                MappingProxyType({}), (), damage=str(err), pinned_by=ref.pinned_by,
            )  # fmt: skip
        raw = state == "raw"
        layers = tuple(_layer_info(c, manifest.chunks.get(c.name, ()), raw) for c in config.layers)
        # A raw layer's stored bytes are its files; its file list is counted too.
        size = desc.size + cdesc.size + sum(x.size for x in layers)
        if raw:
            size += sum(c.size for c in config.layers)
            raw_bytes = sum(c.raw_size for c in config.layers)
        else:
            raw_bytes = self._cache_bytes(ref.id)
        return Entry(
            ref.id, ref.scope, ref.label, ref.created, desc.digest, size,
            MappingProxyType(config.metadata), layers, state=state, raw_bytes=raw_bytes,
            pinned_by=ref.pinned_by,
        )  # fmt: skip

    def _cache_bytes(self, checkpoint_id: str) -> int:
        """Bytes of the raw-image cache files of a compacted checkpoint (0: none)."""
        try:
            with self._core.opened_dir("raw", checkpoint_id) as fd:
                names = os.listdir(fd)
                return sum(
                    fsutil.tree_bytes(fd, n) for n in names if not n.endswith(CACHE_LIST_SUFFIX)
                )
        except (OSError, errors.DataLoss):
            return 0

    def current(self, entry: Entry) -> Entry:
        """The entry as on disk now; DataLoss if it vanished or is damaged.

        A raw entry that was compacted meanwhile is the same checkpoint: its
        compacted form is returned.
        """
        if entry.damage is not None:
            raise errors.DataLoss(f"checkpoint {entry.id} is damaged: {entry.damage}")
        for ref in self._core.read_index().checkpoints:
            if ref.id == entry.id:
                break
        else:
            raise errors.DataLoss(
                f"checkpoint {entry.id} is no longer in {self._core.root} "
                "(removed by retention or prune while in use)"
            )
        current = self.load_entry(ref)
        if current.damage is not None:
            raise errors.DataLoss(f"checkpoint {entry.id} is damaged: {current.damage}")
        compacted = entry.state == "raw" and current.state == "compacted"
        if current.manifest_digest != entry.manifest_digest and not compacted:
            raise errors.DataLoss(
                f"checkpoint {entry.id}: manifest changed from {entry.manifest_digest} "
                f"to {current.manifest_digest}"
            )
        return current

    # -- raw files -----------------------------------------------------------------

    def raw_path(self, checkpoint_id: str, *parts: str) -> str:
        """``<root>/raw/<id>/<parts...>``, for messages and for CRIU."""
        return self._core.path("raw", checkpoint_id, *parts)

    @contextlib.contextmanager
    def raw_layer(
        self, checkpoint_id: str, layer: str, what: str, raw_fd: int | None = None
    ) -> Iterator[int]:
        """The fd of raw/<id>/<layer> (from ``raw_fd``, raw/<id>, if given).

        DataLoss naming ``what`` when it is missing or not a real directory.
        """
        path = self.raw_path(checkpoint_id, layer)
        try:
            if raw_fd is not None:
                fd = fsutil.open_dir(raw_fd, layer, path=path)
            else:
                with self._core.opened_dir("raw", checkpoint_id) as id_fd:
                    fd = fsutil.open_dir(id_fd, layer, path=path)
        except FileNotFoundError:
            raise errors.DataLoss(f"{what}: raw files {path} are missing") from None
        except errors.DataLoss as err:
            raise errors.DataLoss(f"{what}: {err}") from None
        try:
            yield fd
        finally:
            os.close(fd)

    def file_list(self, entry: Entry, layer: str) -> FileList | None:
        """The file list of ``layer``'s raw files; None when it has none."""
        found = self.file_list_bytes(entry, layer)
        return None if found is None else found[0]

    def file_list_bytes(self, entry: Entry, layer: str) -> tuple[FileList, bytes] | None:
        """The file list of ``layer``'s raw files (and its bytes); None when it has none.

        A raw layer's is its blob; a compacted checkpoint's cache keeps a copy
        beside its files, checked against the digest its config records.
        """
        what = f"checkpoint {entry.id}: layer {layer!r}"
        raw_files: Mapping[str, Any] = entry.metadata.get("rawFiles") or {}
        digest = raw_files.get(layer)
        if not isinstance(digest, str):
            return None
        if entry.state == "raw":
            data = self._core.read_blob(digest, MAX_FILE_LIST_BYTES, f"{what}: file list")
        else:
            name = layer + CACHE_LIST_SUFFIX
            path = self.raw_path(entry.id, name)
            try:
                with self._core.opened_dir("raw", entry.id) as fd:
                    data = fsutil.read_file_at(fd, name, MAX_FILE_LIST_BYTES, path=path)
            except (FileNotFoundError, fsutil.TooLarge):
                return None
            if fsutil.sha256_bytes(data) != digest:
                raise errors.DataLoss(f"{what}: {path} does not match the digest in the config")
        files = parse_file_list(data, f"{what}: file list {digest}")
        if files.layer != layer:
            raise errors.DataLoss(f"{what}: its file list is layer {files.layer!r}'s")
        return files, data

    # -- checking --------------------------------------------------------------------

    def check(self, entry: Entry, *, deep: bool) -> None:
        """DataLoss unless every blob (or raw file) of the loaded ``entry`` is intact."""
        for layer in entry.layers:
            if entry.state == "compacted":
                self.check_layer_blob(entry, layer, deep=deep)
                continue
            what = f"checkpoint {entry.id}: layer {layer.name!r}"
            files = self.file_list(entry, layer.name)
            if files is None:
                raise errors.DataLoss(f"{what}: no file list")
            path = self.raw_path(entry.id, layer.name)
            with self.raw_layer(entry.id, layer.name, what) as fd:
                verify_files(fd, files, path=path, describe=f"{what} ({path})", deep=deep)

    def check_layer_blob(self, entry: Entry, layer: LayerInfo, *, deep: bool) -> None:
        """The layer's own blob, then each distinct chunk (hashed in parallel when ``deep``)."""
        path = self._core.blob_path(layer.digest)
        self._check_blob(
            layer.digest,
            layer.blob_size,
            f"checkpoint {entry.id}: layer {layer.name!r} ({path})",
            deep=deep,
        )
        distinct = list({c.digest: c for c in layer.chunks}.values())

        def check(chunk: Chunk) -> None:
            what = self.describe_chunk(entry, layer, chunk)
            self._check_blob(chunk.digest, chunk.size, what, deep=deep)

        if not deep or len(distinct) < 2:
            for chunk in distinct:
                check(chunk)
            return
        workers = pool_width(self._core.config.threads)
        with ThreadPoolExecutor(workers, thread_name_prefix="cedana-verify") as pool:
            for _ in pool.map(check, distinct):
                pass

    def describe_chunk(self, entry: Entry, layer: LayerInfo, chunk: Chunk) -> str:
        """A chunk blob as messages name it."""
        return (
            f"checkpoint {entry.id}: layer {layer.name!r}: chunk of {chunk.file} at offset "
            f"{chunk.offset} ({self._core.blob_path(chunk.digest)})"
        )

    def _check_blob(self, digest: str, size: int, what: str, *, deep: bool) -> None:
        fd = self._core.open_blob_fd(digest, what)
        try:
            have = os.fstat(fd).st_size
            if have != size:
                raise errors.DataLoss(f"{what}: blob is {have} bytes, expected {size} (truncated?)")
            if deep:
                got, _ = hash_fd(fd)
                if got != digest:
                    raise errors.DataLoss(
                        f"{what}: blob is corrupt (sha256 is {got}, expected {digest})"
                    )
        finally:
            os.close(fd)

    # -- garbage -------------------------------------------------------------------

    def sweep_locked(self, index: Index) -> int:
        """Delete what index.json does not reference; the caller holds the index lock."""
        manifests: dict[str, bytes] = {}

        def read(desc: Descriptor) -> bytes:
            what = f"manifest {desc.digest}"
            data = self._core.read_blob(desc.digest, MAX_MANIFEST_BYTES, what, desc.size)
            manifests[desc.digest] = data
            return data

        keep = gc.referenced(index.descriptors, read)
        freed = 0
        if keep is not None:
            with self._core.opened_blobs() as blobs:
                freed += gc.sweep_blobs(blobs, keep)
        whole: set[str] = set()
        cached: set[str] = set()
        groups: dict[tuple[str, str], list[CheckpointRef]] = {}
        for ref in index.checkpoints:
            groups.setdefault((ref.scope, ref.label), []).append(ref)
        failed = self._failures.failures()
        for group in groups.values():
            # The cache is for the checkpoint a restore tries first.
            for rank, ref in enumerate(failed_last(newest_first(group), lambda r: r.id in failed)):
                state = self._state_from(manifests.get(ref.descriptor.digest))
                if state != "compacted":  # raw, or unknown: keep as is
                    whole.add(ref.id)
                elif rank == 0 and self._core.config.cache_raw:
                    cached.add(ref.id)
        with self._core.opened_dir("raw") as raw:
            freed += gc.sweep_raw(raw, whole=whole, cached=cached)
        freed += sweep_records(self._core.root_fd, {ref.id for ref in index.checkpoints})
        freed += sweep_failures(self._core.root_fd, {ref.id for ref in index.checkpoints})
        # The previous format's raw-image cache (a symlink is unlinked, not followed).
        freed += fsutil.remove_entry(self._core.root_fd, "cache")
        return freed

    @staticmethod
    def _state_from(manifest: bytes | None) -> State | None:
        if manifest is None:
            return None
        try:
            return manifest_state(parse_manifest(manifest, "manifest"), "manifest")
        except errors.DataLoss:
            return None
