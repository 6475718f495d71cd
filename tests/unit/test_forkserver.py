"""The fork server as real processes: it removes its socket however it ends, is named
for `ps`, names the daemons it forks like containerd's shims, retires once its code is
replaced (never in the middle of a fork), and sweeps dead sockets from the run dir."""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import socket
import struct
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from cedana_shim.cli import forkserver
from cedana_shim.cli.fork_client import (
    MAGIC,
    STALE_SOCKET_AGE,
    U32,
    answers,
    request_fork,
    spawn_server,
)
from cedana_shim.cli.paths import code_fingerprint
from cedana_shim.cli.proctitle import SHIM_NAME
from cedana_shim.cli.spare import SPARE_NAME
from support.processes import proc_stats

PACKAGE = Path(forkserver.__file__).resolve().parents[1]  # .../cedana_shim


def wait_until(predicate: Callable[[], object], timeout: float = 20.0, what: str = "") -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what or predicate}"
        time.sleep(0.02)


def argv_of(pid: int) -> list[str]:
    raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    return [a.decode() for a in raw.split(b"\0") if a]


def comm_of(pid: int) -> str:
    return Path(f"/proc/{pid}/comm").read_text().strip()


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def peer_pid(path: Path) -> int:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.connect(str(path))
        creds = s.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid: int = struct.unpack("3i", creds)[0]
    return pid


def fingerprint_in(pythonpath: Path | None) -> str:
    if pythonpath is None:
        return code_fingerprint()
    code = "from cedana_shim.cli.paths import code_fingerprint; print(code_fingerprint())"
    env = {**os.environ, "PYTHONPATH": str(pythonpath)}
    out = subprocess.run(
        [sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True
    )
    return out.stdout.strip()


class Servers:
    """Fork servers started by a test, all stopped at its end."""

    def __init__(self, run_dir: Path) -> None:
        self.run_dir = run_dir
        self.procs: list[subprocess.Popen[bytes]] = []

    def start(
        self,
        pythonpath: Path | None = None,
        *,
        env: dict[str, str] | None = None,
        prelude: str = "",
    ) -> tuple[subprocess.Popen[bytes], Path]:
        path = self.run_dir / f"forkserver-{fingerprint_in(pythonpath)}.sock"
        full_env = {**os.environ, **(env or {})}
        if pythonpath is not None:
            full_env["PYTHONPATH"] = str(pythonpath)
        code = "\n".join(
            ["import sys", "from cedana_shim.cli import forkserver as f", prelude,
             f"sys.exit(f.serve({str(path)!r}))"]
        )  # fmt: skip
        proc = subprocess.Popen([sys.executable, "-c", code], env=full_env)
        self.procs.append(proc)
        wait_until(lambda: answers(str(path)) or proc.poll() is not None, what="the server")
        assert proc.poll() is None, f"the fork server exited with {proc.returncode}"
        return proc, path

    def stop_all(self) -> None:
        for proc in self.procs:
            proc.kill()
            proc.wait()


@pytest.fixture
def run_dir() -> Iterator[Path]:
    # Short, under /tmp: a socket path must fit AF_UNIX's 108 bytes, and pytest's
    # tmp_path (longer still under xdist) does not always.
    directory = Path(tempfile.mkdtemp(prefix="fs-", dir="/tmp"))
    directory.chmod(0o700)
    yield directory
    shutil.rmtree(directory, ignore_errors=True)


@pytest.fixture
def servers(run_dir: Path) -> Iterator[Servers]:
    started = Servers(run_dir)
    yield started
    started.stop_all()


@pytest.fixture
def daemons() -> Iterator[list[int]]:
    """Pids of daemons a test had forked; killed at its end."""
    pids: list[int] = []
    yield pids
    for pid in pids:
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


def fork_a_daemon(server: Path, bundle: Path, args: list[str]) -> int:
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(str(bundle / "shim.sock"))
    listener.listen(1)
    try:
        return request_fork(str(server), [listener.fileno()], args, str(bundle), {}, b"")
    finally:
        listener.close()


# -- exit paths ---------------------------------------------------------------------------


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT, signal.SIGHUP])
def test_a_signal_ends_the_server_and_removes_its_socket(
    servers: Servers, sig: signal.Signals
) -> None:
    """Before: SIGTERM left the socket behind (nine were found in one run dir)."""
    proc, path = servers.start()
    proc.send_signal(sig)
    assert proc.wait(10) == 0
    assert not path.exists()


