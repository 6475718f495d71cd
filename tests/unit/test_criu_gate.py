"""The restore gate: the CRIU action script that holds restored tasks at post-restore
until the shim's verdict, run for real by /bin/sh as CRIU runs it. Without a verdict it
gives up at the restore's wall-clock deadline, and at once when the shim that wrote it
is gone."""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import threading
import time
from pathlib import Path

import pytest
from cedana_shim.checkpoint import criu_config
from cedana_shim.checkpoint.criu_config import give_verdict, write_gate
from cedana_shim.runtime.pgroup import start_time


def run_gate(
    script: str, *, env: dict[str, str] | None = None, timeout: float = 60
) -> tuple[int, float]:
    """Run the gate as CRIU does at ``post-restore``; (exit status, seconds it took)."""
    started = time.monotonic()
    proc = subprocess.run(
        ["/bin/sh", script],
        env={**os.environ, **(env or {}), "CRTOOLS_SCRIPT_ACTION": "post-restore"},
        timeout=timeout,
        check=False,
    )
    return proc.returncode, time.monotonic() - started


def test_other_actions_pass_at_once(tmp_path: Path) -> None:
    script, _ = write_gate(str(tmp_path), timeout=600)
    proc = subprocess.run(
        ["/bin/sh", script],
        env={**os.environ, "CRTOOLS_SCRIPT_ACTION": "pre-resume"},
        timeout=5,
        check=False,
    )
    assert proc.returncode == 0
    assert oct(os.stat(script).st_mode & 0o777) == "0o700"


@pytest.mark.parametrize(("ok", "status"), [(True, 0), (False, 1)])
def test_the_verdict_decides(tmp_path: Path, ok: bool, status: int) -> None:
    script, verdict = write_gate(str(tmp_path), timeout=600)
    give_verdict(verdict, ok)
    status_seen, elapsed = run_gate(script)
    assert status_seen == status
    assert elapsed < 5


def test_a_verdict_that_comes_later_releases_the_gate(tmp_path: Path) -> None:
    script, verdict = write_gate(str(tmp_path), timeout=600)
    timer = threading.Timer(0.5, give_verdict, (verdict, True))
    timer.start()
    status, elapsed = run_gate(script)
    assert status == 0
    assert 0.4 < elapsed < 5


def test_an_old_verdict_is_removed_when_a_gate_is_written(tmp_path: Path) -> None:
    _, verdict = write_gate(str(tmp_path), timeout=600)
    give_verdict(verdict, True)
    script, verdict = write_gate(str(tmp_path), timeout=1)
    assert not os.path.exists(verdict)
    assert run_gate(script)[0] == 1


def test_without_a_verdict_it_gives_up_at_the_wall_clock_deadline(tmp_path: Path) -> None:
    """Each turn of the loop forks `date` and `sleep`: on a loaded node a turn costs far
    more than its 10 ms sleep. Here `sleep` itself takes 0.4 s a call; a gate that
    counted its turns (timeout * 100 of them) would hold CRIU for 10 minutes."""
    slow = tmp_path / "bin"
    slow.mkdir()
    (slow / "sleep").write_text("#!/bin/sh\nexec /bin/sleep 0.4\n")
    (slow / "sleep").chmod(0o755)
    script, _ = write_gate(str(tmp_path), timeout=1.5)
    status, elapsed = run_gate(script, env={"PATH": f"{slow}:{os.environ['PATH']}"}, timeout=30)
    assert status == 1
    assert elapsed < 3


def _write_gate_and_exit(directory: str) -> None:
    write_gate(directory, timeout=600)


def test_it_gives_up_at_once_when_the_shim_that_wrote_it_is_gone(tmp_path: Path) -> None:
    """The daemon was SIGKILLed mid-restore: no verdict will ever come."""
    ctx = multiprocessing.get_context("fork")
    writer = ctx.Process(target=_write_gate_and_exit, args=(str(tmp_path),))
    writer.start()
    writer.join(10)
    assert writer.exitcode == 0
    status, elapsed = run_gate(str(tmp_path / "cedana-gate.sh"))
    assert status == 1
    assert elapsed < 2


def test_a_reused_pid_does_not_keep_it_waiting(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The writer's pid now belongs to another process (here: this one, which started
    at another time than the gate was told): `kill -0` would say the shim lives."""
    real = start_time
    monkeypatch.setattr(criu_config, "start_time", lambda pid: (real(pid) or 0) - 1)
    script, _ = write_gate(str(tmp_path), timeout=600)
    status, elapsed = run_gate(script)
    assert status == 1
    assert elapsed < 2


def test_while_the_shim_lives_it_waits(tmp_path: Path) -> None:
    script, verdict = write_gate(str(tmp_path), timeout=600)
    proc = subprocess.Popen(
        ["/bin/sh", script], env={**os.environ, "CRTOOLS_SCRIPT_ACTION": "post-restore"}
    )
    try:
        time.sleep(1.0)
        assert proc.poll() is None, "the gate gave up while its shim was alive"
        give_verdict(verdict, True)
        assert proc.wait(5) == 0
    finally:
        proc.kill()
        proc.wait()
