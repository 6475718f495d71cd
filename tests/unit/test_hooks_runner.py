"""The hook runner with real child processes: small ``sys.executable`` scripts
written into tmp_path as hook executables (trio's habit), run both under a real
Reaper (as the shim daemon does) and with the standalone pidfd spawn."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import sys
import time
from collections.abc import Callable, Coroutine
from pathlib import Path
from typing import Any, TypeVar

import pytest
from cedana_shim import errors
from cedana_shim.hooks import (
    HookConfigError,
    HookFailed,
    HookReport,
    HookState,
    ProcessHookRunner,
    Stage,
    StubHookRunner,
    pidfd_spawn,
    reaper_spawn,
)
from cedana_shim.runtime.reaper import Reaper

T = TypeVar("T")
Body = Callable[[ProcessHookRunner], Coroutine[Any, Any, T]]

SPEC: dict[str, Any] = {
    "ociVersion": "1.0.2-dev",
    "process": {"args": ["/usr/bin/postgres", "-D", "/data"]},
    "annotations": {"io.example/db": "pg", "cedana.ai/checkpoint.id": "spoofed"},
    "mounts": [],
}


def state(**over: Any) -> HookState:
    fields: dict[str, Any] = {
        "container_id": "c1",
        "bundle": "/run/containerd/c1",
        "status": "running",
        "pid": 4242,
        "spec": SPEC,
        "checkpoint_id": "ck-1",
        "checkpoint_path": "/var/lib/cedana/staging/ck-1/criu",
    }
    return HookState(**{**fields, **over})


class Hooks:
    """A hooks.d directory plus the hook executables it names."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.dir = tmp / "hooks.d"
        self.dir.mkdir()
        self.out = tmp / "out"
        self.out.mkdir()

    def script(self, name: str, body: str) -> str:
        path = self.tmp / name
        path.write_text(
            f"#!{sys.executable}\nimport json, os, sys, time\nOUT = {str(self.out)!r}\n{body}"
        )
        path.chmod(0o755)
        return str(path)

    def add(
        self,
        name: str,
        body: str = "",
        *,
        stages: tuple[str, ...] = ("precheckpoint", "postcheckpoint", "prerestore", "postrestore"),
        when: dict[str, Any] | None = None,
        **hook: Any,
    ) -> None:
        """A hook that appends its name to OUT/order, then runs ``body``."""
        record = f"with open(os.path.join(OUT, 'order'), 'a') as f: f.write({name!r} + '\\n')\n"
        hook.setdefault("path", self.script(name.removesuffix(".json"), record + body))
        doc = {
            "version": "1.0.0",
            "hook": hook,
            "when": when or {"always": True},
            "stages": list(stages),
        }
        (self.dir / name).write_text(json.dumps(doc))

    def order(self) -> list[str]:
        path = self.out / "order"
        return path.read_text().splitlines() if path.exists() else []

    def read(self, name: str) -> Any:
        return json.loads((self.out / name).read_text())


@pytest.fixture
def hooks(tmp_path: Path) -> Hooks:
    return Hooks(tmp_path)


@pytest.fixture(params=["reaper", "pidfd"])
def drive(request: pytest.FixtureRequest, hooks: Hooks) -> Callable[..., Any]:
    """Run ``body(runner)`` in a fresh loop; under a Reaper that owns SIGCHLD
    (the daemon's setup) or with the standalone spawn."""

    def run(body: Body[T], **kwargs: Any) -> T:
        async def main() -> T:
            if request.param == "pidfd":
                runner = ProcessHookRunner([str(hooks.dir)], spawn=pidfd_spawn, **kwargs)
                return await asyncio.wait_for(body(runner), 10)
            reaper = Reaper()
            reaper.install()
            try:
                runner = ProcessHookRunner([str(hooks.dir)], spawn=reaper_spawn(reaper), **kwargs)
                return await asyncio.wait_for(body(runner), 10)
            finally:
                reaper.close()

        return asyncio.run(main())

    return run


