"""Checkpoints that failed: their verification or their restore. One small record each,
so that later restores try them after every other candidate, and retention never
keeps one of them in place of a good checkpoint (:func:`failed_last`, used by both).

Layout: ``failures/<id>.json`` under the store root (0700 dir, 0600 files), replaced
atomically: ``{"id", "tag", "why", "failedAt"}``. ``tag`` is the registry tag of a
checkpoint that came from the registry: the restore removes a pulled checkpoint that
failed from the store again, and the record, keyed by that tag, makes the same tag
rank last at the next start instead of being pulled first again (a good checkpoint
that happens to share the id, under another tag, is not affected). A restore that
succeeds clears its checkpoint's record.

Records of checkpoints the store no longer has are kept only when they name a tag,
the newest :data:`MAX_REMOTE_RECORDS` of them; the others go with the checkpoint
(every sweep, under the index lock).
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from typing import Final, TypeVar

from cedana_shim import errors

from . import fsutil, gc
from .core import StoreCore
from .layout import check_checkpoint_id, dump_json, load_json

__all__ = [
    "FAILURES_DIR",
    "Failure",
    "FailureRecords",
    "failed_last",
    "has_failed",
    "sweep_failures",
]

FAILURES_DIR: Final = "failures"
MAX_REMOTE_RECORDS: Final = 256
_RECORD_MAX: Final = 4096
_WHY_MAX: Final = 1024
_SUFFIX: Final = ".json"
_TMP_PREFIX: Final = ".tmp-"
_TMP_GRACE_S: Final = 3600.0  # a temp file this old was left by a writer that died
T = TypeVar("T")

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Failure:
    checkpoint_id: str
    tag: str  # its registry tag when it was pulled; "" for one taken on this node
    why: str
    failed_at: str


def has_failed(failures: Mapping[str, Failure], checkpoint_id: str, tag: str | None = None) -> bool:
    """Whether ``checkpoint_id`` failed, as found under registry tag ``tag`` when given:
    a record of one of this store's own checkpoints (no tag) names it under any tag, a
    record of a pulled one only under its own."""
    found = failures.get(checkpoint_id)
    return found is not None and (tag is None or not found.tag or found.tag == tag)


def failed_last(items: Iterable[T], failed: Callable[[T], bool]) -> list[T]:
    """``items`` (in order of preference, e.g. newest first) with those that failed
    moved after all others, each part in its order."""
    return sorted(items, key=failed)  # stable: False before True


class FailureRecords:
    """The store's failure records (see the module doc)."""

    def __init__(self, core: StoreCore) -> None:
        self._core = core

    def record_failure(self, checkpoint_id: str, why: str, *, tag: str = "") -> None:
        """Record that ``checkpoint_id`` failed and why, durably."""
        if (problem := check_checkpoint_id(checkpoint_id)) is not None:
            raise errors.InvalidArgument(problem)
        record = {
            "id": checkpoint_id,
            "tag": tag[:256],
            "why": why[:_WHY_MAX],
            "failedAt": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
        path = self._core.path(FAILURES_DIR, checkpoint_id + _SUFFIX)
        try:
            with self._core.opened_dir(FAILURES_DIR, create=True) as dir_fd:
                fsutil.write_file_atomic(
                    dir_fd, checkpoint_id + _SUFFIX, dump_json(record), tmp_prefix=_TMP_PREFIX
                )
        except OSError as err:
            raise self._core.os_error(err, f"recording a failed checkpoint in {path}") from err

    def clear_failure(self, checkpoint_id: str) -> None:
        """Forget that ``checkpoint_id`` failed (it was restored since)."""
        if (problem := check_checkpoint_id(checkpoint_id)) is not None:
            raise errors.InvalidArgument(problem)
        try:
            with self._core.opened_dir(FAILURES_DIR) as dir_fd:
                fsutil.remove_entry(dir_fd, checkpoint_id + _SUFFIX)
                os.fsync(dir_fd)
        except FileNotFoundError:
            pass
        except OSError as err:
            raise self._core.os_error(
                err, f"clearing the failure record of {checkpoint_id}"
            ) from err

    def failures(self) -> Mapping[str, Failure]:
        """Every failure record, by checkpoint id. A record that cannot be read is
        skipped, and none at all when the directory cannot be (logged): candidates and
        retention then go by age alone, as before records existed."""
        try:
            with self._core.opened_dir(FAILURES_DIR) as dir_fd:
                return _read_all(dir_fd, self._core.path(FAILURES_DIR))
        except FileNotFoundError:
            return {}
        except (OSError, errors.DataLoss) as err:
            log.warning("cannot read the failed checkpoints' records: %s", err)
            return {}


def _read_all(dir_fd: int, path: str) -> dict[str, Failure]:
    found: dict[str, Failure] = {}
    for name in os.listdir(dir_fd):
        checkpoint_id = name.removesuffix(_SUFFIX)
        if not name.endswith(_SUFFIX) or check_checkpoint_id(checkpoint_id) is not None:
            continue
        try:
            data = fsutil.read_file_at(dir_fd, name, _RECORD_MAX, path=os.path.join(path, name))
            item = load_json(data, name)
        except (OSError, fsutil.TooLarge, errors.DataLoss):
            continue  # torn by a crash, or not ours
        if isinstance(item, dict) and item.get("id") == checkpoint_id:
            found[checkpoint_id] = Failure(
                checkpoint_id,
                str(item.get("tag") or ""),
                str(item.get("why") or ""),
                str(item.get("failedAt") or ""),
            )
    return found


def sweep_failures(root_fd: int, keep: set[str]) -> int:
    """Remove the records of checkpoints not in ``keep``, but for the newest
    MAX_REMOTE_RECORDS that name a tag; returns the bytes freed. The caller holds
    the index lock."""
    try:
        dir_fd = fsutil.open_dir(root_fd, FAILURES_DIR, path=FAILURES_DIR)
    except FileNotFoundError:
        return 0
    freed = gc.sweep_stale_files(dir_fd, _TMP_PREFIX, time.time() - _TMP_GRACE_S)
    try:
        records = _read_all(dir_fd, FAILURES_DIR)
        remote: list[tuple[float, str]] = []
        for name in os.listdir(dir_fd):
            checkpoint_id = name.removesuffix(_SUFFIX)
            if name.startswith(_TMP_PREFIX) or checkpoint_id in keep:
                continue
            record = records.get(checkpoint_id)
            if record is None or not record.tag:
                freed += fsutil.remove_entry(dir_fd, name)
                continue
            with contextlib.suppress(FileNotFoundError):
                st = os.lstat(name, dir_fd=dir_fd)
                if stat.S_ISREG(st.st_mode):
                    remote.append((st.st_mtime, name))
        for _, name in sorted(remote, reverse=True)[MAX_REMOTE_RECORDS:]:
            freed += fsutil.remove_entry(dir_fd, name)
    finally:
        os.close(dir_fd)
    return freed
