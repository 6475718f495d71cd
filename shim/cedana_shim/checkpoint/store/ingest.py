"""A checkpoint being written: the staging area handed out by Writer.begin.

Also the ingest lock protocol: ``<store>/ingest/<name>/lock`` is flock'ed by the
writing process for the ingest's whole life. It appears under that name already
locked (created as .lock.tmp, locked, filled, then renamed), so a sweeper that
can lock it knows the writer is gone: the kernel drops a flock when its holder
dies, however the pid is reused. Its JSON names the writer, and for a
checkpoint ingest its scope and label, so that another process can tell which
labels have a checkpoint in flight (Reader.in_flight). Compaction work dirs use
the same protocol under ``compact-<id>-<hex>`` names.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import secrets
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

from .early_seal import EarlySealer, Prefix
from .fsutil import opened_dir, remove_entry, write_all
from .layout import (
    RESERVED_METADATA_KEYS,
    check_layer_name,
    check_media_type,
    dump_json,
    load_json,
)

__all__ = [
    "INGEST_GRACE_S",
    "Ingest",
    "PendingLayer",
    "check_metadata",
    "create_locked_dir",
    "in_flight",
    "sweep_ingests",
]

log = logging.getLogger(__name__)

MAX_METADATA_BYTES: Final = 1 << 20
INGEST_GRACE_S: Final = 300.0
_LOCK: Final = "lock"
_LOCK_TMP: Final = ".lock.tmp"
_MAX_LOCK_BYTES: Final = 8192
_DIR_FLAGS: Final = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
# Names inside an ingest dir that belong to the store, not to the caller.
STORE_NAMES: Final = frozenset({_LOCK, _LOCK_TMP, "out", "copies"})


@dataclass(frozen=True)
class PendingLayer:
    name: str
    media_type: str  # of the compressed layer
    source: str
    kind: Literal["dir", "file"]
    # The source's path components under the ingest dir: moved into the store
    # at publish. None: the source is the caller's, and is copied.
    staged: tuple[str, ...] | None


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


def _close_all(*fds: int) -> None:
    for fd in fds:
        with contextlib.suppress(OSError):
            os.close(fd)


class Ingest:
    """A checkpoint being written: a private staging dir under ``<root>/ingest``.

    Not thread-safe: one writer fills it, then hands it to Writer.publish (or
    Store.commit) or Writer.abort (or leaves a ``with`` block, which aborts it unless
    published).
    """

    def __init__(
        self,
        owner: object,
        abort: Callable[[Ingest], None],
        checkpoint_id: str,
        path: str,
        fds: tuple[int, int],  # (its directory, its lock)
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
        self._owner = owner  # the store's Writer that may publish it
        self._abort = abort
        self._dir_fd = fds[0]
        # Closing the lock fd drops the flock, which lets gc reclaim the dir: done
        # by Writer.publish/abort, or when a forgotten Ingest is collected.
        self._release = weakref.finalize(self, _close_all, *fds)
        self._metadata: dict[str, Any] = dict(metadata)
        self._layers: list[PendingLayer] = []
        self.raw_layers: set[str] = set()  # dir layers whose raw files the store caches
        # By directory: what seal_early read, and the writeback error that ended it.
        self._prefixes: dict[str, tuple[dict[str, Prefix], OSError | None]] = {}
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

    def _staged(self, name: str, source: str) -> tuple[str, ...] | None:
        """``source``'s components under the ingest dir, or None when it lies outside."""
        rel = os.path.relpath(source, self.path)
        if rel == "." or rel == ".." or rel.startswith("../"):
            if rel == ".":
                raise errors.InvalidArgument(
                    f"checkpoint {self.id}: layer {name!r}: the ingest dir itself is not a layer"
                )
            return None
        parts = tuple(rel.split("/"))
        if parts[0] in STORE_NAMES:
            raise errors.InvalidArgument(
                f"checkpoint {self.id}: layer {name!r}: {source} belongs to the store"
            )
        for other in self._layers:
            if other.staged is None:
                continue
            shorter = min(len(parts), len(other.staged))
            if parts[:shorter] == other.staged[:shorter]:
                raise errors.InvalidArgument(
                    f"checkpoint {self.id}: layer {name!r}: {source} overlaps layer "
                    f"{other.name!r} ({other.source}); layers are moved into the store whole"
                )
        return parts

    def dir(self, name: str) -> str:
        """A private (0700) directory inside the ingest for the caller to fill.

        Made through directory fds: a symlink planted at ``dirs`` or ``dirs/<name>``
        is refused (DataLoss), never followed.
        """
        self._check_open()
        if (why := check_layer_name(name)) is not None:
            raise errors.InvalidArgument(f"checkpoint {self.id}: directory name {why}")
        with opened_dir(self._dir_fd, "dirs", name, path=self.path, create=True):
            pass
        return os.path.join(self.path, "dirs", name)

    def add_dir_layer(self, name: str, directory: str, media_type: str) -> None:
        """Publish ``directory``'s contents as layer ``name``.

        A directory inside the ingest (see dir()) is moved into the store as it
        is; any other is copied at publish.
        """
        self._check_new_layer(name, media_type)
        directory = os.path.abspath(directory)
        if not os.path.isdir(directory):
            raise errors.NotFound(
                f"checkpoint {self.id}: layer {name!r}: {directory} is not a directory"
            )
        staged = self._staged(name, directory)
        self._layers.append(PendingLayer(name, media_type, directory, "dir", staged))

    def seal_early(self, directory: str) -> EarlySealer:
        """Seal ``directory``'s page images while they are written (see early_seal);
        what it read once stopped is used by the publish."""
        directory = os.path.abspath(directory)

        def keep(read: dict[str, Prefix], error: OSError | None) -> None:
            self._prefixes[directory] = (read, error)

        return EarlySealer(directory, keep)

    def prefixes(self, directory: str) -> Mapping[str, Prefix]:
        """What seal_early read of ``directory``'s files, by name; raises the
        writeback error that ended it (the seal's own fsync may not see it)."""
        read, error = self._prefixes.get(os.path.abspath(directory), ({}, None))
        if error is not None:
            raise error
        return MappingProxyType(read)

    def keep_raw(self, name: str) -> None:
        """Keep dir layer ``name``'s raw files as the raw-image cache after compaction."""
        self.raw_layers.add(name)

    def add_file_layer(self, name: str, tar_path: str, media_type: str) -> None:
        """Publish the existing tar archive ``tar_path`` as layer ``name``."""
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
        staged = self._staged(name, tar_path)
        self._layers.append(PendingLayer(name, media_type, tar_path, "file", staged))

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


