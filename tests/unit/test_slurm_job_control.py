"""The runner's control socket and the `cedana slurm` job commands that use it:
the protocol, the SO_PEERCRED check, errors by class, and sbatch's command line."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pwd
import socket
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from cedana_shim import errors
from cedana_shim.slurm import control, jobs_cli


class Runner:
    """A real ControlServer on its own loop in a thread, answering like a job runner."""

    def __init__(self, path: str, allowed: frozenset[int]) -> None:
        self.path = path
        self.allowed = allowed
        self.asked: list[dict[str, Any]] = []
        self.loop = asyncio.new_event_loop()
        self.ready = threading.Event()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.server = control.ControlServer(path, allowed, self.handle)

    async def handle(self, request: dict[str, Any]) -> dict[str, Any]:
        self.asked.append(request)
        if request.get("op") == "status":
            return {"job": "42", "step": "batch", "uid": os.getuid(), "label": "v",
                    "mode": "auto", "state": "running", "pid": 7}  # fmt: skip
        if request.get("op") == "checkpoint":
            return {"checkpoint": "20261201T000000Z-abcdef12", "label": "v", "scope": "s",
                    "size": 123, "job": "42"}  # fmt: skip
        raise errors.FailedPrecondition("not now")

    def __enter__(self) -> Runner:
        self.thread.start()
        asyncio.run_coroutine_threadsafe(self.server.start(), self.loop).result(10)
        return self

    def __exit__(self, *_: object) -> None:
        asyncio.run_coroutine_threadsafe(self.server.close(), self.loop).result(10)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(10)
        self.loop.close()


@pytest.fixture
def run_dir(tmp_path: Path) -> Iterator[str]:
    yield str(tmp_path / "slurm")


def test_status_and_checkpoint_for_an_allowed_peer(run_dir: str) -> None:
    path = control.socket_path("42.batch", run_dir)
    with Runner(path, frozenset({os.getuid()})) as runner:
        assert os.stat(path).st_mode & 0o777 == 0o666
        assert os.stat(run_dir).st_mode & 0o777 == 0o711
        assert control.request(path, {"op": "status"})["state"] == "running"
        with pytest.raises(errors.FailedPrecondition, match="not now"):
            control.request(path, {"op": "other"})
        assert runner.asked == [{"op": "status"}, {"op": "other"}]
    assert not os.path.exists(path)


def test_a_peer_that_is_neither_root_nor_the_owner_is_refused(run_dir: str) -> None:
    path = control.socket_path("42.batch", run_dir)
    with Runner(path, frozenset({os.getuid() + 1})) as runner:
        with pytest.raises(errors.PermissionDenied, match=f"uid {os.getuid()} may not"):
            control.request(path, {"op": "checkpoint"})
        assert runner.asked == []


def test_a_bad_request_is_an_invalid_argument(run_dir: str) -> None:
    import socket

    path = control.socket_path("42.batch", run_dir)
    with Runner(path, frozenset({os.getuid()})), socket.socket(socket.AF_UNIX) as sock:
        sock.connect(path)
        sock.sendall(b"[1, 2]\n")
        reply = json.loads(sock.makefile().readline())
    assert reply["ok"] is False and reply["kind"] == "InvalidArgument"


def test_no_runner_is_not_found(run_dir: str) -> None:
    with pytest.raises(errors.NotFound, match="no cedana job runner"):
        control.request(control.socket_path("1.batch", run_dir), {"op": "status"})
    assert control.list_sockets(run_dir) == []


def test_cli_checkpoint_and_jobs(run_dir: str, capsys: pytest.CaptureFixture[str]) -> None:
    path = control.socket_path("42.batch", run_dir)
    with Runner(path, frozenset({os.getuid()})):
        Path(run_dir, "9.batch.sock").touch()  # a runner that died: skipped
        args = argparse.Namespace(job_id="42", step="batch", json=False)
        assert jobs_cli.cmd_checkpoint(args, run_dir) == 0
        assert capsys.readouterr().out == (
            "checkpoint 20261201T000000Z-abcdef12 of job 42.batch committed (label v, 123 bytes)\n"
        )
        assert jobs_cli.cmd_jobs(argparse.Namespace(json=True), run_dir) == 0
        listed = json.loads(capsys.readouterr().out)
        assert [(j["job"], j["label"], j["state"]) for j in listed] == [("42", "v", "running")]
        assert jobs_cli.cmd_jobs(argparse.Namespace(json=False), run_dir) == 0
        me = pwd.getpwuid(os.getuid()).pw_name
        assert capsys.readouterr().out == (
            f"42.batch  user={me}  label=v  mode=auto  state=running  pid=7\n"
        )
    with pytest.raises(errors.NotFound, match=r"job 42\.batch has no cedana runner on this node"):
        jobs_cli.cmd_checkpoint(argparse.Namespace(job_id="42", step="batch", json=True), run_dir)
    with pytest.raises(errors.InvalidArgument, match="not a Slurm job number"):
        jobs_cli.cmd_checkpoint(argparse.Namespace(job_id="4x", step="batch", json=True), run_dir)


def test_restore_exports_the_checkpoint_to_sbatch() -> None:
    ref = "20261201T000000Z-abcdef12"
    assert jobs_cli.sbatch_command("sbatch", ref, ["--", "-p", "low", "v.sh", "a"]) == [
        "sbatch", f"--export=ALL,CEDANA_ENABLE=1,CEDANA_RESTORE={ref}", "-p", "low", "v.sh", "a"
    ]  # fmt: skip
    assert jobs_cli.sbatch_command("sbatch", ref, ["--export=ALL,CEDANA_CHECKPOINT=v", "v.sh"]) == [
        "sbatch", f"--export=ALL,CEDANA_CHECKPOINT=v,CEDANA_ENABLE=1,CEDANA_RESTORE={ref}", "v.sh"
    ]  # fmt: skip
    assert jobs_cli.sbatch_command("sbatch", ref, ["--export", "A=1", "v.sh"]) == [
        "sbatch", "--export", f"A=1,CEDANA_ENABLE=1,CEDANA_RESTORE={ref}", "v.sh"
    ]  # fmt: skip
    with pytest.raises(errors.InvalidArgument, match="no batch script"):
        jobs_cli.sbatch_command("sbatch", ref, ["--"])
    with pytest.raises(errors.InvalidArgument, match="checkpoint to restore"):
        jobs_cli.sbatch_command("sbatch", "../x", ["v.sh"])


def test_commands_are_registered_with_json() -> None:
    parser = argparse.ArgumentParser()
    jobs_cli.register_job_commands(parser.add_subparsers())
    args = parser.parse_args(["restore", "20261201T0", "--", "-p", "low", "v.sh"])
    assert (args.checkpoint, args.sbatch_args) == ("20261201T0", ["-p", "low", "v.sh"])
    assert args.handler is jobs_cli.cmd_restore
    args = parser.parse_args(["checkpoint", "42", "--json"])
    assert (args.job_id, args.step, args.json, args.handler) == (
        "42", "batch", True, jobs_cli.cmd_checkpoint
    )  # fmt: skip
    assert parser.parse_args(["jobs", "--json"]).handler is jobs_cli.cmd_jobs


# -- what anyone on the node may do to the socket (issue 24 §1) -------------------------


def _connect(path: str) -> socket.socket:
    sock = socket.socket(socket.AF_UNIX)
    sock.settimeout(10)
    deadline = time.monotonic() + 10
    while True:
        try:
            sock.connect(path)
            return sock
        except BlockingIOError:  # a full backlog: the runner has not taken them yet
            assert time.monotonic() < deadline, "the runner takes no connection"
            time.sleep(0.01)


def _answer(sock: socket.socket) -> dict[str, Any]:
    """The one line the runner sends, and that it closes the connection after it."""
    data = b""
    while not data.endswith(b"\n"):
        chunk = sock.recv(4096)
        assert chunk, f"closed without an answer (got {data!r})"
        data += chunk
    try:
        rest = sock.recv(4096)
    except ConnectionResetError:  # closed with some of what was sent unread
        rest = b""
    assert rest == b""
    reply: dict[str, Any] = json.loads(data)
    return reply


def test_a_stranger_is_refused_at_once_without_a_byte_read(run_dir: str) -> None:
    """Before anything is read: a stranger that sends nothing is still answered and
    closed, and fifty of them at once hold nothing of the runner's."""
    path = control.socket_path("42.batch", run_dir)
    with Runner(path, frozenset({os.getuid() + 1})) as runner:
        strangers = [_connect(path) for _ in range(50)]
        for sock in strangers:
            reply = _answer(sock)
            assert reply["kind"] == "PermissionDenied", reply
            assert f"uid {os.getuid()} may not control this job" in reply["error"]
            sock.close()
        assert runner.asked == []


