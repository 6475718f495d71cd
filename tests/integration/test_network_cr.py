"""Networked containers checkpoint and restore for real (CRIU >= 4.2: 4.1 cannot
dump an inet socket on kernels >= 6.16).

- a `ctr run` container (a network namespace of its own, only `lo`): restored, `lo` is
  up with its addresses as in a fresh container (CRIU records none of the namespace's
  links on current kernels; the shim brings `lo` up before any socket is restored) and
  a server listening on 127.0.0.1 answers with its state continued;
- host network (the restore keeps the IP): established client connections survive,
  the clients see no FIN at the stop and are served after the restore; the same for a
  server under load (hundreds of open connections, new ones arriving during the stop);
- UDP and unix datagram sockets (syslogd forwarding to a receiver on the host);
- unix sockets to a server outside the container (fixtures/unix_ticker.c): a datagram
  socket is restored; a stream connection cannot be checkpointed by CRIU, and the
  container stops as it would without us, with CRIU's reason.

Nothing here passes on a fallback branch: when CRIU or the kernel cannot dump a socket,
the checkpoint fails and so does the test, with CRIU's reason. The pod variants (CNI,
a new IP; a restart in the same pod; established TCP kept or closed cleanly) are in
test_checkpoint_restore.py.
"""

from __future__ import annotations

import contextlib
import socket
import subprocess
import threading
import uuid
from collections.abc import Callable
from pathlib import Path

import pytest

from .harness.config import CTR_NAMESPACE
from .harness.containerd import Containerd
from .harness.cr_events import TOPIC_EXIT, TOPIC_FAILED, EventStream
from .harness.cr_support import (
    Box,
    ShimLog,
    Workloads,
    assert_continues,
    counter_script,
    restored_from,
    unique_label,
    wait_ticks,
)
from .harness.util import wait_for

NewId = Callable[[str], str]
pytestmark = pytest.mark.ctrd_versions("1.6", "2.1")
# Bound to 127.0.0.1: restoring the listening socket needs lo's address in place.
HTTPD = "httpd -f -p 127.0.0.1:8080 -h /var &\n"
GET_COUNT = "wget -qO- http://127.0.0.1:8080/count"
CLIENTS = 20
# Open client connections of the load test: one httpd process each.
LOAD_CONNECTIONS = 200
FIXTURES = Path(__file__).parent / "fixtures"


def _exec(w: Workloads, box: Box, script: str) -> str:
    exec_id = f"p{uuid.uuid4().hex[:6]}"
    return str(w.ctr("task", "exec", "--exec-id", exec_id, box.cid, "sh", "-c", script).stdout)


def test_http_server_answers_after_restore(containerd: Containerd, new_id: NewId) -> None:
    """busybox httpd on 127.0.0.1:8080 beside the counter: stopped with a checkpoint,
    restored in a new container whose `lo` is up with 127.0.0.1 and ::1, and the server
    answers with the count continued. Before: CRIU 4.1 failed the dump ("sockets: Can't
    get 1:16 opt"), and with 4.2 the restored `lo` was down ("Network is unreachable")."""
    c = containerd
    script = counter_script(extra=HTTPD)
    with (
        EventStream(c.socket) as events,
        Workloads(
            c, new_id, label=unique_label("httpd"), script=script, namespace=CTR_NAMESPACE
        ) as w,
    ):
        a = w.start("a")
        wait_ticks(a.lines, count=3)
        assert int(_exec(w, a, GET_COUNT)) >= 3
        w.ctr("task", "kill", "-s", "SIGTERM", a.cid)
        # A failed dump fails here, with the shim's error (CRIU's reason).
        committed = events.wait_commit(a.cid, timeout=60)
        exited = events.wait_topic(TOPIC_EXIT, a.cid, timeout=30, id=a.cid)
        assert exited.field("exit_status") == 143, exited
        before = a.ticks()
        assert before is not None
        w.delete(a)

        b = w.start("b")
        restored_from(events, b, committed.checkpoint_id)
        after = wait_ticks(b.lines, count=3)
        assert_continues(before, after, "restore of an HTTP server")
        lo = _exec(w, b, "ip link show lo; ip addr show lo")
        assert "UP" in lo.split(">")[0] and "inet 127.0.0.1/8" in lo and "inet6 ::1/128" in lo, lo
        served = int(_exec(w, b, GET_COUNT))
        assert served > before.last, (served, before)