def run_stage(
    drive: Callable[..., Any], stage: Stage, st: HookState | None = None, **kw: Any
) -> Any:
    async def body(runner: ProcessHookRunner) -> HookReport:
        return await runner.run(stage, st or state())

    return drive(body, **kw)


def gone(pid: int) -> bool:
    """Dead: no such process, or a zombie waiting for its (new) parent."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except FileNotFoundError:
        return True
    return stat.rsplit(")", 1)[1].split()[0] in ("Z", "X")


def wait_gone(*pids: int) -> bool:
    deadline = time.monotonic() + 3
    while time.monotonic() < deadline:
        if all(gone(p) for p in pids):
            return True
        time.sleep(0.02)
    return False


# -- what a hook receives -----------------------------------------------------------


def test_stdin_is_the_oci_state_with_checkpoint_annotations(hooks: Hooks, drive: Any) -> None:
    hooks.add(
        "10-state.json",
        "data = sys.stdin.buffer.read()\nopen(os.path.join(OUT, 'stdin'), 'wb').write(data)\n",
    )
    report = run_stage(drive, Stage.PRECHECKPOINT)
    assert report.ok and [r.name for r in report.results] == ["10-state.json"]
    raw = (hooks.out / "stdin").read_bytes()
    assert json.loads(raw) == {
        "ociVersion": "1.0.2-dev",
        "id": "c1",
        "status": "running",
        "pid": 4242,
        "bundle": "/run/containerd/c1",
        "annotations": {
            "io.example/db": "pg",
            # the container's own value cannot pose as the checkpoint's
            "cedana.ai/checkpoint.id": "ck-1",
            "cedana.ai/checkpoint.path": "/var/lib/cedana/staging/ck-1/criu",
            "cedana.ai/checkpoint.stage": "precheckpoint",
        },
    }
    assert list(json.loads(raw)) == ["ociVersion", "id", "status", "pid", "bundle", "annotations"]


def test_post_stage_state_carries_outcome(hooks: Hooks, drive: Any) -> None:
    hooks.add(
        "10-state.json", "json.dump(json.load(sys.stdin), open(os.path.join(OUT, 's'), 'w'))\n"
    )
    run_stage(drive, Stage.POSTCHECKPOINT, state(status="stopped", outcome="failed"))
    annotations = hooks.read("s")["annotations"]
    assert annotations["cedana.ai/checkpoint.stage"] == "postcheckpoint"
    assert annotations["cedana.ai/checkpoint.outcome"] == "failed"
    assert hooks.read("s")["status"] == "stopped"


def test_env_replaces_and_argv0_is_args0(hooks: Hooks, drive: Any) -> None:
    dump = (
        "import json, os, sys; "
        "json.dump({'argv': sys.orig_argv, 'env': dict(os.environ)}, open(sys.argv[1], 'w'))"
    )
    hooks.add(
        "10-env.json",
        path=sys.executable,
        args=["custom-argv0", "-c", dump, str(hooks.out / "seen")],
        env=["A=1", "B=x=y", "PYTHONCOERCECLOCALE=0"],
    )
    run_stage(drive, Stage.PRECHECKPOINT)
    seen = hooks.read("seen")
    assert seen["argv"][0] == "custom-argv0"  # execv semantics: path and argv[0] differ
    assert seen["env"] == {"A": "1", "B": "x=y", "PYTHONCOERCECLOCALE": "0"}


def test_no_env_inherits_the_shims(
    hooks: Hooks, drive: Any, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setenv("HOOK_TEST_MARK", "inherited")
    hooks.add(
        "10-env.json", "open(os.path.join(OUT, 'mark'), 'w').write(os.environ['HOOK_TEST_MARK'])\n"
    )
    run_stage(drive, Stage.PRECHECKPOINT)
    assert (hooks.out / "mark").read_text() == "inherited"


# -- order and selection ----------------------------------------------------------------


def test_matching_hooks_run_in_file_name_order(hooks: Hooks, drive: Any) -> None:
    hooks.add("10-a.json")
    hooks.add("02-b.json", when={"commands": ["postgres$"]})
    hooks.add("01-C.json", when={"annotations": {"^io\\.example/db$": "^pg$"}})
    hooks.add("05-other-db.json", when={"annotations": {"^io\\.example/db$": "^mysql$"}})
    hooks.add("03-restore-only.json", stages=("prerestore",))
    report = run_stage(drive, Stage.PRECHECKPOINT)
    assert hooks.order() == ["01-C.json", "02-b.json", "10-a.json"]
    assert [r.name for r in report.results] == hooks.order()
    assert all(r.status == 0 and r.duration > 0 for r in report.results)


def test_no_hooks_directory_is_an_empty_report(tmp_path: Path) -> None:
    runner = ProcessHookRunner([str(tmp_path / "absent")])
    report = asyncio.run(runner.run(Stage.PRERESTORE, state()))
    assert report == HookReport(Stage.PRERESTORE) and report.ok


def test_oci_stages_are_runcs(tmp_path: Path) -> None:
    runner = ProcessHookRunner([str(tmp_path)])
    with pytest.raises(errors.InvalidArgument, match=r"run by runc from config\.json"):
        asyncio.run(runner.run(Stage.PRESTART, state()))


# -- failures ------------------------------------------------------------------------------

FAIL = "sys.stderr.write('database not quiesced\\n'); sys.exit(7)\n"


def test_pre_stage_failure_raises_and_stops_later_hooks(hooks: Hooks, drive: Any) -> None:
    hooks.add("10-ok.json")
    hooks.add("20-fail.json", FAIL)
    hooks.add("30-later.json")
    with pytest.raises(HookFailed) as caught:
        run_stage(drive, Stage.PRECHECKPOINT)
    err = caught.value
    assert hooks.order() == ["10-ok.json", "20-fail.json"]
    message = str(err)
    assert str(hooks.dir / "20-fail.json") in message
    assert message.startswith("precheckpoint hook ")
    assert "exit status 7" in message and "database not quiesced" in message
    assert err.code == errors.Code.FAILED_PRECONDITION
    assert err.result.status == 7 and err.result.output == "database not quiesced\n"
    assert [r.name for r in err.report.results] == ["10-ok.json", "20-fail.json"]


def test_post_stage_failure_is_reported_not_raised(hooks: Hooks, drive: Any) -> None:
    hooks.add("10-ok.json")
    hooks.add("20-fail.json", FAIL)
    hooks.add("30-later.json")
    report = run_stage(drive, Stage.POSTCHECKPOINT)
    assert hooks.order() == ["10-ok.json", "20-fail.json", "30-later.json"]
    assert not report.ok
    [failure] = report.failures
    assert (failure.name, failure.status, failure.output) == (
        "20-fail.json",
        7,
        "database not quiesced\n",
    )
    assert failure.describe() == "exit status 7"


def test_exec_error(hooks: Hooks, drive: Any) -> None:
    hooks.add("10-missing.json", path=str(hooks.tmp / "no-such-hook"))
    report = run_stage(drive, Stage.POSTCHECKPOINT)
    [result] = report.failures
    assert result.status is None and "No such file or directory" in result.error
    with pytest.raises(HookFailed, match=r"could not run: .*no-such-hook: No such file"):
        run_stage(drive, Stage.PRECHECKPOINT)


def test_script_without_interpreter_line_is_an_exec_error(hooks: Hooks, drive: Any) -> None:
    path = hooks.tmp / "noshebang"
    path.write_text("echo hi\n")
    path.chmod(0o755)
    hooks.add("10-x.json", path=str(path))
    [result] = run_stage(drive, Stage.POSTCHECKPOINT).failures
    assert result.status is None and "Exec format error" in result.error


def test_killed_by_signal_reads_as_128_plus_signal(hooks: Hooks, drive: Any) -> None:
    hooks.add("10-x.json", "os.kill(os.getpid(), 15)\n")
    [result] = run_stage(drive, Stage.POSTCHECKPOINT).failures
    assert result.status == 128 + signal.SIGTERM and not result.timed_out


def test_output_is_captured_and_bounded(hooks: Hooks, drive: Any) -> None:
    body = (
        "sys.stdout.write('to-stdout\\n'); sys.stdout.flush()\n"
        "sys.stderr.write('x' * 200_000 + 'THE-END\\n'); sys.exit(3)\n"
    )
    hooks.add("10-chatty.json", body)
    [result] = run_stage(drive, Stage.POSTCHECKPOINT, output_limit=1024).failures
    assert len(result.output) == 1024 and result.output.endswith("xxTHE-END\n")
    assert result.dropped == len("to-stdout\n") + 200_000 + len("THE-END\n") - 1024


def test_stdout_and_stderr_interleave_in_order(hooks: Hooks, drive: Any) -> None:
    body = (
        "print('one', flush=True); print('two', file=sys.stderr, flush=True)\n"
        "print('three')\nsys.exit(1)\n"
    )
    hooks.add("10-x.json", body)
    [result] = run_stage(drive, Stage.POSTCHECKPOINT).failures
    assert result.output == "one\ntwo\nthree\n" and result.dropped == 0


def test_error_message_quotes_only_the_end_of_long_output(hooks: Hooks, drive: Any) -> None:
    hooks.add("10-x.json", "sys.stderr.write('a' * 10_000 + 'LAST'); sys.exit(1)\n")
    with pytest.raises(HookFailed) as caught:
        run_stage(drive, Stage.PRERESTORE)
    assert len(caught.value.result.output) == 10_004  # the error keeps it all
    assert str(caught.value).endswith("; output: ..." + ("a" * 4092) + "LAST")


# -- timeouts and cancellation: nothing is left behind ---------------------------------

FORK_AND_SLEEP = """
child = os.fork()
if child == 0:
    time.sleep(60)
    os._exit(0)
