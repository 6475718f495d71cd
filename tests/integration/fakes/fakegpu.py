"""The fake GPU node shared by the fakes in this directory (standard library only).

A test that has no GPU still drives the shim's real GPU steps: the shim daemon imports
the fake NVML (``pynvml/``, this directory first on its ``sys.path``), runs the fake
``cuda-checkpoint`` executable, and CRIU and the hooks.d hooks run ``record-event``.
They all share one JSON state file, named by ``CEDANA_FAKE_GPU_STATE`` in their
environment (the shim's, inherited from containerd's), and append what they do to
``events.jsonl`` next to it, each line stamped with ``time.monotonic()``
(CLOCK_MONOTONIC: one clock for every process of the host, so lines from different
processes can be put in order). Writers hold ``<state>.lock`` (flock).

The state file::

    {"driver": "580.65.06",            # nvmlSystemGetDriverVersion, cuda-checkpoint --help
     "cuda": 13000,                    # nvmlSystemGetCudaDriverVersion
     "gpus": [{"uuid": "GPU-...", "name": "NVIDIA H200", "memory": 150754820096,
               "pci": "00000000:19:00.0", "mig": false}, ...],
     "procs": {"<host pid>": {"state": "running", "gpus": ["GPU-..."], "memory": 123,
                              "identity": null}},
     "fail": [{"action": "checkpoint", "pid": 1234, "message": "out of memory",
               "times": 1}]}

``procs`` are the CUDA processes: NVML lists each one that is alive and not
CHECKPOINTED on each of its ``gpus``, using ``memory`` bytes there, as the real NVML
does (a checkpointed process holds no GPU context). ``cuda-checkpoint`` moves them
through the driver's states and refuses anything else (see :data:`TRANSITIONS`).

A CRIU restore gives the processes new host pids. The GPU state of a real process
travels in its memory; here it travels with its *identity*: its pid inside its own pid
namespace (CRIU restores those) and a hash of its command line and environment (CRIU
restores its memory). The first time ``cuda-checkpoint`` is asked about an unknown pid
whose identity is that of a CHECKPOINTED record whose process is gone, the record moves
to the new pid (``adopted_from`` in the event).

``fail`` rules make the next ``times`` calls of ``action`` (``get-state``, ``lock``,
``checkpoint``, ``restore``, ``unlock``) on ``pid`` (any pid when absent; a restored
process is still named by its pid at checkpoint time) fail with ``message`` and leave
the process's state as it was.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import time
from collections.abc import Iterator
from typing import Any

STATE_ENV = "CEDANA_FAKE_GPU_STATE"
EVENTS_NAME = "events.jsonl"

RUNNING = "running"
LOCKED = "locked"
CHECKPOINTED = "checkpointed"
FAILED = "failed"
# (state before, action) -> state after: the CUDA driver's rules (gpu/driver.py).
TRANSITIONS = {
    (RUNNING, "lock"): LOCKED,
    (LOCKED, "checkpoint"): CHECKPOINTED,
    (CHECKPOINTED, "restore"): LOCKED,
    (LOCKED, "unlock"): RUNNING,
}
ACTIONS = ("lock", "checkpoint", "restore", "unlock")

H200_BYTES = 150_754_820_096  # what NVML reports for an H200's 141 GB
DEFAULT_GPUS = (
    {
        "uuid": "GPU-0c6d2a44-4f0e-7a3b-9c1d-5e8f00000001",
        "name": "NVIDIA H200",
        "memory": H200_BYTES,
        "pci": "00000000:19:00.0",
        "mig": False,
    },
    {
        "uuid": "GPU-0c6d2a44-4f0e-7a3b-9c1d-5e8f00000002",
        "name": "NVIDIA H200",
        "memory": H200_BYTES,
        "pci": "00000000:3B:00.0",
        "mig": False,
    },
)


def default_state() -> dict[str, Any]:
    return {
        "driver": "580.65.06",
        "cuda": 13000,
        "gpus": [dict(g) for g in DEFAULT_GPUS],
        "procs": {},
        "fail": [],
    }


def state_path() -> str:
    path = os.environ.get(STATE_ENV)
    if not path:
        raise RuntimeError(f"{STATE_ENV} is not set: no fake GPU state to use")
    return path


def events_path(state: str) -> str:
    return os.path.join(os.path.dirname(state), EVENTS_NAME)


@contextlib.contextmanager
def locked(state: str) -> Iterator[None]:
    with open(state + ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def read_state(state: str) -> dict[str, Any]:
    """The state; written by rename, so it can be read without the lock."""
    try:
        with open(state) as f:
            data: dict[str, Any] = json.load(f)
    except FileNotFoundError:
        return default_state()
    return data


def write_state(state: str, data: dict[str, Any]) -> None:
    tmp = f"{state}.{os.getpid()}.tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)
    os.rename(tmp, state)


def append_event(state: str, event: dict[str, Any]) -> None:
    """One JSON line; the caller holds :func:`locked`."""
    event.setdefault("t", time.monotonic())
    event.setdefault("by", os.getpid())
    with open(events_path(state), "a") as f:
        f.write(json.dumps(event, sort_keys=True) + "\n")


def record(event: dict[str, Any]) -> None:
    """Append ``event`` under the lock (for processes that do nothing else)."""
    state = state_path()
    with locked(state):
        append_event(state, event)


# -- /proc ----------------------------------------------------------------------------


def _read(path: str) -> bytes | None:
    try:
        with open(path, "rb") as f:
            return f.read()
    except OSError:
        return None


def _status(pid: int) -> dict[str, str]:
    raw = _read(f"/proc/{pid}/status")
    fields: dict[str, str] = {}
    for line in (raw or b"").decode(errors="replace").splitlines():
        key, _, value = line.partition(":")
        fields[key] = value.strip()
    return fields


def alive(pid: int) -> bool:
    state = _status(pid).get("State", "")
    return bool(state) and not state.startswith(("Z", "X"))


def identity(pid: int) -> str | None:
    """Who the process is across a CRIU restore: its pid in its own pid namespace and
    a hash of its command line and environment."""
    nspid = _status(pid).get("NSpid", "").split()
    cmdline = _read(f"/proc/{pid}/cmdline")
    environ = _read(f"/proc/{pid}/environ")
    if not nspid or cmdline is None or environ is None:
        return None
    digest = hashlib.sha256(cmdline + b"\0\0" + environ).hexdigest()[:16]
    return f"{nspid[-1]}:{digest}"


def frozen(pid: int) -> bool | None:
    """Is the process's cgroup frozen (runc pause, or CRIU freezing it for a dump)?
    None when that cannot be told."""
    raw = _read(f"/proc/{pid}/cgroup")
    if raw is None:
        return None
    unified = None
    for line in raw.decode(errors="replace").splitlines():
        _, controllers, path = line.split(":", 2)
        if "freezer" in controllers.split(","):
            if path == "/":
                return False  # the root cgroup cannot be frozen
            state = _read(f"/sys/fs/cgroup/freezer{path}/freezer.state")
            if state is not None:
                return state.strip() != b"THAWED"
        if controllers == "":
            unified = path
    if unified is not None:
        for root in ("/sys/fs/cgroup/unified", "/sys/fs/cgroup"):  # hybrid, then pure v2
            events = _read(f"{root}{unified}/cgroup.events")
            if events is not None:
                return b"frozen 1" in events.splitlines()
    return None


def facts(pid: int) -> dict[str, Any]:
    """What a driver call can see of the process: does it exist, can it run."""
    status = _status(pid)
    if not status:
        return {"exists": False}
    return {
        "exists": True,
        "state": status.get("State", "?")[:1],
        "tracer": int(status.get("TracerPid", "0") or 0),
        "frozen": frozen(pid),
        "nspid": status.get("NSpid", "").split(),
        "comm": status.get("Name", ""),
    }