def test_established_connections_survive_a_restore_that_keeps_the_ip(
    containerd: Containerd, new_id: NewId
) -> None:
    """A host-network httpd (the IP is the node's: kept by the restore) holding 20
    established client connections at the stop: after the restore each connection is
    still open at both ends and served. Before: the kill after the checkpoint sent FIN
    to every client (they read EOF), and the restored server held ghost connections."""
    c = containerd
    log = ShimLog(c)
    port = _free_port()
    script = counter_script(extra=f"httpd -f -p 127.0.0.1:{port} -h /var &\n")
    with (
        EventStream(c.socket) as events,
        Workloads(
            c, new_id, label=unique_label("hostnet"), script=script, namespace=CTR_NAMESPACE
        ) as w,
        contextlib.ExitStack() as clients,
    ):
        a = w.start("a", extra=("--net-host",))
        conns = _connect_clients(w, a, clients, port, CLIENTS, timeout=15)
        w.ctr("task", "kill", "-s", "SIGTERM", a.cid)
        committed = events.wait_commit(a.cid, timeout=60)
        events.wait_topic(TOPIC_EXIT, a.cid, timeout=30, id=a.cid)
        kept = log.wait("TCP connections left open for their peers until the restore")
        assert kept["connections"] >= CLIENTS, kept
        before = a.ticks()
        assert before is not None
        w.delete(a)
        for conn in conns:  # no FIN reached the clients
            conn.settimeout(0.2)
            with pytest.raises(TimeoutError):
                conn.recv(1)

        b = w.start("b", extra=("--net-host",))
        restored_from(events, b, committed.checkpoint_id)
        assert_continues(before, wait_ticks(b.lines, count=3), "restore with connections")
        for conn in conns:
            conn.settimeout(10)
            conn.sendall(b"GET /count HTTP/1.0\r\n\r\n")
            reply = b""
            while chunk := conn.recv(65536):
                reply += chunk
            head, _, body = reply.decode().partition("\r\n\r\n")
            assert " 200 " in head.split("\r\n")[0], reply
            assert int(body) > before.last


def test_udp_and_unix_datagram_sockets_work_after_restore(
    containerd: Containerd, new_id: NewId
) -> None:
    """busybox syslogd in a host-network container: its /dev/log (a bound unix datagram
    socket) and its UDP socket to a receiver on the host (-R) are restored; a message
    logged inside the restored container reaches the receiver."""
    c = containerd
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as receiver:
        receiver.bind(("127.0.0.1", 0))
        receiver.settimeout(10)
        port = receiver.getsockname()[1]
        script = counter_script(extra=f"syslogd -n -R 127.0.0.1:{port} &\n")
        with (
            EventStream(c.socket) as events,
            Workloads(
                c, new_id, label=unique_label("udp"), script=script, namespace=CTR_NAMESPACE
            ) as w,
        ):
            a = w.start("a", extra=("--net-host",))
            wait_ticks(a.lines, count=3)
            _exec(w, a, "logger cedana-before")
            assert b"cedana-before" in _receive(receiver, b"cedana-before")
            w.ctr("task", "kill", "-s", "SIGTERM", a.cid)
            committed = events.wait_commit(a.cid, timeout=60)
            events.wait_topic(TOPIC_EXIT, a.cid, timeout=30, id=a.cid)
            w.delete(a)

            b = w.start("b", extra=("--net-host",))
            restored_from(events, b, committed.checkpoint_id)
            wait_ticks(b.lines, count=3)
            _exec(w, b, "logger cedana-after")
            assert b"cedana-after" in _receive(receiver, b"cedana-after")