def test_an_idle_connection_is_dropped_at_the_read_deadline(
    run_dir: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(control, "READ_TIMEOUT", 0.3, raising=False)
    path = control.socket_path("42.batch", run_dir)
    with Runner(path, frozenset({os.getuid()})) as runner, _connect(path) as sock:
        sock.sendall(b'{"op": "status"')  # one byte or a whole object: no newline
        reply = _answer(sock)
        assert reply["kind"] == "DeadlineExceeded" and "within 0.3s" in reply["error"]
        assert runner.asked == []


def test_a_request_longer_than_the_limit_is_refused(run_dir: str) -> None:
    path = control.socket_path("42.batch", run_dir)
    with Runner(path, frozenset({os.getuid()})), _connect(path) as sock:
        sock.sendall(b"x" * (control.MAX_REQUEST + 1))
        reply = _answer(sock)
        assert reply["kind"] == "InvalidArgument" and "longer than 4096 bytes" in reply["error"]


def test_connections_of_one_uid_are_bounded(run_dir: str) -> None:
    """MAX_PER_UID connections being served (here: idle, within their deadline); the
    next one of that uid is refused at once, and served again once one has ended."""
    path = control.socket_path("42.batch", run_dir)
    with Runner(path, frozenset({os.getuid()})):
        held = [_connect(path) for _ in range(control.MAX_PER_UID)]
        with _connect(path) as one_more:
            reply = _answer(one_more)
        assert reply["kind"] == "ResourceExhausted", reply
        assert f"at most {control.MAX_PER_UID} per user" in reply["error"]
        for sock in held:
            sock.close()
        deadline = time.monotonic() + 30
        while True:  # the runner sees the ends on its next turns
            try:
                assert control.request(path, {"op": "status"})["state"] == "running"
                break
            except errors.ResourceExhausted:
                assert time.monotonic() < deadline, "closed connections still counted"
                time.sleep(0.05)


# The server out of descriptors, in a process of its own: it hoards every descriptor
# its limit allows until SIGUSR1.
SERVER_OUT_OF_FDS = """
import asyncio, logging, os, resource, signal, sys
from cedana_shim import log as shim_log
from cedana_shim.slurm import control

shim_log.configure(None, debug=False)
shim_log.add_node_log(sys.argv[2])

async def handle(request):
    return {"state": "running"}

async def main():
    server = control.ControlServer(sys.argv[1], frozenset({os.getuid()}), handle)
    await server.start()
    resource.setrlimit(resource.RLIMIT_NOFILE, (128, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
    hoard = []
    try:
        while True:
            hoard.append(os.open(os.devnull, os.O_RDONLY))
    except OSError:
        pass
    freed = asyncio.Event()
    def free():
        for fd in hoard:
            os.close(fd)
        freed.set()
    asyncio.get_running_loop().add_signal_handler(signal.SIGUSR1, free)
    print("ready", flush=True)
    await freed.wait()
    await asyncio.sleep(3600)

asyncio.run(main())
"""


def test_out_of_descriptors_connections_are_closed_unserved_and_logged_once(
    run_dir: str, tmp_path: Path
) -> None:
    """asyncio's own server logs a traceback for each retry of accept() (thousands a
    second) and leaves the callers hanging; this one closes each waiting connection
    with its spare descriptor, logs that in a few lines, and serves again once
    descriptors are free."""
    import signal
    import subprocess
    import sys

    path = control.socket_path("42.batch", run_dir)
    os.makedirs(run_dir)
    log_file = tmp_path / "shim.log"
    server = subprocess.Popen(
        [sys.executable, "-c", SERVER_OUT_OF_FDS, path, str(log_file)],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert server.stdout is not None and server.stdout.readline() == "ready\n"
        for _ in range(200):
            with _connect(path) as sock:
                assert sock.recv(4096) == b"", "a connection got an answer without a descriptor"
        lines = [json.loads(x) for x in log_file.read_text().splitlines()]
        shed = [x for x in lines if "out of file descriptors" in str(x["msg"])]
        assert 1 <= len(shed) <= 10, [x["msg"] for x in lines][:20]
        assert not [x for x in lines if "accept() out of system resource" in str(x["msg"])]

        server.send_signal(signal.SIGUSR1)
        deadline = time.monotonic() + 30
        while True:
            try:
                assert control.request(path, {"op": "status"}, timeout=10)["state"] == "running"
                break
            except errors.Unavailable:  # closed unserved: SIGUSR1 not handled yet
                assert time.monotonic() < deadline, "still out of descriptors"
                time.sleep(0.05)
    finally:
        server.kill()
        server.wait()
