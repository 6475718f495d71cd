"""Socket helpers shared by the test tiers."""

from __future__ import annotations

import socket


def closed_by_peer(sock: socket.socket) -> bool:
    """Whether the other end has closed ``sock`` (an end of file or a reset), without
    waiting: a connection still open and silent is False."""
    sock.settimeout(0)
    try:
        return sock.recv(1) == b""
    except BlockingIOError:
        return False
    except ConnectionResetError:
        return True
