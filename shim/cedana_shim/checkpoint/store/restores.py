"""What was restored from each checkpoint, and when: one small append-only record per
checkpoint, written by the shim that restored it, read by `cedana checkpoints inspect`.

Layout: ``restores/<id>.jsonl`` under the store root (0700 dir, 0600 files), one JSON
object per line, oldest first. A file that would grow past :data:`RECORD_FILE_MAX`
is renamed to ``<id>.jsonl.old`` (replacing the previous one) and a new one begun, so
a checkpoint restored thousands of times holds at most two files of that size. A line
that cannot be read (torn by a crash, or not ours) is skipped by the reader.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import stat
from collections.abc import Mapping
from typing import Any, Final

from cedana_shim import errors

from . import fsutil
from .core import StoreCore
from .layout import check_checkpoint_id

__all__ = ["RECORD_FILE_MAX", "RESTORES_DIR", "RestoreRecords", "sweep_records"]

RESTORES_DIR: Final = "restores"
RECORD_FILE_MAX: Final = 64 << 10  # bytes per file; two files per checkpoint at most
_LINE_MAX: Final = 2048  # one record, after its strings are cut to _VALUE_MAX
_VALUE_MAX: Final = 256
_APPEND: Final = os.O_RDWR | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC
_SUFFIXES: Final = (".jsonl", ".jsonl.old")


def _bounded(value: Any) -> Any:
    if isinstance(value, str):
        return value[:_VALUE_MAX]
    if isinstance(value, bool | int | float) or value is None:
        return value
    return str(value)[:_VALUE_MAX]


class RestoreRecords:
    """The store's restore records (see the module doc)."""

    def __init__(self, core: StoreCore) -> None:
        self._core = core

    def record_restore(self, checkpoint_id: str, record: Mapping[str, Any]) -> None:
        """Append ``record`` (flat: strings, numbers, booleans) to the checkpoint's
        restore records, durably."""
        if (why := check_checkpoint_id(checkpoint_id)) is not None:
            raise errors.InvalidArgument(why)
        line = json.dumps(
            {str(k)[:64]: _bounded(v) for k, v in record.items()}, sort_keys=True
        ).encode()
        if len(line) >= _LINE_MAX:
            raise errors.InvalidArgument(
                f"restore record of checkpoint {checkpoint_id} is {len(line)} bytes, "
                f"over {_LINE_MAX}"
            )
        name = f"{checkpoint_id}.jsonl"
        path = self._core.path(RESTORES_DIR, name)
        try:
            with self._core.opened_dir(RESTORES_DIR, create=True) as dir_fd:
                fd = self._open_append(dir_fd, name, path)
                try:
                    fcntl.flock(fd, fcntl.LOCK_EX)
                    size = os.fstat(fd).st_size
                    if size + len(line) + 2 > RECORD_FILE_MAX:
                        os.replace(name, f"{name}.old", src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
                        os.close(fd)
                        fd = self._open_append(dir_fd, name, path)
                        size = 0
                    # A line torn by a crash stays alone on its line.
                    torn = size > 0 and os.pread(fd, 1, size - 1) != b"\n"
                    fsutil.write_all(fd, (b"\n" if torn else b"") + line + b"\n")
                    os.fsync(fd)
                finally:
                    os.close(fd)
                os.fsync(dir_fd)
        except OSError as err:
            raise self._core.os_error(err, f"recording a restore in {path}") from err

    @staticmethod
    def _open_append(dir_fd: int, name: str, path: str) -> int:
        try:
            fd = os.open(name, _APPEND, 0o600, dir_fd=dir_fd)
        except OSError as err:
            if err.errno == errno.ELOOP:
                raise errors.DataLoss(f"{path} is a symbolic link; refusing to write it") from None
            raise
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise errors.DataLoss(f"{path} is not a regular file; refusing to write it")
        return fd

    def restores(self, checkpoint_id: str) -> list[dict[str, Any]]:
        """The checkpoint's restore records, oldest first; empty when it has none."""
        if (why := check_checkpoint_id(checkpoint_id)) is not None:
            raise errors.InvalidArgument(why)
        found: list[dict[str, Any]] = []
        for name in (f"{checkpoint_id}.jsonl.old", f"{checkpoint_id}.jsonl"):
            path = self._core.path(RESTORES_DIR, name)
            try:
                with self._core.opened_dir(RESTORES_DIR) as dir_fd:
                    data = fsutil.read_file_at(dir_fd, name, RECORD_FILE_MAX + _LINE_MAX, path=path)
            except FileNotFoundError:
                continue
            except fsutil.TooLarge as err:
                raise errors.DataLoss(str(err)) from None
            except OSError as err:
                raise self._core.os_error(err, f"reading {path}") from err
            for line in data.splitlines():
                with contextlib.suppress(ValueError):
                    item = json.loads(line)
                    if isinstance(item, dict):
                        found.append(item)
        return found


def sweep_records(root_fd: int, keep: set[str]) -> int:
    """Remove the records of checkpoints not in ``keep``; returns the bytes freed.
    The caller holds the index lock (nothing else removes records)."""
    freed = 0
    try:
        dir_fd = fsutil.open_dir(root_fd, RESTORES_DIR, path=RESTORES_DIR)
    except FileNotFoundError:
        return 0
    try:
        for name in os.listdir(dir_fd):
            checkpoint_id = next(
                (name.removesuffix(s) for s in _SUFFIXES if name.endswith(s)), name
            )
            if checkpoint_id not in keep:
                freed += fsutil.remove_entry(dir_fd, name)
    finally:
        os.close(dir_fd)
    return freed
