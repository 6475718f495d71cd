"""A warm template process that forks shim daemons (or Slurm job keepers) on request.

Starting a Python daemon cold costs ~80 ms of imports (asyncio, protobuf, the
task service) on the critical path of every pod start; the runc shim's whole
``ctr run`` takes about as long. The fork server imports everything once and
forks a ready daemon in about a millisecond. It is an optimisation only:
``start`` falls back to forking the daemon itself when no server answers, and
then starts one in the background for the next container.

The client side and the wire format are in :mod:`.fork_client`, which
``start`` imports without this module's heavier imports. Between requests the
server keeps a spare (:mod:`.spare`): a child forked ahead of time that has made
its event loop and waits for the next request, so that a daemon costs containerd
no fork at all.

Kinds. What a server forks is named in its socket: ``forkserver-<fingerprint>.sock``
forks shim daemons; ``forkserver-<kind>-<fingerprint>.sock`` forks what the
:class:`Template` of that kind forks (``slurm``: the keepers of Slurm jobs, see
:mod:`.slurm_template`). The lifecycle below is the same for every kind.

``ps`` shows the server as ``containerd-shim-cedana-v2 template`` and each
daemon it forks under containerd's usual shim command line (:mod:`.proctitle`).

Lifecycle. The server stays single-threaded (forking a threaded process is
unsafe) and handles one request at a time, so whatever ends it takes effect
between requests, never while it forks a daemon. It serves on
``forkserver-<code fingerprint>.sock`` and exits, removing that socket (if it is
still its own):

- after ``CEDANA_FORKSERVER_IDLE`` seconds (default 3600) without requests;
- once its code is no longer what is installed (an upgrade, a reinstall): a new
  server asks every other one in the run dir to check itself as soon as it
  listens, and an idle server checks on its own every ``CURRENCY_CHECK`` seconds.
  Servers of another install that is still on disk stay;
- on SIGTERM, SIGINT or SIGHUP.

A new server also removes the sockets in the run dir that nothing listens on
(servers and daemons that were SIGKILLed cannot remove their own).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import struct
import sys
import time
from collections.abc import Mapping

from .args import ShimArgs, UsageError, parse_args
from .fork_client import (
    CHECK_MAGIC,
    REPLY_TIMEOUT,
    answers,
    decode_request,
    read_all,
    remove_if_refused,
    unix_socket,
)
from .proctitle import SHIM_NAME, daemon_title, set_name, set_title
from .spare import Spare

TYPE_CHECKING = False  # typing costs ~10 ms of import on the start path
if TYPE_CHECKING:
    import asyncio
    from collections.abc import Sequence
    from types import FrameType
    from typing import NoReturn

REQUEST_LIMIT = 16 << 20
MAX_FDS = 8
IDLE_DEFAULT = 3600.0
CURRENCY_CHECK = 60.0
# A spare is forked once the server has had no request for this long: not while the
# daemon just handed out (and containerd) need the CPU on the pod's critical path.
SPARE_DELAY = 0.25
SOCKET_PREFIX, SOCKET_SUFFIX = "forkserver-", ".sock"
TEMPLATE_NAME = "cedana-template"  # comm: not counted by `pgrep containerd-shim`


def become_daemon(listener_fd: int, cwd: str, env: Mapping[str, str], args: ShimArgs) -> None:
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
    # What `ps` and `pgrep containerd-shim` find, as with the runc shim.
    set_title(daemon_title(args))
    set_name(SHIM_NAME)


def run_forked_daemon(
    listener_fd: int,
    cwd: str,
    env: Mapping[str, str],
    args: ShimArgs,
    stdin: bytes,
    runner: asyncio.Runner | None = None,
) -> NoReturn:
    """Body of a freshly forked daemon (``runner``: its event loop, made by a spare
    before the request came); never returns."""
    code = 1
    try:
        become_daemon(listener_fd, cwd, env, args)
        from .daemon import run_daemon

        code = run_daemon(args, stdin, runner)
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


class ForkRequest:
    """One request as a template gets it: what the client sent, the descriptors it
    attached, and who it is (SO_PEERCRED)."""

    __slots__ = ("argv", "cwd", "env", "fds", "peer_pid", "stdin")

    def __init__(
        self,
        argv: list[str],
        cwd: str,
        env: dict[str, str],
        stdin: bytes,
        fds: Sequence[int],
        peer_pid: int,
    ) -> None:
        self.argv, self.cwd, self.env, self.stdin = argv, cwd, env, stdin
        self.fds, self.peer_pid = list(fds), peer_pid


class Template:
    """What one kind of server forks. The server calls ``warm_up`` once, ``check`` for
    every request (ValueError refuses it, before any fork), then ``run`` in the forked
    child, which never returns; the server closes the request's descriptors itself."""

    title: tuple[str, ...] = (SHIM_NAME, "template")
    comm = TEMPLATE_NAME
    # Keep a spare forked ahead of the next request (cli/spare.py), which runs
    # prepare() while nobody waits.
    keeps_spare = True
    _runner: asyncio.Runner | None = None

    def warm_up(self) -> None:
        """Import everything a child needs now, so forked children start warm."""
        from . import daemon  # noqa: F401

    def prepare(self) -> None:
        """In a spare, before its request: what every child of this kind does first."""
        from .daemon import LISTENER_FD, prepare_daemon

        # become_daemon puts the listener at fd 3: /dev/null holds that number until
        # then (when it is free), so that the loop's descriptors get other numbers.
        placeholder = os.open(os.devnull, os.O_RDONLY)  # the lowest free number
        if placeholder != LISTENER_FD:
            os.close(placeholder)
        self._runner = prepare_daemon()

    def check(self, request: ForkRequest) -> object:
        if len(request.fds) != 1:
            raise ValueError(f"expected one listener fd, got {len(request.fds)}")
        try:
            return parse_args(request.argv)
        except UsageError as err:
            raise ValueError(str(err)) from None

    def run(self, request: ForkRequest, checked: object) -> NoReturn:
        assert isinstance(checked, ShimArgs)
        run_forked_daemon(
            request.fds[0], request.cwd, request.env, checked, request.stdin, self._runner
        )


