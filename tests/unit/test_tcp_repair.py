"""Which sockets the stop leaves open for their peers: the TCP connections, found in
/proc/<pid>/net/tcp{,6} (readable without privileges); and when a restore keeps the
checkpoint's connections (the IP kept, or none of them leaves the container)."""

from __future__ import annotations

import os
import socket

import pytest
from cedana_shim.checkpoint.netinfo import tcp_can_live
from cedana_shim.runtime.tcp_repair import connected_tcp_inodes, tcp_summary

ADDR_X = {"interface": "eth0", "family": "ipv4", "address": "10.0.0.5", "prefixlen": 24}
ADDR_Y = {**ADDR_X, "address": "10.0.0.9"}
LEAVING = {"connections": 4, "external": 1}
WITHIN = {"connections": 4, "external": 0}


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


def test_the_summary_tells_connections_within_from_those_leaving() -> None:
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        before = tcp_summary(os.getpid())
        with socket.create_connection(server.getsockname()) as _client:
            accepted, _ = server.accept()
            with accepted:
                after = tcp_summary(os.getpid())
    assert after["connections"] - before["connections"] == 2
    assert after["external"] == before["external"]  # both ends on loopback


@pytest.mark.parametrize(
    ("before", "after", "live"),
    [
        (
            {"addresses": [ADDR_X], "tcp": {"connections": 4, "external": 1}},
            {"addresses": [ADDR_X]},
            True,
        ),
        (
            {"addresses": [ADDR_X], "tcp": {"connections": 4, "external": 1}},
            {"addresses": [ADDR_Y]},
            False,
        ),
        (
            {"addresses": [ADDR_X], "tcp": {"connections": 4, "external": 0}},
            {"addresses": [ADDR_Y]},
            True,
        ),
        ({"addresses": [ADDR_X]}, {"addresses": [ADDR_Y]}, False),  # recorded before the count
    ],
)
def test_connections_live_when_the_ip_stays_or_none_leaves(
    before: dict[str, object], after: dict[str, object], live: bool
) -> None:
    assert tcp_can_live(before, after) is live