# CI time (~40 s a version): the TCP work under load is the shim's and CRIU's alone.
@pytest.mark.ctrd_versions("2.1")
def test_a_server_under_load_during_the_stop(containerd: Containerd, new_id: NewId) -> None:
    """busybox httpd (one process per connection) holding LOAD_CONNECTIONS open client
    connections while clients keep opening new ones and asking, as the stop lands: the
    checkpoint holds them all, the restored server answers on every kept connection
    and on new ones."""
    c = containerd
    log = ShimLog(c)
    port = _free_port()
    script = counter_script(extra=f"httpd -f -p 127.0.0.1:{port} -h /var &\n")
    stop = threading.Event()
    asked = [0]

    def hammer() -> None:  # short requests on new connections, throughout the stop
        while not stop.is_set():
            with (
                contextlib.suppress(OSError),
                socket.create_connection(("127.0.0.1", port), timeout=2) as conn,
            ):
                conn.sendall(b"GET /count HTTP/1.0\r\n\r\n")
                conn.recv(4096)
                asked[0] += 1

    with (
        EventStream(c.socket) as events,
        Workloads(
            c, new_id, label=unique_label("load"), script=script, namespace=CTR_NAMESPACE
        ) as w,
        contextlib.ExitStack() as clients,
    ):
        a = w.start("a", extra=("--net-host",))
        conns = _connect_clients(w, a, clients, port, LOAD_CONNECTIONS, timeout=60)
        workers = [threading.Thread(target=hammer) for _ in range(4)]
        for worker in workers:
            worker.start()
        try:
            wait_for(lambda: asked[0] >= 20, timeout=30, what="the load to run")
            w.ctr("task", "kill", "-s", "SIGTERM", a.cid)
            committed = events.wait_commit(a.cid, timeout=120)
        finally:
            stop.set()
            for worker in workers:
                worker.join()
        events.wait_topic(TOPIC_EXIT, a.cid, timeout=30, id=a.cid)
        kept = log.wait("TCP connections left open for their peers until the restore")
        assert kept["connections"] >= LOAD_CONNECTIONS, kept
        w.delete(a)

        b = w.start("b", extra=("--net-host",))
        restored_from(events, b, committed.checkpoint_id)
        for conn in conns:
            conn.settimeout(30)
            conn.sendall(b"GET /count HTTP/1.0\r\n\r\n")
            assert _status(conn.recv(64)) == b"200", "a kept connection"
        with socket.create_connection(("127.0.0.1", port), timeout=10) as conn:
            conn.sendall(b"GET /count HTTP/1.0\r\n\r\n")
            assert _status(conn.recv(64)) == b"200", "a new connection"


@pytest.fixture(scope="module")
def unix_ticker(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """fixtures/unix_ticker.c, built static (the test image has only busybox)."""
    out = tmp_path_factory.mktemp("ticker") / "unix_ticker"
    subprocess.run(
        ["gcc", "-static", "-O2", "-o", str(out), str(FIXTURES / "unix_ticker.c")], check=True
    )
    return out


def _outside_mounts(ticker: Path, shared: Path) -> tuple[str, ...]:
    """The ticker at /ticker, and the host's `shared` dir at the same path inside: CRIU
    reconnects a socket to its peer by the name the peer bound, as the host sees it."""
    return (
        "--mount", f"type=bind,src={ticker},dst=/ticker,options=rbind:ro",
        "--mount", f"type=bind,src={shared},dst={shared},options=rbind:rw",
    )  # fmt: skip


def _ticks(receiver: socket.socket, count: int) -> list[int]:
    return [int(receiver.recv(64).split()[1]) for _ in range(count)]


def test_a_datagram_socket_to_a_server_outside_is_restored(
    containerd: Containerd, new_id: NewId, unix_ticker: Path, tmp_path: Path
) -> None:
    """A host-network process sending datagrams to a unix socket of the host,
    bind-mounted into the container (as /dev/log often is): checkpointed
    (ext-unix-sk), restored, it sends on to the same server, its count continued. (The
    socket must be at the same path inside and outside: CRIU reconnects by the peer's
    name. In a network namespace of its own CRIU cannot find the peer at all.)"""
    c = containerd
    shared = tmp_path / "ext"
    shared.mkdir()
    with socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM) as server:
        server.bind(str(shared / "log"))
        server.settimeout(10)
        script = counter_script(extra=f"/ticker dgram {shared}/log &\n")
        flags = (*_outside_mounts(unix_ticker, shared), "--net-host")
        with (
            EventStream(c.socket) as events,
            Workloads(
                c, new_id, label=unique_label("unixdg"), script=script, namespace=CTR_NAMESPACE
            ) as w,
        ):
            a = w.start("a", extra=flags)
            wait_ticks(a.lines, count=3)
            _ticks(server, 3)
            w.ctr("task", "kill", "-s", "SIGTERM", a.cid)
            committed = events.wait_commit(a.cid, timeout=60)
            events.wait_topic(TOPIC_EXIT, a.cid, timeout=30, id=a.cid)
            w.delete(a)
            last = 0
            with contextlib.suppress(TimeoutError):  # what was sent before the dump
                server.settimeout(0.5)
                while True:
                    last = _ticks(server, 1)[0]
            server.settimeout(10)

            b = w.start("b", extra=flags)
            restored_from(events, b, committed.checkpoint_id)
            after = _ticks(server, 3)
            assert after[0] > last and after == list(range(after[0], after[0] + 3)), (last, after)


