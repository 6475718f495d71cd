"""Reading checkpoints: the candidates of a restore, verify, extract and stream layers,
raw or compacted (listing and lookup are the catalog's: catalog.py).

A raw checkpoint's layers are read from ``raw/<id>/<layer>`` and checked
against their file lists (size, CRC-32) in the same pass; a compacted one's
from its blobs (size, sha256): a split layer's tar, then its chunks, two
decompressed and written at once (measured faster than one on 2 cores). An
entry read before a concurrent compaction finished is still good: its
compacted form is used.
"""

from __future__ import annotations

import io
import os
import shutil
import threading
from collections.abc import Callable, Collection
from typing import IO, TYPE_CHECKING, BinaryIO, Final

from cedana_shim import errors

from . import compress, fsutil
from .catalog import Catalog
from .chunks import extract_split_files, write_split_tar
from .compress import CHUNK, LayerStream, extract_tar, extract_tar_zstd
from .core import SPACE_ERRNOS, StoreCore
from .filelist import FileList
from .ingest import in_flight
from .layout import Chunk, check_scope_or_label
from .model import Entry, LayerInfo
from .rawfiles import CheckingReader, copy_out, open_listed, write_tar

if TYPE_CHECKING:
    from typing_extensions import Buffer

__all__ = ["Reader"]

# Chunks decompressed and written at once by an extraction (see the module doc).
_EXTRACT_WORKERS: Final = 2


class _TarPipe(io.RawIOBase):
    """The bytes a thread produces (a raw dir layer's tar), read through a pipe.

    The producer's error, if any, is raised at the end of the stream.
    """

    def __init__(self, produce: Callable[[IO[bytes]], None]) -> None:
        super().__init__()
        rfd, wfd = os.pipe2(os.O_CLOEXEC)
        self._fd = rfd
        self._error: BaseException | None = None

        def run() -> None:
            try:
                with open(wfd, "wb", buffering=CHUNK) as out:
                    produce(out)
            except BrokenPipeError:
                pass  # the reader closed early
            except BaseException as err:  # handed to the reader at the end of the stream
                self._error = err

        self._thread = threading.Thread(target=run, name="cedana-raw-tar", daemon=True)
        self._thread.start()

    def readable(self) -> bool:
        return True

    def readinto(self, b: Buffer) -> int:
        n = os.readv(self._fd, [b])
        if n == 0:
            self._thread.join()
            if self._error is not None:
                error, self._error = self._error, None
                raise error
        return n

    def close(self) -> None:
        if not self.closed:
            os.close(self._fd)
            self._thread.join()
        super().close()


