"""The ``start`` side of the fork server protocol, and the socket helpers it shares.

Everything here runs inside ``start``, once per container on containerd's
critical path, so it uses the C-level ``_socket`` and ``_struct`` modules: the
``socket`` module alone costs ~7 ms of import (enum conversions, selectors),
more than the rest of ``start`` together.

Wire format (unix stream socket, root only): the client sends, with its file
descriptors attached (SCM_RIGHTS: the shim's ``start`` sends its listener; each
kind of server says what it expects), one request frame — ``MAGIC``, a u32 count
of strings, each string as u32 length + UTF-8 (surrogateescape) bytes:
``cwd, argc, *argv, *env as KEY=VALUE`` — then the raw ``start`` stdin until it
shuts down its write side. The server answers ``pid <N>`` or ``error <text>``.
A newer server sends ``CHECK_MAGIC`` alone instead: the server answers
``current``, or ``retiring`` and exits, when its code is no longer installed.
"""

from __future__ import annotations

import _socket
import _struct
import errno
import os
import sys
import time

TYPE_CHECKING = False  # collections.abc costs ~1.5 ms: start/delete are hot
if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

MAGIC = b"CDNFS1\0"
CHECK_MAGIC = b"CDNFS1-check\0"
# A unix socket bound this recently may still be on its way to listen(): never
# taken for a dead one.
STALE_SOCKET_AGE = 2.0
CONNECT_TIMEOUT = 0.5
REPLY_TIMEOUT = 5.0
U32 = _struct.Struct(">I")
FD = _struct.Struct("=i")  # SCM_RIGHTS carries native ints
SCM_RIGHTS = 1


class ForkServerUnavailable(Exception):
    pass


def _encode(text: str) -> bytes:
    data = text.encode("utf-8", "surrogateescape")
    return U32.pack(len(data)) + data


def encode_request(argv: Sequence[str], cwd: str, env: Mapping[str, str]) -> bytes:
    fields = [cwd, str(len(argv)), *argv, *(f"{k}={v}" for k, v in env.items())]
    return MAGIC + U32.pack(len(fields)) + b"".join(_encode(f) for f in fields)


def decode_request(data: bytes) -> tuple[list[str], str, dict[str, str], bytes]:
    """(argv, cwd, env, stdin) from a whole request; ValueError when malformed."""
    if not data.startswith(MAGIC):
        raise ValueError("not a fork request")
    pos = len(MAGIC)
    (count,) = U32.unpack_from(data, pos)
    pos += 4
    fields: list[str] = []
    for _ in range(count):
        (size,) = U32.unpack_from(data, pos)
        pos += 4
        if pos + size > len(data):
            raise ValueError("truncated fork request")
        fields.append(data[pos : pos + size].decode("utf-8", "surrogateescape"))
        pos += size
    if len(fields) < 2 or not fields[1].isdigit() or len(fields) < 2 + int(fields[1]):
        raise ValueError("malformed fork request")
    argc = int(fields[1])
    argv = fields[2 : 2 + argc]
    env = dict(item.partition("=")[::2] for item in fields[2 + argc :])
    return argv, fields[0], env, data[pos:]


def unix_socket() -> _socket.socket:
    return _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM | _socket.SOCK_CLOEXEC)


def answers(path: str, timeout: float = CONNECT_TIMEOUT) -> bool:
    """Does something accept connections on the unix socket at ``path``?"""
    probe = unix_socket()
    probe.settimeout(timeout)
    try:
        probe.connect(path)
        return True
    except OSError:
        return False
    finally:
        probe.close()


