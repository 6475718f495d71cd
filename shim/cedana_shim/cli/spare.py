"""A spare: the child a fork server forks *before* its next request, ready to become
what that request asks for.

A daemon forked from the warm server at request time still pays, on containerd's
critical path, for the fork, for the copy-on-write faults of its first touches of
the server's memory and for its event loop, between the request and the first RPC it
can answer. A spare pays for them while nobody waits. A server whose
:class:`~.forkserver.Template` keeps spares forks one as soon as it listens and
again after each request it handed to one; the spare runs the template's ``prepare``
and waits on a socketpair. The server hands it the next request (the frame and the
descriptors, as the client sent them) and answers the client with the spare's pid
once the spare has taken it; a spare that is gone or does not take it in time is
killed, and the server forks for that request as before. A spare exits when the
server's end of the pair closes (the server exited, retired or was killed): every
other process the server forks closes it first.

``ps`` shows a spare as ``containerd-shim-cedana-v2 template spare``, named
``cedana-spare``: neither a template nor a shim daemon to ``pgrep``.
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import signal
import socket

from .fork_client import decode_request, read_all
from .proctitle import set_name, set_title

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import NoReturn

    from .forkserver import ForkRequest, Template

SPARE_NAME = "cedana-spare"
HAND_OFF_TIMEOUT = 1.0  # the spare only reads the request and answers
REQUEST_LIMIT = 16 << 20
MAX_FDS = 8
TAKEN = b"taken"


class Spare:
    """The server's side: the spare's pid and the server's end of the pair."""

    def __init__(self, pid: int, conn: socket.socket) -> None:
        self.pid = pid
        self.conn = conn

    @classmethod
    def fork(cls, template: Template, server: socket.socket) -> Spare:
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
        pid = os.fork()
        if pid == 0:
            server.close()
            ours.close()
            # Out of the way of the descriptor numbers the child is to use (a shim
            # daemon takes its listener at fd 3).
            low = theirs.detach()
            high = fcntl.fcntl(low, fcntl.F_DUPFD_CLOEXEC, 10)
            os.close(low)
            _wait_for_request(socket.socket(fileno=high), template)
        theirs.close()
        return cls(pid, ours)

    def hand(self, peer_pid: int, request: bytes, fds: list[int]) -> bool:
        """Give the spare this request; False when it did not take it (it is then
        killed, and the request is the server's to fork for)."""
        taken = False
        try:
            self.conn.settimeout(HAND_OFF_TIMEOUT)
            header = f"{peer_pid}\n".encode()
            socket.send_fds(self.conn, [header], fds)
            self.conn.sendall(request)
            self.conn.shutdown(socket.SHUT_WR)
            taken = read_all(self.conn, len(TAKEN)) == TAKEN
        except OSError:
            pass
        finally:
            self.close()
        if not taken:
            with contextlib.suppress(OSError):
                os.kill(self.pid, signal.SIGKILL)
        return taken

    def close(self) -> None:
        """The server's end: closing it (without a request) lets the spare exit."""
        self.conn.close()


def _wait_for_request(conn: socket.socket, template: Template) -> NoReturn:
    """The spare's body: prepare, wait for a request (or the server's end), run it."""
    try:
        taken = _take_request(conn, template)
    except BaseException:
        os._exit(1)
    if taken is None:
        os._exit(0)  # the server is gone or retired: nothing to become
    template.run(*taken)


def _take_request(conn: socket.socket, template: Template) -> tuple[ForkRequest, object] | None:
    # The server's stop handler is for the server; a spare is simply ended.
    for sig in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
        signal.signal(sig, signal.SIG_DFL)
    set_title([*template.title, "spare"])
    set_name(SPARE_NAME)
    template.prepare()
    data, fds, _, _ = socket.recv_fds(conn, 4096, MAX_FDS)
    if not data:
        return None
    while b"\n" not in data:
        more = conn.recv(4096)
        if not more:
            raise OSError("the server hung up in the middle of a hand-off")
        data += more
    peer, _, rest = data.partition(b"\n")
    rest += read_all(conn, REQUEST_LIMIT)
    # Taken as soon as it is all here: the server decoded and checked these very
    # bytes with the same code before it handed them over.
    conn.sendall(TAKEN)
    conn.close()
    argv, cwd, env, stdin = decode_request(rest)
    from .forkserver import ForkRequest

    request = ForkRequest(argv, cwd, env, stdin, fds, int(peer))
    return request, template.check(request)
