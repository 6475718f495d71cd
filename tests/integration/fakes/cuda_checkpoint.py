"""The fake ``cuda-checkpoint`` (run as ``fakes/cuda-checkpoint``): the command lines and
outputs of NVIDIA's tool (driver 580) that ``cedana_shim.gpu.driver_cli`` speaks::

    cuda-checkpoint --help
    cuda-checkpoint --get-state --pid N                 prints running|locked|checkpointed|failed
    cuda-checkpoint --action lock --pid N --timeout MS
    cuda-checkpoint --action checkpoint|unlock --pid N
    cuda-checkpoint --action restore --pid N [--device-map OLD=NEW,...]

A refused or failed call exits 1 and prints ``Could not <action> on process ID N:
"<CUDA error string>"``, as the real tool does. Per-pid state lives in the shared state
file (see ``fakegpu``); every call, refused or not, is appended to the event log with
what it saw of the process.

It enforces what the real driver would: the process exists; it is a CUDA process; only
the driver's transitions (lock from RUNNING, checkpoint from LOCKED, restore from
CHECKPOINTED, unlock from LOCKED); a process that is frozen or stopped (runc pause,
CRIU's freeze, ptrace) cannot be driven at all (the real lock waits for its GPU work
and times out); a restore without a device map needs the process's GPUs present, and a
device map must name all of them and point at present GPUs. Each refusal is marked
``violation`` in the event: the tests assert the shim never causes one.
"""

from __future__ import annotations

import os
import sys
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # mypy sees this directory as the package integration.fakes
    from . import fakegpu
else:  # run as a script: this directory is sys.path[0]
    import fakegpu

HELP = """CUDA checkpoint and restore utility.
Version {version}. Copyright (C) 2025 NVIDIA Corporation. All rights reserved.

Operations:
--get-state --pid <pid>
--action lock | checkpoint | restore | unlock --pid <pid> [--timeout <ms>] [--device-map <uuids>]
--toggle --pid <pid>
--get-restore-tid --pid <pid>
"""

NOT_CUDA = "OS call failed or operation not supported on this OS"
ILLEGAL_STATE = "the operation cannot be performed in the present state"
TIMED_OUT = "the wait operation has timed out"
BAD_MAP = "invalid device map"
NO_DEVICE = "invalid device ordinal"


class Usage(Exception):
    pass


def _parse(argv: list[str]) -> dict[str, Any]:
    """The one command line the shim may send; anything else is a usage error."""
    args: dict[str, Any] = {}
    rest = list(argv)
    while rest:
        flag = rest.pop(0)
        if flag == "--get-state":
            args["call"] = "get-state"
            continue
        if flag not in ("--action", "--pid", "--timeout", "--device-map") or not rest:
            raise Usage(f"unexpected argument {flag!r}")
        key = flag.removeprefix("--")
        if key in args:
            raise Usage(f"{flag} given twice")
        args[key] = rest.pop(0)
    if "action" in args:
        if "call" in args:
            raise Usage("--get-state and --action together")
        if args["action"] not in fakegpu.ACTIONS:
            raise Usage(f"unknown action {args['action']!r}")
        args["call"] = args.pop("action")
    if "call" not in args or "pid" not in args:
        raise Usage("needs --get-state or --action, and --pid")
    if not args["pid"].isdigit():
        raise Usage(f"--pid {args['pid']!r} is not a pid")
    args["pid"] = int(args["pid"])
    if args["call"] == "lock":
        if not args.get("timeout", "").isdigit() or int(args["timeout"]) <= 0:
            raise Usage("lock needs a positive --timeout (0 would wait forever)")
        args["timeout"] = int(args["timeout"])
    elif "timeout" in args:
        raise Usage(f"--timeout with {args['call']}")
    if "device-map" in args and args["call"] != "restore":
        raise Usage(f"--device-map with {args['call']}")
    return args


def _device_map(text: str) -> dict[str, str]:
    pairs = [item.split("=", 1) for item in text.split(",")]
    if not text or any(len(p) != 2 or not p[0] or not p[1] for p in pairs):
        raise ValueError(text)
    return {old: new for old, new in pairs}


def _find(data: dict[str, Any], pid: int) -> tuple[dict[str, Any] | None, int | None]:
    """The record of ``pid``, adopting a restored process's record (see fakegpu)."""
    procs: dict[str, Any] = data["procs"]
    rec = procs.get(str(pid))
    if rec is not None:
        if rec.get("identity") is None:
            rec["identity"] = fakegpu.identity(pid)
        return rec, None
    who = fakegpu.identity(pid)
    if who is None:
        return None, None
    for key, candidate in list(procs.items()):
        if (
            candidate.get("identity") == who
            and candidate["state"] == fakegpu.CHECKPOINTED
            and not fakegpu.alive(int(key))
        ):
            del procs[key]
            procs[str(pid)] = candidate
            candidate["adopted_from"] = int(key)
            return candidate, int(key)
    return None, None


