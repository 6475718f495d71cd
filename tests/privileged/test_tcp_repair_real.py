"""A killed process whose TCP socket was put back in repair mode ends it silently:
the peer reads neither EOF nor a reset (what a restore that keeps the IP needs)."""

from __future__ import annotations

import signal
import socket
import subprocess
import sys

import pytest
from cedana_shim.runtime.tcp_repair import silence_connections

CLIENT = (
    "import socket, sys, time\n"
    "s = socket.create_connection(('127.0.0.1', int(sys.argv[1])))\n"
    "sys.stdout.write('up\\n'); sys.stdout.flush()\n"
    "time.sleep(600)\n"
)


def _client(port: int) -> subprocess.Popen[bytes]:
    proc = subprocess.Popen([sys.executable, "-c", CLIENT, str(port)], stdout=subprocess.PIPE)
    assert proc.stdout is not None and proc.stdout.readline() == b"up\n"
    return proc


@pytest.mark.parametrize("silenced", [True, False])
def test_the_peer_sees_no_end_of_a_silenced_connection(silenced: bool) -> None:
    with socket.socket() as server:
        server.bind(("127.0.0.1", 0))
        server.listen()
        proc = _client(server.getsockname()[1])
        conn, _ = server.accept()
        with conn:
            if silenced:
                assert silence_connections([proc.pid]) == 1
            proc.send_signal(signal.SIGKILL)
            proc.wait()
            conn.settimeout(1.0)
            if silenced:
                with pytest.raises(TimeoutError):
                    conn.recv(1)
            else:  # the control: without it the peer reads EOF at once
                assert conn.recv(1) == b""