def test_an_idle_server_exits_and_removes_its_socket(servers: Servers) -> None:
    proc, path = servers.start(env={"CEDANA_FORKSERVER_IDLE": "0.5"})
    assert proc.wait(10) == 0
    assert not path.exists()


class HalfRequest:
    """A fork request sent in two halves: between them the server is inside it."""

    def __init__(self, server: Path, bundle: Path) -> None:
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(str(bundle / "shim.sock"))
        self.listener.listen(1)
        argv = ["-namespace", "ns", "-id", "c1", "-address", "/run/ctrd.sock"]
        fields = [str(bundle), str(len(argv)), *argv]
        self.rest = b"".join(U32.pack(len(f.encode())) + f.encode() for f in fields)
        self.client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.client.connect(str(server))
        rights = struct.pack("i", self.listener.fileno())
        head = MAGIC + U32.pack(len(fields))
        self.client.sendmsg([head], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, rights)])

    def finish(self) -> int:
        """Send the rest; the pid of the daemon the server forked."""
        self.client.sendall(self.rest)
        self.client.shutdown(socket.SHUT_WR)
        reply = self.client.recv(100).decode()
        self.client.close()
        self.listener.close()
        word, _, pid = reply.partition(" ")
        assert word == "pid", reply
        return int(pid)


def test_a_stop_signal_waits_for_the_fork_in_progress(
    servers: Servers, tmp_path: Path, daemons: list[int]
) -> None:
    """A server stopped between a request and its reply would leave `start` to fork a
    second daemon for the same socket."""
    proc, path = servers.start()
    request = HalfRequest(path, tmp_path)
    time.sleep(0.3)
    proc.send_signal(signal.SIGTERM)
    time.sleep(0.3)
    assert proc.poll() is None, "the server left in the middle of a request"
    daemons.append(request.finish())
    assert proc.wait(10) == 0
    assert not path.exists()


# -- names in ps ----------------------------------------------------------------------------


def test_ps_shows_the_template_and_its_daemons_by_what_they_are(
    run_dir: Path, tmp_path: Path, daemons: list[int]
) -> None:
    """Before: both read `python -m cedana_shim.cli.forkserver /run/cedana/...`. The
    server is started as `start` starts it, with a pod id and a containerd address as
    long as Kubernetes' to prove that the daemon's title fits."""
    path = run_dir / f"forkserver-{code_fingerprint()}.sock"
    spawn_server(str(path))
    wait_until(lambda: answers(str(path)), what="the fork server")
    server = peer_pid(path)
    try:
        assert argv_of(server) == [SHIM_NAME, "template"]
        assert comm_of(server) == forkserver.TEMPLATE_NAME
        pod = "f" * 64
        address = "/run/containerd/containerd.sock"
        bundle = tmp_path / "bundle"
        bundle.mkdir()
        argv = ["-namespace", "k8s.io", "-id", pod, "-address", address]
        daemon = fork_a_daemon(path, bundle, [*argv, "-publish-binary", "/usr/bin/containerd"])
        daemons.append(daemon)
        expected = [SHIM_NAME, *argv]
        wait_until(lambda: argv_of(daemon) == expected, what=f"the title {expected}")
        assert comm_of(daemon) == "containerd-shim"
    finally:
        os.kill(server, signal.SIGTERM)
        wait_until(lambda: not alive(server), what="the server to exit")
        with contextlib.suppress(ChildProcessError):
            os.waitpid(server, 0)  # spawned by this process: reap it
    assert not path.exists()


