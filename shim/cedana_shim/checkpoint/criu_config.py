"""The CRIU configuration file runc hands to CRIU for an opted-in container.

runc has flags for only some CRIU options; for the rest it reads the file named
by the ``org.criu.config`` annotation in the container's config.json (settings
there override runc's own RPC options). The shim points that annotation at
``<bundle>/cedana-criu.conf`` when it creates an opted-in container and rewrites
the file before every dump and restore with what that operation needs.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
from collections.abc import Mapping
from typing import Any

from ..config import NodeConfig
from ..errors import Internal
from ..runtime.pgroup import start_time

ANNOTATION = "org.criu.config"
FILE_NAME = "cedana-criu.conf"


def config_path(bundle: str) -> str:
    return os.path.join(bundle, FILE_NAME)


def dump_options(config: NodeConfig, *, track_mem: bool = False) -> list[str]:
    """Options runc has no flag for (tcp-established, ext-unix-sk and file-locks go
    through runc's own flags)."""
    return [
        # Files unlinked while open (common in pods: log rotation, temp files).
        "link-remap",
        # Data still in flight on half-open connections is not ours to save.
        "skip-in-flight",
        # Clear the soft-dirty bits after the dump: the next one can write only what
        # changed (dirty_tracking.py). runc sets it itself only with a parent.
        *(["track-mem"] if track_mem else []),
        *_extra(config),
    ]


def restore_options(
    config: NodeConfig, *, keep_tcp: bool, gate: str = "", netns_setup: str = ""
) -> list[str]:
    # Established connections survive only when the pod kept its IP; otherwise
    # CRIU closes them cleanly and the application sees a reset, not a hang.
    tcp = [] if keep_tcp and config.tcp_established else ["tcp-close"]
    # A gate script holds CRIU before it resumes the restored tasks (see write_gate);
    # the netns setup script brings up lo in a private netns (see write_netns_setup).
    scripts = [f"action-script {path}" for path in (netns_setup, gate) if path]
    return [*tcp, *scripts, *_extra(config)]


NETNS_SETUP_SCRIPT = """#!/bin/sh
# Written by cedana-shim: CRIU runs it at each restore step. Once the restored
# container's namespaces exist (setup-namespaces: before any socket is restored),
# it brings up lo in the container's private network namespace, as runc does for a
# fresh container. CRIU restores a namespace's links only when the dump recorded
# them, and on current kernels it records none for a container's namespace: without
# this, lo stays down with no address, a socket bound to 127.0.0.1 cannot be
# restored and nothing in the container reaches a local server.
[ "$CRTOOLS_SCRIPT_ACTION" = "setup-namespaces" ] || exit 0
PATH=/usr/sbin:/usr/bin:/sbin:/bin
exec nsenter --net="/proc/$CRTOOLS_INIT_PID/ns/net" ip link set lo up
"""
NETNS_SETUP_FILE = "cedana-netns-setup.sh"


def private_netns(spec: Mapping[str, Any]) -> bool:
    """Whether the container gets a network namespace of its own (no path to join):
    a `ctr run` container without --net-host. A pod's (the sandbox's) and the host's
    are joined by path and are never touched."""
    linux = spec.get("linux")
    namespaces = linux.get("namespaces") if isinstance(linux, Mapping) else None
    for ns in namespaces if isinstance(namespaces, list) else []:
        if isinstance(ns, Mapping) and ns.get("type") == "network":
            return not ns.get("path")
    return False


def write_netns_setup(bundle: str, spec: Mapping[str, Any]) -> str:
    """The setup-namespaces action script (NETNS_SETUP_SCRIPT), written to ``bundle``
    for a container with a private network namespace; "" for any other."""
    if not private_netns(spec):
        return ""
    path = os.path.join(bundle, NETNS_SETUP_FILE)
    if "'" in path or any(c.isspace() for c in path):
        raise ValueError(f"unsupported path for a CRIU action script: {path!r}")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o700)
    with os.fdopen(fd, "w") as f:
        f.write(NETNS_SETUP_SCRIPT)
    return path


