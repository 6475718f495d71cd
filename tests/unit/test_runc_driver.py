"""The runc driver against a fake runc: a Python script that records how it was
called, writes log.json lines and exits as told (trio's ``sys.executable`` habit)."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from cedana_shim import errors
from cedana_shim.runtime import criu_log
from cedana_shim.runtime.console import ConsoleSocket
from cedana_shim.runtime.reaper import Reaper
from cedana_shim.runtime.runc import (
    CheckpointOpts,
    CreateOpts,
    ExecOpts,
    RestoreOpts,
    Runc,
    RuncAlreadyExists,
    RuncError,
    RuncFailedPrecondition,
    RuncNotFound,
    RuncUnknown,
    Stdio,
    classify,
    read_pid_file,
)
from support.processes import run_with_reaper

FAKE_RUNC = r"""#!{python}
import json, os, signal, socket, sys, time

HERE = {here!r}
GLOBAL_WITH_VALUE = {{"--root", "--log", "--log-format", "--criu"}}
argv = sys.argv[1:]
i = 0
while i < len(argv) and argv[i].startswith("-"):
    i += 2 if argv[i] in GLOBAL_WITH_VALUE else 1
verb = argv[i]


def flag(name):
    return argv[argv.index(name) + 1] if name in argv else None


try:
    with open(os.path.join(HERE, "control.json")) as f:
        control = json.load(f).get(verb, {{}})
except FileNotFoundError:
    control = {{}}
if control.get("ignore_term"):
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
process = flag("--process")
record = {{
    "argv": argv,
    "pid": os.getpid(),
    "stdin": sys.stdin.read(),
    "notify_socket": os.environ.get("NOTIFY_SOCKET"),
    "process": open(process).read() if process else None,
}}
with open(os.path.join(HERE, "calls.jsonl"), "a") as f:
    f.write(json.dumps(record) + "\n")
log = flag("--log")
if log:
    with open(log, "a") as f:
        for entry in control.get("log", []):
            f.write((entry if isinstance(entry, str) else json.dumps(entry)) + "\n")
if "criu_log" in control:
    directory = flag("--work-path") or flag("--image-path")
    os.makedirs(directory, exist_ok=True)
    with open(os.path.join(directory, control["criu_log"]["name"]), "w") as f:
        f.write(control["criu_log"]["text"])
if control.get("console"):
    r, w = os.pipe()
    os.write(w, b"from-the-pty")
    os.close(w)
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.connect(flag("--console-socket"))
        socket.send_fds(s, [b"/dev/pts/fake"], [r])
