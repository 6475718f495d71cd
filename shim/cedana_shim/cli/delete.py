"""``containerd-shim-cedana-v2 -bundle B delete``: clean up after one container.

containerd runs this whenever its connection to a shim closes: after every
normal task delete, when the daemon died, after a containerd restart that
found no daemon, and when a Create failed. So it is idempotent, touches only
container ``-id`` (the pod's daemon may serve others), never talks to the
daemon, and must finish well inside containerd's 5 s cleanup timeout.

A daemon that died mid-restore leaves ``runc restore`` running: runc would
finish the restore on its own, after ``runc delete`` found nothing to delete
(runc writes the container's state at the end of a restore), and the container
would run outside containerd. So that restore is killed first: runc's process
group (runc, CRIU, CRIU's scripts) and the tasks CRIU restored, which CRIU's
death alone leaves behind (:mod:`cedana_shim.runtime.pgroup`). For a lazy
restore the recorded group is CRIU's lazy-pages daemon, still bringing the
restored tasks' memory in: it is frozen and the tasks killed before it dies
(:mod:`cedana_shim.runtime.lazy_pages`). Then the rootfs runc bound for CRIU is
unmounted, and only then does ``runc delete`` remove runc's state dir. A restore
killed before runc wrote its state leaves the container's cgroups, which runc made
first, and which ``runc delete`` does not know of: they are removed once empty.
"""

from __future__ import annotations

import os
import sys
import time

from ..bundle_state import (
    BundleState,
    clear_criu_group,
    clear_stopping,
    criu_root,
    read_criu_group,
    read_deleted,
    read_stopping,
)
from ..wire import delete_response
from .args import ShimArgs

RUNC_DELETE_TIMEOUT = 3.0
# SIGKILLed processes are gone in milliseconds; one stuck in the kernel must not
# take containerd's whole cleanup budget (runc delete needs its share).
CRIU_KILL_TIMEOUT = 1.0
# How long an application whose stop checkpoint died with the daemon gets to handle its
# signal before the forced delete (containerd gives the whole command 5 s).
STOP_GRACE = 1.5
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


def _runc_argv(state: BundleState) -> list[str]:
    """runc and the global flags the daemon ran it with."""
    argv = [state.runc_binary, "--root", state.runc_root]
    if state.systemd_cgroup:
        argv.append("--systemd-cgroup")
    return argv


def _runc_delete(state: BundleState, container_id: str) -> str:
    """``runc delete --force``; returns runc's complaint, if any, for the log."""
    argv = [*_runc_argv(state), "delete", "--force", container_id]
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


def _stop_criu(state: BundleState, bundle: str, container_id: str) -> bool:
    """Kill the ``runc restore`` or ``runc checkpoint`` a dead daemon left running, or
    the lazy-pages daemon of a lazy restore (which that group is then); whether one
    was recorded."""
    record = read_criu_group(bundle)
    if record is None:
        return False
    from ..runtime.pgroup import is_same_group, kill_criu_group

    pgid, leader_start, lazy = record
    if lazy and is_same_group(pgid, leader_start):
        # A lazy-pages daemon is its restored tasks' memory: once it dies their pages not
        # yet in read as zeros. So the group is frozen, the tasks (done restoring: runc
        # knows them) killed, and only then the group.
        _kill_tasks_first(state, pgid, container_id)
    if kill_criu_group(pgid, leader_start, CRIU_KILL_TIMEOUT):
        clear_criu_group(bundle)
        return True
    sys.stderr.write(
        f"container {container_id}: the runc/CRIU process group {pgid} still runs "
        f"{CRIU_KILL_TIMEOUT:g}s after SIGKILL (stuck in the kernel?); see `pgrep -a -g "
        f"{pgid}`, and once it is gone run `runc delete --force {container_id}`\n"
    )
    return True


