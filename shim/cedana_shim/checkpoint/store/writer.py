"""Writing checkpoints: begin, abort, and publish (the durable point, raw state).

Publish sequence (each step a crash point, see PUBLISH_STEPS): every layer's
staged files are sealed where they are (fsynced, 0600, CRC-32 recorded in the
layer's file list; files staged outside the ingest are copied in first), the
file lists, config and manifest are written as temp blobs in the ingest dir;
then, holding ``index.lock``: the staged dirs are renamed into
``raw/<id>/<layer>`` (dirs fsynced), the file lists and config into
``blobs/sha256``, the manifest last, and index.json is replaced atomically.
Membership in index.json is the commit marker: nothing is compressed or
copied on this path, and everything the checkpoint references is durable by
the time it is visible.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Any

from cedana_shim import errors

from . import fsutil
from .catalog import Catalog, newest_first
from .core import StoreCore
from .failures import FailureRecords, failed_last
from .filelist import FILE_LAYER_NAME, FileList, RawFile, dump_file_list
from .ingest import (
    Ingest,
    PendingLayer,
    check_metadata,
    create_locked_dir,
    new_checkpoint_id,
    sweep_ingests,
)
from .layout import (
    ANN_CREATED,
    ANN_ID,
    ANN_LABEL,
    ANN_SCOPE,
    ANN_TITLE,
    MAX_CONFIG_BYTES,
    MEDIA_TYPE_CONFIG,
    MEDIA_TYPE_FILE_LIST,
    MEDIA_TYPE_MANIFEST,
    Descriptor,
    Index,
    check_scope_or_label,
    dump_json,
    dump_manifest,
    format_created,
    parse_checkpoint_ref,
)
from .model import Entry
from .rawfiles import copy_dir, copy_file, crc_pool, seal_dir, seal_file

__all__ = ["Writer"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class _Staged:
    """A layer sealed in the ingest dir, ready to be renamed into raw/<id>/."""

    layer: PendingLayer
    files: FileList
    file_list: bytes
    parent: tuple[str, ...]  # under the ingest dir
    name: str

    @property
    def digest(self) -> str:
        return fsutil.sha256_bytes(self.file_list)


class Writer:
    """Begins, aborts and publishes checkpoints (see the module doc)."""

    def __init__(self, core: StoreCore, catalog: Catalog, failures: FailureRecords) -> None:
        self._core = core
        self._catalog = catalog
        self._failures = failures  # retention drops the failed ones first

    def begin(self, *, scope: str, label: str, metadata: Mapping[str, Any]) -> Ingest:
        """Start a checkpoint: returns its staging area. Nothing is visible until publish."""
        for what, value in (("scope", scope), ("label", label)):
            if (why := check_scope_or_label(what, value)) is not None:
                raise errors.InvalidArgument(why)
        check_metadata(metadata)
        now = datetime.now(UTC)
        try:
            self._catalog.index_repaired()
            with self._core.opened_dir("ingest") as ingest_root:
                checkpoint_id, dir_fd, lock_fd = create_locked_dir(
                    ingest_root, new_checkpoint_id(now), {"scope": scope, "label": label}
                )
        except OSError as err:
            raise self._core.os_error(
                err, f"creating an ingest directory in {self._core.root}"
            ) from err
        return Ingest(
            self,
            self.abort,
            checkpoint_id,
            self._core.path("ingest", checkpoint_id),
            (dir_fd, lock_fd),
            scope=scope,
            label=label,
            created=format_created(now),
            metadata=metadata,
        )

    def abort(self, ingest: Ingest) -> None:
        """Throw away an unpublished checkpoint. Idempotent."""
        self._own(ingest)
        if ingest._state == "committing":
            raise errors.FailedPrecondition(f"checkpoint {ingest.id} is being published")
        self._discard(ingest)

    def _own(self, ingest: Ingest) -> None:
        if ingest._owner is not self:
            raise errors.InvalidArgument(f"checkpoint {ingest.id} belongs to another Store")

    def _discard(self, ingest: Ingest) -> None:
        ingest._state = "closed"
        if not ingest._release.alive:
            return
        # Removed while still locked, so a concurrent gc keeps its hands off.
        with contextlib.suppress(OSError), self._core.opened_dir("ingest") as ingest_root:
            fsutil.remove_entry(ingest_root, ingest.id)
        ingest._release()

    def publish(self, ingest: Ingest) -> Entry:
        """Make the checkpoint durable and visible, raw; fast (see the module doc).

        Whatever happens, the ingest is gone afterwards: on success its files
        are in the store, on failure (ResourceExhausted when the disk is full)
        the store and index.json are as they were.
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
            entry = self._publish(ingest, doing)
        except OSError as err:
            raise self._core.os_error(err, f"{doing[0]} of checkpoint {ingest.id}") from err
        finally:
            self._discard(ingest)
        with contextlib.suppress(OSError), self._core.opened_dir("ingest") as ingest_root:
            sweep_ingests(ingest_root)
        return entry

    # -- the publish sequence ------------------------------------------------------

    def _publish(self, ingest: Ingest, doing: list[str]) -> Entry:
        # doing[0] says what was under way, for the error message if it fails.
        staged = self._seal_layers(ingest, doing)
        doing[0] = "writing config and manifest"
        with fsutil.opened_dir(ingest._dir_fd, "out", path=ingest.path, create=True) as out:
            config_digest, manifest_desc = self._write_documents(ingest, staged, out)
            doing[0] = "publishing (blobs and index.json)"
            with self._core.index_lock():
                self._core.step("index-locked")
                index = self._catalog.index_for_write()
                if any(r.id == ingest.id for r in index.checkpoints):
                    raise errors.Internal(
                        f"checkpoint id {ingest.id} is already in {self._core.index_path}"
                    )
                # No sweep here: unlinking the GiBs of a checkpoint dropped by retention
                # (or of an older raw-image cache) would delay the stop; the compaction
                # that follows, or gc, collects them.
                new_index = self._place_all(
                    ingest, staged, out, index, (config_digest, manifest_desc)
                )
        ref = parse_checkpoint_ref(manifest_desc, len(new_index.descriptors) - 1, "index.json")
        return self._catalog.load_entry(ref)

    def _seal_layers(self, ingest: Ingest, doing: list[str]) -> list[_Staged]:
        staged: list[_Staged] = []
        parent: tuple[str, ...]
        with crc_pool() as pool:
            for layer in ingest._layers:
                doing[0] = f"writing layer {layer.name!r} into the store"
                describe = f"checkpoint {ingest.id}: layer {layer.name!r}"
                if layer.staged is None:
                    doing[0] += f" (copying {layer.source})"
                    parent, name = ("copies",), layer.name
                    entries = self._copy_in(ingest, layer, describe)
                else:
                    parent, name = layer.staged[:-1], layer.staged[-1]
                    with fsutil.opened_dir(ingest._dir_fd, *parent, path=ingest.path) as fd:
                        if layer.kind == "dir":
                            with fsutil.opened_dir(fd, name, path=layer.source) as layer_fd:
                                prefixes = ingest.prefixes(layer.source)
                                entries = seal_dir(layer_fd, pool, describe, prefixes)
                        else:
                            entries = [seal_file(fd, name, FILE_LAYER_NAME, pool)]
                cache = layer.kind == "dir" and layer.name in ingest.raw_layers
                files = FileList(layer.name, layer.kind, layer.media_type, cache, tuple(entries))
                staged.append(_Staged(layer, files, dump_file_list(files), parent, name))
                self._core.step("layer-listed")
        return staged

    @staticmethod
    def _copy_in(ingest: Ingest, layer: PendingLayer, describe: str) -> list[RawFile]:
        """Copy a layer staged outside the ingest into ``copies/<layer>``."""
        path = os.path.join(ingest.path, "copies")
        with fsutil.opened_dir(ingest._dir_fd, "copies", path=ingest.path, create=True) as copies:
            if layer.kind == "file":
                src = os.open(layer.source, os.O_RDONLY | os.O_CLOEXEC)
                try:
                    return [copy_file(src, copies, layer.name, FILE_LAYER_NAME)]
                finally:
                    os.close(src)
            src = os.open(layer.source, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
            try:
                with fsutil.opened_dir(copies, layer.name, path=path, create=True) as dest:
                    return copy_dir(src, dest, describe)
            finally:
                os.close(src)

    def _write_documents(
        self, ingest: Ingest, staged: list[_Staged], out: int
    ) -> tuple[str, Descriptor]:
        """File lists, config and manifest as temp blobs in ``out``.

        Returns the config's digest and the manifest's descriptor.
        """
        for i, s in enumerate(staged):
            fsutil.create_file_at(out, f"list-{i}", s.file_list)
        config = self._raw_config(ingest, staged)
        config_bytes = dump_json(config)
        if len(config_bytes) > MAX_CONFIG_BYTES:
            raise errors.InvalidArgument(f"checkpoint {ingest.id}: metadata too large")
        fsutil.create_file_at(out, "config", config_bytes)
        config_desc = Descriptor(
            MEDIA_TYPE_CONFIG, fsutil.sha256_bytes(config_bytes), len(config_bytes)
        )
        self._core.step("config-written")
        annotations = {
            ANN_ID: ingest.id,
            ANN_SCOPE: ingest.scope,
            ANN_LABEL: ingest.label,
            ANN_CREATED: ingest.created,
        }
        layers = [
            Descriptor(MEDIA_TYPE_FILE_LIST, s.digest, len(s.file_list), {ANN_TITLE: s.layer.name})
            for s in staged
        ]
        data = dump_manifest(annotations, config_desc, layers)
        fsutil.create_file_at(out, "manifest", data)
        self._core.step("manifest-written")
        digest = fsutil.sha256_bytes(data)
        return config_desc.digest, Descriptor(MEDIA_TYPE_MANIFEST, digest, len(data), annotations)

    @staticmethod
    def _raw_config(ingest: Ingest, staged: list[_Staged]) -> dict[str, Any]:
        total = sum(s.files.total_bytes for s in staged)
        return {
            **ingest._metadata,
            "id": ingest.id,
            "scope": ingest.scope,
            "label": ingest.label,
            "created": ingest.created,
            "sizes": {"raw": total, "stored": total},
            "layers": [
                {
                    "name": s.layer.name,
                    "media_type": MEDIA_TYPE_FILE_LIST,
                    "digest": s.digest,
                    "size": len(s.file_list),
                    "raw_size": s.files.total_bytes,
                }
                for s in staged
            ],
            "rawFiles": {s.layer.name: s.digest for s in staged},
        }

    def _place_all(
        self,
        ingest: Ingest,
        staged: list[_Staged],
        out: int,
        index: Index,
        documents: tuple[str, Descriptor],
    ) -> Index:
        """Raw dirs, blobs, then index.json (the caller holds the index lock)."""
        config, manifest = documents
        placed: list[str] = []
        committed = False
        try:
            self._place_raw(ingest, staged)
            self._core.step("raw-placed")
            with self._core.opened_blobs() as blobs:
                for i, s in enumerate(staged):
                    self._core.place(out, f"list-{i}", blobs, s.digest, placed)
                self._core.place(out, "config", blobs, config, placed)
                os.fsync(blobs)
                self._core.step("blobs-placed")
                self._core.place(out, "manifest", blobs, manifest.digest, placed)
                os.fsync(blobs)
                self._core.step("manifest-placed")
            drops = self._retention_drops(index, ingest.scope, ingest.label)
            descriptors = [d for d in index.descriptors if d.annotations.get(ANN_ID) not in drops]
            descriptors.append(manifest)
            new_index = self._core.replace_index(index, descriptors, "index-temp-written")
            committed = True
            self._core.step("index-replaced")
            os.fsync(self._core.root_fd)
            self._core.step("committed")
        except BaseException:
            if not committed:
                self._core.unplace(placed)
                with contextlib.suppress(OSError), self._core.opened_dir("raw") as raw:
                    fsutil.remove_entry(raw, ingest.id)
            raise
        if drops:
            log.info(
                "retention removed checkpoints",
                extra={"scope": ingest.scope, "label": ingest.label, "removed": sorted(drops)},
            )
        return new_index

    def _place_raw(self, ingest: Ingest, staged: list[_Staged]) -> None:
        """Rename each sealed layer into raw/<id>/<layer> and make that durable."""
        with self._core.opened_dir("raw") as raw:
            os.mkdir(ingest.id, 0o700, dir_fd=raw)
            with fsutil.opened_dir(raw, ingest.id, path=self._core.path("raw")) as target:
                for s in staged:
                    with fsutil.opened_dir(ingest._dir_fd, *s.parent, path=ingest.path) as src:
                        if s.files.kind == "dir":
                            os.rename(s.name, s.layer.name, src_dir_fd=src, dst_dir_fd=target)
                            continue
                        os.mkdir(s.layer.name, 0o700, dir_fd=target)
                        where = self._catalog.raw_path(ingest.id)
                        with fsutil.opened_dir(target, s.layer.name, path=where) as layer:
                            os.rename(s.name, FILE_LAYER_NAME, src_dir_fd=src, dst_dir_fd=layer)
                            os.fsync(layer)
                os.fsync(target)
            os.fsync(raw)

    def _retention_drops(self, index: Index, scope: str, label: str) -> set[str]:
        """Ids to drop so that, with the checkpoint being published, `retain` remain."""
        keep = self._core.config.retain
        if keep == 0:
            return set()
        # A pinned checkpoint is neither dropped nor counted: `retain` are kept beside it.
        group = newest_first(
            r for r in index.checkpoints if (r.scope, r.label) == (scope, label) and not r.pinned
        )
        # Never a good checkpoint dropped for one that failed: those go first.
        failed = self._failures.failures()
        return {r.id for r in failed_last(group, lambda r: r.id in failed)[keep - 1 :]}