sys.stdout.write(control.get("stdout", ""))
sys.stderr.write(control.get("stderr", ""))
sys.stdout.flush()
sys.stderr.flush()
time.sleep(control.get("sleep", 0))
sys.exit(control.get("exit", 0))
"""


class Fake:
    def __init__(self, tmp: Path) -> None:
        self.dir = tmp
        self.binary = tmp / "runc"
        self.binary.write_text(FAKE_RUNC.format(python=sys.executable, here=str(tmp)))
        self.binary.chmod(0o755)
        self.bundle = tmp / "bundle"
        self.bundle.mkdir()
        self.log = self.bundle / "log.json"
        self.root = str(tmp / "root")

    def control(self, **verbs: dict[str, Any]) -> None:
        (self.dir / "control.json").write_text(json.dumps(verbs))

    def calls(self) -> list[dict[str, Any]]:
        path = self.dir / "calls.jsonl"
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines()]

    def runc(self, reaper: Reaper, **kwargs: Any) -> Runc:
        kwargs.setdefault("log_path", str(self.log))
        return Runc(reaper=reaper, root=self.root, binary=str(self.binary), **kwargs)

    @property
    def g(self) -> list[str]:
        return ["--root", self.root, "--log", str(self.log), "--log-format", "json"]


@pytest.fixture
def fake(tmp_path: Path) -> Fake:
    return Fake(tmp_path)


def test_argv_per_verb(fake: Fake) -> None:
    fake.control(ps={"stdout": "[1, 22, 333]"}, state={"stdout": '{"id": "c1", "pid": 7}'})
    b = str(fake.bundle)

    async def body(reaper: Reaper) -> tuple[list[int], dict[str, Any]]:
        r = fake.runc(reaper)
        await r.create(
            "c1",
            CreateOpts(
                b,
                pid_file=f"{b}/init.pid",
                console_socket="/s.sock",
                no_pivot=True,
                no_new_keyring=True,
            ),
        )
        await r.create("c2", CreateOpts(b))
        await r.run("c3", CreateOpts(b, pid_file=f"{b}/init.pid"))
        await r.start("c1")
        await r.kill("c1", signal.SIGKILL, all=True)
        await r.kill("c1", 15)
        await r.delete("c1", force=True)
        await r.delete("c1")
        await r.pause("c1")
        await r.resume("c1")
        pids = await r.ps("c1")
        await r.update("c1", b'{"pids":{"limit":5}}')
        state = await r.state("c1")
        return pids, state

    pids, state = run_with_reaper(body)
    assert pids == [1, 22, 333]
    assert state == {"id": "c1", "pid": 7}
    argvs = [c["argv"] for c in fake.calls()]
    g = fake.g
    create = ["--pid-file", f"{b}/init.pid", "--console-socket", "/s.sock"]
    assert argvs == [
        [*g, "create", "--bundle", b, *create, "--no-pivot", "--no-new-keyring", "c1"],
        [*g, "create", "--bundle", b, "c2"],
        [*g, "run", "--detach", "--bundle", b, "--pid-file", f"{b}/init.pid", "c3"],
        [*g, "start", "c1"],
        [*g, "kill", "--all", "c1", "9"],
        [*g, "kill", "c1", "15"],
        [*g, "delete", "--force", "c1"],
        [*g, "delete", "c1"],
        [*g, "pause", "c1"],
        [*g, "resume", "c1"],
        [*g, "ps", "--format", "json", "c1"],
        [*g, "update", "--resources", "-", "c1"],
        [*g, "state", "c1"],
    ]
    assert fake.calls()[11]["stdin"] == '{"pids":{"limit":5}}'


def test_global_flags(fake: Fake) -> None:
    async def body(reaper: Reaper) -> None:
        r = fake.runc(reaper, log_path=None, systemd_cgroup=True, criu="/opt/criu", debug=True)
        assert r.global_args() == [
            "--root",
            fake.root,
            "--systemd-cgroup",
            "--criu",
            "/opt/criu",
            "--debug",
        ]
        await r.start("c1")

    run_with_reaper(body)
    expected = ["--root", fake.root, "--systemd-cgroup", "--criu", "/opt/criu", "--debug"]
    assert fake.calls()[0]["argv"] == [*expected, "start", "c1"]


def test_exec_passes_process_file_and_removes_it(fake: Fake) -> None:
    spec = b'{"args": ["sh"], "cwd": "/", "terminal": false}'

    async def body(reaper: Reaper) -> None:
        r = fake.runc(reaper)
        await r.exec("c1", ExecOpts(spec, pid_file="/b/e1.pid"))
        await r.exec("c1", ExecOpts(spec, detach=False, console_socket="/c.sock"))

    run_with_reaper(body)
    first, second = fake.calls()
    g = fake.g
    process = first["argv"][len(g) + 2]
    tail = ["--detach", "--pid-file", "/b/e1.pid", "c1"]
    assert first["argv"] == [*g, "exec", "--process", process, *tail]
    assert first["process"] == spec.decode()
    assert not os.path.exists(process)
    assert second["argv"][len(g) + 3 :] == ["--console-socket", "/c.sock", "c1"]


def test_exec_refuses_empty_spec() -> None:
    with pytest.raises(errors.InvalidArgument):
        ExecOpts(b"  ")


def test_checkpoint_and_restore_argv(fake: Fake) -> None:
    b = str(fake.bundle)

    async def body(reaper: Reaper) -> None:
        r = fake.runc(reaper)
        await r.checkpoint(
            "c1",
            CheckpointOpts(
                image_path="/img",
                work_path="/work",
                parent_path="../pre",
                leave_running=True,
                tcp_established=True,
                ext_unix_sk=True,
                shell_job=True,
                file_locks=True,
                empty_ns=("network", "uts"),
                page_server="10.0.0.1:27",
                manage_cgroups_mode="soft",
                pre_dump=True,
                auto_dedup=True,
            ),
        )
        await r.checkpoint("c1", CheckpointOpts(image_path="/img"))
        await r.restore(
            "c1",
            RestoreOpts(
                bundle=b,
                image_path="/img",
                work_path="/work",
                pid_file=f"{b}/init.pid",
                console_socket="/c.sock",
                no_pivot=True,
                tcp_established=True,
                ext_unix_sk=True,
                shell_job=True,
                file_locks=True,
                empty_ns=("network",),
                manage_cgroups_mode="full",
                lsm_profile="apparmor:x",
            ),
        )
        await r.restore("c1", RestoreOpts(bundle=b, image_path="/img", no_subreaper=False))

    run_with_reaper(body)
    g = fake.g
    # fmt: off
    checkpoint = [
        "--image-path", "/img", "--work-path", "/work", "--leave-running",
        "--tcp-established", "--ext-unix-sk", "--shell-job", "--file-locks",
        "--empty-ns", "network", "--empty-ns", "uts", "--parent-path", "../pre",
        "--page-server", "10.0.0.1:27", "--manage-cgroups-mode", "soft",
        "--pre-dump", "--auto-dedup",
    ]
    restore = [
        "--image-path", "/img", "--work-path", "/work", "--tcp-established",
        "--ext-unix-sk", "--shell-job", "--file-locks", "--empty-ns", "network",
        "--manage-cgroups-mode", "full", "--lsm-profile", "apparmor:x",
        "--detach", "--pid-file", f"{b}/init.pid", "--console-socket", "/c.sock",
        "--no-pivot", "--no-subreaper", "--bundle", b,
    ]
    # fmt: on
    assert [c["argv"] for c in fake.calls()] == [
        [*g, "checkpoint", *checkpoint, "c1"],
        [*g, "checkpoint", "--image-path", "/img", "c1"],
        [*g, "restore", *restore, "c1"],
        [*g, "restore", "--image-path", "/img", "--detach", "--bundle", b, "c1"],
    ]


def test_lazy_pages_status_fd_is_passed_through(fake: Fake) -> None:
    r_fd, w_fd = os.pipe()

    async def body(reaper: Reaper) -> None:
        opts = CheckpointOpts(image_path="/img", lazy_pages=True, status_fd=w_fd)
        await fake.runc(reaper).checkpoint("c1", opts)

    try:
        run_with_reaper(body)
        argv = fake.calls()[0]["argv"]
        assert argv[len(fake.g) + 3 :] == ["--lazy-pages", "--status-fd", str(w_fd), "c1"]
    finally:
        os.close(r_fd)
        os.close(w_fd)


@pytest.mark.parametrize(
    "kwargs",
    [
        {"manage_cgroups_mode": "loose"},
        {"empty_ns": ("",)},
        {"empty_ns": ("--leave-running",)},
        {"status_fd": 3},
        {"image_path": ""},
    ],
)
def test_checkpoint_opts_validate(kwargs: dict[str, Any]) -> None:
    kwargs = {"image_path": "/img", **kwargs}
    with pytest.raises(errors.InvalidArgument):
        CheckpointOpts(**kwargs)


@pytest.mark.parametrize(
    ("verb", "message", "cls", "base"),
    [
        ("kill", "container not running", RuncNotFound, errors.NotFound),
        ("kill", "no such process", RuncNotFound, errors.NotFound),
        ("kill", "os: process already finished", RuncNotFound, errors.NotFound),
        ("kill", "kill: ESRCH", RuncNotFound, errors.NotFound),
        ("kill", "container does not exist", RuncNotFound, errors.NotFound),
        ("delete", "container does not exist", RuncNotFound, errors.NotFound),
        ("state", 'container "c1" not found', RuncNotFound, errors.NotFound),
        (
            "create",
            "container with given ID already exists",
            RuncAlreadyExists,
            errors.AlreadyExists,
        ),
        ("pause", "container not running", RuncFailedPrecondition, errors.FailedPrecondition),
        ("resume", "container not paused", RuncFailedPrecondition, errors.FailedPrecondition),
        (
            "checkpoint",
            "Container cannot be checkpointed in stopped state",
            RuncFailedPrecondition,
            errors.FailedPrecondition,
        ),
        (
            "exec",
            "cannot exec in a stopped state",
            RuncFailedPrecondition,
            errors.FailedPrecondition,
        ),
        (
            "create",
            "unable to start container process: exec: no such file",
            RuncUnknown,
            errors.Unknown,
        ),
        ("kill", "operation not permitted", RuncUnknown, errors.Unknown),
        (
            "create",
            'unable to start container process: exec: "x": executable file not found in $PATH',
            RuncUnknown,
            errors.Unknown,
        ),
        (
            "exec",
            "cannot exec in a paused container",
            RuncFailedPrecondition,
            errors.FailedPrecondition,
        ),
    ],
)
def test_classify(
    verb: str, message: str, cls: type[RuncError], base: type[errors.ShimError]
) -> None:
    err = classify(verb, 1, message)
    assert type(err) is cls
    assert isinstance(err, base) and isinstance(err, RuncError)
    assert err.code == base.code
    assert (err.verb, err.exit_status, err.message) == (verb, 1, message)
    assert message in str(err) and verb in str(err)


def test_error_is_the_last_error_line_of_this_call(fake: Fake) -> None:
    fake.log.write_text(json.dumps({"level": "error", "msg": "stale error"}) + "\n")
    fake.control(
        start={
            "exit": 1,
            "stderr": "stderr text",
            "log": [
                {"level": "info", "msg": "starting"},
                {"level": "error", "msg": "first error"},
                "not json at all",
                {"level": "error", "msg": "container with given ID already exists"},
                {"level": "warning", "msg": "a warning after it"},
            ],
        }
    )

    async def body(reaper: Reaper) -> None:
        await fake.runc(reaper).start("c1")

    with pytest.raises(RuncAlreadyExists) as info:
        run_with_reaper(body)
    assert info.value.message == "container with given ID already exists"
    assert info.value.exit_status == 1


def test_stale_log_lines_are_not_reported(fake: Fake) -> None:
    fake.log.write_text(json.dumps({"level": "error", "msg": "container does not exist"}) + "\n")
    fake.control(pause={"exit": 2, "stderr": "  fresh complaint\n"})

    async def body(reaper: Reaper) -> None:
        await fake.runc(reaper).pause("c1")

    with pytest.raises(RuncUnknown) as info:
        run_with_reaper(body)
    assert info.value.message == "fresh complaint"
    assert info.value.exit_status == 2


def test_truncated_log_is_read_from_the_start(fake: Fake) -> None:
    # Someone rotated log.json between our size probe and the read.
    fake.log.write_text("x" * 10_000)
    fake.control(start={"exit": 1, "log": [{"level": "error", "msg": "after rotation"}]})

    async def body(reaper: Reaper) -> None:
        r = fake.runc(reaper)
        size = r._log_size()
        fake.log.write_text("")
        with pytest.raises(RuncUnknown) as info:
            await r._run("start", "c1", ["c1"])
        assert size == 10_000
        assert info.value.message == "after rotation"

    run_with_reaper(body)


def test_error_without_any_message(fake: Fake) -> None:
    fake.control(resume={"exit": 7})

    async def body(reaper: Reaper) -> None:
        await fake.runc(reaper).resume("c1")

    with pytest.raises(RuncUnknown, match="exit status 7"):
        run_with_reaper(body)


def test_delete_of_missing_container_is_not_an_error(fake: Fake) -> None:
    fake.control(delete={"exit": 1, "log": [{"level": "error", "msg": "container does not exist"}]})

    async def body(reaper: Reaper) -> None:
        await fake.runc(reaper).delete("c1", force=True)

    run_with_reaper(body)


def test_kill_of_exited_process_is_not_found(fake: Fake) -> None:
    fake.control(kill={"exit": 1, "log": [{"level": "error", "msg": "container not running"}]})

    async def body(reaper: Reaper) -> None:
        await fake.runc(reaper).kill("c1", 9)

    with pytest.raises(errors.NotFound):
        run_with_reaper(body)


def test_signal_death_is_reported_as_128_plus_signal(fake: Fake) -> None:
    fake.control(start={"sleep": 30})

    async def body(reaper: Reaper) -> None:
        task = asyncio.create_task(fake.runc(reaper).start("c1"))
        pid = await _wait_for_call(fake)
        os.kill(pid, signal.SIGKILL)
        with pytest.raises(RuncUnknown) as info:
            await task
        assert info.value.exit_status == 128 + signal.SIGKILL

    run_with_reaper(body)


def test_notify_socket_is_not_passed(fake: Fake, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("NOTIFY_SOCKET", "/run/systemd/notify")

    async def body(reaper: Reaper) -> None:
        await fake.runc(reaper).start("c1")

    run_with_reaper(body)
    assert fake.calls()[0]["notify_socket"] is None


def test_bad_json_output_is_internal(fake: Fake) -> None:
    fake.control(ps={"stdout": "not json"}, state={"stdout": "[1]"})

    async def body(reaper: Reaper) -> None:
        r = fake.runc(reaper)
        with pytest.raises(errors.Internal):
            await r.ps("c1")
        with pytest.raises(errors.Internal):
            await r.state("c1")

    run_with_reaper(body)


def test_ps_null_is_empty(fake: Fake) -> None:
    fake.control(ps={"stdout": "null"})

    async def body(reaper: Reaper) -> list[int]:
        return await fake.runc(reaper).ps("c1")

    assert run_with_reaper(body) == []


def test_missing_binary_is_internal(tmp_path: Path) -> None:
    async def body(reaper: Reaper) -> None:
        r = Runc(reaper=reaper, root=str(tmp_path), binary=str(tmp_path / "no-runc"))
        await r.start("c1")

    with pytest.raises(errors.Internal, match="cannot run"):
        run_with_reaper(body)


@pytest.mark.parametrize("verb", ["create", "run"])
def test_stdio_is_inherited_by_create(fake: Fake, verb: str) -> None:
    fake.control(**{verb: {"stdout": "to-container-stdout", "stderr": "to-container-stderr"}})
    in_r, in_w = os.pipe()
    out_r, out_w = os.pipe()
    err_r, err_w = os.pipe()
    os.write(in_w, b"container-stdin")
    os.close(in_w)

    async def body(reaper: Reaper) -> None:
        opts = CreateOpts(str(fake.bundle), stdio=Stdio(in_r, out_w, err_w))
        await getattr(fake.runc(reaper), verb)("c1", opts)

    try:
        run_with_reaper(body)
        os.close(out_w)
        os.close(err_w)
        out_w = err_w = -1
        assert fake.calls()[0]["stdin"] == "container-stdin"
        assert os.read(out_r, 100) == b"to-container-stdout"
        assert os.read(err_r, 100) == b"to-container-stderr"
    finally:
        for fd in (in_r, out_r, err_r, out_w, err_w):
            if fd >= 0:
                os.close(fd)


def test_create_without_stdio_gives_the_container_devnull(fake: Fake) -> None:
    # runc's output there is the container's: it must not land in a capture file
    # the container would hold open; so the error comes from log.json only.
    fake.control(create={"exit": 1, "stderr": "lost"})

    async def body(reaper: Reaper) -> None:
        await fake.runc(reaper).create("c1", CreateOpts(str(fake.bundle)))

    with pytest.raises(RuncUnknown, match="exit status 1"):
        run_with_reaper(body)


def test_console_socket_receives_the_master(fake: Fake) -> None:
    fake.control(create={"console": True, "exit": 1, "stderr": "runc said so"})

    async def body(reaper: Reaper) -> None:
        async with ConsoleSocket(base_dir=str(fake.dir)) as console:
            assert os.stat(os.path.dirname(console.path)).st_mode & 0o777 == 0o700
            opts = CreateOpts(str(fake.bundle), console_socket=console.path)
            # With a terminal runc's own output is captured, not the container's.
            with pytest.raises(RuncUnknown, match="runc said so"):
                await fake.runc(reaper).create("c1", opts)
            master = await console.receive_master(timeout=5)
            try:
                assert os.get_inheritable(master) is False
                assert os.read(master, 100) == b"from-the-pty"
            finally:
                os.close(master)
            path = console.path
        assert not os.path.exists(os.path.dirname(path))

    run_with_reaper(body)


def test_console_socket_times_out(tmp_path: Path) -> None:
    async def body() -> None:
        async with ConsoleSocket(base_dir=str(tmp_path)) as console:
            with pytest.raises(errors.DeadlineExceeded):
                await console.receive_master(timeout=0.1)

    asyncio.run(body())


def test_console_socket_peer_without_fd(tmp_path: Path) -> None:
    async def body() -> None:
        async with ConsoleSocket(base_dir=str(tmp_path)) as console:
            peer = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            peer.connect(console.path)
            peer.close()
            with pytest.raises(errors.Internal, match="without sending"):
                await console.receive_master(timeout=5)

    asyncio.run(body())


def _failing_dump(fake: Fake, work: Path, criu_log: str, runc_says: str = "") -> None:
    """runc checkpoint fails as it does when CRIU does, after CRIU wrote ``criu_log``."""
    said = runc_says or f"criu failed: type NOTIFY errno 0\nlog file: {work}/dump.log"
    fake.control(
        checkpoint={
            "exit": 1,
            "log": [{"level": "error", "msg": said}],
            "criu_log": {"name": "dump.log", "text": criu_log},
        }
    )


def _dump(fake: Fake, tmp_path: Path, keep_log_in: Path | None = None) -> RuncError:
    async def body(reaper: Reaper) -> None:
        opts = CheckpointOpts(image_path=str(tmp_path / "img"), work_path=str(tmp_path / "work"))
        await fake.runc(reaper).checkpoint(
            "c1", opts, keep_log_in=str(keep_log_in) if keep_log_in else None
        )

    with pytest.raises(RuncUnknown) as info:
        run_with_reaper(body)
    return info.value


def test_criu_dump_log_is_kept_in_the_bundle(fake: Fake, tmp_path: Path) -> None:
    _failing_dump(fake, tmp_path / "work", "(00.1) a\n(00.2) Error (criu/x.c:1): boom\n")
    err = _dump(fake, tmp_path)
    kept = fake.bundle / "criu-dump.log"
    assert kept.read_text().endswith("boom\n")
    assert err.message == f"criu: Error (criu/x.c:1): boom; criu log: {kept}"


def test_a_failed_dump_says_criu_s_first_error_not_runc_s(fake: Fake, tmp_path: Path) -> None:
    """CRIU's log of a process of another user dumped without CAP_SYS_RESOURCE, as CRIU
    4.2 writes it: the error about CRIU's own fd limit comes first and is not the
    reason; the cascade after the reason is not either."""
    _failing_dump(
        fake,
        tmp_path / "work",
        "(00.106813) Dumping processes (pid: 26794 comm: python3)\n"
        "(00.106832) Error (criu/util.c:1534): rlimit: Can't setup RLIMIT_NOFILE for self: "
        "Operation not permitted\n"
        "(00.107356) cg: Dumping cgroups for thread 26880\n"
        "(00.113408) Error (criu/cr-dump.c:389): Can't get rlimit 0: Operation not permitted\n"
        "(00.113411) Error (criu/cr-dump.c:1584): Dump core (pid: 26794) failed with -1\n"
        "(00.119079) Error (criu/cr-dump.c:1975): Dumping FAILED.\n",
    )
    err = _dump(fake, tmp_path)
    assert err.message.startswith(
        "criu: Error (criu/cr-dump.c:389): Can't get rlimit 0: Operation not permitted; "
    ), err.message
    assert "NOTIFY" not in str(err)


def test_the_older_runc_wording_is_replaced_too(fake: Fake, tmp_path: Path) -> None:
    runc_says = f"criu failed: type DUMP errno 0 path= {tmp_path}/work/dump.log"
    _failing_dump(fake, tmp_path / "work", "Error (criu/x.c:1): boom\n", runc_says)
    assert _dump(fake, tmp_path).message.startswith("criu: Error (criu/x.c:1): boom; criu log: ")


def test_runc_s_own_message_stays_beside_criu_s(fake: Fake, tmp_path: Path) -> None:
    fake.control(
        checkpoint={
            "exit": 1,
            "log": [{"level": "error", "msg": "cannot write state.json"}],
            "criu_log": {"name": "dump.log", "text": "pie: 12: Error (criu/pie/x.c:5): bad fd\n"},
        }
    )
    err = _dump(fake, tmp_path)
    assert err.message.startswith(
        "cannot write state.json; criu: Error (criu/pie/x.c:5): bad fd; criu log: "
    ), err.message


def test_criu_logs_are_kept_bounded_outside_the_bundle(fake: Fake, tmp_path: Path) -> None:
    """With a keep dir (the store's, which outlives the container): the tail of each
    log, at most criu_log.KEEP_FILES of them, the newest kept."""
    keep = tmp_path / "kept"
    big = "(00.1) x\n" * (criu_log.KEEP_BYTES // 9 + 100) + "(00.2) Error (criu/x.c:1): last\n"
    _failing_dump(fake, tmp_path / "work", big)
    err = _dump(fake, tmp_path, keep)
    (first,) = keep.iterdir()
    assert err.message.endswith(f"; criu log: {first}")
    assert first.name.endswith("-c1-dump.log")
    assert first.stat().st_size == criu_log.KEEP_BYTES
    assert first.read_text().endswith("Error (criu/x.c:1): last\n")
    assert first.stat().st_mode & 0o777 == 0o600 and keep.stat().st_mode & 0o777 == 0o700
    assert not (fake.bundle / "criu-dump.log").exists()


def test_old_copies_of_criu_logs_are_removed(tmp_path: Path) -> None:
    keep, source = tmp_path / "kept", tmp_path / "dump.log"
    paths = []
    for n in range(criu_log.KEEP_FILES + 3):
        source.write_text(f"Error (criu/x.c:1): failure {n}\n")
        paths.append(criu_log.keep(str(source), str(keep), "c1-dump.log"))
    assert sorted(str(p) for p in keep.iterdir()) == paths[3:]
    assert Path(paths[-1]).read_text() == f"Error (criu/x.c:1): failure {criu_log.KEEP_FILES + 2}\n"


def test_criu_restore_log_is_kept_and_stale_logs_ignored(fake: Fake, tmp_path: Path) -> None:
    img = tmp_path / "img"
    img.mkdir()
    (img / "restore.log").write_text("Error: from an older restore\n")
    fake.control(restore={"exit": 1, "log": [{"level": "error", "msg": "bundle is wrong"}]})

    async def body(reaper: Reaper) -> None:
        opts = RestoreOpts(bundle=str(fake.bundle), image_path=str(img))
        await fake.runc(reaper).restore("c1", opts)

    with pytest.raises(RuncUnknown) as info:
        run_with_reaper(body)
    assert info.value.message == "bundle is wrong"
    assert not (fake.bundle / "criu-restore.log").exists()

    fake.control(
        restore={
            "exit": 1,
            "criu_log": {"name": "restore.log", "text": "Error (criu/cr-restore.c:9): no pid\n"},
        }
    )
    with pytest.raises(RuncUnknown) as info:
        run_with_reaper(body)
    kept = fake.bundle / "criu-restore.log"
    assert info.value.message == (
        f"exit status 1; criu: Error (criu/cr-restore.c:9): no pid; criu log: {kept}"
    )


async def _wait_for_call(fake: Fake, n: int = 1) -> int:
    deadline = time.monotonic() + 10
    while len(fake.calls()) < n:
        assert time.monotonic() < deadline, "fake runc never started"
        await asyncio.sleep(0.01)
    return int(fake.calls()[n - 1]["pid"])


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


@pytest.mark.parametrize("ignore_term", [False, True])
def test_cancellation_terminates_and_reaps_runc(fake: Fake, ignore_term: bool) -> None:
    fake.control(start={"sleep": 60, "ignore_term": ignore_term})
    grace = 0.3

    async def body(reaper: Reaper) -> tuple[int, float]:
        task = asyncio.create_task(fake.runc(reaper, kill_grace=grace).start("c1"))
        pid = await _wait_for_call(fake)
        await asyncio.sleep(0.2)  # let the fake install its SIGTERM disposition
        started = time.monotonic()
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        return pid, time.monotonic() - started

    pid, elapsed = run_with_reaper(body)
    assert _gone(pid)  # reaped: not even a zombie
    if ignore_term:
        assert grace <= elapsed < grace + 5
    else:
        assert elapsed < grace


def test_cancelled_again_while_terminating_still_waits(fake: Fake) -> None:
    fake.control(start={"sleep": 60, "ignore_term": True})

    async def body(reaper: Reaper) -> int:
        task = asyncio.create_task(fake.runc(reaper, kill_grace=0.5).start("c1"))
        pid = await _wait_for_call(fake)
        await asyncio.sleep(0.2)
        task.cancel()
        await asyncio.sleep(0.1)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        assert _gone(pid)
        return pid

    run_with_reaper(body)


def test_timeout_around_a_call(fake: Fake) -> None:
    fake.control(start={"sleep": 60})

    async def body(reaper: Reaper) -> None:
        with pytest.raises(TimeoutError):
            async with asyncio.timeout(0.3):
                await fake.runc(reaper).start("c1")
        assert _gone(await _wait_for_call(fake))

    run_with_reaper(body)


def test_read_pid_file(tmp_path: Path) -> None:
    path = tmp_path / "init.pid"
    with pytest.raises(errors.NotFound):
        read_pid_file(str(path))
    path.write_text("")
    with pytest.raises(errors.Internal):
        read_pid_file(str(path))
    path.write_text("1234")
    assert read_pid_file(str(path)) == 1234
