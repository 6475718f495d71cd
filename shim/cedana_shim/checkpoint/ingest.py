"""A checkpoint being written: the staging area handed out by Store.begin."""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import secrets
import shutil
import stat
import tarfile
import time
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from datetime import datetime
from types import MappingProxyType, TracebackType
from typing import Any, Final, Literal

from cedana_shim import errors
from cedana_shim.checkpoint import fsutil
from cedana_shim.checkpoint.layout import (
    RESERVED_METADATA_KEYS,
    check_layer_name,
    check_media_type,
    dump_json,
)

__all__ = [
    "INGEST_GRACE_S",
    "Ingest",
    "PendingLayer",
    "check_metadata",
    "create_ingest_dir",
    "sweep_ingests",
]

log = logging.getLogger(__name__)

MAX_METADATA_BYTES: Final = 1 << 20


@dataclass(frozen=True)
class PendingLayer:
    name: str
    media_type: str
    source: str
    kind: Literal["dir", "file"]


def check_metadata(fields: Mapping[str, Any]) -> None:
    for key in fields:
        if not isinstance(key, str):
            raise errors.InvalidArgument(f"metadata keys must be strings, got {key!r}")
        if key in RESERVED_METADATA_KEYS:
            raise errors.InvalidArgument(
                f"metadata key {key!r} is reserved: the store sets "
                f"{', '.join(sorted(RESERVED_METADATA_KEYS))} itself"
            )
    try:
        data = dump_json(dict(fields))
    except (TypeError, ValueError) as err:
        raise errors.InvalidArgument(f"metadata is not JSON-serialisable: {err}") from None
    if len(data) > MAX_METADATA_BYTES:
        raise errors.InvalidArgument(
            f"metadata is {len(data)} bytes as JSON, more than the {MAX_METADATA_BYTES} allowed"
        )


class Ingest:
    """A checkpoint being written: a private staging dir under ``<root>/ingest``.

    Not thread-safe: one writer fills it, then hands it to Store.commit or
    Store.abort (or leaves a ``with`` block, which aborts it unless committed).
    """

    def __init__(
        self,
        owner: object,
        abort: Callable[[Ingest], None],
        checkpoint_id: str,
        path: str,
        lock_fd: int,
        *,
        scope: str,
        label: str,
        created: str,
        metadata: Mapping[str, Any],
    ) -> None:
        self.id = checkpoint_id
        self.path = path
        self.scope = scope
        self.label = label
        self.created = created
        self._owner = owner  # the Store that may commit it
        self._abort = abort
        # Closing the fd drops the flock, which lets gc reclaim the dir: done
        # by Store.commit/abort, or when a forgotten Ingest is collected.
        self._release_lock = weakref.finalize(self, os.close, lock_fd)
        self._metadata: dict[str, Any] = dict(metadata)
        self._layers: list[PendingLayer] = []
        self.raw_layers: set[str] = set()  # dir layers whose raw files the store caches
        self._state: Literal["open", "committing", "closed"] = "open"

    def __repr__(self) -> str:
        return f"Ingest(id={self.id!r}, scope={self.scope!r}, label={self.label!r})"

    def __enter__(self) -> Ingest:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._state == "open":
            self._abort(self)

    def _check_open(self) -> None:
        if self._state != "open":
            raise errors.FailedPrecondition(
                f"checkpoint {self.id} was already committed or aborted; begin a new one"
            )

    def _check_new_layer(self, name: str, media_type: str) -> None:
        self._check_open()
        if (why := check_layer_name(name)) is not None:
            raise errors.InvalidArgument(f"checkpoint {self.id}: layer name {why}")
        if (why := check_media_type(media_type)) is not None:
            raise errors.InvalidArgument(f"checkpoint {self.id}: layer {name!r}: {why}")
        if any(x.name == name for x in self._layers):
            raise errors.InvalidArgument(f"checkpoint {self.id}: layer {name!r} added twice")

    def dir(self, name: str) -> str:
        """A private (0700) directory inside the ingest for the caller to fill."""
        self._check_open()
        if (why := check_layer_name(name)) is not None:
            raise errors.InvalidArgument(f"checkpoint {self.id}: directory name {why}")
        parent = os.path.join(self.path, "dirs")
        path = os.path.join(parent, name)
        with contextlib.suppress(FileExistsError):
            os.mkdir(parent, 0o700)
        with contextlib.suppress(FileExistsError):
            os.mkdir(path, 0o700)
        return path

    def add_dir_layer(self, name: str, directory: str, media_type: str) -> None:
        """Archive ``directory``'s contents as layer ``name`` at commit."""
        self._check_new_layer(name, media_type)
        directory = os.path.abspath(directory)
        if not os.path.isdir(directory):
            raise errors.NotFound(
                f"checkpoint {self.id}: layer {name!r}: {directory} is not a directory"
            )
        self._layers.append(PendingLayer(name, media_type, directory, "dir"))

    def keep_raw(self, name: str) -> None:
        """Keep dir layer ``name``'s raw files in the store's cache after the commit."""
        self.raw_layers.add(name)

    def add_file_layer(self, name: str, tar_path: str, media_type: str) -> None:
        """Store the existing tar archive ``tar_path`` (compressed) as layer ``name``."""
        self._check_new_layer(name, media_type)
        tar_path = os.path.abspath(tar_path)
        try:
            with open(tar_path, "rb") as f:
                if not stat.S_ISREG(os.fstat(f.fileno()).st_mode):
                    raise errors.InvalidArgument(f"{tar_path} is not a regular file")
                head = f.read(tarfile.BLOCKSIZE)
                size = os.fstat(f.fileno()).st_size
        except FileNotFoundError:
            raise errors.NotFound(
                f"checkpoint {self.id}: layer {name!r}: no such file {tar_path}"
            ) from None
        # Cheap sanity check so a wrong path fails now, not at restore time.
        bad = size < 2 * tarfile.BLOCKSIZE or size % tarfile.BLOCKSIZE != 0
        if not bad and head.strip(b"\0"):
            try:
                tarfile.TarInfo.frombuf(head, tarfile.ENCODING, "surrogateescape")
            except tarfile.HeaderError:
                bad = True
        if bad:
            raise errors.InvalidArgument(
                f"checkpoint {self.id}: layer {name!r}: {tar_path} is not a tar archive"
            )
        self._layers.append(PendingLayer(name, media_type, tar_path, "file"))

    def set_metadata(self, **fields: Any) -> None:
        """Merge more fields (shallowly) into the checkpoint's metadata."""
        self._check_open()
        check_metadata(fields)
        merged = {**self._metadata, **fields}
        check_metadata(merged)
        self._metadata = merged

    @property
    def metadata(self) -> Mapping[str, Any]:
        return MappingProxyType(self._metadata)


