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

from ..bundle_state import BundleState, read_deleted
from ..wire import delete_response
from .args import ShimArgs

RUNC_DELETE_TIMEOUT = 3.0
KILLED_STATUS = 128 + 9


def _which(name: str) -> str | None:
    if "/" in name:
        return name
    for directory in os.environ.get("PATH", "/usr/sbin:/usr/bin:/sbin:/bin").split(":"):
        path = os.path.join(directory or ".", name)
        if os.access(path, os.X_OK) and not os.path.isdir(path):
            return path
    return None


def _run(argv: list[str], timeout: float) -> tuple[int, bytes]:
    """(exit status, stderr) of ``argv``; posix_spawn, not the subprocess module,
    whose import would cost this command a third of its run time."""
    import select
    import signal

    binary = _which(argv[0])
    if binary is None:
        raise FileNotFoundError(f"{argv[0]} not found on PATH")
    r, w = os.pipe2(os.O_CLOEXEC)
    devnull = os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC)
    try:
        pid = os.posix_spawn(
            binary,
            argv,
            os.environ,
            file_actions=[
                (os.POSIX_SPAWN_DUP2, devnull, 0),
                (os.POSIX_SPAWN_DUP2, devnull, 1),
                (os.POSIX_SPAWN_DUP2, w, 2),
            ],
        )
    finally:
        os.close(w)
        os.close(devnull)
    err = b""
    try:
        while select.select([r], [], [], timeout)[0]:
            chunk = os.read(r, 65536)
            if not chunk:
                break
            err += chunk
        else:
            os.kill(pid, signal.SIGKILL)
            err += f"killed after {timeout:g}s".encode()
    finally:
        os.close(r)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status), err


def _runc_delete(state: BundleState, container_id: str) -> str:
    """``runc delete --force``; returns runc's complaint, if any, for the log."""
    argv = [state.runc_binary, "--root", state.runc_root]
    if state.systemd_cgroup:
        argv.append("--systemd-cgroup")
    argv += ["delete", "--force", container_id]
    try:
        code, stderr = _run(argv, RUNC_DELETE_TIMEOUT)
    except OSError as err:
        return str(err)
    text = stderr.decode(errors="replace").strip()
    if code != 0 and "does not exist" not in text and "not found" not in text:
        return text or f"exit status {code}"
    return ""


def _read_pid(bundle: str) -> int:
    try:
        with open(os.path.join(bundle, "init.pid")) as f:
            return int(f.read().strip() or 0)
    except (OSError, ValueError):
        return 0


def run_delete(args: ShimArgs) -> int:
    bundle = args.bundle or os.getcwd()
    done = read_deleted(bundle)
    if done is not None:
        # The normal path: the daemon already deleted it and recorded how it exited.
        sys.stdout.buffer.write(delete_response(*done))
        sys.stdout.flush()
        return 0
    state = BundleState.load(bundle, args.namespace)
    problem = _runc_delete(state, args.id)
    if problem:
        sys.stderr.write(f"runc delete of container {args.id}: {problem}\n")
    from ..runtime.unmount import unmount_all

    # The rootfs, and anything a killed CRIU left mounted in the work dir.
    for path in (os.path.join(bundle, "rootfs"), os.path.realpath(os.path.join(bundle, "work"))):
        try:
            unmount_all(path)
        except Exception as err:  # any failure here is a warning for containerd's log
            sys.stderr.write(f"unmount {path} of container {args.id}: {err}\n")
    sys.stdout.buffer.write(delete_response(_read_pid(bundle), KILLED_STATUS))
    sys.stdout.flush()
    return 0
