"""`containerd-shim-cedana-v2 start` as containerd runs it: the answer comes at once,
the daemon is started behind it by a helper, and containerd's first request, sent on
a connection made the moment start returned, is answered by that daemon."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from cedana_shim.api.containerd.task.v2 import shim_pb2 as pb
from cedana_shim.cli.forkserver import TEMPLATE_NAME
from cedana_shim.cli.spare import SPARE_NAME
from cedana_shim.launcher import write_launcher
from cedana_shim.ttrpc.client import Client

SHIM_ARGS = ["-namespace", "ns", "-publish-binary", "/bin/false", "-id", "c1"]


@pytest.fixture
def run_dir() -> Iterator[Path]:
    # Short, under /tmp: the pod socket's path must fit AF_UNIX's 108 bytes.
    directory = Path(tempfile.mkdtemp(prefix="st-", dir="/tmp"))
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture
def bundle(tmp_path: Path) -> Path:
    path = tmp_path / "bundle"
    path.mkdir()
    (path / "config.json").write_text(json.dumps({"ociVersion": "1.0.2"}))
    return path


async def connect_call(path: str) -> pb.ConnectResponse:
    client = await Client.connect(path)
    try:
        return await client.call(
            "containerd.task.v2.Task",
            "Connect",
            pb.ConnectRequest(id="c1"),
            pb.ConnectResponse,
            timeout=20,
        )
    finally:
        await client.close()


def test_start_answers_and_the_daemon_serves_the_request_sent_at_once(
    tmp_path: Path, bundle: Path, run_dir: Path
) -> None:
    launcher = tmp_path / "containerd-shim-cedana-v2"
    write_launcher(str(launcher))
    # The cold path (no fork server): the helper forks the daemon, imports and all.
    env = {**os.environ, "CEDANA_RUN_DIR": str(run_dir), "CEDANA_FORKSERVER": "0"}
    argv = [str(launcher), "-address", str(tmp_path / "containerd.sock"), *SHIM_ARGS, "start"]
    proc = subprocess.Popen(
        argv, cwd=bundle, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE
    )
    # containerd reads until EOF: start's helper let go of the pipes.
    out, err = proc.communicate(timeout=30)
    assert proc.returncode == 0, err
    address = out.decode()
    assert address.startswith(f"unix://{run_dir}/s/")
    assert (bundle / "address").read_text() == address
    path = address.removeprefix("unix://")
    daemon = 0
    try:
        # As containerd does: connect at once; the daemon may not even exist yet.
        daemon = asyncio.run(connect_call(path)).shim_pid
        assert daemon != proc.pid
        assert Path(f"/proc/{daemon}/comm").read_text().strip() == "containerd-shim"
        own = int(Path(f"/proc/{os.getpid()}/oom_score_adj").read_text())
        assert int(Path(f"/proc/{daemon}/oom_score_adj").read_text()) == min(own + 1, 1000)
    finally:
        if daemon:
            os.kill(daemon, signal.SIGKILL)


def test_a_daemon_that_cannot_be_started_leaves_no_socket_and_says_why(
    bundle: Path, run_dir: Path
) -> None:
    """containerd's connection to the socket then fails (its requests with it) and
    the reason is in containerd's log, which reads the bundle's log FIFO."""
    fifo = bundle / "log"
    os.mkfifo(fifo)
    reader = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK)
    path = str(run_dir / "pod.sock")
    code = "\n".join(
        [
            "import _socket, sys",
            "from cedana_shim.cli import start",
            "from cedana_shim.cli.args import ShimArgs",
            "def refuse(*args): raise OSError('Resource temporarily unavailable')",
            "start.fork_daemon = refuse",
            "listener = _socket.socket(_socket.AF_UNIX, _socket.SOCK_STREAM)",
            "listener.bind(sys.argv[1])",
            "listener.listen(1)",
            "start._cold_start(listener, sys.argv[1], ShimArgs(namespace='ns', id='c1'), b'', 0)",
        ]
    )
    try:
        proc = subprocess.run(
            [sys.executable, "-c", code, path], cwd=bundle, capture_output=True, timeout=30
        )
        assert proc.returncode == 1
        assert proc.stdout == proc.stderr == b""  # its stdio was containerd's pipes
        assert not os.path.exists(path)
        deadline = time.monotonic() + 5
        data = b""
        while not data.endswith(b"\n") and time.monotonic() < deadline:
            with contextlib.suppress(BlockingIOError):
                data += os.read(reader, 65536)
            time.sleep(0.01)
    finally:
        os.close(reader)
    line = json.loads(data)
    assert line["level"] == "error"
    assert line["container"] == "c1"
    assert "cannot start the shim daemon: Resource temporarily unavailable" in line["msg"]


def test_with_a_warm_server_the_daemon_is_its_spare(
    tmp_path: Path, bundle: Path, run_dir: Path
) -> None:
    """The first start finds no server: it starts one and forks its daemon cold. The
    next one's daemon is the spare the server forked meanwhile."""
    launcher = tmp_path / "containerd-shim-cedana-v2"
    write_launcher(str(launcher))
    env = {k: v for k, v in os.environ.items() if k != "CEDANA_FORKSERVER"}
    env["CEDANA_RUN_DIR"] = str(run_dir)
    address = str(tmp_path / "containerd.sock")
    started: list[int] = []
    server = 0
    try:
        for cid in ("c1", "c2"):
            if cid == "c2":
                wait_for(
                    lambda: server_with_a_spare(run_dir),
                    f"a fork server with a spare in {run_dir}: {sorted(os.listdir(run_dir))}",
                )
                server, spare = server_with_a_spare(run_dir) or (0, 0)
            argv = [str(launcher), "-address", address, *SHIM_ARGS[:-1], cid, "start"]
            out = subprocess.run(argv, cwd=bundle, env=env, capture_output=True, timeout=30)
            assert out.returncode == 0, out.stderr
            path = out.stdout.decode().removeprefix("unix://")
            started.append(asyncio.run(connect_call(path)).shim_pid)
        assert started[1] == spare
    finally:
        for pid in [*started, server]:
            if pid:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(pid, signal.SIGKILL)


def server_with_a_spare(run_dir: Path) -> tuple[int, int] | None:
    """Found through /proc: a connection to its socket would count as a request (and
    the server forks its spare only once it has had none for a while)."""
    marker = f"CEDANA_RUN_DIR={run_dir}".encode()
    for entry in Path("/proc").iterdir():
        try:
            if (entry / "comm").read_text().strip() != TEMPLATE_NAME:
                continue
            if marker not in (entry / "environ").read_bytes().split(b"\0"):
                continue
        except OSError:
            continue
        spares = spares_of(int(entry.name))
        if spares:
            return int(entry.name), spares[0]
    return None


def spares_of(server: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            ppid = int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1])
            comm = (entry / "comm").read_text().strip()
        except OSError:
            continue
        if ppid == server and comm == SPARE_NAME:
            found.append(int(entry.name))
    return found


def wait_for(predicate: Callable[[], object], what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)
