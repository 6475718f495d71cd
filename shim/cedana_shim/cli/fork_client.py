"""The ``start`` side of the fork server protocol, and the socket helpers it shares.

Everything here runs inside ``start``, once per container on containerd's
critical path, so it uses the C-level ``_socket`` and ``_struct`` modules: the
``socket`` module alone costs ~7 ms of import (enum conversions, selectors),
more than the rest of ``start`` together.

Wire format (unix stream socket, root only): the client sends, with the
listener fd attached (SCM_RIGHTS), one request frame — ``MAGIC``, a u32 count
of strings, each string as u32 length + UTF-8 (surrogateescape) bytes:
``cwd, argc, *argv, *env as KEY=VALUE`` — then the raw ``start`` stdin until it
shuts down its write side. The server answers ``pid <N>`` or ``error <text>``.
"""

from __future__ import annotations

import _socket
import _struct
import os
import sys

TYPE_CHECKING = False  # collections.abc costs ~1.5 ms: start/delete are hot
if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

MAGIC = b"CDNFS1\0"
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
    listener_fd: int,
    argv: Sequence[str],
    cwd: str,
    env: Mapping[str, str],
    stdin: bytes,
) -> int:
    """Ask the fork server at ``path`` for a daemon; returns its pid."""
    conn = unix_socket()
    try:
        conn.settimeout(CONNECT_TIMEOUT)
        try:
            conn.connect(path)
        except OSError as err:
            raise ForkServerUnavailable(str(err)) from err
        conn.settimeout(REPLY_TIMEOUT)
        rights = [(_socket.SOL_SOCKET, SCM_RIGHTS, FD.pack(listener_fd))]
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


def spawn_server(path: str) -> None:
    """Start a fork server in the background, detached from the caller."""
    devnull = os.open(os.devnull, os.O_RDWR)
    try:
        os.posix_spawn(
            sys.executable,
            [sys.executable, "-m", "cedana_shim.cli.forkserver", path],
            dict(os.environ),
            file_actions=[(os.POSIX_SPAWN_DUP2, devnull, fd) for fd in (0, 1, 2)],
            setsid=True,
        )
    finally:
        os.close(devnull)
