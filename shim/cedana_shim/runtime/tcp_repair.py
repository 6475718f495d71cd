"""Ending a checkpointed container without ending its TCP connections for the peers.

After a stop's checkpoint is durable the container is killed. A killed process's
connected TCP sockets send FIN (or RST) to their peers, so a restore that keeps the
IP (host network, the same pod sandbox) would bring back connections their peers
already took as closed: they read EOF. CRIU avoids this when it ends the tasks
itself: it leaves their sockets in TCP repair mode, where closing one sends nothing
and leaves no orphan. The stop dumps with leave-running instead (a checkpoint that
fails before it is durable must let the container run on), and CRIU takes the
sockets out of repair mode again. So, between the durable point and the kill, every
connected TCP socket of the still frozen container goes back into repair mode
through a duplicate of its fd (``pidfd_getfd``, Linux >= 5.6), and the kill ends
them silently. What is not covered: a peer that sends in the gap before the restore
gets a reset from the kernel (no socket there any more); a restore onto another IP
closes the connections on the container's side (CRIU's tcp-close) and the peer
finds out by its own timeout, as when the node itself goes away.
"""

from __future__ import annotations

import ctypes
import errno
import os
import socket

TCP_REPAIR = 19  # linux/tcp.h
_SYS_PIDFD_GETFD = 438  # the same number on every architecture (unified table)
# /proc/net/tcp "st" values that are not a connection: LISTEN, CLOSE.
_NOT_CONNECTED = frozenset({"0A", "07"})


def _connections(pid: int) -> list[tuple[int, bytes]]:
    """(inode, local address bytes) of the TCP connections in ``pid``'s network
    namespace (/proc/<pid>/net/tcp{,6}; listeners and closed sockets left out)."""
    found: list[tuple[int, bytes]] = []
    for table in ("tcp", "tcp6"):
        try:
            with open(f"/proc/{pid}/net/{table}") as f:
                lines = f.read().splitlines()[1:]
        except FileNotFoundError:
            continue  # no IPv6 in this kernel
        for line in lines:
            fields = line.split()
            if len(fields) > 9 and fields[3] not in _NOT_CONNECTED and fields[9].isdigit():
                found.append((int(fields[9]), _address(fields[1].split(":")[0])))
    return [(inode, local) for inode, local in found if inode]


def _address(hex_address: str) -> bytes:
    """The kernel prints each 32-bit word of an address in host (little-endian) order."""
    raw = bytes.fromhex(hex_address)
    return b"".join(raw[i : i + 4][::-1] for i in range(0, len(raw), 4))


def connected_tcp_inodes(pid: int) -> set[int]:
    """Socket inodes of the TCP connections in ``pid``'s network namespace."""
    return {inode for inode, _ in _connections(pid)}


def tcp_summary(pid: int) -> dict[str, int]:
    """How many TCP connections ``pid``'s network namespace holds, and how many of them
    leave it (a local address other than loopback): connections within the container
    can be restored whatever address its new pod gets."""
    connections = _connections(pid)
    external = sum(1 for _, local in connections if not _loopback(local))
    return {"connections": len(connections), "external": external}


def _loopback(address: bytes) -> bool:
    v4 = address[12:] if address[:12] == b"\0" * 10 + b"\xff\xff" else address
    if len(v4) == 4:
        return v4[0] == 127
    return address == b"\0" * 15 + b"\x01"


def _socket_fds(pid: int, wanted: set[int]) -> list[tuple[int, int]]:
    """(fd, inode) of ``pid``'s open fds that are sockets in ``wanted``."""
    found = []
    try:
        names = os.listdir(f"/proc/{pid}/fd")
    except (FileNotFoundError, ProcessLookupError):
        return []
    for name in names:
        try:
            link = os.readlink(f"/proc/{pid}/fd/{name}")
        except OSError:
            continue
        if link.startswith("socket:[") and link.endswith("]"):
            inode = int(link[8:-1])
            if inode in wanted:
                found.append((int(name), inode))
    return found


def _getfd(pidfd: int, fd: int) -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    dup = int(libc.syscall(_SYS_PIDFD_GETFD, pidfd, fd, 0))
    if dup < 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))
    return dup


def silence_connections(pids: list[int]) -> int:
    """Put every connected TCP socket of ``pids`` (a frozen container's processes) in
    repair mode; how many. A process or fd gone meanwhile is skipped; any other
    failure raises OSError (the caller kills the container anyway)."""
    done: set[int] = set()
    by_netns: dict[str, set[int]] = {}
    for pid in pids:
        try:
            netns = os.readlink(f"/proc/{pid}/ns/net")
        except FileNotFoundError:
            continue
        if netns not in by_netns:
            by_netns[netns] = connected_tcp_inodes(pid)
        targets = [(fd, ino) for fd, ino in _socket_fds(pid, by_netns[netns]) if ino not in done]
        if not targets:
            continue
        try:
            pidfd = os.pidfd_open(pid)
        except ProcessLookupError:
            continue
        try:
            for fd, inode in targets:
                try:
                    dup = _getfd(pidfd, fd)
                except OSError as err:
                    if err.errno in (errno.EBADF, errno.ESRCH):
                        continue  # closed or exited meanwhile
                    raise
                with socket.socket(fileno=dup) as sock:
                    sock.setsockopt(socket.IPPROTO_TCP, TCP_REPAIR, 1)
                done.add(inode)
        finally:
            os.close(pidfd)
    return len(done)