def test_a_spawned_server_imports_the_code_its_caller_runs(run_dir: Path, tmp_path: Path) -> None:
    """`start` run by the node's launcher (`python -IS`, a sys.path of its own): before,
    the server was started with the interpreter's default path and imported whatever
    cedana_shim that found (or none)."""
    site = copy_package(tmp_path)
    fingerprint = fingerprint_in(site)
    path = run_dir / f"forkserver-{fingerprint}.sock"
    start = (
        "import sys; sys.path.insert(0, sys.argv[1]);"
        "from cedana_shim.cli.fork_client import spawn_server; spawn_server(sys.argv[2])"
    )
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    subprocess.run([sys.executable, "-I", "-c", start, str(site), str(path)], env=env, check=True)
    wait_until(lambda: answers(str(path)), what="the fork server")
    server = peer_pid(path)
    try:
        # It serves (a server that imported other code than its name says exits at
        # once), and its code is the copy's: the code this test runs is another.
        assert fingerprint != code_fingerprint()
        assert forkserver.ask_to_check(str(path)) == "current"
        change_code(site)
        assert forkserver.ask_to_check(str(path)) == "retiring"
    finally:
        os.kill(server, signal.SIGTERM)
        wait_until(lambda: not alive(server), what="the server to exit")
    assert not path.exists()


# -- retirement -----------------------------------------------------------------------------


def copy_package(where: Path) -> Path:
    root = where / "site"
    shutil.copytree(PACKAGE, root / "cedana_shim", ignore=shutil.ignore_patterns("__pycache__"))
    return root


def change_code(root: Path) -> None:
    init = root / "cedana_shim" / "__init__.py"
    init.write_text(init.read_text() + "\n# reinstalled\n")


def test_a_server_whose_code_was_replaced_retires_when_a_new_one_serves(
    servers: Servers, tmp_path: Path
) -> None:
    """Before: it idled on for an hour; twenty reinstalls, twenty servers."""
    site = copy_package(tmp_path)
    old, old_path = servers.start(site)
    change_code(site)
    new, new_path = servers.start(site)
    assert new_path != old_path
    assert old.wait(10) == 0
    assert not old_path.exists()
    assert new.poll() is None and answers(str(new_path))


def test_a_server_of_another_install_that_is_still_current_stays(
    servers: Servers, tmp_path: Path
) -> None:
    other = copy_package(tmp_path / "other")
    site = copy_package(tmp_path / "site")
    change_code(site)  # a different fingerprint from `other`, both on disk
    kept, kept_path = servers.start(other)
    servers.start(site)
    time.sleep(1.0)
    assert kept.poll() is None and answers(str(kept_path))


def test_an_idle_server_notices_on_its_own_that_its_code_was_replaced(
    servers: Servers, tmp_path: Path
) -> None:
    site = copy_package(tmp_path)
    proc, path = servers.start(site, prelude="f.CURRENCY_CHECK = 0.2")
    time.sleep(0.5)
    assert proc.poll() is None
    change_code(site)
    assert proc.wait(10) == 0
    assert not path.exists()


def test_a_retiring_server_finishes_the_fork_in_progress_first(
    servers: Servers, tmp_path: Path, daemons: list[int]
) -> None:
    site = copy_package(tmp_path)
    proc, path = servers.start(site)
    request = HalfRequest(path, tmp_path)
    time.sleep(0.3)
    change_code(site)
    answer: list[str] = []
    asking = threading.Thread(target=lambda: answer.append(forkserver.ask_to_check(str(path))))
    asking.start()
    time.sleep(0.3)
    assert proc.poll() is None
    daemons.append(request.finish())
    asking.join(10)
    assert answer == ["retiring"]
    assert proc.wait(10) == 0
    assert not path.exists()


# -- run dir hygiene ------------------------------------------------------------------------


def dead_socket(path: Path) -> None:
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.bind(str(path))


