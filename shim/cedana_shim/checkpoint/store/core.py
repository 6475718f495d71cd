"""The store's machinery shared by every part: the root, the index, blobs, errors.

The root is opened once (it may be a symlink to another disk: that is allowed)
and everything under it is reached from that fd without following symlinks
(see fsutil). index.json is read and replaced here; blobs are read, verified
and placed here. Every other part of the store (store.py) is given this one
object and works through its methods; none of them holds an fd of its own.
"""

from __future__ import annotations

import contextlib
import errno
import os
import secrets
import stat
import weakref
from collections.abc import Sequence
from typing import Final

from cedana_shim import errors

from . import fsutil
from .layout import (
    MAX_CHUNK_BYTES,
    MAX_INDEX_BYTES,
    Descriptor,
    Index,
    dump_json,
    parse_index,
    parse_layout_file,
)
from .model import StepHook, StoreConfig

__all__ = ["INDEX_DAMAGED_PREFIX", "INDEX_TMP_PREFIX", "StoreCore"]

INDEX: Final = "index.json"
INDEX_TMP_PREFIX: Final = "index.json.tmp-"
INDEX_DAMAGED_PREFIX: Final = "index.json.damaged-"
# What a store root may hold. "cache" is the raw-image cache of the previous
# format: garbage now, removed by gc.
LAYOUT_NAMES: Final = frozenset(
    {
        "oci-layout",
        INDEX,
        "index.lock",
        "blobs",
        "ingest",
        "raw",
        "damaged",
        "spool",
        "cache",
        "restores",
        "failures",
    }
)
# Smaller chunks are allowed for tests; a real store wants MiBs (one blob each).
MIN_CHUNK_BYTES: Final = 4096
SPACE_ERRNOS: Final = frozenset({errno.ENOSPC, errno.EDQUOT})
REPAIR_HINT: Final = (
    "run `cedana checkpoints repair` to rebuild it from the checkpoints' blobs and raw "
    "files (the shim also repairs it on its next checkpoint)"
)


