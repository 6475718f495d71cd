"""A warm template process that forks shim daemons on request.

Starting a Python daemon cold costs ~80 ms of imports (asyncio, protobuf, the
task service) on the critical path of every pod start; the runc shim's whole
``ctr run`` takes about as long. The fork server imports everything once and
forks a ready daemon in about a millisecond. It is an optimisation only:
``start`` falls back to forking the daemon itself when no server answers, and
then starts one in the background for the next container.

The client side and the wire format are in :mod:`.fork_client`, which
``start`` imports without this module's heavier imports.

The server stays single-threaded (forking a threaded process is unsafe) and
exits after ``CEDANA_FORKSERVER_IDLE`` seconds (default 3600) without requests.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import struct
import sys
from collections.abc import Mapping

from .args import ShimArgs, UsageError, parse_args
from .fork_client import answers, decode_request, read_all

TYPE_CHECKING = False  # typing costs ~10 ms of import on the start path
if TYPE_CHECKING:
    from typing import NoReturn

REQUEST_LIMIT = 16 << 20
IDLE_DEFAULT = 3600.0


def become_daemon(listener_fd: int, cwd: str, env: Mapping[str, str]) -> None:
    """Detach the current (freshly forked) process and give it the shim's fd layout."""
    os.setsid()
    os.chdir(cwd)
    os.environ.clear()
    os.environ.update(env)
    if listener_fd != 3:
        os.dup2(listener_fd, 3)
        os.close(listener_fd)
    os.set_inheritable(3, False)
    # Nothing may keep containerd's start pipes open: it waits for their EOF.
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    if devnull > 2:
        os.close(devnull)
    for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)
    # What `pgrep containerd-shim` finds, as with the runc shim (comm is 15 bytes).
    set_process_name("containerd-shim")


def set_process_name(name: str) -> None:
    try:
        with open("/proc/self/comm", "w") as f:
            f.write(name[:15])
    except OSError:
        pass


def run_forked_daemon(
    listener_fd: int, cwd: str, env: Mapping[str, str], args: ShimArgs, stdin: bytes
) -> NoReturn:
    """Body of a freshly forked daemon; never returns."""
    code = 1
    try:
        become_daemon(listener_fd, cwd, env)
        from .daemon import run_daemon

        code = run_daemon(args, stdin)
    except BaseException:
        _report_crash(args)
    finally:
        os._exit(code)


def _report_crash(args: ShimArgs) -> None:
    """stderr is /dev/null by now: leave the traceback in containerd's log."""
    import traceback

    from ..log import open_log_fifo

    fd = open_log_fifo(os.getcwd())
    if fd is None:
        return
    line = json.dumps(
        {
            "level": "fatal",
            "msg": "shim daemon crashed",
            "container": args.id,
            "error": traceback.format_exc(),
        }
    )
    with contextlib.suppress(OSError):
        os.write(fd, line.encode() + b"\n")


def _serve_one(server: socket.socket, conn: socket.socket) -> None:
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    _, uid, _ = struct.unpack("3i", creds)
    if uid != os.geteuid():
        return
    conn.settimeout(5.0)
    first, fds, _, _ = socket.recv_fds(conn, 65536, 4)
    try:
        if len(fds) != 1:
            raise ValueError(f"expected one listener fd, got {len(fds)}")
        argv, cwd, env, stdin = decode_request(first + read_all(conn, REQUEST_LIMIT))
        args = parse_args(argv)
    except (ValueError, struct.error, UsageError) as err:
        conn.sendall(f"error bad request: {err}".encode())
        for fd in fds:
            os.close(fd)
        return
    pid = os.fork()
    if pid == 0:
        server.close()
        conn.close()
        run_forked_daemon(fds[0], cwd, env, args, stdin)
    os.close(fds[0])
    conn.sendall(f"pid {pid}".encode())


def serve(path: str) -> int:
    # Import everything a daemon needs now, so forked children start warm.
    from . import daemon  # noqa: F401
    from .paths import ensure_private_dir

    ensure_private_dir(os.path.dirname(path))
    # Not the bundle of whichever container happened to start us: it gets deleted.
    os.chdir("/")
    set_process_name("cedana-forksrv")
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        server.bind(path)
    except OSError:
        if answers(path):
            return 0  # another server owns it
        os.unlink(path)  # left by a server that was killed
        server.bind(path)
    os.chmod(path, 0o600)
    server.listen(64)
    # Auto-reap forked daemons; they reset this to the default.
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)
    server.settimeout(float(os.environ.get("CEDANA_FORKSERVER_IDLE", IDLE_DEFAULT)))
    try:
        while True:
            try:
                conn, _ = server.accept()
            except TimeoutError:
                return 0
            with conn, contextlib.suppress(OSError):  # one broken client must not stop us
                _serve_one(server, conn)
    finally:
        if os.path.exists(path):
            os.unlink(path)
        server.close()


if __name__ == "__main__":
    sys.exit(serve(sys.argv[1]))