class Reader:
    """Reads checkpoints back: what a restore tries, verifies, extracts and streams."""

    def __init__(self, core: StoreCore, catalog: Catalog) -> None:
        self._core = core
        self._catalog = catalog

    def candidates(self, scope: str, label: str) -> list[Entry]:
        """What a restore of ``label`` in ``scope`` should try, in order (newest first).

        Damaged entries are included: the caller verifies each and falls back.
        """
        for what, value in (("scope", scope), ("label", label)):
            if (why := check_scope_or_label(what, value)) is not None:
                raise errors.InvalidArgument(why)
        return self._catalog.list(scope=scope, label=label)

    def matching(self, scope: str, ref: str) -> list[Entry]:
        """Checkpoints of ``scope`` whose id is ``ref`` (that one alone) or starts with
        it, newest first. Another scope's checkpoints are never looked at."""
        if (why := check_scope_or_label("scope", scope)) is not None:
            raise errors.InvalidArgument(why)
        if not ref:
            return []
        entries = self._catalog.list(scope=scope)
        exact = [e for e in entries if e.id == ref]
        return exact or [e for e in entries if e.id.startswith(ref)]

    def in_flight(self, scope: str, label: str) -> list[str]:
        """Ids of checkpoints of (scope, label) still being written by a live process."""
        with self._core.opened_dir("ingest") as ingest_root:
            return in_flight(ingest_root, scope, label)

    def spool_dir(self) -> str:
        """A private (0700) directory on the store's filesystem for temporary spools."""
        with self._core.opened_dir("spool", create=True):
            pass
        return self._core.path("spool")

    def verify(self, entry: Entry, *, deep: bool = True, require: Collection[str] = ()) -> None:
        """Raise DataLoss unless everything ``entry`` is made of is present and intact.

        Checks the manifest and config (digests, JSON shape, agreement with the
        index), then each layer: a blob's size and, with ``deep``, its sha256
        (~1.5 GB/s), or a raw layer's files' sizes and, with ``deep``, their
        CRC-32s. ``require`` names layers that must be present.
        """
        current = self._catalog.current(entry)
        names = {x.name for x in current.layers}
        for name in require:
            if name not in names:
                raise errors.DataLoss(f"checkpoint {entry.id} has no {name!r} layer")
        self._catalog.check(current, deep=deep)

    # -- extracting --------------------------------------------------------------------

    def extract_layer(self, entry: Entry, name: str, dest_dir: str) -> None:
        """Unpack a layer into ``dest_dir`` (created, 0700; must not exist or be empty).

        Checked in the same pass (a blob's digest, raw files' CRC-32s); tar
        members other than plain files and directories (links, devices, FIFOs),
        absolute paths and ``..`` are refused. The result appears at
        ``dest_dir`` by rename only when all is well: on error nothing is left.
        """
        current = self._catalog.current(entry)
        layer = current.layer(name)
        dest = os.path.abspath(dest_dir)
        if os.path.lexists(dest) and (
            os.path.islink(dest) or not os.path.isdir(dest) or os.listdir(dest)
        ):
            raise errors.FailedPrecondition(
                f"cannot extract checkpoint {entry.id} layer {name!r} into {dest}: "
                "it exists and is not an empty directory"
            )
        parent = os.path.dirname(dest)
        tmp: str | None = None
        try:
            os.makedirs(parent, mode=0o700, exist_ok=True)
            # Known before a byte is written (and nothing past it is: compress.RawBound).
            if layer.raw_size > (free := fsutil.free_bytes(parent)):
                raise errors.ResourceExhausted(
                    f"extracting checkpoint {entry.id} layer {name!r} needs {layer.raw_size} "
                    f"bytes in {parent}, which has {free} free; nothing was extracted. Free "
                    "space there and retry"
                )
            tmp = fsutil.mkdtemp_private(parent, f".{os.path.basename(dest)}.extract-")
            if current.state == "raw":
                self._extract_raw(current, name, tmp)
            else:
                self._extract_blob(current, layer, tmp)
            os.rename(tmp, dest)  # atomically replaces an empty dest directory
            tmp = None
        except OSError as err:
            if err.errno in SPACE_ERRNOS:
                raise errors.ResourceExhausted(
                    f"no space left on {parent} extracting checkpoint {entry.id} layer "
                    f"{name!r} ({layer.raw_size} bytes uncompressed): free space there and retry"
                ) from err
            raise errors.Internal(
                f"extracting checkpoint {entry.id} layer {name!r} into {dest}: {err}"
            ) from err
        finally:
            if tmp is not None:
                shutil.rmtree(tmp, ignore_errors=True)

    def _extract_blob(self, entry: Entry, layer: LayerInfo, dest: str) -> None:
        describe = (
            f"checkpoint {entry.id}: layer {layer.name!r} ({self._core.blob_path(layer.digest)})"
        )
        fd = self._core.open_blob_fd(layer.digest, describe)
        try:
            extract_tar_zstd(fd, layer.digest, layer.blob_size, layer.tar_raw_size, dest, describe)
        finally:
            os.close(fd)
        if not layer.split_files:
            return
        dest_fd = os.open(dest, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            extract_split_files(
                layer,
                dest_fd,
                self._open_chunk,
                lambda chunk: self._catalog.describe_chunk(entry, layer, chunk),
                workers=_EXTRACT_WORKERS,
            )
        finally:
            os.close(dest_fd)

    def _open_chunk(self, chunk: Chunk, what: str) -> int:
        return self._core.open_blob_fd(chunk.digest, what)

    def _raw_files(self, entry: Entry, name: str) -> tuple[FileList, str, str]:
        """(file list, raw dir path, description) of a raw layer."""
        what = f"checkpoint {entry.id}: layer {name!r}"
        files = self._catalog.file_list(entry, name)
        if files is None:
            raise errors.DataLoss(f"{what}: no file list")
        path = self._catalog.raw_path(entry.id, name)
        return files, path, f"{what} ({path})"

    def _extract_raw(self, entry: Entry, name: str, dest: str) -> None:
        files, path, describe = self._raw_files(entry, name)
        with self._catalog.raw_layer(entry.id, name, describe) as layer_fd:
            if files.kind == "dir":
                dest_fd = os.open(dest, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
                try:
                    copy_out(layer_fd, files, dest_fd, path=path, describe=describe)
                finally:
                    os.close(dest_fd)
                return
            (raw,) = files.files
            fd = open_listed(layer_fd, raw, path=path, describe=describe)
        try:
            reader = CheckingReader(fd, raw, describe)
            extract_tar(reader, dest, describe)
            reader.drain()
        finally:
            os.close(fd)

    # -- streaming -----------------------------------------------------------------------

    def open_layer(self, entry: Entry, name: str) -> BinaryIO:
        """A checked stream of a layer's tar, for the caller to apply.

        A compacted layer's blob (and chunks) is verified first (sha256) and
        again as it is decompressed; a raw file layer's tar is verified first (CRC-32); a raw
        dir layer's tar is made as it is read, each file checked as it goes.
        """
        current = self._catalog.current(entry)
        current.layer(name)
        if current.state == "raw":
            stream = self._open_raw(current, name)
            if stream is not None:
                return stream
            current = self._catalog.current(entry)  # compacted meanwhile
        return self._open_blob_layer(current, current.layer(name))

    def layer_source(self, entry: Entry, name: str) -> BinaryIO | None:
        """A raw checkpoint's file layer as its seekable tar file, verified (CRC-32).

        None when the layer is compressed (use open_layer) or a directory. The
        file is open: a concurrent compaction deleting it does not matter.
        """
        current = self._catalog.current(entry)
        current.layer(name)
        if current.state != "raw":
            return None
        files = self._catalog.file_list(current, name)
        if files is None or files.kind != "file":
            return None
        return self._open_raw(current, name)

    def _open_raw(self, entry: Entry, name: str) -> BinaryIO | None:
        """A raw layer's tar stream; None if compaction removed its files meanwhile."""
        files, path, describe = self._raw_files(entry, name)
        try:
            with self._catalog.raw_layer(entry.id, name, describe) as layer_fd:
                if files.kind == "dir":
                    produce_fd = os.dup(layer_fd)
                else:
                    fd = open_listed(layer_fd, files.files[0], path=path, describe=describe)
        except errors.DataLoss:
            if self._catalog.current(entry).state == "compacted":
                return None
            raise
        if files.kind == "dir":

            def produce(out: IO[bytes]) -> None:
                try:
                    write_tar(produce_fd, files, out, path=path, describe=describe)
                finally:
                    os.close(produce_fd)

            return io.BufferedReader(_TarPipe(produce), buffer_size=CHUNK)
        try:
            CheckingReader(fd, files.files[0], describe).drain()
            os.lseek(fd, 0, os.SEEK_SET)
        except BaseException:
            os.close(fd)
            raise
        return os.fdopen(fd, "rb")

    def _open_blob_layer(self, entry: Entry, layer: LayerInfo) -> BinaryIO:
        """The layer's tar: its blob decompressed, followed by its split files if any."""
        path = self._core.blob_path(layer.digest)
        describe = f"checkpoint {entry.id}: layer {layer.name!r} ({path})"
        if layer.chunks:
            self._catalog.check_layer_blob(
                entry, layer, deep=True
            )  # chunks are checked up front too
        fd = self._core.open_blob_fd(layer.digest, describe)
        try:
            size = os.fstat(fd).st_size
            if size != layer.blob_size:
                raise errors.DataLoss(
                    f"{describe}: blob is {size} bytes, expected {layer.blob_size}"
                )
            digest, _ = compress.hash_fd(fd)
            if digest != layer.digest:
                raise errors.DataLoss(
                    f"{describe}: blob is corrupt (sha256 is {digest}, expected {layer.digest})"
                )
            os.lseek(fd, 0, os.SEEK_SET)
            raw = LayerStream(fd, layer.digest, layer.blob_size, layer.tar_raw_size, describe)
        except BaseException:
            os.close(fd)
            raise
        stream = io.BufferedReader(raw, buffer_size=CHUNK)
        if not layer.split_files:
            return stream

        def produce(out: IO[bytes]) -> None:
            with stream:
                write_split_tar(
                    stream,
                    layer,
                    self._open_chunk,
                    lambda chunk: self._catalog.describe_chunk(entry, layer, chunk),
                    out,
                    what=describe,
                )

        return io.BufferedReader(_TarPipe(produce), buffer_size=CHUNK)