open(os.path.join(OUT, 'pids'), 'w').write(json.dumps([os.getpid(), child]))
print('started', flush=True)
time.sleep(60)
"""


def test_timeout_kills_the_whole_process_group(hooks: Hooks, drive: Any) -> None:
    hooks.add("10-slow.json", FORK_AND_SLEEP)
    hooks.add("20-next.json")
    started = time.monotonic()
    report = run_stage(drive, Stage.POSTCHECKPOINT, default_timeout=0.5)
    assert time.monotonic() - started < 5
    [result] = report.failures
    assert result.timed_out and result.status == 128 + signal.SIGKILL
    assert result.timeout == 0.5 and result.output == "started\n"
    assert result.describe() == "timed out after 0.5s (process group killed)"
    leader, grandchild = hooks.read("pids")
    assert wait_gone(leader, grandchild)
    assert hooks.order() == ["10-slow.json", "20-next.json"]  # a post stage carries on


def test_pre_stage_timeout_raises(hooks: Hooks, drive: Any) -> None:
    hooks.add("10-slow.json", "time.sleep(60)\n")
    with pytest.raises(HookFailed, match=r"prerestore hook .*10-slow.json .* timed out after 0.3s"):
        run_stage(drive, Stage.PRERESTORE, default_timeout=0.3)


def test_file_timeout_overrides_the_default(hooks: Hooks, drive: Any) -> None:
    hooks.add("10-x.json", timeout=7)
    [result] = run_stage(drive, Stage.PRECHECKPOINT, default_timeout=0.1).results
    assert result.ok and result.timeout == 7.0


def test_cancelling_the_stage_kills_the_hook(hooks: Hooks, drive: Any) -> None:
    hooks.add("10-slow.json", FORK_AND_SLEEP)
    pids_file = hooks.out / "pids"

    async def body(runner: ProcessHookRunner) -> None:
        task = asyncio.ensure_future(runner.run(Stage.PRECHECKPOINT, state()))
        while not pids_file.exists() or not pids_file.read_text():
            await asyncio.sleep(0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task

    drive(body)
    leader, grandchild = hooks.read("pids")
    assert wait_gone(leader, grandchild)


def test_a_child_left_holding_the_output_does_not_hang_the_stage(hooks: Hooks, drive: Any) -> None:
    body = """