def test_a_new_server_removes_dead_sockets_from_the_run_dir(
    servers: Servers, run_dir: Path
) -> None:
    """SIGKILLed servers and daemons cannot remove their sockets."""
    (run_dir / "s").mkdir()
    dead_server = run_dir / "forkserver-0123456789abcdef01234567.sock"
    dead_daemon = run_dir / "s" / ("d" * 16)
    live_daemon = run_dir / "s" / ("1" * 16)
    dead_socket(dead_server)
    dead_socket(dead_daemon)
    live = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    live.bind(str(live_daemon))
    live.listen(1)
    other_file = run_dir / "notes.txt"
    other_file.write_text("not ours")
    time.sleep(STALE_SOCKET_AGE + 0.2)
    young = run_dir / "s" / ("y" * 16)
    dead_socket(young)  # may be between bind() and listen(): kept
    try:
        servers.start()
        assert not dead_server.exists()
        assert not dead_daemon.exists()
        assert live_daemon.exists() and young.exists() and other_file.exists()
    finally:
        live.close()


def test_a_servers_kind_and_fingerprint_are_in_its_socket_name() -> None:
    """The shim's servers keep their name; a server of another kind forks what its
    template forks (the Slurm runner's: job keepers)."""
    shim, slurm = "/run/x/forkserver-ab12.sock", "/run/x/forkserver-slurm-ab12.sock"
    assert (forkserver.kind_of(shim), forkserver.fingerprint_of(shim)) == ("", "ab12")
    assert (forkserver.kind_of(slurm), forkserver.fingerprint_of(slurm)) == ("slurm", "ab12")
    assert forkserver.fingerprint_of("/run/x/other.sock") == ""
    assert type(forkserver.template_for("slurm")).__name__ == "KeeperTemplate"
    with pytest.raises(ValueError, match="no fork server template of kind 'nope'"):
        forkserver.template_for("nope")


# -- spares ---------------------------------------------------------------------------------


def spares_of(server: int) -> list[int]:
    return [
        pid
        for pid, fields in proc_stats()
        if int(fields[1]) == server and alive(pid) and comm_of(pid) == SPARE_NAME
    ]


def test_a_server_keeps_a_spare_that_becomes_the_next_daemon(
    servers: Servers, tmp_path: Path, daemons: list[int]
) -> None:
    """The spare forked after each answer has its event loop made before the request."""
    proc, path = servers.start()
    wait_until(lambda: spares_of(proc.pid), what="a spare")
    [spare] = spares_of(proc.pid)
    assert argv_of(spare) == [SHIM_NAME, "template", "spare"]
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    daemon = fork_a_daemon(path, bundle, ["-namespace", "ns", "-id", "c1", "-address", "/x"])
    daemons.append(daemon)
    assert daemon == spare
    wait_until(lambda: comm_of(daemon) == "containerd-shim", what="the spare to be the daemon")
    wait_until(lambda: [p for p in spares_of(proc.pid) if p != spare], what="the next spare")
    assert len(spares_of(proc.pid)) == 1


def test_a_spare_ends_with_its_server(servers: Servers) -> None:
    proc, _ = servers.start()
    wait_until(lambda: spares_of(proc.pid), what="a spare")
    [spare] = spares_of(proc.pid)
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(10) == 0
    wait_until(lambda: not alive(spare), what="the spare to exit")


def test_a_request_is_forked_for_when_the_spare_is_gone(
    servers: Servers, tmp_path: Path, daemons: list[int]
) -> None:
    proc, path = servers.start()
    wait_until(lambda: spares_of(proc.pid), what="a spare")
    [spare] = spares_of(proc.pid)
    os.kill(spare, signal.SIGKILL)
    wait_until(lambda: not alive(spare), what="the spare to die")
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    daemon = fork_a_daemon(path, bundle, ["-namespace", "ns", "-id", "c1", "-address", "/x"])
    daemons.append(daemon)
    assert daemon != spare
    wait_until(lambda: comm_of(daemon) == "containerd-shim", what="the forked daemon")
