"""CRIU's log of a failed run: the line that says why, and a copy that outlives it.

runc reports every CRIU failure as ``criu failed: type NOTIFY errno 0`` (or ``DUMP``,
``RESTORE``) and names the log in CRIU's work dir, which the caller deletes with the
container. The reason is CRIU's first error line (``Error (file:line): message``);
the ones after it are the failure unwinding, and the last is ``Dumping FAILED.``. A
few error lines CRIU prints about itself and then goes on (:data:`HARMLESS`): they
are not the reason.

The copy is the log's tail (:data:`KEEP_BYTES`), in a directory that holds at most
:data:`KEEP_FILES` of them, the oldest removed first: failures cannot fill a disk.
"""

from __future__ import annotations

import contextlib
import os
import re
import time
from typing import Final

KEEP_BYTES: Final = 64 << 10
KEEP_FILES: Final = 64
# No more of a log is read for its first error line: at runc's log level CRIU writes
# a few MiB for a large process tree, and a runaway log must not be read whole.
SCAN_BYTES: Final = 64 << 20
# CRIU raising its own RLIMIT_NOFILE: without CAP_SYS_RESOURCE it logs this as an
# error in every run and carries on with the limit it has.
HARMLESS: Final = (b"rlimit: Can't setup RLIMIT_NOFILE for self",)

_ERROR: Final = re.compile(rb"Error \([^)\n]*\): .*")


def first_error(path: str) -> str:
    """CRIU's first error line in the log at ``path``, from ``Error (`` on; ""."""
    scanned = 0
    try:
        with open(path, "rb") as f:
            for line in f:
                scanned += len(line)
                if scanned > SCAN_BYTES:
                    break
                found = _ERROR.search(line)
                if found and not any(h in line for h in HARMLESS):
                    return found.group(0).decode(errors="replace").strip()
    except OSError:
        pass
    return ""


def keep(source: str, directory: str, name: str) -> str:
    """Copy the tail of ``source`` into ``directory`` as ``<time>-<name>``, removing
    the oldest copies beyond :data:`KEEP_FILES`; the copy's path. OSError if it
    cannot be written."""
    os.makedirs(directory, mode=0o700, exist_ok=True)
    now = time.time_ns()
    stamp = time.strftime("%Y%m%dT%H%M%S", time.gmtime(now // 10**9))
    path = os.path.join(directory, f"{stamp}.{now % 10**9:09d}Z-{name}")
    with open(source, "rb") as f:
        f.seek(max(0, os.fstat(f.fileno()).st_size - KEEP_BYTES))
        tail = f.read(KEEP_BYTES)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        os.write(fd, tail)
    finally:
        os.close(fd)
    _bound(directory, KEEP_FILES)
    return path


def _bound(directory: str, limit: int) -> None:
    """The names start with the time: sorted, the oldest come first."""
    names = sorted(os.listdir(directory))
    for old in names[: max(0, len(names) - limit)]:
        with contextlib.suppress(FileNotFoundError):  # another shim pruned it meanwhile
            os.unlink(os.path.join(directory, old))
