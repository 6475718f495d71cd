"""Crash-safe checkpoint store: an OCI image layout on local disk.

Layout under ``root`` (0700, every file 0600; checkpoints hold process memory)::

    oci-layout              {"imageLayoutVersion": "1.0.0"}
    index.json              OCI image index: one manifest descriptor per checkpoint
    index.lock              flock(2) target serialising every index.json writer
    blobs/sha256/<hex>      manifests, configs (metadata JSON), zstd tar layers
    ingest/<id>/            staging for one checkpoint being written
        lock                flock held by the writing process while it lives
        dirs/<name>/        directories the caller fills (CRIU writes here)
        out/                temp blobs, renamed into blobs/sha256 at commit

Commit sequence (``Store.commit``), each step a crash point (see COMMIT_STEPS):
layers are compressed into temp blobs in the ingest dir and fsynced; config and
manifest likewise; then, holding ``index.lock``: layers and config are renamed
into ``blobs/sha256`` (dir fsynced), the manifest last (dir fsynced), and
index.json is replaced atomically (temp, fsync, rename, dir fsync). Membership
in index.json is the commit marker: a checkpoint is visible once it is there
and not before, and everything it references is durable by then.

Garbage rule: blobs enter ``blobs/sha256`` only while ``index.lock`` is held,
immediately followed (same hold) by the index write that references them or by
their removal on failure. So under the lock, any blob not reachable from
index.json is an orphan of a crashed commit, safe to delete with no grace
period. An ingest dir is garbage when its ``lock`` file can be flock'ed, i.e.
the process that created it is gone (the kernel drops flocks on death, whatever
the pid is reused for); one without a ``lock`` file (crash during ``begin``) is
garbage after ingest.INGEST_GRACE_S (5 min).
"""

from __future__ import annotations

import contextlib
import errno
import io
import logging
import os
import secrets
import shutil
import stat
from collections.abc import Callable, Collection, Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from types import MappingProxyType
from typing import Any, BinaryIO, Final, TypeAlias

from cedana_shim import errors
from cedana_shim.checkpoint import compress, fsutil, gc
from cedana_shim.checkpoint.ingest import (
    Ingest,
    PendingLayer,
    check_metadata,
    create_ingest_dir,
    sweep_ingests,
)
from cedana_shim.checkpoint.layout import (
    ANN_CREATED,
    ANN_ID,
    ANN_LABEL,
    ANN_SCOPE,
    ANN_TITLE,
    LAYOUT_VERSION,
    MAX_CONFIG_BYTES,
    MAX_INDEX_BYTES,
    MAX_MANIFEST_BYTES,
    MEDIA_TYPE_CONFIG,
    MEDIA_TYPE_INDEX,
    MEDIA_TYPE_MANIFEST,
    CheckpointRef,
    Descriptor,
    Index,
    check_checkpoint_id,
    check_scope_or_label,
    dump_json,
    format_created,
    load_json,
    parse_config,
    parse_index,
    parse_layout_file,
    parse_manifest,
)
from cedana_shim.checkpoint.rawcache import RawCache

__all__ = ["COMMIT_STEPS", "Entry", "Ingest", "LayerInfo", "Store", "StoreConfig"]

log = logging.getLogger(__name__)

# Where Store(step_hook=...) is called during commit, in order. Tests kill the
# process at each one to prove that a crash anywhere leaves only complete
# checkpoints visible. "layer-writing"/"layer-written" fire once per layer.
COMMIT_STEPS: Final = (
    "layer-writing",  # a layer's first compressed bytes are in its temp blob
    "layer-written",  # that temp blob is complete and fsynced
    "config-written",
    "manifest-written",
    "index-locked",
    "blobs-placed",  # layers + config renamed into blobs/sha256, dir fsynced
    "manifest-placed",
    "index-temp-written",  # new index.json fsynced under a temp name
    "index-replaced",  # renamed over index.json: the commit point
    "committed",  # root dir fsynced
    "gc-done",  # unreferenced blobs swept, lock still held
)

_LAYOUT_NAMES: Final = frozenset({"oci-layout", "index.json", "index.lock", "blobs", "ingest"})
_INDEX_TMP_PREFIX: Final = "index.json.tmp-"
_SPACE_ERRNOS: Final = frozenset({errno.ENOSPC, errno.EDQUOT})
StepHook: TypeAlias = Callable[[str], None]


