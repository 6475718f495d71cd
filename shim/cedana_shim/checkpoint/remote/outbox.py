"""Pushes still to do, kept on disk until the registry has the checkpoint.

``<store>/outbox/<checkpoint id>``: one small JSON record per pending push (0600,
fsynced with its directory before :meth:`Outbox.add` returns), so a push that the
registry being down, a kill or a reboot interrupted is done by the next
:func:`sync`. Whoever pushes a checkpoint holds an flock on its record meanwhile:
a second process finds it busy and leaves it alone, and a pusher that dies drops
the lock with it. Unfinished blob uploads are remembered beside the records
(``outbox/uploads/``, by the registry client), so the next push resumes them.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
from collections.abc import Callable, Collection, Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import TYPE_CHECKING, Final

from cedana_shim import errors
from cedana_shim.checkpoint.store.layout import check_checkpoint_id, dump_json, format_created

if TYPE_CHECKING:
    from .remote import OnCompacted, RemoteStore

__all__ = ["Outbox", "SyncResult", "sync"]

log = logging.getLogger(__name__)

OUTBOX_DIR: Final = "outbox"
_FLAGS: Final = os.O_RDWR | os.O_NOFOLLOW | os.O_CLOEXEC


class Outbox:
    """The pending pushes of one store (see the module doc)."""

    def __init__(self, store_root: str) -> None:
        self.path = os.path.join(os.path.abspath(store_root), OUTBOX_DIR)

    def add(self, checkpoint_id: str) -> None:
        """Record a push to do; durable when this returns. Adding one twice is harmless."""
        _check_id(checkpoint_id)
        try:
            os.makedirs(self.path, mode=0o700, exist_ok=True)
            record = dump_json({"id": checkpoint_id, "added": format_created(datetime.now(UTC))})
            fd = os.open(self._record(checkpoint_id), _FLAGS | os.O_CREAT | os.O_TRUNC, 0o600)
            try:
                os.write(fd, record)
                os.fsync(fd)
            finally:
                os.close(fd)
            self._sync_dir()
        except OSError as err:
            doing = f"recording a push of checkpoint {checkpoint_id} in {self.path}"
            raise _error(err, doing) from err

    def pending(self) -> list[str]:
        """Checkpoint ids still to push, oldest first."""
        try:
            names = os.listdir(self.path)
        except FileNotFoundError:
            return []
        return sorted(n for n in names if check_checkpoint_id(n) is None)

    def done(self, checkpoint_id: str) -> None:
        """Forget a push (done, or no longer possible). Idempotent."""
        _check_id(checkpoint_id)
        try:
            os.unlink(self._record(checkpoint_id))
        except FileNotFoundError:
            return
        except OSError as err:
            raise _error(err, f"removing {self._record(checkpoint_id)}") from err
        self._sync_dir()

    @contextlib.contextmanager
    def claimed(self, checkpoint_id: str) -> Iterator[bool | None]:
        """Yield True holding the record's lock, False when another process holds it,
        None when the record is gone."""
        path = self._record(checkpoint_id)
        try:
            fd = os.open(path, _FLAGS)
        except FileNotFoundError:
            yield None
            return
        try:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                yield False
                return
            try:
                same = os.path.samestat(os.fstat(fd), os.stat(path))
            except FileNotFoundError:
                same = False  # done by whoever held the lock before us
            yield True if same else None
        finally:
            os.close(fd)

    def _record(self, checkpoint_id: str) -> str:
        return os.path.join(self.path, checkpoint_id)

    def _sync_dir(self) -> None:
        fd = os.open(self.path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def _check_id(checkpoint_id: str) -> None:
    if (why := check_checkpoint_id(checkpoint_id)) is not None:
        raise errors.InvalidArgument(why)


def _error(err: OSError, doing: str) -> errors.ShimError:
    if err.errno in (errno.ENOSPC, errno.EDQUOT):
        return errors.ResourceExhausted(f"{doing}: {err.strerror}; free space there")
    if err.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return errors.PermissionDenied(f"{doing}: {err.strerror}")
    return errors.Internal(f"{doing}: {err}")


@dataclass(frozen=True)
class SyncResult:
    """What one sync did with each pending push."""

    pushed: list[str] = field(default_factory=list)
    failed: list[tuple[str, str]] = field(default_factory=list)  # (id, why)
    busy: list[str] = field(default_factory=list)  # being pushed by another process


def sync(
    remote: RemoteStore,
    outbox: Outbox,
    *,
    only: Collection[str] | None = None,
    progress: Callable[[str, int, int], None] | None = None,
    on_compacted: OnCompacted | None = None,
    niced: bool = True,
) -> SyncResult:
    """Push every pending checkpoint (or those of ``only`` that are pending), oldest
    first (see the module doc); then keep the newest ``remote.retain`` checkpoints of
    each label it pushed in the registry. Whoever syncs (a shim, the node agent, the
    CLI), retention applies.

    ``progress(checkpoint_id, done, total)`` follows each push's bytes;
    ``on_compacted`` is told of each raw checkpoint the push compacted (``niced``, or
    at the caller's priority when a stop waits for it). A checkpoint
    no longer in the store is dropped from the outbox with a warning.
    """
    result = SyncResult()
    for checkpoint_id in outbox.pending():
        if only is not None and checkpoint_id not in only:
            continue
        with outbox.claimed(checkpoint_id) as claimed:
            if claimed is None:
                continue
            if not claimed:
                result.busy.append(checkpoint_id)
                continue
            try:
                remote.store.catalog.get(checkpoint_id)
            except errors.NotFound as err:
                log.warning("dropping a pending push: %s", err, extra={"checkpoint": checkpoint_id})
                outbox.done(checkpoint_id)
                continue
            try:
                remote.push(
                    checkpoint_id,
                    None if progress is None else _for(progress, checkpoint_id),
                    on_compacted,
                    niced=niced,
                )
            except errors.ShimError as err:
                log.warning("push failed: %s", err, extra={"checkpoint": checkpoint_id})
                result.failed.append((checkpoint_id, str(err) or type(err).__name__))
                continue
            outbox.done(checkpoint_id)
            result.pushed.append(checkpoint_id)
    if remote.retain > 0:
        _prune_labels(remote, result.pushed)
    return result


def _prune_labels(remote: RemoteStore, pushed: Collection[str]) -> None:
    """Retention in the registry for the labels of ``pushed``; never fails the sync."""
    labels = set()
    for checkpoint_id in pushed:
        with contextlib.suppress(errors.ShimError, OSError):
            entry = remote.store.catalog.get(checkpoint_id)
            labels.add((entry.scope, entry.label))
    for scope, label in sorted(labels):
        try:
            remote.prune(scope, label, remote.retain)
        except (errors.ShimError, OSError) as err:
            log.warning(
                "cannot prune the registry",
                extra={"scope": scope, "label": label, "error": str(err)},
            )


def _for(
    progress: Callable[[str, int, int], None], checkpoint_id: str
) -> Callable[[int, int], None]:
    return lambda done, total: progress(checkpoint_id, done, total)