class StoreCore:
    """An opened store root: its fd, index.json and its lock, blobs, the step hook."""

    def __init__(self, config: StoreConfig, *, step_hook: StepHook | None = None) -> None:
        if not -7 <= config.compression_level <= 22:
            raise errors.InvalidArgument(
                f"compression_level {config.compression_level} is out of range (-7..22)"
            )
        if config.threads < 0:
            raise errors.InvalidArgument(
                f"threads must be >= 0 (0 = all cores), got {config.threads}"
            )
        if config.chunk_size != 0 and not MIN_CHUNK_BYTES <= config.chunk_size <= MAX_CHUNK_BYTES:
            raise errors.InvalidArgument(
                f"chunk_size {config.chunk_size} is out of range: 0 (one blob per layer) or "
                f"{MIN_CHUNK_BYTES}..{MAX_CHUNK_BYTES} bytes"
            )
        if config.retain < 0:
            raise errors.InvalidArgument(f"retain must be >= 0 (0 = keep all), got {config.retain}")
        self.config = config
        self.root = os.path.abspath(config.root)
        self.index_path = os.path.join(self.root, INDEX)
        self._step_hook = step_hook
        try:
            self.root_fd = self._open_root()
            self._close_root = weakref.finalize(self, os.close, self.root_fd)
            self._check_layout()
        except OSError as err:
            raise self.os_error(err, f"opening checkpoint store {self.root}") from err

    # -- setup ---------------------------------------------------------------

    def _open_root(self) -> int:
        root = self.root
        os.makedirs(os.path.dirname(root), exist_ok=True)
        with contextlib.suppress(FileExistsError):
            os.mkdir(root, 0o700)
        # Follows a symlink: pointing the store at another disk is fine. Nothing
        # below the root is ever reached through one.
        fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            st = os.fstat(fd)
            if st.st_uid != os.geteuid():
                raise errors.PermissionDenied(
                    f"checkpoint store {root} is owned by uid {st.st_uid}, not by uid "
                    f"{os.geteuid()} that runs the shim; checkpoints hold process memory, so "
                    f"refusing to use it. Fix: chown {os.geteuid()} {root} (or point the store "
                    "elsewhere)"
                )
            if st.st_mode & 0o077:
                raise errors.PermissionDenied(
                    f"checkpoint store {root} is accessible to group/others "
                    f"(mode {stat.S_IMODE(st.st_mode):04o}); checkpoints hold process memory "
                    f"and secrets, so refusing to use it. Fix: chmod 0700 {root}"
                )
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _check_layout(self) -> None:
        names = set(os.listdir(self.root_fd))
        strays = {
            n
            for n in names - LAYOUT_NAMES
            if not n.startswith((INDEX_TMP_PREFIX, INDEX_DAMAGED_PREFIX))
        }
        if "oci-layout" not in names and strays:
            raise errors.FailedPrecondition(
                f"checkpoint store {self.root} is not empty and is not an OCI image layout "
                f"(no oci-layout file; found {', '.join(sorted(strays)[:5])}); refusing to "
                "write checkpoints into it. Point the store at a new or empty directory"
            )
        if "oci-layout" in names:
            path = self.path("oci-layout")
            parse_layout_file(self._read_root_file("oci-layout", 4096), path)
        for parts in (("blobs",), ("blobs", "sha256"), ("ingest",), ("raw",)):
            with self.opened_dir(*parts, create=True):
                pass

    # -- small helpers -------------------------------------------------------

    def step(self, name: str) -> None:
        """A crash point (model.PUBLISH_STEPS, COMPACT_STEPS): the step hook's cue."""
        if self._step_hook is not None:
            self._step_hook(name)

    def path(self, *parts: str) -> str:
        """``<root>/<parts...>``, for messages and for what is handed out by name."""
        return os.path.join(self.root, *parts)

    def opened_dir(
        self, *parts: str, create: bool = False
    ) -> contextlib.AbstractContextManager[int]:
        """An fd of ``<root>/<parts...>``, reached without following a symlink."""
        return fsutil.opened_dir(self.root_fd, *parts, path=self.root, create=create)

    def index_lock(self) -> contextlib.AbstractContextManager[None]:
        """Hold ``index.lock``: every index.json writer, and every blob or raw dir placed."""
        return fsutil.flocked(self.root_fd, "index.lock", path=self.path("index.lock"))

    def _read_root_file(self, name: str, limit: int) -> bytes:
        try:
            return fsutil.read_file_at(self.root_fd, name, limit, path=self.path(name))
        except fsutil.TooLarge as err:
            raise errors.DataLoss(str(err)) from None

    def os_error(self, err: OSError, doing: str) -> errors.ShimError:
        """The ShimError an OSError met while ``doing`` is: a full disk says how to free it."""
        if err.errno in SPACE_ERRNOS:
            return errors.ResourceExhausted(
                f"checkpoint store {self.root} is full: {err.strerror} while {doing}. "
                "Free space on that filesystem, lower `retain`, or prune old checkpoints"
            )
        if err.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
            return errors.PermissionDenied(f"{doing}: {err}")
        return errors.Internal(f"{doing}: {err}")

    # -- index.json ----------------------------------------------------------

    def load_index(self) -> Index:
        """index.json parsed; DataLoss (naming the file) when it is missing or damaged."""
        try:
            data = self._read_root_file(INDEX, MAX_INDEX_BYTES)
        except FileNotFoundError:
            raise errors.DataLoss(
                f"{self.index_path} is missing: the checkpoint store's index was deleted"
            ) from None
        return parse_index(data, self.index_path)

    def read_index(self) -> Index:
        """For read paths: the index, or DataLoss that says how to repair it."""
        try:
            return self.load_index()
        except errors.DataLoss as err:
            raise errors.DataLoss(
                f"{err}. The store's index is damaged: no checkpoint can be listed until it "
                f"is repaired; {REPAIR_HINT}"
            ) from None

    def write_index(self, index: Index, descriptors: Sequence[Descriptor]) -> Index:
        """Replace index.json (the caller holds the index lock); returns what it says now."""
        data = dump_json(index.to_json(descriptors))
        fsutil.write_file_atomic(self.root_fd, INDEX, data, INDEX_TMP_PREFIX)
        return parse_index(data, self.index_path)

    def replace_index(
        self, index: Index, descriptors: Sequence[Descriptor], temp_step: str
    ) -> Index:
        """Write the new index.json under a temp name, fsync it, rename it into place.

        The rename is the commit point of every write; the caller fsyncs the
        root dir after it. Returns what the new index says.
        """
        data = dump_json(index.to_json(descriptors))
        tmp = f"{INDEX_TMP_PREFIX}{os.getpid()}-{secrets.token_hex(4)}"
        try:
            fsutil.create_file_at(self.root_fd, tmp, data)
            self.step(temp_step)
            os.replace(tmp, INDEX, src_dir_fd=self.root_fd, dst_dir_fd=self.root_fd)
        except BaseException:
            with contextlib.suppress(OSError):
                os.unlink(tmp, dir_fd=self.root_fd)
            raise
        return parse_index(data, self.index_path)

    # -- blobs ---------------------------------------------------------------

    def blob_path(self, digest: str) -> str:
        """Where a blob is, for messages (blobs are opened through ``opened_blobs``)."""
        return self.path("blobs", "sha256", digest.removeprefix("sha256:"))

    def opened_blobs(self) -> contextlib.AbstractContextManager[int]:
        """An fd of ``blobs/sha256``."""
        return self.opened_dir("blobs", "sha256")

    def open_blob_fd(self, digest: str, what: str) -> int:
        """A blob's fd; DataLoss naming ``what`` when it is missing or not a file."""
        path = self.blob_path(digest)
        try:
            with self.opened_blobs() as blobs:
                return fsutil.open_file(blobs, digest.removeprefix("sha256:"), path=path)
        except FileNotFoundError:
            raise errors.DataLoss(f"{what}: blob {path} is missing") from None
        except errors.DataLoss as err:
            raise errors.DataLoss(f"{what}: {err}") from None
        except OSError as err:
            raise errors.DataLoss(f"{what}: cannot open blob {path}: {err.strerror}") from None

    def read_blob(self, digest: str, limit: int, what: str, size: int | None = None) -> bytes:
        """A small blob's bytes, checked against its digest (and size when known)."""
        if size is not None and size > limit:
            raise errors.DataLoss(f"{what}: descriptor says {size} bytes, over the {limit} allowed")
        path = self.blob_path(digest)
        fd = self.open_blob_fd(digest, what)
        try:
            data = os.read(fd, (limit if size is None else size) + 1)
        finally:
            os.close(fd)
        if size is not None and len(data) != size:
            raise errors.DataLoss(f"{what}: blob {path} is {len(data)} bytes, expected {size}")
        if len(data) > limit:
            raise errors.DataLoss(f"{what}: blob {path} is over the {limit} bytes allowed")
        if fsutil.sha256_bytes(data) != digest:
            raise errors.DataLoss(f"{what}: blob {path} is corrupt (sha256 mismatch)")
        return data

    @staticmethod
    def place(work_fd: int, tmp: str, blobs_fd: int, digest: str, placed: list[str]) -> None:
        """Rename a temp blob into blobs/sha256 (the caller holds the index lock)."""
        name = digest.removeprefix("sha256:")
        try:
            os.lstat(name, dir_fd=blobs_fd)
            existed = True
        except FileNotFoundError:
            existed = False
        # Replacing an existing blob of the same digest is harmless (same bytes)
        # and heals one that was damaged on disk.
        os.rename(tmp, name, src_dir_fd=work_fd, dst_dir_fd=blobs_fd)
        if not existed:
            placed.append(name)

    def unplace(self, placed: list[str]) -> None:
        """Undo ``place`` for blobs a failed write created (others may be shared)."""
        with contextlib.suppress(OSError), self.opened_blobs() as blobs:
            for name in placed:
                with contextlib.suppress(OSError):
                    os.unlink(name, dir_fd=blobs)
