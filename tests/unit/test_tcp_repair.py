"""Which sockets the stop leaves open for their peers: the TCP connections, found in
/proc/<pid>/net/tcp{,6} (readable without privileges)."""

from __future__ import annotations

import os
import socket

from cedana_shim.runtime.tcp_repair import connected_tcp_inodes


def _inode(sock: socket.socket) -> int:
    return os.fstat(sock.fileno()).st_ino


def test_connections_are_found_listeners_are_not() -> None:
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        with socket.create_connection(server.getsockname()) as client:
            accepted, _ = server.accept()
            with accepted:
                found = connected_tcp_inodes(os.getpid())
                assert {_inode(client), _inode(accepted)} <= found
                assert _inode(server) not in found


def test_ipv6_connections_are_found() -> None:
    with socket.socket(socket.AF_INET6) as server:
        server.bind(("::1", 0))
        server.listen()
        with socket.create_connection(server.getsockname()[:2]) as client:
            accepted, _ = server.accept()
            with accepted:
                assert _inode(client) in connected_tcp_inodes(os.getpid())
