"""Moving compacted checkpoints between stores: their blobs read out, and adopted in.

Reading out (a push to a registry): :meth:`Adopter.checkpoint_manifest` and
:meth:`Adopter.open_blob` hand out a checkpoint's manifest and blobs, each checked
when read by whoever sends them.

Adopting in (a pull): the caller opens an :class:`Adoption`, a locked staging dir
``ingest/adopt-<id>-<hex>/`` (the ingest lock protocol: gc leaves it alone while its
process lives, removes it once that process is gone), writes every blob of the
checkpoint into it (``write_blob``: verified by the caller as it streams; sizes are
checked here) or pins the store's own copy (``link_existing``: a chunk another
checkpoint already holds, hard-linked and hashed), then calls :meth:`Adopter.adopt`
with the manifest. Adopt checks the manifest and config as strictly as a read does
(identity, layers, chunks against split files), then, holding ``index.lock``,
renames the blobs into ``blobs/sha256``, the manifest last, and appends the
checkpoint to index.json: the commit sequence of a compaction, so nothing partial
is ever visible and a failure leaves the store as it was. Retention does not apply:
an adopted checkpoint was asked for.

With ``cache_raw`` on, a pull also builds the CRIU layer's raw-image cache while the
chunks stream in (``begin_cache``, rawcache.py); adopt moves it to ``raw/<id>/`` in
the same hold of the lock, when the files rebuild the file list the config records
and the checkpoint is the newest of its label, so that a restore runs CRIU from it
at once instead of unpacking the blobs first. Every byte of such a cache was checked
as it was written (each chunk's sha256, each file's CRC-32): the first restore from it
may skip the second read for CRC-32s a restore from raw images otherwise runs beside
CRIU (:meth:`Adopter.take_fresh_cache`).
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import secrets
import threading
import weakref
from collections.abc import Callable
from typing import IO, BinaryIO, Final, cast

from cedana_shim import errors

from . import fsutil
from .catalog import Catalog, manifest_state, newest_first
from .compress import RawBound, ZstdReader, hash_fd
from .core import StoreCore
from .filelist import CACHE_LIST_SUFFIX
from .ingest import create_locked_dir
from .layout import (
    ANN_CREATED,
    ANN_ID,
    ANN_LABEL,
    ANN_SCOPE,
    ANN_TITLE,
    MAX_CONFIG_BYTES,
    MAX_MANIFEST_BYTES,
    MEDIA_TYPE_CRIU,
    MEDIA_TYPE_MANIFEST,
    CheckpointRef,
    Config,
    ConfigLayer,
    Descriptor,
    Index,
    Manifest,
    check_checkpoint_id,
    is_digest,
    match_split_files,
    parse_checkpoint_ref,
    parse_config,
    parse_manifest,
)
from .model import Entry
from .rawcache import CACHE_DIR_PREFIX, CacheBuilder, ChunkSink

__all__ = ["Adopter", "Adoption", "manifest_blobs"]

_PART: Final = ".part"
_MANIFEST_NAME: Final = "manifest"


def manifest_blobs(manifest: Manifest) -> dict[str, int]:
    """Every blob a checkpoint manifest references (config, layers, chunks): digest -> size."""
    blobs = {manifest.config.digest: manifest.config.size}
    for layer in manifest.layers:
        blobs[layer.digest] = layer.size
    for chunks in manifest.chunks.values():
        for chunk in chunks:
            blobs[chunk.digest] = chunk.size
    return blobs


class Adoption:
    """The staging dir of one checkpoint being adopted (see the module doc).

    ``write_blob`` and ``link_existing`` may be called from several threads at once
    (distinct digests). Close it (or leave its ``with`` block) when done: the staging
    dir goes, whatever was or was not adopted.
    """

    def __init__(
        self,
        checkpoint_id: str,
        path: str,
        fds: tuple[int, int, int],  # (its directory, its lock, the store's blobs dir)
        os_error: Callable[[OSError, str], errors.ShimError],
        remove: Callable[[], None],
        *,
        cache_raw: bool = False,
    ) -> None:
        self.checkpoint_id = checkpoint_id
        self._cache_raw = cache_raw
        self._cache: CacheBuilder | None = None
        self.path = path
        self._dir_fd, self._lock_fd, self._blobs_fd = fds
        self._os_error = os_error
        self._remove = remove
        self._staged: dict[str, int] = {}
        self._mutex = threading.Lock()
        self._closed = False
        self._release = weakref.finalize(self, _close_all, *fds)

    def __enter__(self) -> Adoption:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def staged(self) -> dict[str, int]:
        """Blobs in the staging dir so far: digest -> size."""
        with self._mutex:
            return dict(self._staged)

    def write_blob(self, digest: str, size: int, fill: Callable[[IO[bytes]], None]) -> None:
        """Stage a blob: ``fill(file)`` writes its bytes (and checks their digest).

        A file of another size than ``size`` is DataLoss; a full disk is
        ResourceExhausted naming the store. Nothing is staged unless ``fill`` returns.
        """
        name = self._name(digest)
        tmp = f"{name}{_PART}-{secrets.token_hex(4)}"
        what = f"checkpoint {self.checkpoint_id}: blob {digest}"
        try:
            fd = os.open(
                tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600,
                dir_fd=self._dir_fd,
            )  # fmt: skip
            try:
                sink = self._cache.sink(digest) if self._cache is not None else None
                with os.fdopen(fd, "wb", closefd=False) as out:
                    fill(out if sink is None else cast("IO[bytes]", _Tee(out, sink)))
                if sink is not None:
                    sink.finish()
                have = os.fstat(fd).st_size
                if have != size:
                    raise errors.DataLoss(f"{what}: {have} bytes staged, expected {size}")
                os.fsync(fd)
            finally:
                os.close(fd)
            os.rename(tmp, name, src_dir_fd=self._dir_fd, dst_dir_fd=self._dir_fd)
        except BaseException as err:
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=self._dir_fd)
            if isinstance(err, OSError):
                raise self._os_error(err, f"staging {what} in {self.path}") from err
            raise
        with self._mutex:
            self._staged[digest] = size

    def link_existing(self, digest: str, size: int) -> bool:
        """Pin the store's own blob of ``digest`` into the staging dir, if it is intact.

        True when the store has it with ``size`` bytes and that digest (hashed here:
        a damaged copy is not adopted, the caller downloads the blob instead).
        """
        name = self._name(digest)
        try:
            os.link(name, name, src_dir_fd=self._blobs_fd, dst_dir_fd=self._dir_fd,
                    follow_symlinks=False)  # fmt: skip
        except FileExistsError:
            return digest in self.staged
        except OSError:
            return False
        try:
            fd = fsutil.open_file(self._dir_fd, name, path=name)
        except (OSError, errors.DataLoss):
            intact = False
        else:
            try:
                intact = os.fstat(fd).st_size == size and hash_fd(fd)[0] == digest
            finally:
                os.close(fd)
        if not intact:
            os.unlink(name, dir_fd=self._dir_fd)
            return False
        with self._mutex:
            self._staged[digest] = size
        return True

    def read_staged(self, digest: str, limit: int) -> bytes:
        """A small staged blob's bytes (a config), checked against its digest."""
        name = self._name(digest)
        path = os.path.join(self.path, name)
        try:
            data = fsutil.read_file_at(self._dir_fd, name, limit, path=path)
        except FileNotFoundError:
            raise errors.NotFound(f"{path} is not staged") from None
        except fsutil.TooLarge as err:
            raise errors.DataLoss(str(err)) from None
        if fsutil.sha256_bytes(data) != digest:
            raise errors.DataLoss(f"{path} does not hash to {digest}")
        return data

    # -- the raw-image cache (see rawcache.py) ----------------------------------------

    def cache_layer(self, manifest: Manifest, config: Config) -> ConfigLayer | None:
        """The layer whose raw-image cache this pull can build (None: none, or
        ``cache_raw`` is off); its ``raw_size`` is what the cache takes on disk."""
        if not self._cache_raw:
            return None
        for layer in config.layers:
            chunks = manifest.chunks.get(layer.name, ())
            if (
                layer.media_type == MEDIA_TYPE_CRIU
                and layer.split_files
                and layer.name in config.raw_files
                and CacheBuilder.worth_building(chunks)
            ):
                return layer
        return None

    def begin_cache(self, manifest: Manifest, config: Config) -> bool:
        """Build the raw-image cache of ``cache_layer`` as the blobs are staged."""
        layer = self.cache_layer(manifest, config)
        if layer is None or self._cache is not None:
            return False
        where = f"checkpoint {self.checkpoint_id}"
        try:
            self._cache = CacheBuilder(
                self._dir_fd,
                layer,
                manifest.chunks.get(layer.name, ()),
                config.raw_files[layer.name],
                where,
            )
        except OSError as err:
            raise self._os_error(err, f"creating the raw-image cache in {self.path}") from err
        return True

    def fill_cache(self, digest: str) -> None:
        """Write a staged (or linked) chunk blob into the cache, if it is one of its."""
        cache = self._cache
        if cache is None or not cache.wants(digest):
            return
        try:
            cache.fill_from(digest, self._open_staged)
        except OSError as err:
            raise self._os_error(err, f"writing the raw-image cache in {self.path}") from err

    def finish_cache(self) -> tuple[str, bytes] | None:
        """(the cache's dir in the staging dir, its file list), or None: no cache. Every
        blob must be staged; DataLoss if one does not decompress to what the manifest
        says."""
        cache = self._cache
        if cache is None:
            return None
        tar_digest = cache.layer.digest
        what = f"checkpoint {self.checkpoint_id}: layer {cache.layer.name!r}: blob {tar_digest}"
        try:
            for digest in cache.unfilled():
                cache.fill_from(digest, self._open_staged)
            fd = self._open_staged(tar_digest)
            try:
                with (
                    os.fdopen(fd, "rb", closefd=False) as blob,
                    ZstdReader(blob, RawBound(cache.layer.tar_raw_size, what), what) as reader,
                ):
                    data = cache.finish(cast("IO[bytes]", reader))
                    reader.drain()
            finally:
                os.close(fd)
        except OSError as err:
            raise self._os_error(err, f"writing the raw-image cache in {self.path}") from err
        finally:
            cache.close()
        return None if data is None else (cache.dir_name, data)

    def close(self) -> None:
        if not self._closed:
            self._closed = True
            if self._cache is not None:
                self._cache.close()
            self._remove()  # while locked: gc keeps its hands off
        self._release()

    def _open_staged(self, digest: str) -> int:
        name = self._name(digest)
        return fsutil.open_file(self._dir_fd, name, path=os.path.join(self.path, name))

    def _name(self, digest: str) -> str:
        if not is_digest(digest):
            raise errors.InvalidArgument(f"{digest!r} is not sha256:<64 lowercase hex>")
        return digest.removeprefix("sha256:")

    def _check_open(self) -> None:
        if self._closed:
            raise errors.FailedPrecondition(
                f"the adoption of checkpoint {self.checkpoint_id} was closed; begin a new one"
            )