# -- the ingest lock protocol ------------------------------------------------
#
# <ingest_root>/<id>/lock is flock'ed by the writing process for the ingest's
# whole life. It appears under that name already locked (created as .lock.tmp,
# locked, then renamed), so a sweeper that can lock it knows the writer is gone:
# the kernel drops a flock when its holder dies, however the pid is reused.

INGEST_GRACE_S: Final = 300.0
_LOCK: Final = "lock"


def create_ingest_dir(ingest_root: str, now: datetime) -> tuple[str, str, int]:
    """Make ``<ingest_root>/<id>`` (0700) with its lock held: (id, path, lock fd)."""
    while True:
        checkpoint_id = f"{now:%Y%m%dT%H%M%S}Z-{secrets.token_hex(4)}"
        path = os.path.join(ingest_root, checkpoint_id)
        try:
            os.mkdir(path, 0o700)
            break
        except FileExistsError:
            continue
    try:
        tmp = os.path.join(path, ".lock.tmp")
        fd = os.open(tmp, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            # For a human wondering whose ingest this is; nothing reads it.
            fsutil.write_all(fd, dump_json({"pid": os.getpid(), "started": now.isoformat()}))
            os.rename(tmp, os.path.join(path, _LOCK))
        except BaseException:
            os.close(fd)
            raise
    except BaseException:
        shutil.rmtree(path, ignore_errors=True)
        raise
    return checkpoint_id, path, fd


def sweep_ingests(ingest_root: str, grace_s: float = INGEST_GRACE_S) -> int:
    """Remove ingest dirs whose writer is gone; returns the bytes freed."""
    freed = 0
    now = time.time()
    for name in os.listdir(ingest_root):
        path = os.path.join(ingest_root, name)
        try:
            fd = os.open(os.path.join(path, _LOCK), os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC)
        except (FileNotFoundError, NotADirectoryError):
            # Its writer died inside create_ingest_dir (or it is a stray file).
            with contextlib.suppress(OSError):
                if now - os.lstat(path).st_mtime > grace_s:
                    freed += fsutil.tree_bytes(path)
                    fsutil.remove_path(path)
            continue
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # its writer is alive
            freed += fsutil.tree_bytes(path)
            fsutil.remove_path(path)  # while locked: nobody else judges it meanwhile
            log.info("removed an abandoned checkpoint ingest", extra={"checkpoint": name})
        finally:
            os.close(fd)
    return freed