def template_for(kind: str) -> Template:
    """The template a server of ``kind`` forks from ("" is the shim's)."""
    if kind == "slurm":
        from .slurm_template import KeeperTemplate

        return KeeperTemplate()
    if kind:
        raise ValueError(f"no fork server template of kind {kind!r}")
    return Template()


class _Lifecycle:
    """A stop signal ends the server between requests, never while it forks: a start
    left without its reply would fork a second daemon for the same socket."""

    busy = False
    stop_requested = False

    def on_signal(self, signum: int, frame: FrameType | None) -> None:
        if self.busy:
            self.stop_requested = True
        else:
            raise SystemExit(0)


class _Spares:
    """At most one spare (cli/spare.py), forked between requests, for the next one."""

    def __init__(self, template: Template, server: socket.socket) -> None:
        self.template, self.server = template, server
        self.spare: Spare | None = None
        self._not_before = 0.0

    def wanted(self) -> bool:
        return (
            self.template.keeps_spare
            and self.spare is None
            and time.monotonic() >= self._not_before
        )

    def refill(self) -> None:
        if self.wanted():
            try:
                self.spare = Spare.fork(self.template, self.server)
            except OSError:
                # No fork now (out of processes or memory): requests are forked for
                # as before, and the next spare is tried a while later.
                self._not_before = time.monotonic() + CURRENCY_CHECK

    def take(self) -> Spare | None:
        spare, self.spare = self.spare, None
        return spare

    def close(self) -> None:
        """Let the spare go (it exits); in a forked child, just drop the server's end."""
        if self.spare is not None:
            self.spare.close()
            self.spare = None


def _serve_one(
    server: socket.socket,
    conn: socket.socket,
    fingerprint: str,
    template: Template,
    spares: _Spares,
) -> bool:
    """Answer one request; True when this server must retire."""
    creds = conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    peer_pid, uid, _ = struct.unpack("3i", creds)
    if uid != os.geteuid():
        return False
    conn.settimeout(5.0)
    first, fds, _, _ = socket.recv_fds(conn, 65536, MAX_FDS)
    try:
        if first.startswith(CHECK_MAGIC):
            current = is_current(fingerprint)
            conn.sendall(b"current" if current else b"retiring")
            return not current
        try:
            data = first + read_all(conn, REQUEST_LIMIT)
            argv, cwd, env, stdin = decode_request(data)
            request = ForkRequest(argv, cwd, env, stdin, fds, peer_pid)
            checked = template.check(request)
        except (ValueError, struct.error) as err:
            conn.sendall(f"error bad request: {err}".encode())
            return False
        spare = spares.take()
        if spare is not None and spare.hand(peer_pid, data, fds):
            conn.sendall(f"pid {spare.pid}".encode())
            return False
        pid = os.fork()
        if pid == 0:
            server.close()
            conn.close()
            spares.close()
            template.run(request, checked)
        conn.sendall(f"pid {pid}".encode())
        return False
    finally:
        for fd in fds:  # the child has its own copies
            with contextlib.suppress(OSError):
                os.close(fd)


def fingerprint_of(path: str) -> str:
    """The code fingerprint a fork server socket is named after ("" if none)."""
    return _name_parts(path)[1]


def kind_of(path: str) -> str:
    """The kind of server a socket is named for ("" for the shim's own)."""
    return _name_parts(path)[0]


