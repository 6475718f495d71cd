"""Jobs whose keeper died: found and killed by the next runner on the node.

The keeper kills its job whenever the task process goes (see runner.py); only the
keeper's own death (SIGKILL by hand, the OOM killer) can leave a job running
outside Slurm. Each keeper records itself in its bundle (pid and start time, so a
reused pid does not pass for it) before it creates the container; a runner
starting on the node kills and removes the containers of recorded keepers that
are gone.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
from typing import Final

from ..errors import ShimError
from ..runtime.runc import Runc
from .control import socket_path
from .job_spec import container_id_of

log = logging.getLogger(__name__)

KEEPER_FILE: Final = "keeper"


def mark_keeper(bundle: str) -> None:
    """Record this process as the keeper of ``bundle``."""
    pid = os.getpid()
    with open(os.path.join(bundle, KEEPER_FILE), "w") as f:
        f.write(f"{pid} {_running_since(pid)}\n")


def keeper_gone(bundle: str) -> bool:
    """The bundle's recorded keeper no longer runs (False when none is recorded yet:
    a keeper is still setting it up)."""
    try:
        with open(os.path.join(bundle, KEEPER_FILE)) as f:
            pid_text, _, start_text = f.read().strip().partition(" ")
        pid, start = int(pid_text), int(start_text)
    except FileNotFoundError:
        return False
    except (OSError, ValueError):
        return True  # a record cut short: its keeper died writing it
    return _running_since(pid) != start


def _running_since(pid: int) -> int | None:
    """The start time of ``pid`` if it runs: None for a zombie (a dead keeper whose
    new parent has not reaped it yet) or no process."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            stat = f.read()
        fields = stat[stat.rfind(b")") + 2 :].split()
        return None if fields[0] in (b"Z", b"X") else int(fields[19])
    except (OSError, IndexError, ValueError):
        return None


async def sweep(bundles: str, roots: str, sockets: str, runc: Runc) -> list[str]:
    """Kill and remove the job steps under ``bundles`` whose keeper is gone (their
    containers, bundles, root bind points and control sockets); their names."""
    try:
        names = sorted(os.listdir(bundles))
    except FileNotFoundError:
        return []
    swept = []
    for name in names:
        bundle = os.path.join(bundles, name)
        if not keeper_gone(bundle):
            continue
        with contextlib.suppress(ShimError, OSError):
            await runc.delete(container_id_of(name), force=True)
        shutil.rmtree(bundle, ignore_errors=True)
        with contextlib.suppress(OSError):
            os.rmdir(os.path.join(roots, name))  # never rmtree: a root bind point
        with contextlib.suppress(OSError):
            os.unlink(socket_path(name, sockets))
        log.warning("killed a Slurm job left running by a runner that died", extra={"job": name})
        swept.append(name)
    return swept


__all__ = ["keeper_gone", "mark_keeper", "sweep"]
