"""Background work (compaction) yields to the node's foreground work, across daemons.

A thread's nice value orders it only against the threads of its own autogroup:
with ``kernel.sched_autogroup_enabled`` (the default of Debian's and most
distributions' kernels) every session of the root cpu cgroup is one scheduling
entity, and each shim daemon is a session of its own. A compaction thread at
nice 10 in one daemon still got as much CPU as the CRIU restore another daemon
ran beside it for the next container of the label. So while this process runs
background work and no foreground work (a dump, a restore), its autogroup is at
nice 19 as well; the old value comes back as soon as either changes. Where the
kernel has no autogroups the file is absent, and it is empty for a process outside
the root cpu cgroup (a daemon run inside a container): then only the thread's nice
counts. Without CAP_SYS_NICE (needed to raise it back) the autogroup is left alone.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Iterator
from typing import Final

__all__ = ["autogroup_nice", "background", "foreground"]

_AUTOGROUP: Final = "/proc/self/autogroup"
_CAP_SYS_NICE: Final = 23
BACKGROUND_NICE: Final = 19

_lock = threading.Lock()
_counts = {"background": 0, "foreground": 0}
_restore_to: list[int] = []  # the autogroup's nice before we lowered it


def autogroup_nice() -> int | None:
    """This process's autogroup nice (``/autogroup-<n> nice <k>``); None: no autogroups."""
    try:
        with open(_AUTOGROUP) as f:
            return int(f.read().split()[-1])
    except (OSError, ValueError, IndexError):
        return None


def _can_raise() -> bool:
    try:
        with open("/proc/self/status") as f:
            caps = next(line for line in f if line.startswith("CapEff:"))
        return bool(int(caps.split()[1], 16) >> _CAP_SYS_NICE & 1)
    except (OSError, ValueError, IndexError, StopIteration):
        return False


def _write(nice: int) -> None:
    with contextlib.suppress(OSError), open(_AUTOGROUP, "w") as f:
        f.write(str(nice))


def _apply() -> None:
    lower = _counts["background"] > 0 and _counts["foreground"] == 0
    if lower and not _restore_to:
        current = autogroup_nice()
        if current is not None and current < BACKGROUND_NICE and _can_raise():
            _restore_to.append(current)
            _write(BACKGROUND_NICE)
    elif not lower and _restore_to:
        _write(_restore_to.pop())


@contextlib.contextmanager
def _counted(kind: str) -> Iterator[None]:
    with _lock:
        _counts[kind] += 1
        _apply()
    try:
        yield
    finally:
        with _lock:
            _counts[kind] -= 1
            _apply()


def background() -> contextlib.AbstractContextManager[None]:
    """Work that may wait: its process's autogroup goes to nice 19 while no foreground
    work runs."""
    return _counted("background")


def foreground() -> contextlib.AbstractContextManager[None]:
    """Work a user waits for: its process's autogroup keeps its priority meanwhile."""
    return _counted("foreground")