def _name_parts(path: str) -> tuple[str, str]:
    name = os.path.basename(path)
    if name.startswith(SOCKET_PREFIX) and name.endswith(SOCKET_SUFFIX):
        kind, _, fingerprint = name[len(SOCKET_PREFIX) : -len(SOCKET_SUFFIX)].rpartition("-")
        return kind, fingerprint
    return "", ""


def is_current(fingerprint: str) -> bool:
    """Is the code installed now the code this server runs?"""
    from .paths import code_fingerprint

    try:
        return code_fingerprint() == fingerprint
    except OSError:  # the package is gone (mid-reinstall or removed)
        return False


def ask_to_check(path: str) -> str:
    """Ask the server at ``path`` whether its code is still current; its answer
    ("current" or "retiring"), or "" when it does not answer."""
    conn = unix_socket()
    conn.settimeout(REPLY_TIMEOUT)
    try:
        conn.connect(path)
        conn.sendall(CHECK_MAGIC)
        conn.shutdown(socket.SHUT_WR)
        return read_all(conn, 64).decode(errors="replace")
    except OSError:
        return ""
    finally:
        conn.close()


def sweep_run_dir(run_dir: str, own: str) -> None:
    """Retire the other servers whose code was replaced; remove dead sockets."""
    with contextlib.suppress(OSError):
        for name in os.listdir(run_dir):
            path = os.path.join(run_dir, name)
            if path == own or not fingerprint_of(path):
                continue
            if not remove_if_refused(path):
                ask_to_check(path)
    daemons = os.path.join(run_dir, "s")
    with contextlib.suppress(OSError):
        for name in os.listdir(daemons):
            remove_if_refused(os.path.join(daemons, name))


def _serve_forever(
    server: socket.socket,
    fingerprint: str,
    idle: float,
    lifecycle: _Lifecycle,
    template: Template,
) -> None:
    spares = _Spares(template, server)
    try:
        last_request = last_check = time.monotonic()
        while True:
            now = time.monotonic()
            if now - last_request >= idle:
                return
            if spares.wanted() and now - last_request >= SPARE_DELAY:
                lifecycle.busy = True
                try:
                    spares.refill()
                finally:
                    lifecycle.busy = False
                if lifecycle.stop_requested:
                    return
                continue
            wake = min(last_request + idle, last_check + CURRENCY_CHECK)
            if spares.wanted():
                wake = min(wake, last_request + SPARE_DELAY)
            server.settimeout(max(wake - now, 0.001))
            try:
                conn, _ = server.accept()
            except TimeoutError:
                if time.monotonic() - last_check >= CURRENCY_CHECK:
                    if not is_current(fingerprint):
                        return
                    last_check = time.monotonic()
                continue
            lifecycle.busy = True
            retire = False
            try:
                with conn, contextlib.suppress(OSError):  # one broken client must not stop us
                    retire = _serve_one(server, conn, fingerprint, template, spares)
            finally:
                lifecycle.busy = False
            if retire or lifecycle.stop_requested:
                return
            last_request = time.monotonic()
    finally:
        lifecycle.busy = True  # a stop signal now must not cut the clean-up short
        spares.close()


def serve(path: str) -> int:
    from .paths import ensure_private_dir

    template = template_for(kind_of(path))
    template.warm_up()
    fingerprint = fingerprint_of(path)
    if not is_current(fingerprint):
        return 0  # the code changed since `start` named this server: serve nothing old
    ensure_private_dir(os.path.dirname(path))
    # Not the bundle of whichever container happened to start us: it gets deleted.
    os.chdir("/")
    set_title(list(template.title))
    set_name(template.comm)
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        server.bind(path)
    except OSError:
        if answers(path):
            server.close()
            return 0  # another server owns it
        os.unlink(path)  # left by a server that was killed
        server.bind(path)
    owner, inode = os.getpid(), os.stat(path).st_ino
    lifecycle = _Lifecycle()
    try:
        for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(sig, lifecycle.on_signal)
        os.chmod(path, 0o600)
        server.listen(64)
        # Auto-reap forked daemons; they reset this to the default.
        signal.signal(signal.SIGCHLD, signal.SIG_IGN)
        sweep_run_dir(os.path.dirname(path), path)
        idle = float(os.environ.get("CEDANA_FORKSERVER_IDLE", IDLE_DEFAULT))
        _serve_forever(server, fingerprint, idle, lifecycle, template)
    finally:
        server.close()
        # A forked child that never reached its own exit path must not take the
        # socket, nor may this server take one a newer server bound since.
        if os.getpid() == owner:
            with contextlib.suppress(OSError):
                if os.stat(path).st_ino == inode:
                    os.unlink(path)
    return 0


if __name__ == "__main__":
    sys.exit(serve(sys.argv[1]))