def _injected(data: dict[str, Any], call: str, pid: int, rec: dict[str, Any]) -> str | None:
    """The message of the first live ``fail`` rule for this call; a rule's pid also
    names the process after a restore (its record's ``adopted_from``)."""
    for rule in data.get("fail") or []:
        if rule.get("action") != call:
            continue
        if rule.get("pid", pid) not in (pid, rec.get("adopted_from")):
            continue
        if rule.get("times", 1) <= 0:
            continue
        rule["times"] = rule.get("times", 1) - 1
        return str(rule.get("message", "unknown error"))
    return None


def _run(data: dict[str, Any], args: dict[str, Any], event: dict[str, Any]) -> str:
    """Apply one call to ``data``; returns stdout, raises ``_Refused`` with the CUDA
    error string."""
    call, pid = args["call"], args["pid"]
    seen = fakegpu.facts(pid)
    event["facts"] = seen
    if not seen["exists"]:
        raise _Refused(NOT_CUDA)
    rec, adopted_from = _find(data, pid)
    event["adopted_from"] = adopted_from
    if rec is None:
        event["not_cuda"] = True
        raise _Refused(NOT_CUDA)
    event["identity"] = rec.get("identity")
    event["before"] = rec["state"]
    message = _injected(data, call, pid, rec)
    if message is not None:
        event["injected"] = True
        raise _Refused(message)
    if call == "get-state":
        return str(rec["state"]) + "\n"
    if seen["frozen"] or seen["state"] in ("T", "t") or seen["tracer"]:
        event["violation"] = f"{call} of a frozen or stopped process ({seen})"
        raise _Refused(TIMED_OUT)
    after = fakegpu.TRANSITIONS.get((rec["state"], call))
    if after is None:
        event["violation"] = f"{call} from {rec['state']}"
        raise _Refused(ILLEGAL_STATE)
    if call == "restore":
        present = {g["uuid"] for g in data["gpus"]}
        used = list(rec["gpus"])
        if "device-map" in args:
            try:
                mapping = _device_map(args["device-map"])
            except ValueError:
                event["violation"] = f"malformed device map {args['device-map']!r}"
                raise _Refused(BAD_MAP) from None
            event["device_map"] = mapping
            if any(u not in mapping for u in used) or any(
                new not in present for new in mapping.values()
            ):
                event["violation"] = f"device map {mapping} does not fit {used} -> {present}"
                raise _Refused(BAD_MAP)
            rec["gpus"] = [mapping[u] for u in used]
        elif any(u not in present for u in used):
            event["violation"] = f"restore onto absent GPUs {used} (present {sorted(present)})"
            raise _Refused(NO_DEVICE)
    rec["state"] = after
    event["after"] = after
    return ""


class _Refused(Exception):
    pass


def main(argv: list[str]) -> int:
    state = fakegpu.state_path()
    started = time.monotonic()
    event: dict[str, Any] = {
        "src": "cuda-checkpoint",
        "argv": argv,
        "t0": started,
        "caller": os.getppid(),
    }
    if argv in (["--help"], ["-h"]):
        data = fakegpu.read_state(state)
        sys.stdout.write(HELP.format(version=data.get("driver", "580.65.06")))
        with fakegpu.locked(state):
            fakegpu.append_event(state, {**event, "call": "help", "rc": 0})
        return 0
    try:
        args = _parse(argv)
    except Usage as usage:
        with fakegpu.locked(state):
            fakegpu.append_event(
                state, {**event, "call": "usage", "rc": 2, "violation": f"usage: {usage}"}
            )
        sys.stderr.write(f"cuda-checkpoint: {usage}\n")
        return 2
    call, pid = args["call"], args["pid"]
    event.update(call=call, pid=pid, timeout_ms=args.get("timeout"))
    verb = "get state of" if call == "get-state" else f"{call} on"
    with fakegpu.locked(state):
        data = fakegpu.read_state(state)
        try:
            out = _run(data, args, event)
            rc, err = 0, ""
        except _Refused as refused:
            out, rc, err = "", 1, f'Could not {verb} process ID {pid}: "{refused}"\n'
        fakegpu.write_state(state, data)
        event.update(rc=rc, out=out.strip(), error=err.strip())
        fakegpu.append_event(state, event)
    sys.stdout.write(out)
    sys.stdout.write(err)  # the real tool prints its errors on stdout
    return rc
