"""Sealing CRIU's page images while CRIU still writes them.

A stop reports its exit only once the checkpoint is durable, and a seal at
publish (rawfiles: every file fsynced and its CRC-32 read) that started only
after CRIU was done put all of it after the dump. An EarlySealer follows a dump
directory from a thread of its own while CRIU fills it: each pass starts the
writeback (sync_file_range, SYNC_FILE_RANGE_WRITE) of all that the page images
(``pages-<n>.img``, the bulk of a dump) hold by then, and then reads what they
gained since the last pass into their running CRC-32, so that the writeback runs
beside the dump instead of after it. What it has read becomes a Prefix; the seal
at publish reads only the rest of each file and its fsync finds little left to
write.

The writeback goes ahead of the reads, and passes follow each other without a
pause while each finds at least 16 MiB new: a follower that started the writeback
only of what it had read, in bounded passes, let the disk idle while CRIU wrote
faster than it, and left most of a large dump dirty for the seal's fsync. A pass
that finds less pauses, because in a slow dump every pass finds a few pages and the
follower would spin on a CPU beside CRIU. (The stop's figures, before and after:
bench/README.md and its archive.)

Not fdatasync: on ext4 each fdatasync of a file still growing commits the journal
(its size changed), and CRIU's appends wait for those commits; starting the
writeback does not.

A prefix is trusted only because CRIU appends page images and never rewrites
them; it is dropped at the seal when the file there is not the one followed
(another inode) or is shorter than what was read. A restore checks every
file's CRC anyway: a prefix gone wrong fails the restore, never passes it.

Durability comes from the seal's fsync, on a description it opens itself: a
writeback error nobody has seen yet is reported to it (the kernel's errseq), and
this follower, which never waits for writeback, sees none first. An error in
starting the writeback (or in the fdatasync used where sync_file_range is missing)
is handed on with the prefixes and the publish raises it.
"""

from __future__ import annotations

import contextlib
import os
import stat
import threading
import zlib
from collections.abc import Callable
from dataclasses import dataclass
from typing import Final, TypeAlias

from .fsutil import start_writeback

__all__ = ["EarlySealer", "Prefix"]

_PASS_INTERVAL_S: Final = 0.02  # the pause after a pass that found little new
_PASS_BYTES: Final = 64 << 20  # read per file and pass: the writeback is started that often
# A pass that read less pauses: a slow dump must not turn the follower into a busy loop
# that takes the CPU CRIU needs (at 2.7 GB/s CRIU writes this much in ~6 ms).
_BUSY_BYTES: Final = 16 << 20
_BUF: Final = 1 << 20
_DIR_FLAGS: Final = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC


@dataclass(frozen=True)
class Prefix:
    """The first ``size`` bytes of the file (``dev``, ``ino``) have CRC-32 ``crc``."""

    dev: int
    ino: int
    size: int
    crc: int


def _is_page_image(name: str) -> bool:
    return name.startswith("pages-") and name.endswith(".img")


@dataclass
class _Followed:
    fd: int
    dev: int
    ino: int
    size: int = 0
    crc: int = 0
    started: int = 0  # the writeback is started up to here


Keep: TypeAlias = Callable[[dict[str, Prefix], OSError | None], None]


class EarlySealer:
    """Follows the page images in ``directory`` until stop(); see the module doc.

    A file it could not open or read is sealed whole at publish, which reports
    any failure then; a writeback that cannot start ends the following and goes to
    ``keep``.
    """

    def __init__(self, directory: str, keep: Keep = lambda _p, _e: None) -> None:
        self._directory = directory
        self._keep = keep
        self._error: OSError | None = None
        self._files: dict[str, _Followed] = {}
        self._stopping = threading.Event()
        self._buf = bytearray(_BUF)
        self._thread = threading.Thread(target=self._run, name="cedana-early-seal", daemon=True)
        self._thread.start()

    @property
    def bytes_read(self) -> int:
        return sum(f.size for f in list(self._files.values()))

    def stop(self) -> None:
        """Ends the following (after at most one pass); ``keep`` gets what it read,
        by file name, and the writeback error that ended it if one did."""
        self._stopping.set()
        self._thread.join()
        prefixes = {
            name: Prefix(f.dev, f.ino, f.size, f.crc) for name, f in self._files.items() if f.size
        }
        for followed in self._files.values():
            with contextlib.suppress(OSError):
                os.close(followed.fd)
        self._files.clear()
        self._keep(prefixes, self._error)

    def _run(self) -> None:
        try:
            dir_fd = os.open(self._directory, _DIR_FLAGS)
        except OSError:
            return
        try:
            while self._error is None and not self._stopping.is_set():
                if self._pass(dir_fd) < _BUSY_BYTES:
                    self._stopping.wait(_PASS_INTERVAL_S)
        finally:
            os.close(dir_fd)

    def _pass(self, dir_fd: int) -> int:
        """One pass over the page images; how many bytes it read."""
        read = 0
        with contextlib.suppress(OSError):
            with os.scandir(dir_fd) as it:
                names = sorted(e.name for e in it if _is_page_image(e.name))
            files = [
                f for name in names if (f := self._files.get(name) or self._open(dir_fd, name))
            ]
            ends = [self._start_writeback(f) for f in files]
            for followed, end in zip(files, ends, strict=True):
                if self._stopping.is_set():
                    break
                read += self._read(followed, end)
        return read

    def _open(self, dir_fd: int, name: str) -> _Followed | None:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            os.close(fd)
            return None
        followed = _Followed(fd, st.st_dev, st.st_ino)
        self._files[name] = followed
        return followed

    def _start_writeback(self, f: _Followed) -> int:
        """Starts the writeback of what the file holds now; its size."""
        # What lies below the size seen now is written (appends only).
        size = os.fstat(f.fd).st_size
        if size > f.started:
            try:
                start_writeback(f.fd, f.started, size - f.started)
            except OSError as err:
                self._error = err
                raise
            f.started = size
        return size

    def _read(self, f: _Followed, size: int) -> int:
        """Reads on up to ``size`` (at most _PASS_BYTES) into the CRC; how much it read."""
        end = min(size, f.size + _PASS_BYTES)
        view = memoryview(self._buf)
        before = f.size
        while f.size < end and not self._stopping.is_set():
            n = os.preadv(f.fd, [view[: min(_BUF, end - f.size)]], f.size)
            if n <= 0:
                break
            f.crc = zlib.crc32(view[:n], f.crc)
            f.size += n
        return f.size - before