child = os.fork()
if child == 0:
    time.sleep(30)
    os._exit(0)
open(os.path.join(OUT, 'left'), 'w').write(str(child))
print('bye', flush=True)
"""
    hooks.add("10-x.json", body)
    started = time.monotonic()
    try:
        [result] = run_stage(drive, Stage.PRECHECKPOINT).results
        assert result.ok and result.output == "bye\n"
        assert time.monotonic() - started < 5
    finally:
        os.kill(int((hooks.out / "left").read_text()), signal.SIGKILL)


# -- hooks.d problems ----------------------------------------------------------------------


def test_unusable_file_fails_pre_stages_closed_and_is_reported_in_post(
    hooks: Hooks, drive: Any
) -> None:
    hooks.add("10-ok.json")
    (hooks.dir / "20-broken.json").write_text('{"version": "1.0.0", "hook": {"path": "rel"}}')
    with pytest.raises(HookConfigError, match=r"20-broken\.json: hook\.path: must be an absolute"):
        run_stage(drive, Stage.PRECHECKPOINT)
    assert hooks.order() == []
    report = run_stage(drive, Stage.POSTCHECKPOINT)
    assert hooks.order() == ["10-ok.json"]
    assert not report.ok and report.failures == ()
    [problem] = report.config_errors
    assert "20-broken.json" in problem


def test_edits_take_effect_at_the_next_stage(hooks: Hooks) -> None:
    runner = ProcessHookRunner([str(hooks.dir)])

    async def body() -> tuple[HookReport, HookReport]:
        first = await runner.run(Stage.PRECHECKPOINT, state())
        hooks.add("10-new.json")
        return first, await runner.run(Stage.PRECHECKPOINT, state())

    first, second = asyncio.run(body())
    assert first.results == () and [r.name for r in second.results] == ["10-new.json"]


# -- logs ------------------------------------------------------------------------------------


def test_failures_are_logged_with_structured_fields(
    hooks: Hooks, drive: Any, caplog: pytest.LogCaptureFixture
) -> None:
    hooks.add("10-ok.json")
    hooks.add("20-fail.json", FAIL)
    with caplog.at_level(logging.INFO, logger="cedana_shim.hooks.runner"):
        run_stage(drive, Stage.POSTRESTORE)
    ran, failed = caplog.records
    assert (ran.levelno, ran.getMessage()) == (logging.INFO, "hook ran")
    assert failed.levelno == logging.WARNING
    fields = vars(failed)
    assert fields["stage"] == "postrestore" and fields["container"] == "c1"
    assert fields["checkpoint"] == "ck-1" and fields["hook"] == "20-fail.json"
    assert fields["status"] == 7 and fields["output"] == "database not quiesced\n"
    assert fields["error"] == "exit status 7"


# -- the stub ------------------------------------------------------------------------------


def test_stub_records_and_fails_like_the_real_runner() -> None:
    stub = StubHookRunner()
    stub.fail(Stage.PRECHECKPOINT, "no")
    stub.fail(Stage.POSTCHECKPOINT)

    async def body() -> HookReport:
        with pytest.raises(HookFailed, match=r"precheckpoint hook .* exit status 1; output: no"):
            await stub.run(Stage.PRECHECKPOINT, state())
        assert (await stub.run(Stage.PRERESTORE, state())).ok
        return await stub.run(Stage.POSTCHECKPOINT, state(outcome="failed"))

    report = asyncio.run(body())
    assert not report.ok and len(report.failures) == 1
    assert stub.stages == [Stage.PRECHECKPOINT, Stage.PRERESTORE, Stage.POSTCHECKPOINT]
    assert stub.calls[2][1].outcome == "failed"


def test_state_refuses_unknown_outcome() -> None:
    with pytest.raises(ValueError, match="outcome"):
        state(outcome="maybe")
