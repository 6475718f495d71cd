"""Raw images: CRIU restores straight from them, without decompressing anything.

A raw checkpoint's images are its ``raw/<id>/<layer>`` dir; a compacted one
may keep them as the raw-image cache (the newest checkpoint of its label), with
a copy of the layer's file list beside them, matched by the digest its config
records (``rawFiles``). A restore runs CRIU from them while verify_raw checks
every file's CRC-32 in parallel; on a mismatch the caller discards them: a
cache is forgotten (the blob is still good), a raw checkpoint has nothing else
and is moved aside to ``damaged/<id>``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import secrets
from collections.abc import Callable
from dataclasses import replace

from cedana_shim import errors

from . import fsutil
from .catalog import Catalog
from .core import StoreCore
from .filelist import CACHE_LIST_SUFFIX, MAX_FILE_LIST_BYTES
from .layout import ANN_ID, ANN_TITLE, MAX_CONFIG_BYTES, MAX_MANIFEST_BYTES, parse_manifest
from .model import Entry
from .rawfiles import verify_files

__all__ = ["RawImages"]

log = logging.getLogger(__name__)


class RawImages:
    """The raw images of checkpoints, for CRIU (see the module doc)."""

    def __init__(self, core: StoreCore, catalog: Catalog) -> None:
        self._core = core
        self._catalog = catalog

    def raw_images(self, entry: Entry, layer: str) -> str | None:
        """A directory CRIU can restore ``layer`` from without decompressing anything.

        The raw dir of a raw checkpoint, or the cache of a compacted one; None
        when there is none, or a file is missing or of another size (sizes only:
        run verify_raw alongside the restore for the CRC-32s).
        """
        try:
            current = self._catalog.current(entry)
            files = self._catalog.file_list(current, layer)
            if files is None:
                return None
            path = self._catalog.raw_path(current.id, layer)
            what = f"checkpoint {current.id}: raw images of layer {layer!r} ({path})"
            with self._catalog.raw_layer(current.id, layer, what) as fd:
                verify_files(fd, files, path=path, describe=what, deep=False)
        except errors.DataLoss as err:
            log.info("raw images unusable: %s", err, extra={"checkpoint": entry.id})
            return None
        return path

    def verify_raw(
        self, entry: Entry, layer: str, *, only: Callable[[str], bool] | None = None
    ) -> None:
        """Every file of ``layer``'s raw images has its size and CRC-32; DataLoss naming it.
        ``only`` picks the files by their path in the layer (a lazy restore checks its
        memory pages apart from the rest).

        The directory is opened once: a concurrent compaction moving it does
        not matter.
        """
        current = self._catalog.current(entry)
        what = f"checkpoint {current.id}: raw images of layer {layer!r}"
        files = self._catalog.file_list(current, layer)
        if files is None:
            raise errors.DataLoss(f"{what}: none kept")
        if only is not None:
            files = replace(files, files=tuple(f for f in files.files if only(f.path)))
        path = self._catalog.raw_path(current.id, layer)
        with self._catalog.raw_layer(current.id, layer, what) as fd:
            verify_files(fd, files, path=path, describe=f"{what} ({path})", deep=True)

    def discard_raw(self, entry: Entry) -> None:
        """Raw images found bad: forget a cache, or move a raw checkpoint aside.

        A raw checkpoint has no other copy: it leaves index.json and its files
        are kept under ``<store>/damaged/<id>/`` (with its config and file
        lists) for inspection.
        """
        try:
            with self._core.index_lock():
                index = self._catalog.index_for_write()
                ref = next((r for r in index.checkpoints if r.id == entry.id), None)
                if ref is None:
                    return
                current = self._catalog.load_entry(ref)
                if current.state == "compacted" and current.damage is None:
                    with self._core.opened_dir("raw") as raw:
                        fsutil.remove_entry(raw, entry.id)
                    log.warning("raw-image cache discarded", extra={"checkpoint": entry.id})
                    return
                where = self._move_aside(entry.id)
                descriptors = [
                    d for d in index.descriptors if d.annotations.get(ANN_ID) != entry.id
                ]
                self._catalog.sweep_locked(self._core.write_index(index, descriptors))
        except OSError as err:
            raise self._core.os_error(err, f"discarding checkpoint {entry.id}") from err
        log.warning(
            "raw checkpoint damaged: removed from the index, its files kept for inspection",
            extra={"checkpoint": entry.id, "path": where},
        )

    def _move_aside(self, checkpoint_id: str) -> str:
        """Move raw/<id> to damaged/<name> with its manifest's config and file lists."""
        with (
            self._core.opened_dir("damaged", create=True) as damaged,
            self._core.opened_dir("raw") as raw,
        ):
            name = checkpoint_id
            while True:
                try:
                    os.lstat(name, dir_fd=damaged)
                except FileNotFoundError:
                    break
                name = f"{checkpoint_id}-{secrets.token_hex(4)}"
            try:
                os.rename(checkpoint_id, name, src_dir_fd=raw, dst_dir_fd=damaged)
            except FileNotFoundError:
                os.mkdir(name, 0o700, dir_fd=damaged)
            with fsutil.opened_dir(damaged, name, path=self._core.path("damaged")) as target:
                self._keep_documents(checkpoint_id, target)
        return self._core.path("damaged", name)

    def _keep_documents(self, checkpoint_id: str, target: int) -> None:
        """Best effort: the config and file lists, to tell what the files should be."""
        for ref in self._core.load_index().checkpoints:
            if ref.id != checkpoint_id:
                continue
            with contextlib.suppress(errors.DataLoss, OSError):
                what = f"checkpoint {checkpoint_id}"
                desc = ref.descriptor
                manifest = parse_manifest(
                    self._core.read_blob(desc.digest, MAX_MANIFEST_BYTES, what, desc.size), what
                )
                config = manifest.config
                data = self._core.read_blob(config.digest, MAX_CONFIG_BYTES, what, config.size)
                fsutil.write_file_atomic(target, "config.json", data)
                for layer in manifest.layers:
                    name = layer.annotations.get(ANN_TITLE, "layer")
                    data = self._core.read_blob(layer.digest, MAX_FILE_LIST_BYTES, what, layer.size)
                    fsutil.write_file_atomic(target, name + CACHE_LIST_SUFFIX, data)