class _Tee:
    """A staged blob's file, and the cache's sink for the same bytes."""

    def __init__(self, out: IO[bytes], sink: ChunkSink) -> None:
        self._out = out
        self._sink = sink

    def write(self, data: bytes) -> int:
        self._out.write(data)
        self._sink.write(data)
        return len(data)


def _close_all(*fds: int) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


class Adopter:
    """Hands out compacted checkpoints' blobs and adopts others' (see the module doc)."""

    def __init__(self, core: StoreCore, catalog: Catalog) -> None:
        self._core = core
        self._catalog = catalog
        self._fresh_caches: set[str] = set()  # ids whose raw-image cache adopt placed
        self._fresh_lock = threading.Lock()

    def take_fresh_cache(self, checkpoint_id: str) -> bool:
        """Whether this adopter placed ``checkpoint_id``'s raw-image cache, checked as it
        was written, and no one asked since: True once."""
        with self._fresh_lock:
            if checkpoint_id not in self._fresh_caches:
                return False
            self._fresh_caches.discard(checkpoint_id)
            return True

    @property
    def root(self) -> str:
        """The store's root: pulls check the free space of its filesystem."""
        return self._core.root

    # -- reading out ---------------------------------------------------------------

    def checkpoint_manifest(self, entry: Entry) -> bytes:
        """The manifest of a loaded checkpoint, checked against its digest."""
        return self._core.read_blob(
            entry.manifest_digest, MAX_MANIFEST_BYTES, f"checkpoint {entry.id}: manifest"
        )

    def open_blob(self, digest: str, what: str) -> BinaryIO:
        """A stream of a blob of the store (DataLoss naming ``what`` when it is missing)."""
        if not is_digest(digest):
            raise errors.InvalidArgument(f"{digest!r} is not sha256:<64 lowercase hex>")
        return os.fdopen(self._core.open_blob_fd(digest, what), "rb")

    # -- adopting in -----------------------------------------------------------------

    def begin_adoption(self, checkpoint_id: str) -> Adoption:
        """A locked staging dir for the blobs of ``checkpoint_id`` (see the module doc)."""
        if (why := check_checkpoint_id(checkpoint_id)) is not None:
            raise errors.InvalidArgument(why)
        try:
            self._catalog.index_repaired()
            with self._core.opened_dir("ingest") as ingest_root:
                name, dir_fd, lock_fd = create_locked_dir(
                    ingest_root,
                    lambda: f"adopt-{checkpoint_id}-{secrets.token_hex(4)}",
                    {"adopting": checkpoint_id},
                )
            blobs_fd = fsutil.open_dir(self._core.root_fd, "blobs", path=self._core.root)
            try:
                sha = fsutil.open_dir(blobs_fd, "sha256", path=self._core.path("blobs"))
            finally:
                os.close(blobs_fd)
        except OSError as err:
            raise self._core.os_error(
                err, f"creating a staging directory in {self._core.root}"
            ) from err

        def remove() -> None:
            with contextlib.suppress(OSError), self._core.opened_dir("ingest") as ingest_root:
                fsutil.remove_entry(ingest_root, name)

        return Adoption(
            checkpoint_id,
            self._core.path("ingest", name),
            (dir_fd, lock_fd, sha),
            self._core.os_error,
            remove,
            cache_raw=self._core.config.cache_raw,
        )

    def adopt(self, adoption: Adoption, manifest: bytes) -> Entry:
        """Commit a staged compacted checkpoint (see the module doc); returns its entry.

        Idempotent: a checkpoint of that id already in the store is returned as it is
        (whatever was staged).
        """
        adoption._check_open()
        where = f"checkpoint {adoption.checkpoint_id}"
        if len(manifest) > MAX_MANIFEST_BYTES:
            raise errors.DataLoss(f"{where}: manifest over {MAX_MANIFEST_BYTES} bytes")
        parsed = parse_manifest(manifest, f"{where}: manifest")
        desc = Descriptor(
            MEDIA_TYPE_MANIFEST,
            fsutil.sha256_bytes(manifest),
            len(manifest),
            {k: parsed.annotations.get(k, "") for k in (ANN_ID, ANN_SCOPE, ANN_LABEL, ANN_CREATED)},
        )
        ref = parse_checkpoint_ref(desc, 0, f"{where}: manifest annotations")
        if ref.id != adoption.checkpoint_id:
            raise errors.DataLoss(f"{where}: the manifest is checkpoint {ref.id}'s")
        for known in self._catalog.index_repaired().checkpoints:
            if known.id == ref.id:
                return self._catalog.load_entry(known)
        self._check_adoptable(adoption, parsed, ref, where)
        cache = adoption.finish_cache()
        try:
            fsutil.create_file_at(adoption._dir_fd, _MANIFEST_NAME, manifest)
            with self._core.index_lock():
                index = self._catalog.index_for_write()
                for known in index.checkpoints:
                    if known.id == ref.id:
                        return self._catalog.load_entry(known)
                placed: list[str] = []
                committed = cached = False
                try:
                    with self._core.opened_blobs() as blobs:
                        for digest in manifest_blobs(parsed):
                            name = digest.removeprefix("sha256:")
                            self._core.place(adoption._dir_fd, name, blobs, digest, placed)
                        os.fsync(blobs)
                        self._core.place(
                            adoption._dir_fd, _MANIFEST_NAME, blobs, desc.digest, placed
                        )
                        os.fsync(blobs)
                    cached = cache is not None and self._place_cache(adoption, index, ref, cache)
                    new_index = self._core.replace_index(
                        index, [*index.descriptors, desc], "adopt-index-temp-written"
                    )
                    committed = True
                    adoption._staged.clear()  # moved into the store
                    os.fsync(self._core.root_fd)
                except BaseException:
                    if not committed:
                        self._core.unplace(placed)
                        if cached:
                            with contextlib.suppress(OSError), self._core.opened_dir("raw") as raw:
                                fsutil.remove_entry(raw, ref.id)
                    raise
        except OSError as err:
            raise self._core.os_error(err, f"adopting {where} into {self._core.root}") from err
        if cached:
            with self._fresh_lock:
                self._fresh_caches.add(ref.id)
        position = len(new_index.descriptors) - 1
        return self._catalog.load_entry(parse_checkpoint_ref(desc, position, "index.json"))

    def _place_cache(
        self, adoption: Adoption, index: Index, ref: CheckpointRef, cache: tuple[str, bytes]
    ) -> bool:
        """Move the built raw-image cache to ``raw/<id>/<layer>`` beside its file list,
        when the checkpoint is the newest of its label (gc keeps no other's cache).
        Under the index lock, before the index write that adds the checkpoint."""
        group = [r for r in index.checkpoints if (r.scope, r.label) == (ref.scope, ref.label)]
        mine = dataclasses.replace(ref, position=len(index.descriptors))
        if newest_first([*group, mine])[0] is not mine:
            return False
        dir_name, file_list = cache
        layer = dir_name.removeprefix(CACHE_DIR_PREFIX)
        with self._core.opened_dir("raw", create=True) as raw:
            fsutil.remove_entry(raw, ref.id)  # a crash's leftover: no checkpoint has it
            os.mkdir(ref.id, 0o700, dir_fd=raw)
            with fsutil.opened_dir(raw, ref.id, path=self._core.path("raw")) as target:
                os.rename(dir_name, layer, src_dir_fd=adoption._dir_fd, dst_dir_fd=target)
                fsutil.write_file_atomic(target, layer + CACHE_LIST_SUFFIX, file_list)
            os.fsync(raw)
        return True

    def _check_adoptable(
        self, adoption: Adoption, manifest: Manifest, ref: CheckpointRef, where: str
    ) -> None:
        """DataLoss unless the staged checkpoint is whole and as strict a read accepts."""
        if manifest_state(manifest, where) != "compacted":
            raise errors.InvalidArgument(f"{where}: only a compacted checkpoint can be adopted")
        staged = adoption.staged
        for digest, size in manifest_blobs(manifest).items():
            if staged.get(digest) != size:
                have = "missing" if digest not in staged else f"{staged[digest]} bytes"
                raise errors.DataLoss(f"{where}: blob {digest} ({size} bytes) is {have}")
        cdesc = manifest.config
        config = parse_config(
            adoption.read_staged(cdesc.digest, MAX_CONFIG_BYTES),
            f"{where}: config {cdesc.digest}",
            ref,
        )
        got = [(d.annotations[ANN_TITLE], d.media_type, d.digest, d.size) for d in manifest.layers]
        want = [(c.name, c.media_type, c.digest, c.size) for c in config.layers]
        if got != want:
            raise errors.DataLoss(f"{where}: manifest and config disagree about the layers")
        for c in config.layers:
            match_split_files(manifest.chunks.get(c.name, ()), c.split_files, f"{where}: {c.name}")