def test_a_stream_connection_to_a_server_outside_stops_the_container_as_without_us(
    containerd: Containerd, new_id: NewId, unix_ticker: Path, tmp_path: Path
) -> None:
    """CRIU cannot checkpoint one half of a unix stream connection whose other half is
    outside the container: the stop fails its checkpoint, says CRIU's reason, and the
    application gets its SIGTERM (its trap runs): nothing is lost, nothing is committed."""
    c = containerd
    log = ShimLog(c)
    shared = tmp_path / "ext"
    shared.mkdir()
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as server:
        server.bind(str(shared / "stream"))
        server.listen(1)
        script = counter_script(extra=f"/ticker stream {shared}/stream &\n")
        with (
            EventStream(c.socket) as events,
            Workloads(
                c, new_id, label=unique_label("unixst"), script=script, namespace=CTR_NAMESPACE
            ) as w,
        ):
            a = w.start("a", extra=_outside_mounts(unix_ticker, shared))
            conn, _ = server.accept()
            with conn:
                wait_ticks(a.lines, count=3)
                w.ctr("task", "kill", "-s", "SIGTERM", a.cid)
                failed = events.wait_topic(TOPIC_FAILED, a.cid, timeout=60)
                exited = events.wait_topic(TOPIC_EXIT, a.cid, timeout=30, id=a.cid)
                assert exited.field("exit_status") == 143, exited
                assert "got-TERM" in a.lines()
                why = log.wait("checkpoint on stop failed; stopping without it", container=a.cid)
                assert why["error"] == failed.field("error")
                criu = log.find("criu failed")
                assert any(
                    "Can't dump half of stream unix connection" in line
                    for record in criu
                    for line in record.get("criu_log_tail") or []
                ), criu


def _status(reply: bytes) -> bytes:
    """The status code of an HTTP reply's first line."""
    return reply.split(b"\r\n", 1)[0].split(b" ")[1]


def _receive(receiver: socket.socket, wanted: bytes) -> bytes:
    """Datagrams until one holds `wanted` (syslogd may send others first)."""
    while wanted not in (data := receiver.recv(65536)):
        pass
    return data


def _connect_clients(
    w: Workloads,
    box: Box,
    clients: contextlib.ExitStack,
    port: int,
    count: int,
    *,
    timeout: float,
) -> list[socket.socket]:
    """`count` client connections to the container's httpd (closed with `clients`),
    once each is served by an httpd process of its own."""
    wait_ticks(box.lines, count=3)
    conns = [
        clients.enter_context(socket.create_connection(("127.0.0.1", port), timeout=10))
        for _ in range(count)
    ]
    wait_for(
        lambda: _httpd_count(w, box) > count,
        timeout=timeout,
        what=f"httpd to accept {count} connections",
    )
    return conns


def _httpd_count(w: Workloads, box: Box) -> int:
    """httpd processes in the container: the server and one child per connection."""
    return int(_exec(w, box, "ps -o comm | grep -c '^httpd'; true").strip() or 0)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
