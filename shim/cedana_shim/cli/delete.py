"""``containerd-shim-cedana-v2 -bundle B delete``: clean up after one container.

containerd runs this whenever its connection to a shim closes: after every
normal task delete, when the daemon died, after a containerd restart that
found no daemon, and when a Create failed. So it is idempotent, touches only
container ``-id`` (the pod's daemon may serve others), never talks to the
daemon, and must finish well inside containerd's 5 s cleanup timeout.
"""

from __future__ import annotations

import os
import sys

from ..bundle_state import BundleState
from ..wire import delete_response
from .args import ShimArgs

RUNC_DELETE_TIMEOUT = 3.0
KILLED_STATUS = 128 + 9


def _runc_delete(state: BundleState, container_id: str) -> str:
    """``runc delete --force``; returns runc's complaint, if any, for the log."""
    import subprocess

    argv = [state.runc_binary, "--root", state.runc_root]
    if state.systemd_cgroup:
        argv.append("--systemd-cgroup")
    argv += ["delete", "--force", container_id]
    try:
        done = subprocess.run(argv, capture_output=True, timeout=RUNC_DELETE_TIMEOUT, check=False)
    except (OSError, subprocess.TimeoutExpired) as err:
        return str(err)
    text = done.stderr.decode(errors="replace").strip()
    if done.returncode != 0 and "does not exist" not in text and "not found" not in text:
        return text or f"exit status {done.returncode}"
    return ""


def _read_pid(bundle: str) -> int:
    try:
        with open(os.path.join(bundle, "init.pid")) as f:
            return int(f.read().strip() or 0)
    except (OSError, ValueError):
        return 0


def run_delete(args: ShimArgs) -> int:
    bundle = args.bundle or os.getcwd()
    state = BundleState.load(bundle, args.namespace)
    problem = _runc_delete(state, args.id)
    if problem:
        sys.stderr.write(f"runc delete of container {args.id}: {problem}\n")
    from ..errors import ShimError
    from ..runtime.unmount import unmount_all

    try:
        unmount_all(os.path.join(bundle, "rootfs"))
    except (OSError, ShimError) as err:
        sys.stderr.write(f"unmount rootfs of container {args.id}: {err}\n")
    sys.stdout.buffer.write(delete_response(_read_pid(bundle), KILLED_STATUS))
    sys.stdout.flush()
    return 0