GATE_TEMPLATE = """#!/bin/sh
# Written by cedana-shim for one restore: CRIU runs it at each restore step; at
# post-restore (everything restored, nothing resumed yet) it waits for the shim's
# verdict on the images CRIU read, and a bad one makes CRIU abort the restore and
# kill the restored tasks before any of them runs again. (A failing pre-resume
# script is only logged by CRIU, so the gate cannot sit there.) Without a verdict
# it gives up the same way at the restore's deadline (wall clock: each turn of the
# loop costs more than its sleep), and at once when the shim that wrote it is gone
# (pid {owner_pid}, started at tick {owner_start}: a reused pid starts later).
[ "$CRTOOLS_SCRIPT_ACTION" = "post-restore" ] || exit 0
while [ ! -e '{verdict}' ]; do
  [ "$(date +%s)" -lt {deadline} ] || exit 1
  read -r owner 2>/dev/null </proc/{owner_pid}/stat || exit 1
  set -- ${{owner##*) }}
  [ "${{20}}" = {owner_start} ] || exit 1
  sleep 0.01
done
[ "$(cat '{verdict}')" = ok ]
"""


def write_gate(directory: str, timeout: float) -> tuple[str, str]:
    """A CRIU action script that blocks post-restore until ``verdict`` says ok.

    Returns (script path, verdict path); write "ok" (or anything else) to the
    verdict file with :func:`give_verdict`. The script gives up (CRIU aborts the
    restore) ``timeout`` seconds from now, or as soon as this process is gone.
    """
    script = os.path.join(directory, "cedana-gate.sh")
    verdict = os.path.join(directory, "cedana-verdict")
    for path in (script, verdict):
        if "'" in path:
            raise ValueError(f"unsupported path for a CRIU action script: {path!r}")
    owner_pid = os.getpid()
    owner_start = start_time(owner_pid)
    if owner_start is None:
        raise Internal(f"cannot read the start time of pid {owner_pid} in /proc")
    with contextlib.suppress(FileNotFoundError):
        os.unlink(verdict)
    text = GATE_TEMPLATE.format(
        verdict=verdict,
        deadline=int(time.time() + timeout),
        owner_pid=owner_pid,
        owner_start=owner_start,
    )
    fd = os.open(script, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o700)
    with os.fdopen(fd, "w") as f:
        f.write(text)
    return script, verdict


def give_verdict(verdict: str, ok: bool) -> None:
    tmp = verdict + ".tmp"
    with open(tmp, "w") as f:
        f.write("ok" if ok else "bad")
    os.rename(tmp, verdict)


def _extra(config: NodeConfig) -> list[str]:
    return [line.strip() for line in config.criu_config_extra.splitlines() if line.strip()]


def write(bundle: str, options: list[str]) -> str:
    path = config_path(bundle)
    tmp = path + ".tmp"
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write("".join(f"{option}\n" for option in options))
    os.rename(tmp, path)
    return path


def annotate_spec(bundle: str, spec: dict[str, Any]) -> bool:
    """Point the bundle's config.json at our CRIU config; False if the user set their own."""
    annotations = spec.setdefault("annotations", {})
    if not isinstance(annotations, dict):
        return False
    if ANNOTATION in annotations and annotations[ANNOTATION] != config_path(bundle):
        return False
    annotations[ANNOTATION] = config_path(bundle)
    _rewrite_spec(bundle, spec)
    return True


def _rewrite_spec(bundle: str, spec: Mapping[str, Any]) -> None:
    path = os.path.join(bundle, "config.json")
    tmp = path + ".cedana.tmp"
    st = os.stat(path)
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, st.st_mode & 0o777)
    with os.fdopen(fd, "w") as f:
        json.dump(spec, f)
    os.rename(tmp, path)
