"""``fakes/record-event``: puts a hooks.d hook run or a CRIU action-script call in the
fake GPU event log (see ``fakegpu``), with a snapshot of every fake CUDA process's
state at that instant.

- As a hook (``"args": ["record-event", NAME]`` in a hooks.d file): reads the OCI
  state on stdin and records ``{"src": "hook", "hook": NAME, "stage", "container",
  "pid", "outcome"}``.
- As CRIU's ``action-script`` (``CRTOOLS_SCRIPT_ACTION`` in the environment): records
  ``{"src": "criu", "action", "container", "runc"}``, the container and the runc verb
  taken from the runc process that runs this CRIU.

It always exits 0: a failing action script would fail the dump, a failing precheckpoint
hook would veto it, and neither is what it is there to test. A problem is recorded as
``{"src": "record-event", "error": ...}`` instead.
"""

from __future__ import annotations

import json
import os
import sys
import traceback
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # mypy sees this directory as the package integration.fakes
    from . import fakegpu
else:  # run as a script: this directory is sys.path[0]
    import fakegpu

RUNC_VERBS = ("checkpoint", "restore")


def _argv(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return [a.decode(errors="replace") for a in f.read().split(b"\0") if a]
    except OSError:
        return []


def _ppid(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[1])
    except (OSError, IndexError, ValueError):
        return 0


def runc_ancestor() -> tuple[str, str]:
    """(runc verb, container id) of the nearest runc process above this one."""
    pid = os.getppid()
    for _ in range(8):
        argv = _argv(pid)
        if argv and os.path.basename(argv[0]) == "runc":
            verb = next((a for a in argv if a in RUNC_VERBS), "")
            return verb, argv[-1]
        pid = _ppid(pid)
        if pid <= 1:
            break
    return "", ""


def gpu_states(state: str) -> dict[str, str]:
    procs = fakegpu.read_state(state).get("procs") or {}
    return {pid: str(rec.get("state")) for pid, rec in procs.items()}


def main(argv: list[str]) -> int:
    try:
        state = fakegpu.state_path()
    except RuntimeError as err:
        sys.stderr.write(f"record-event: {err}\n")
        return 0
    try:
        event: dict[str, Any]
        action = os.environ.get("CRTOOLS_SCRIPT_ACTION")
        if action is not None:
            verb, container = runc_ancestor()
            event = {"src": "criu", "action": action, "container": container, "runc": verb}
        else:
            oci = json.load(sys.stdin)
            annotations = oci.get("annotations") or {}
            event = {
                "src": "hook",
                "hook": argv[0] if argv else "",
                "stage": annotations.get("cedana.ai/checkpoint.stage"),
                "outcome": annotations.get("cedana.ai/checkpoint.outcome"),
                "checkpoint": annotations.get("cedana.ai/checkpoint.id"),
                "container": oci.get("id"),
                "pid": oci.get("pid"),
            }
        with fakegpu.locked(state):
            event["gpu_states"] = gpu_states(state)
            fakegpu.append_event(state, event)
    except Exception:
        with fakegpu.locked(state):
            fakegpu.append_event(
                state, {"src": "record-event", "argv": argv, "error": traceback.format_exc()}
            )
    return 0