@dataclass(frozen=True)
class StoreConfig:
    root: str = "/var/lib/cedana/checkpoints"
    compression_level: int = 3  # zstd level, -7 (fastest) .. 22
    threads: int = 0  # zstd worker threads; 0 = all cores
    retain: int = 3  # checkpoints kept per (scope, label) at commit; 0 = keep all
    # Keep the raw images of the newest checkpoint per label (see rawcache.py).
    cache_raw: bool = True


@dataclass(frozen=True)
class LayerInfo:
    name: str
    media_type: str
    digest: str
    size: int  # stored (compressed) bytes
    raw_size: int  # uncompressed tar bytes


@dataclass(frozen=True)
class Entry:
    id: str
    scope: str
    label: str
    created: str  # RFC 3339, UTC
    manifest_digest: str
    size: int  # stored bytes of all its blobs (manifest, config, layers)
    metadata: Mapping[str, Any]  # the config JSON
    layers: tuple[LayerInfo, ...]
    # Why the manifest or config could not be read, for an entry that is
    # listed (index.json names it) but broken; verify() raises DataLoss with it.
    damage: str | None = None

    def layer(self, name: str) -> LayerInfo:
        for layer in self.layers:
            if layer.name == name:
                return layer
        have = ", ".join(repr(x.name) for x in self.layers) or "none"
        raise errors.NotFound(f"checkpoint {self.id} has no layer {name!r} (layers: {have})")

    def to_json(self) -> dict[str, Any]:
        """The `cedana checkpoints list --json` item."""
        return {
            "id": self.id,
            "namespace": self.scope,
            "label": self.label,
            "container": self.metadata.get("container"),
            "created": self.created,
            "size": self.size,
            "layers": [
                {"name": x.name, "mediaType": x.media_type, "size": x.size, "rawSize": x.raw_size}
                for x in self.layers
            ],
            "damage": self.damage,
        }


# `list` is a method name below, so the class body cannot say list[...].
_Entries: TypeAlias = list[Entry]
_Ids: TypeAlias = list[str]


def _newest_first(refs: Iterable[CheckpointRef]) -> list[CheckpointRef]:
    # created is when the dump happened; index position (commit order) breaks ties.
    return sorted(refs, key=lambda r: (r.created_at, r.position), reverse=True)