def _remove_cgroups(bundle: str, container_id: str) -> None:
    """The cgroups a killed ``runc restore`` made (see the module's docstring)."""
    import json

    from ..task.cgroups import remove_cgroup

    try:
        with open(os.path.join(bundle, "config.json"), "rb") as f:
            path = (json.load(f).get("linux") or {}).get("cgroupsPath")
        left = remove_cgroup(path) if isinstance(path, str) else []
    except (OSError, ValueError, AttributeError) as err:
        sys.stderr.write(f"container {container_id}: cannot remove its cgroups: {err!r}\n")
        return
    if left:
        sys.stderr.write(f"container {container_id}: cgroups still in use, left: {left}\n")


def _kill_tasks_first(state: BundleState, pgid: int, container_id: str) -> None:
    import signal

    try:
        os.killpg(pgid, signal.SIGSTOP)
    except ProcessLookupError:
        return  # gone meanwhile: nothing is left to serve or to kill
    try:
        _run([*_runc_argv(state), "kill", "--all", container_id, "9"], RUNC_DELETE_TIMEOUT)
    except OSError as err:
        sys.stderr.write(f"container {container_id}: runc kill before its restore's: {err}\n")


def _finish_stop(state: BundleState, bundle: str, container_id: str) -> None:
    """The daemon died while it checkpointed a stopping container, which it had frozen:
    with no durable checkpoint, the application gets its stop signal after all (and
    a short grace) before the forced delete, as it would have without us."""
    sig = read_stopping(bundle)
    if sig is None:
        return
    runc = _runc_argv(state)
    try:
        _run([*runc, "resume", container_id], RUNC_DELETE_TIMEOUT)
        _run([*runc, "kill", container_id, str(sig)], RUNC_DELETE_TIMEOUT)
    except OSError as err:
        sys.stderr.write(f"container {container_id}: delivering signal {sig}: {err}\n")
        return
    pid = _read_pid(bundle)
    deadline = time.monotonic() + STOP_GRACE
    while pid > 0 and time.monotonic() < deadline and _alive(pid):
        time.sleep(0.02)
    clear_stopping(bundle)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            return f.read().rsplit(b")", 1)[1].split()[0] != b"Z"
    except (OSError, IndexError):
        return False


def _unmount(paths: list[str], container_id: str) -> None:
    from ..runtime.unmount import unmount_all

    for path in paths:
        try:
            unmount_all(path)
        except Exception as err:  # any failure here is a warning for containerd's log
            sys.stderr.write(f"unmount {path} of container {container_id}: {err}\n")


def _remove_dead_socket(bundle: str) -> None:
    """The pod's socket, when no daemon listens on it any more (a killed daemon
    cannot remove it; a live one, serving other containers, keeps it)."""
    try:
        with open(os.path.join(bundle, "address")) as f:
            address = f.read().strip()
    except OSError:
        return
    if not address.startswith("unix:///"):
        return
    from .fork_client import remove_if_refused

    remove_if_refused(address.removeprefix("unix://"))


def run_delete(args: ShimArgs) -> int:
    bundle = args.bundle or os.getcwd()
    done = read_deleted(bundle)
    if done is not None:
        # The daemon already deleted it and left the answer (which the shell launcher
        # normally prints itself: this runs under another launcher or from an old mark).
        sys.stdout.buffer.write(done)
        sys.stdout.flush()
        return 0
    state = BundleState.load(bundle, args.namespace)
    stopped = _stop_criu(state, bundle, args.id)
    _finish_stop(state, bundle, args.id)
    # Before runc delete, which removes runc's state dir, through any mount in it.
    _unmount([criu_root(state.runc_root, args.id)], args.id)
    problem = _runc_delete(state, args.id)
    if problem:
        sys.stderr.write(f"runc delete of container {args.id}: {problem}\n")
    if stopped:
        _remove_cgroups(bundle, args.id)
    # The rootfs, and anything a killed CRIU left mounted in the work dir.
    _unmount(
        [os.path.join(bundle, "rootfs"), os.path.realpath(os.path.join(bundle, "work"))], args.id
    )
    _remove_dead_socket(bundle)
    sys.stdout.buffer.write(delete_response(_read_pid(bundle), KILLED_STATUS))
    sys.stdout.flush()
    return 0