def create_locked_dir(
    root_fd: int, new_name: Callable[[], str], record: Mapping[str, Any]
) -> tuple[str, int, int]:
    """Make ``<root>/<name>`` (0700) with its lock held: (name, dir fd, lock fd).

    ``record`` (plus the pid and the time) is written into the lock file before
    it appears under its name.
    """
    while True:
        name = new_name()
        try:
            os.mkdir(name, 0o700, dir_fd=root_fd)
            break
        except FileExistsError:
            continue
    try:
        dir_fd = os.open(name, _DIR_FLAGS, dir_fd=root_fd)
        try:
            flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
            lock_fd = os.open(_LOCK_TMP, flags, 0o600, dir_fd=dir_fd)
            try:
                fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                doc = {"pid": os.getpid(), "started": datetime.now().astimezone().isoformat()}
                write_all(lock_fd, dump_json({**doc, **record}))
                os.rename(_LOCK_TMP, _LOCK, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
            except BaseException:
                os.close(lock_fd)
                raise
        except BaseException:
            os.close(dir_fd)
            raise
    except BaseException:
        remove_entry(root_fd, name)
        raise
    return name, dir_fd, lock_fd


def new_checkpoint_id(now: datetime) -> Callable[[], str]:
    return lambda: f"{now:%Y%m%dT%H%M%S}Z-{secrets.token_hex(4)}"


def _open_lock(root_fd: int, name: str) -> int:
    """The lock fd of ingest ``name``; OSError when it has none (or is no directory)."""
    dir_fd = os.open(name, _DIR_FLAGS, dir_fd=root_fd)
    try:
        return os.open(_LOCK, os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    finally:
        os.close(dir_fd)


def _is_link(root_fd: int, name: str) -> bool:
    with contextlib.suppress(OSError):
        return stat.S_ISLNK(os.lstat(name, dir_fd=root_fd).st_mode)
    return False


def sweep_ingests(root_fd: int, grace_s: float = INGEST_GRACE_S) -> int:
    """Remove ingest and work dirs whose writer is gone; returns the bytes freed."""
    freed = 0
    now = time.time()
    with os.scandir(root_fd) as it:
        names = [e.name for e in it]
    for name in names:
        try:
            fd = _open_lock(root_fd, name)
        except OSError as err:
            # A symlink is never the store's: gone at once (unlinked, not followed).
            # Otherwise its writer died inside create_locked_dir (or it is a stray
            # file): gone after the grace period.
            with contextlib.suppress(OSError):
                stale = now - os.lstat(name, dir_fd=root_fd).st_mtime > grace_s
                if err.errno == errno.ELOOP or _is_link(root_fd, name) or stale:
                    freed += remove_entry(root_fd, name)
            continue
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                continue  # its writer is alive
            freed += remove_entry(root_fd, name)  # while locked: nobody else judges it
            log.info("removed an abandoned checkpoint ingest", extra={"checkpoint": name})
        finally:
            os.close(fd)
    return freed


def in_flight(root_fd: int, scope: str, label: str) -> list[str]:
    """Ids of the checkpoints of (scope, label) being written by a live process."""
    found: list[str] = []
    with os.scandir(root_fd) as it:
        names = sorted(e.name for e in it)
    for name in names:
        try:
            fd = _open_lock(root_fd, name)
        except OSError:
            continue
        try:
            record = load_json(os.read(fd, _MAX_LOCK_BYTES), f"ingest {name} lock")
            if not isinstance(record, dict) or (record.get("scope"), record.get("label")) != (
                scope,
                label,
            ):
                continue
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
            except BlockingIOError:
                found.append(name)  # its writer holds the lock: alive
        except errors.DataLoss:
            continue  # a lock file still being written, or not one of ours
        finally:
            os.close(fd)
    return found