class Store:
    def __init__(self, config: StoreConfig, *, step_hook: StepHook | None = None) -> None:
        if not -7 <= config.compression_level <= 22:
            raise errors.InvalidArgument(
                f"compression_level {config.compression_level} is out of range (-7..22)"
            )
        if config.threads < 0:
            raise errors.InvalidArgument(
                f"threads must be >= 0 (0 = all cores), got {config.threads}"
            )
        if config.retain < 0:
            raise errors.InvalidArgument(f"retain must be >= 0 (0 = keep all), got {config.retain}")
        self.config = config
        self.root = os.path.abspath(config.root)
        self._blobs = os.path.join(self.root, "blobs", "sha256")
        self._ingest_root = os.path.join(self.root, "ingest")
        self._index_path = os.path.join(self.root, "index.json")
        self._lock_path = os.path.join(self.root, "index.lock")
        self._step_hook = step_hook
        self.raw_cache = RawCache(self.root)
        try:
            self._open_layout()
        except OSError as err:
            raise self._os_error(err, f"opening checkpoint store {self.root}") from err

    # -- setup ---------------------------------------------------------------

    def _open_layout(self) -> None:
        root = self.root
        os.makedirs(os.path.dirname(root), exist_ok=True)
        with contextlib.suppress(FileExistsError):
            os.mkdir(root, 0o700)
        st = os.stat(root)  # follows a symlink: pointing the store at another disk is fine
        if not stat.S_ISDIR(st.st_mode):
            raise errors.FailedPrecondition(f"checkpoint store {root} is not a directory")
        if st.st_uid != os.geteuid():
            raise errors.PermissionDenied(
                f"checkpoint store {root} is owned by uid {st.st_uid}, not by uid {os.geteuid()} "
                f"that runs the shim; checkpoints hold process memory, so refusing to use it. "
                f"Fix: chown {os.geteuid()} {root} (or point the store elsewhere)"
            )
        if st.st_mode & 0o077:
            raise errors.PermissionDenied(
                f"checkpoint store {root} is accessible to group/others "
                f"(mode {stat.S_IMODE(st.st_mode):04o}); checkpoints hold process memory "
                f"and secrets, so refusing to use it. Fix: chmod 0700 {root}"
            )
        names = set(os.listdir(root))
        strays = {n for n in names - _LAYOUT_NAMES if not n.startswith(_INDEX_TMP_PREFIX)}
        if "oci-layout" not in names and strays:
            raise errors.FailedPrecondition(
                f"checkpoint store {root} is not empty and is not an OCI image layout "
                f"(no oci-layout file; found {', '.join(sorted(strays)[:5])}); refusing to "
                "write checkpoints into it. Point the store at a new or empty directory"
            )
        if "oci-layout" in names:
            layout_path = os.path.join(root, "oci-layout")
            parse_layout_file(self._read_file(layout_path, 4096), layout_path)
        for path in (os.path.join(root, "blobs"), self._blobs, self._ingest_root):
            with contextlib.suppress(FileExistsError):
                os.mkdir(path, 0o700)
        if {"oci-layout", "index.json"} <= names:
            return  # initialised; no need to wait for the lock behind a commit
        with self._index_lock():
            if not os.path.lexists(self._index_path):
                if "oci-layout" in names and os.listdir(self._blobs):
                    # An empty index over existing blobs would make gc delete them all.
                    raise errors.DataLoss(
                        f"{self._index_path} is missing but {self._blobs} holds blobs; "
                        "refusing to start an empty index over them. Restore index.json "
                        "from a backup, or move the store aside to start afresh"
                    )
                self._write_file_atomic(
                    self._index_path,
                    dump_json({"schemaVersion": 2, "mediaType": MEDIA_TYPE_INDEX, "manifests": []}),
                )
            # Written last: its presence says the layout was fully initialised.
            if "oci-layout" not in names:
                self._write_file_atomic(
                    os.path.join(root, "oci-layout"),
                    dump_json({"imageLayoutVersion": LAYOUT_VERSION}),
                )

    # -- small helpers -------------------------------------------------------

    def _step(self, name: str) -> None:
        if self._step_hook is not None:
            self._step_hook(name)

    def _blob_path(self, digest: str) -> str:
        return os.path.join(self._blobs, digest.removeprefix("sha256:"))

    def _index_lock(self) -> contextlib.AbstractContextManager[None]:
        return fsutil.flocked(self._lock_path)

    def _write_file_atomic(self, path: str, data: bytes) -> None:
        fsutil.write_file_atomic(
            path, data, tmp_prefix=_INDEX_TMP_PREFIX if path == self._index_path else None
        )

    def _read_file(self, path: str, limit: int) -> bytes:
        try:
            return fsutil.read_file(path, limit)
        except fsutil.TooLarge as err:
            raise errors.DataLoss(str(err)) from None

    def _os_error(self, err: OSError, doing: str) -> errors.ShimError:
        if err.errno in _SPACE_ERRNOS:
            return errors.ResourceExhausted(
                f"checkpoint store {self.root} is full: {err.strerror} while {doing}. "
                "Free space on that filesystem, lower `retain`, or prune old checkpoints"
            )
        if err.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
            return errors.PermissionDenied(f"{doing}: {err}")
        return errors.Internal(f"{doing}: {err}")

    def _read_index(self) -> Index:
        try:
            data = self._read_file(self._index_path, MAX_INDEX_BYTES)
        except FileNotFoundError:
            raise errors.DataLoss(
                f"{self._index_path} is missing: the checkpoint store's index was deleted"
            ) from None
        try:
            return parse_index(data, self._index_path)
        except errors.DataLoss as err:
            raise errors.DataLoss(
                f"{err}. The store's index is damaged: no checkpoint can be listed, added or "
                f"collected until it is repaired or moved aside (blobs under {self._blobs} "
                "are left untouched)"
            ) from None

    def _read_small_blob(self, desc: Descriptor, limit: int, what: str) -> bytes:
        if desc.size > limit:
            raise errors.DataLoss(
                f"{what}: descriptor says {desc.size} bytes, over the {limit} allowed"
            )
        path = self._blob_path(desc.digest)
        try:
            fd = compress.open_blob(path)
        except FileNotFoundError:
            raise errors.DataLoss(f"{what}: blob {path} is missing") from None
        try:
            data = os.read(fd, desc.size + 1)
        finally:
            os.close(fd)
        if len(data) != desc.size:
            raise errors.DataLoss(f"{what}: blob {path} is {len(data)} bytes, expected {desc.size}")
        if fsutil.sha256_bytes(data) != desc.digest:
            raise errors.DataLoss(f"{what}: blob {path} is corrupt (sha256 mismatch)")
        return data

    def _load_entry(self, ref: CheckpointRef) -> Entry:
        desc = ref.descriptor
        where = f"checkpoint {ref.id}"
        try:
            manifest = parse_manifest(
                self._read_small_blob(desc, MAX_MANIFEST_BYTES, f"{where}: manifest"),
                f"{where}: manifest {desc.digest}",
            )
            config, clayers = parse_config(
                self._read_small_blob(manifest.config, MAX_CONFIG_BYTES, f"{where}: config"),
                f"{where}: config {manifest.config.digest}",
                ref,
            )
            got = [
                (d.annotations[ANN_TITLE], d.media_type, d.digest, d.size) for d in manifest.layers
            ]
            want = [(c.name, c.media_type, c.digest, c.size) for c in clayers]
            if got != want:
                raise errors.DataLoss(f"{where}: manifest and config disagree about the layers")
        except errors.DataLoss as err:
            return Entry(
                ref.id, ref.scope, ref.label, ref.created, desc.digest, desc.size,
                MappingProxyType({}), (), damage=str(err),
            )  # fmt: skip
        layers = tuple(
            LayerInfo(c.name, c.media_type, c.digest, c.size, c.raw_size) for c in clayers
        )
        size = desc.size + manifest.config.size + sum(x.size for x in layers)
        return Entry(
            ref.id, ref.scope, ref.label, ref.created, desc.digest, size,
            MappingProxyType(config), layers,
        )  # fmt: skip

    # -- writing -------------------------------------------------------------

    def begin(self, *, scope: str, label: str, metadata: Mapping[str, Any]) -> Ingest:
        """Start a checkpoint: returns its staging area. Nothing is visible until commit."""
        for what, value in (("scope", scope), ("label", label)):
            if (why := check_scope_or_label(what, value)) is not None:
                raise errors.InvalidArgument(why)
        check_metadata(metadata)
        now = datetime.now(UTC)
        try:
            checkpoint_id, path, lock_fd = create_ingest_dir(self._ingest_root, now)
        except OSError as err:
            raise self._os_error(
                err, f"creating an ingest directory in {self._ingest_root}"
            ) from err
        return Ingest(
            self,
            self.abort,
            checkpoint_id,
            path,
            lock_fd,
            scope=scope,
            label=label,
            created=format_created(now),
            metadata=metadata,
        )

    def abort(self, ingest: Ingest) -> None:
        """Throw away an uncommitted checkpoint. Idempotent."""
        self._own(ingest)
        if ingest._state == "committing":
            raise errors.FailedPrecondition(f"checkpoint {ingest.id} is being committed")
        self._discard(ingest)

    def _own(self, ingest: Ingest) -> None:
        if ingest._owner is not self:
            raise errors.InvalidArgument(f"checkpoint {ingest.id} belongs to another Store")

    def _discard(self, ingest: Ingest) -> None:
        ingest._state = "closed"
        if not ingest._release_lock.alive:
            return
        # Removed while still locked, so a concurrent gc keeps its hands off.
        shutil.rmtree(ingest.path, ignore_errors=True)
        ingest._release_lock()

    def commit(self, ingest: Ingest) -> Entry:
        """Compress, write and publish a checkpoint; blocking. See the module doc.

        Whatever happens, the ingest is gone afterwards: on success its data is
        in the store, on failure (ResourceExhausted when the disk is full) the
        store and index.json are as they were.
        """
        self._own(ingest)
        ingest._check_open()
        if not ingest._layers:
            raise errors.InvalidArgument(
                f"checkpoint {ingest.id}: nothing to commit (add a layer first)"
            )
        ingest._state = "committing"
        doing = ["preparing"]
        try:
            entry = self._commit(ingest, doing)
            self._cache_raw(ingest, entry)
        except OSError as err:
            raise self._os_error(err, f"{doing[0]} of checkpoint {ingest.id}") from err
        finally:
            self._discard(ingest)
        with contextlib.suppress(OSError):
            sweep_ingests(self._ingest_root)
        return entry

    def _commit(self, ingest: Ingest, doing: list[str]) -> Entry:
        # doing[0] says what was under way, for the error message if it fails.
        out = os.path.join(ingest.path, "out")
        os.mkdir(out, 0o700)
        written: list[tuple[PendingLayer, compress.WrittenBlob, str]] = []
        dirs_root = os.path.join(ingest.path, "dirs") + os.sep
        level, threads = self.config.compression_level, self.config.threads
        for i, layer in enumerate(ingest._layers):
            doing[0] = f"writing layer {layer.name!r}"
            tmp = os.path.join(out, f"layer-{i}")
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
            try:
                if layer.kind == "dir":
                    blob = compress.compress_tree(
                        layer.source, fd, level=level, threads=threads,
                        on_first_write=lambda: self._step("layer-writing"),
                    )  # fmt: skip
                else:
                    blob = compress.compress_file(
                        layer.source, fd, level=level, threads=threads,
                        on_first_write=lambda: self._step("layer-writing"),
                    )  # fmt: skip
                os.fsync(fd)
            finally:
                os.close(fd)
            self._step("layer-written")
            written.append((layer, blob, tmp))
            # Staged CRIU images are no longer needed once compressed: freeing
            # them now keeps peak disk use near raw + one compressed layer.
            keep_raw = self.config.cache_raw and layer.name in ingest.raw_layers
            if layer.kind == "dir" and layer.source.startswith(dirs_root) and not keep_raw:
                src = layer.source + os.sep
                later = [x.source + os.sep for x in ingest._layers[i + 1 :]]
                if not any(x.startswith(src) or src.startswith(x) for x in later):
                    shutil.rmtree(layer.source, ignore_errors=True)

        layers_json = [
            {
                "name": layer.name,
                "media_type": layer.media_type,
                "digest": blob.digest,
                "size": blob.size,
                "raw_size": blob.raw_size,
            }
            for layer, blob, _ in written
        ]
        config = {
            **ingest._metadata,
            "id": ingest.id,
            "scope": ingest.scope,
            "label": ingest.label,
            "created": ingest.created,
            "sizes": {
                "raw": sum(b.raw_size for _, b, _ in written),
                "stored": sum(b.size for _, b, _ in written),
            },
            "layers": layers_json,
        }
        doing[0] = "writing config and manifest"
        config_bytes = dump_json(config)
        if len(config_bytes) > MAX_CONFIG_BYTES:
            raise errors.InvalidArgument(f"checkpoint {ingest.id}: metadata too large")
        config_tmp = os.path.join(out, "config")
        fsutil.create_file(config_tmp, config_bytes)
        config_desc = Descriptor(
            MEDIA_TYPE_CONFIG, fsutil.sha256_bytes(config_bytes), len(config_bytes)
        )
        self._step("config-written")

        annotations = {
            ANN_ID: ingest.id,
            ANN_SCOPE: ingest.scope,
            ANN_LABEL: ingest.label,
            ANN_CREATED: ingest.created,
        }
        layer_descs = [
            Descriptor(layer.media_type, blob.digest, blob.size, {ANN_TITLE: layer.name})
            for layer, blob, _ in written
        ]
        manifest_bytes = dump_json(
            {
                "schemaVersion": 2,
                "mediaType": MEDIA_TYPE_MANIFEST,
                "config": config_desc.to_json(),
                "layers": [d.to_json() for d in layer_descs],
                "annotations": annotations,
            }
        )
        manifest_tmp = os.path.join(out, "manifest")
        fsutil.create_file(manifest_tmp, manifest_bytes)
        manifest_desc = Descriptor(
            MEDIA_TYPE_MANIFEST,
            fsutil.sha256_bytes(manifest_bytes),
            len(manifest_bytes),
            annotations,
        )
        self._step("manifest-written")

        doing[0] = "publishing (blobs and index.json)"
        with self._index_lock():
            self._step("index-locked")
            index = self._read_index()
            if any(r.id == ingest.id for r in index.checkpoints):
                raise errors.Internal(f"checkpoint id {ingest.id} is already in {self._index_path}")
            placed: list[str] = []
            committed = False
            try:
                for _, blob, tmp in written:
                    self._place(tmp, blob.digest, placed)
                self._place(config_tmp, config_desc.digest, placed)
                fsutil.fsync_dir(self._blobs)
                self._step("blobs-placed")
                self._place(manifest_tmp, manifest_desc.digest, placed)
                fsutil.fsync_dir(self._blobs)
                self._step("manifest-placed")

                drops = self._retention_drops(index, ingest.scope, ingest.label)
                descriptors = [
                    d for d in index.descriptors if d.annotations.get(ANN_ID) not in drops
                ]
                descriptors.append(manifest_desc)
                new_index = dump_json(index.to_json(descriptors))
                tmp_index = os.path.join(
                    self.root, f"{_INDEX_TMP_PREFIX}{os.getpid()}-{secrets.token_hex(4)}"
                )
                try:
                    fsutil.create_file(tmp_index, new_index)
                    self._step("index-temp-written")
                    os.replace(tmp_index, self._index_path)
                except BaseException:
                    with contextlib.suppress(OSError):
                        os.unlink(tmp_index)
                    raise
                committed = True
                self._step("index-replaced")
                fsutil.fsync_dir(self.root)
                self._step("committed")
            except BaseException:
                if not committed:
                    # Only blobs this commit created; ones that already existed
                    # may be referenced by other checkpoints.
                    for path in placed:
                        with contextlib.suppress(OSError):
                            os.unlink(path)
                raise
            if drops:
                log.info(
                    "retention removed checkpoints",
                    extra={"scope": ingest.scope, "label": ingest.label, "removed": sorted(drops)},
                )
            try:
                self._sweep_blobs_locked(descriptors)
            except OSError as err:  # the checkpoint is committed; gc can run again later
                log.warning("gc after commit failed: %s", err)
            self._step("gc-done")

        layers = tuple(
            LayerInfo(layer.name, layer.media_type, blob.digest, blob.size, blob.raw_size)
            for layer, blob, _ in written
        )
        size = manifest_desc.size + config_desc.size + sum(x.size for x in layers)
        return Entry(
            ingest.id, ingest.scope, ingest.label, ingest.created, manifest_desc.digest, size,
            MappingProxyType(load_json(config_bytes, "config")), layers,
        )  # fmt: skip

    def _place(self, tmp: str, digest: str, placed: list[str]) -> None:
        dst = self._blob_path(digest)
        existed = os.path.lexists(dst)
        # Replacing an existing blob of the same digest is harmless (same bytes)
        # and heals one that was damaged on disk.
        os.rename(tmp, dst)
        if not existed:
            placed.append(dst)

    def _retention_drops(self, index: Index, scope: str, label: str) -> set[str]:
        """Ids to drop so that, with the checkpoint being committed, `retain` remain."""
        keep = self.config.retain
        if keep == 0:
            return set()
        group = _newest_first(r for r in index.checkpoints if (r.scope, r.label) == (scope, label))
        return {r.id for r in group[keep - 1 :]}

    # -- reading -------------------------------------------------------------

    def list(self, *, scope: str | None = None, label: str | None = None) -> _Entries:
        """Committed checkpoints, newest first, optionally of one scope and/or label."""
        index = self._read_index()
        refs = _newest_first(
            r
            for r in index.checkpoints
            if (scope is None or r.scope == scope) and (label is None or r.label == label)
        )
        entries = [self._load_entry(r) for r in refs]
        if any(e.damage for e in entries):
            # A blob may have been deleted by a concurrent remove/retention after
            # we read the index: such entries are gone, not damaged.
            current = {r.id for r in self._read_index().checkpoints}
            entries = [e for e in entries if e.damage is None or e.id in current]
        return entries

    def candidates(self, scope: str, label: str) -> _Entries:
        """What a restore of ``label`` in ``scope`` should try, in order (newest first).

        Damaged entries are included: the caller verifies each and falls back.
        """
        for what, value in (("scope", scope), ("label", label)):
            if (why := check_scope_or_label(what, value)) is not None:
                raise errors.InvalidArgument(why)
        return self.list(scope=scope, label=label)

    def get(self, checkpoint_id: str) -> Entry:
        if (why := check_checkpoint_id(checkpoint_id)) is not None:
            raise errors.InvalidArgument(why)
        for ref in self._read_index().checkpoints:
            if ref.id == checkpoint_id:
                return self._load_entry(ref)
        raise errors.NotFound(f"checkpoint {checkpoint_id} not found in {self.root}")

    def _current(self, entry: Entry) -> Entry:
        """The entry as on disk now; DataLoss if it vanished or is damaged."""
        for ref in self._read_index().checkpoints:
            if ref.id == entry.id:
                break
        else:
            raise errors.DataLoss(
                f"checkpoint {entry.id} is no longer in {self.root} "
                "(removed by retention or prune while in use)"
            )
        current = self._load_entry(ref)
        if current.damage is not None:
            raise errors.DataLoss(f"checkpoint {entry.id} is damaged: {current.damage}")
        if current.manifest_digest != entry.manifest_digest:
            raise errors.DataLoss(
                f"checkpoint {entry.id}: manifest changed from {entry.manifest_digest} "
                f"to {current.manifest_digest}"
            )
        return current

    def verify(self, entry: Entry, *, deep: bool = True, require: Collection[str] = ()) -> None:
        """Raise DataLoss unless every blob of ``entry`` is present and intact.

        Checks the manifest and config (digests, JSON shape, agreement with the
        index), each layer blob's size and, with ``deep``, its sha256 (reads it
        all: ~1.5 GB/s). ``require`` names layers that must be present.
        """
        if entry.damage is not None:
            raise errors.DataLoss(f"checkpoint {entry.id} is damaged: {entry.damage}")
        current = self._current(entry)
        names = {x.name for x in current.layers}
        for name in require:
            if name not in names:
                raise errors.DataLoss(f"checkpoint {entry.id} has no {name!r} layer")
        for layer in current.layers:
            self._check_layer_blob(entry, layer, deep=deep)

    def _check_layer_blob(self, entry: Entry, layer: LayerInfo, *, deep: bool) -> None:
        path = self._blob_path(layer.digest)
        what = f"checkpoint {entry.id}: layer {layer.name!r} ({path})"
        try:
            fd = compress.open_blob(path)
        except FileNotFoundError:
            raise errors.DataLoss(f"{what}: blob is missing") from None
        except OSError as err:
            raise errors.DataLoss(f"{what}: cannot open blob: {err.strerror}") from None
        try:
            size = os.fstat(fd).st_size
            if size != layer.size:
                raise errors.DataLoss(
                    f"{what}: blob is {size} bytes, expected {layer.size} (truncated?)"
                )
            if deep:
                digest, _ = compress.hash_fd(fd)
                if digest != layer.digest:
                    raise errors.DataLoss(
                        f"{what}: blob is corrupt (sha256 is {digest}, expected {layer.digest})"
                    )
        finally:
            os.close(fd)

    def extract_layer(self, entry: Entry, name: str, dest_dir: str) -> None:
        """Unpack a layer into ``dest_dir`` (created, 0700; must not exist or be empty).

        The blob's digest is checked in the same pass; members other than plain
        files and directories (links, devices, FIFOs), absolute paths and ``..``
        are refused. The result appears at ``dest_dir`` by rename only when all
        is well: on error nothing is left behind.
        """
        layer = self._current(entry).layer(name) if entry.damage is None else None
        if layer is None:
            raise errors.DataLoss(f"checkpoint {entry.id} is damaged: {entry.damage}")
        dest = os.path.abspath(dest_dir)
        if os.path.lexists(dest) and (
            os.path.islink(dest) or not os.path.isdir(dest) or os.listdir(dest)
        ):
            raise errors.FailedPrecondition(
                f"cannot extract checkpoint {entry.id} layer {name!r} into {dest}: "
                "it exists and is not an empty directory"
            )
        parent = os.path.dirname(dest)
        describe = f"checkpoint {entry.id}: layer {name!r} ({self._blob_path(layer.digest)})"
        tmp: str | None = None
        try:
            os.makedirs(parent, mode=0o700, exist_ok=True)
            tmp = fsutil.mkdtemp_private(parent, f".{os.path.basename(dest)}.extract-")
            try:
                fd = compress.open_blob(self._blob_path(layer.digest))
            except FileNotFoundError:
                raise errors.DataLoss(f"{describe}: blob is missing") from None
            try:
                compress.extract_tar_zstd(fd, layer.digest, layer.size, tmp, describe)
            finally:
                os.close(fd)
            os.rename(tmp, dest)  # atomically replaces an empty dest directory
            tmp = None
        except OSError as err:
            if err.errno in _SPACE_ERRNOS:
                raise errors.ResourceExhausted(
                    f"no space left on {parent} extracting checkpoint {entry.id} layer {name!r} "
                    f"({layer.raw_size} bytes uncompressed): free space there and retry"
                ) from err
            raise errors.Internal(
                f"extracting checkpoint {entry.id} layer {name!r} into {dest}: {err}"
            ) from err
        finally:
            if tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)

    def open_layer(self, entry: Entry, name: str) -> BinaryIO:
        """A verified, decompressed stream of a layer (a tar), for the caller to apply."""
        layer = self._current(entry).layer(name) if entry.damage is None else None
        if layer is None:
            raise errors.DataLoss(f"checkpoint {entry.id} is damaged: {entry.damage}")
        path = self._blob_path(layer.digest)
        describe = f"checkpoint {entry.id}: layer {name!r} ({path})"
        try:
            fd = compress.open_blob(path)
        except FileNotFoundError:
            raise errors.DataLoss(f"{describe}: blob is missing") from None
        try:
            size = os.fstat(fd).st_size
            if size != layer.size:
                raise errors.DataLoss(f"{describe}: blob is {size} bytes, expected {layer.size}")
            digest, _ = compress.hash_fd(fd)
            if digest != layer.digest:
                raise errors.DataLoss(
                    f"{describe}: blob is corrupt (sha256 is {digest}, expected {layer.digest})"
                )
            os.lseek(fd, 0, os.SEEK_SET)
            raw = compress.LayerStream(fd, layer.digest, layer.size, describe)
        except BaseException:
            os.close(fd)
            raise
        return io.BufferedReader(raw, buffer_size=compress.CHUNK)

    # -- removal and garbage -------------------------------------------------

    def remove(self, checkpoint_id: str) -> None:
        if (why := check_checkpoint_id(checkpoint_id)) is not None:
            raise errors.InvalidArgument(why)
        self._drop(
            lambda index: {checkpoint_id} & {r.id for r in index.checkpoints} or None, checkpoint_id
        )

    def prune(self, *, scope: str | None = None, label: str | None = None, keep: int) -> _Ids:
        """Keep the newest ``keep`` per matching (scope, label); return the removed ids."""
        if keep < 0:
            raise errors.InvalidArgument(f"keep must be >= 0, got {keep}")

        def select(index: Index) -> set[str]:
            groups: dict[tuple[str, str], list[CheckpointRef]] = {}
            for r in index.checkpoints:
                if (scope is None or r.scope == scope) and (label is None or r.label == label):
                    groups.setdefault((r.scope, r.label), []).append(r)
            return {r.id for g in groups.values() for r in _newest_first(g)[keep:]}

        removed = self._drop(select, None)
        return removed

    def _drop(self, select: Callable[[Index], set[str] | None], must: str | None) -> _Ids:
        try:
            with self._index_lock():
                index = self._read_index()
                drops = select(index)
                if drops is None:
                    raise errors.NotFound(f"checkpoint {must} not found in {self.root}")
                if not drops:
                    return []
                removed = [r.id for r in _newest_first(index.checkpoints) if r.id in drops]
                descriptors = [
                    d for d in index.descriptors if d.annotations.get(ANN_ID) not in drops
                ]
                self._write_file_atomic(self._index_path, dump_json(index.to_json(descriptors)))
                self._sweep_blobs_locked(descriptors)
                return removed
        except OSError as err:
            raise self._os_error(err, f"removing checkpoints from {self.root}") from err

    def gc(self) -> int:
        """Delete what no committed checkpoint needs; returns the bytes freed.

        Unreferenced blobs (orphans of crashed commits, of removed checkpoints),
        ingest dirs of dead writers, stale index.json temp files. Never touches a
        commit in progress in another process (see the module doc).
        """
        try:
            with self._index_lock():
                # Index temp files are only written under the lock: any seen now is stale.
                freed = gc.sweep_stale_files(self.root, _INDEX_TMP_PREFIX)
                freed += self._sweep_blobs_locked(self._read_index().descriptors)
            return freed + sweep_ingests(self._ingest_root)
        except OSError as err:
            raise self._os_error(err, f"collecting garbage in {self.root}") from err

    def _cache_raw(self, ingest: Ingest, entry: Entry) -> None:
        """Move the committed layers' raw images into the cache; never fails the commit."""
        if not self.config.cache_raw:
            return
        for layer in ingest._layers:
            if layer.name not in ingest.raw_layers or layer.kind != "dir":
                continue
            try:
                self.raw_cache.adopt(
                    entry.id, entry.scope, entry.label, layer.name,
                    entry.layer(layer.name).digest, layer.source,
                )  # fmt: skip
            except OSError as err:
                log.warning("not caching raw images: %s", err, extra={"checkpoint": entry.id})
                self.raw_cache.drop(entry.id)

    def _sweep_blobs_locked(self, descriptors: Iterable[Descriptor]) -> int:
        descriptors = list(descriptors)
        self.raw_cache.retain_only({d.annotations.get(ANN_ID, "") for d in descriptors})
        keep = gc.referenced(
            descriptors,
            lambda d: self._read_small_blob(d, MAX_MANIFEST_BYTES, f"manifest {d.digest}"),
        )
        return 0 if keep is None else gc.sweep_blobs(self._blobs, keep)
