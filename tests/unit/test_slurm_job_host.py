"""A job's container on the fake runc: its output reaches the job's own stdout and
stderr through pipes, its stdin is empty, and the lines the job's stderr gets."""

from __future__ import annotations

import asyncio
import ctypes
import json
import os
from pathlib import Path

import pytest
from cedana_shim.api.cedana.v1 import cedana_pb2 as cedana_ev
from cedana_shim.checkpoint.policy import Mode, Policy
from cedana_shim.checkpoint.restore import RestoreRequest
from cedana_shim.runtime.reaper import PR_SET_CHILD_SUBREAPER, Exit, Reaper, set_child_subreaper
from cedana_shim.runtime.runc import Runc, RuncError
from cedana_shim.slurm.job_host import JobHost
from cedana_shim.slurm.job_run import JobEvents
from cedana_shim.slurm.job_spec import JobRequest, build_spec
from fakes.fake_runc import FakeRunc


def host_for(tmp: Path, reaper: Reaper, argv: tuple[str, ...], out: int, err: int) -> JobHost:
    fake = FakeRunc.install(str(tmp / "fake-runc"))
    bundle = tmp / "bundle"
    bundle.mkdir()
    request = JobRequest("42", "batch", os.getuid(), os.getgid(), (), str(tmp), argv, {"A": "1"})
    spec = build_spec(request, rootfs="/", mounts=[], cgroup="/c", rlimits=[])
    (bundle / "config.json").write_text(json.dumps(spec))
    return JobHost(
        container_id=request.container_id,
        bundle=str(bundle),
        rootfs="/",
        spec=spec,
        runc=Runc(reaper=reaper, root=fake.root, binary=fake.binary, log_path=str(bundle / "l")),
        policy=Policy(Mode.AUTO, "v", "slurm-c-u"),
        out=out,
        err=err,
    )


def test_cold_start_pipes_the_output_and_gives_an_empty_stdin(tmp_path: Path) -> None:
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    script = 'cat; echo "out $A"; echo err >&2; exit 3'

    async def body() -> tuple[int, Exit]:
        reaper = Reaper()
        reaper.install()
        exits: dict[int, Exit] = {}
        reaper.subscribe(lambda ex: exits.__setitem__(ex.pid, ex))
        host = host_for(tmp_path, reaper, ("/bin/sh", "-c", script), out_w, err_w)
        try:
            pid = await host.create_cold()
            while pid not in exits:
                await asyncio.sleep(0.02)
            await host.drain_output()
            await host.discard_attempt()
            return pid, exits[pid]
        finally:
            reaper.close()

    set_child_subreaper()
    try:
        pid, ex = asyncio.run(asyncio.wait_for(body(), 20))
    finally:
        ctypes.CDLL(None).prctl(PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0)
    os.close(out_w)
    os.close(err_w)
    assert ex.status == 3
    assert os.read(out_r, 100) == b"out 1\n"
    assert os.read(err_r, 100) == b"err\n"
    assert Path(tmp_path / "bundle" / "init.pid").read_text().strip() == str(pid)


def test_restore_images_hands_runc_the_request(tmp_path: Path) -> None:
    async def body() -> list[list[str]]:
        reaper = Reaper()
        reaper.install()
        host = host_for(tmp_path, reaper, ("/bin/true",), 1, 2)
        try:
            request = RestoreRequest(str(tmp_path / "images"), str(tmp_path / "work"), False, True)
            with pytest.raises(RuncError):  # the fake finds no images: like CRIU, it fails
                await host.restore_images(request)
            assert host.io is not None and host.io.stdio.stdout is not None
            return FakeRunc(str(tmp_path / "fake-runc")).calls("restore")
        finally:
            reaper.close()

    (calls,) = asyncio.run(asyncio.wait_for(body(), 20))
    assert calls[calls.index("--image-path") + 1] == str(tmp_path / "images")
    assert calls[calls.index("--work-path") + 1] == str(tmp_path / "work")
    assert "--file-locks" in calls and "--tcp-established" not in calls
    assert calls[-1] == "slurm-42.batch"


def test_events_become_one_line_each_on_the_jobs_stderr() -> None:
    r, w = os.pipe()
    events = JobEvents(w)
    events.send(cedana_ev.RestoreOutcome(checkpoint_id="c1", label="v", outcome="restored"))
    events.send(
        cedana_ev.RestoreOutcome(outcome="cold", detail="no checkpoint for this label", label="v")
    )
    events.send(cedana_ev.CheckpointCommitted(checkpoint_id="c2", reason="stop", label="v"))
    events.send(cedana_ev.CheckpointFailed(reason="stop", error="criu said no"))
    os.close(w)
    assert os.read(r, 4096).decode().splitlines() == [
        "cedana: restored from c1 (label v)",
        "cedana: starting cold: no checkpoint for this label",
        "cedana: checkpoint c2 committed (stop, label v)",
        "cedana: checkpoint failed (stop): criu said no",
    ]
