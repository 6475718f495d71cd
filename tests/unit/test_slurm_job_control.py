"""The runner's control socket and the `cedana slurm` job commands that use it:
the protocol, the SO_PEERCRED check, errors by class, and sbatch's command line."""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import pwd
import threading
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