def remove_if_refused(path: str) -> bool:
    """Remove the unix socket at ``path`` if nothing listens on it; True if removed.

    Only a refused connection counts (a busy listener with a full backlog keeps
    its socket), and only for a socket bound more than ``STALE_SOCKET_AGE``
    seconds ago (a fresh one may be between bind() and listen()). The file is
    removed only if it is still the one that refused.
    """
    try:
        before = os.stat(path)
    except OSError:
        return False
    if time.time() - before.st_ctime < STALE_SOCKET_AGE:
        return False
    probe = unix_socket()
    probe.settimeout(CONNECT_TIMEOUT)
    try:
        probe.connect(path)
        return False
    except OSError as err:
        if err.errno != errno.ECONNREFUSED:
            return False
    finally:
        probe.close()
    try:
        if os.stat(path).st_ino != before.st_ino:
            return False
        os.unlink(path)
    except OSError:
        return False
    return True


def read_all(conn: _socket.socket, limit: int) -> bytes:
    chunks: list[bytes] = []
    size = 0
    while True:
        data = conn.recv(65536)
        if not data:
            return b"".join(chunks)
        size += len(data)
        if size > limit:
            raise OSError("message too large")
        chunks.append(data)


def request_fork(
    path: str,
    fds: Sequence[int],
    argv: Sequence[str],
    cwd: str,
    env: Mapping[str, str],
    stdin: bytes,
) -> int:
    """Ask the fork server at ``path`` for a daemon (or whatever its kind forks),
    handing it ``fds``; returns the forked process's pid."""
    conn = unix_socket()
    try:
        conn.settimeout(CONNECT_TIMEOUT)
        try:
            conn.connect(path)
        except OSError as err:
            raise ForkServerUnavailable(str(err)) from err
        conn.settimeout(REPLY_TIMEOUT)
        rights = [(_socket.SOL_SOCKET, SCM_RIGHTS, b"".join(FD.pack(fd) for fd in fds))]
        conn.sendmsg([encode_request(argv, cwd, env)], rights)
        conn.sendall(stdin)
        conn.shutdown(_socket.SHUT_WR)
        reply = read_all(conn, 4096).decode(errors="replace")
    except OSError as err:
        raise ForkServerUnavailable(str(err)) from err
    finally:
        conn.close()
    word, _, rest = reply.partition(" ")
    if word == "pid" and rest.isdigit():
        return int(rest)
    raise ForkServerUnavailable(rest if word == "error" else f"bad reply {reply[:100]!r}")


# Bytes of command line the server's daemons can show as their titles (see
# proctitle): a title can only reuse the argv area it was started with.
TITLE_ROOM = 512
# The server imports exactly what this process imports, however it was started (the
# node's launcher runs `python -IS` with a path of its own): isolated, no site, and
# this process's sys.path. Otherwise it could run other code than its socket names.
SERVER_BOOTSTRAP = (
    "import os, sys; sys.path[:] = sys.argv[2].split(os.pathsep); "
    "from cedana_shim.cli.forkserver import serve; sys.exit(serve(sys.argv[1]))"
)


def spawn_server(path: str, *, orphan: bool = False) -> None:
    """Start a fork server in the background, detached from the caller.

    ``orphan``: through an intermediate process that exits at once, so that the
    server is not a descendant of a caller that lives on (a Slurm task process: Slurm
    signals a step's whole process tree)."""
    if orphan:
        middle = os.fork()
        if middle == 0:
            code = 0
            try:
                spawn_server(path)
            except BaseException:
                code = 1
            finally:
                os._exit(code)
        os.waitpid(middle, 0)
        return
    search = os.pathsep.join(entry for entry in sys.path if entry)
    argv = [sys.executable, "-IS", "-c", SERVER_BOOTSTRAP, path, search]
    room = TITLE_ROOM - sum(len(arg.encode()) + 1 for arg in argv)
    if room > 1:
        argv.append(" " * (room - 1))  # ignored by the server; blank in `ps` until retitled
    devnull = os.open(os.devnull, os.O_RDWR)
    try:
        os.posix_spawn(
            sys.executable,
            argv,
            dict(os.environ),
            file_actions=[(os.POSIX_SPAWN_DUP2, devnull, fd) for fd in (0, 1, 2)],
            setsid=True,
        )
    finally:
        os.close(devnull)
