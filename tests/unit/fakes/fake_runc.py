"""A fake runc that runs containers as plain host processes, for root-free tests.

:meth:`FakeRunc.install` writes an executable ``runc`` (``#!sys.executable -S``,
trio's habit) that runs :func:`main`; ``cedana_shim.runtime.runc.Runc`` drives it
unchanged. Per-container state lives in ``<--root>/<id>/state``:

* ``create`` forks the init, which starts a session of its own (its process
  group is the container) and blocks on ``exec.fifo`` until ``start`` reads
  it, then execs the bundle's ``process.args`` with the stdio runc was given
  (or a pty sent over ``--console-socket``). The init's env carries
  ``FAKE_RUNC_MEMORY``: a file standing for the process's memory. ``run
  --detach`` is the two in one call.
* ``kill [--all]``, ``delete [--force]``, ``pause``/``resume`` (SIGSTOP/SIGCONT
  to every process group of the container), ``ps --format json``, ``state``,
  ``update``, ``exec`` (a process group of its own, recorded with the container).
* ``checkpoint`` writes ``inventory.img``, ``pstree.img`` and ``pages-1.img``
  (the memory file's content) into ``--image-path``; without
  ``--leave-running`` the container is killed and destroyed, as runc does.
* ``restore`` starts the bundle's process again with its memory file seeded
  from ``pages-1.img``; it runs the CRIU config's ``action-script`` (the shim's
  restore gate) at post-restore before letting the process run, and fails like
  CRIU when the images carry a ``bad`` marker or are missing. With
  ``--lazy-pages`` it fails like CRIU unless a lazy-pages daemon listens in the
  work dir, and tells that daemon when the restore is finished.
* Run as ``criu lazy-pages`` (the ``criu`` executable installed beside ``runc``),
  it stands for CRIU's lazy-pages daemon: a marker file in ``--work-dir`` for its
  socket, a byte on ``--status-fd`` once it "listens", exit 0 once the restore
  said it finished (after ``sleep``: the pages still arriving), or exit 1 with
  ``error`` (before listening) or ``die`` (after the restore).

Failure injection: the control file next to the executable maps a verb to
``{"error": msg, "sleep": s, "bad_images": bool}`` (``bad_images`` for
checkpoint, and ``error_with_parent``: fail only a dump given ``--parent-path``,
which otherwise is checked and linked as ``parent`` as CRIU does;
:meth:`FakeRunc.control` writes it). Errors go to ``--log`` as
runc's json lines (level error), exit status 1. Every call's argv is recorded
(:meth:`FakeRunc.calls`).

The processes it starts are detached: the test process must be a child
subreaper to reap them (``cedana_shim.runtime.reaper.set_child_subreaper``).

Every runc call starts this program anew, so it starts fast: it is compiled once
per install, its own files are marshal (json only where runc speaks json), and
it imports nothing it can do without. One file on purpose (over the usual
length): the executable is exactly this module.
"""

from __future__ import annotations

import marshal
import os
import select
import signal
import sys
import time

TYPE_CHECKING = False
if TYPE_CHECKING:  # typing costs the fake's every start a few ms
    from typing import Any

CONTROL_FILE = "fake-runc-control"  # marshal: {verb: {setting: value}}
CALLS_FILE = "fake-runc-calls"  # marshal records: each call's argv
GROUPS_FILE = "fake-runc-groups"  # every process group started, one pgid a line
CODE_FILE = "fake-runc.code"  # this module, compiled once per install
MEMORY_ENV = "FAKE_RUNC_MEMORY"
INVENTORY_IMAGE = "inventory.img"
PSTREE_IMAGE = "pstree.img"
PAGES_IMAGE = "pages-1.img"
BAD_MARKER = "bad"
LAZY_SOCKET = "lazy-pages.socket"  # a plain file here: the daemon "listens"
LAZY_FINISHED = "lazy-pages.finished"  # the restore told the daemon it is done
CRIU_CONFIG_ANNOTATION = "org.criu.config"
VERSION = "runc version 1.1.12 (fake)\ncommit: fake\nspec: 1.0.2-dev\n"
DEFAULT_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
GLOBAL_WITH_VALUE = {"--root", "--log", "--log-format", "--criu"}
WITH_VALUE = {
    "--bundle",
    "--console-socket",
    "--empty-ns",
    "--format",
    "--image-path",
    "--images-dir",
    "--log-file",
    "--lsm-profile",
    "--manage-cgroups-mode",
    "--page-server",
    "--parent-path",
    "--pid-file",
    "--process",
    "--resources",
    "--status-fd",
    "--work-dir",
    "--work-path",
}
WAIT_SECONDS = 5.0  # for a process to die, stop, or reach its exec


class Fail(Exception):
    """runc refuses: the message goes to --log at level error, exit status 1."""


# -- the executable ------------------------------------------------------------------


class Call:
    def __init__(self, argv: list[str]) -> None:
        self.globals: dict[str, str] = {}
        i = 0
        while i < len(argv) and argv[i].startswith("-"):
            if argv[i] in GLOBAL_WITH_VALUE:
                self.globals[argv[i]] = argv[i + 1]
                i += 2
            else:
                self.globals[argv[i]] = ""
                i += 1
        self.verb = argv[i] if i < len(argv) else ""
        self.flags: dict[str, str] = {}
        self.args: list[str] = []
        i += 1
        while i < len(argv):
            if argv[i] in WITH_VALUE:
                self.flags[argv[i]] = argv[i + 1]
                i += 2
            elif argv[i].startswith("--"):
                self.flags[argv[i]] = ""
                i += 1
            else:
                self.args.append(argv[i])
                i += 1
        self.root = self.globals.get("--root", "/run/runc")
        self.here = os.path.dirname(os.path.abspath(sys.argv[0]))

    @property
    def id(self) -> str:
        if not self.args:
            raise Fail(f'"{self.verb}" requires a container id')
        return self.args[0]

    def control(self) -> dict[str, Any]:
        try:
            with open(os.path.join(self.here, CONTROL_FILE), "rb") as f:
                verbs = marshal.load(f)
        except FileNotFoundError:
            return {}
        found = verbs.get(self.verb, {})
        return found if isinstance(found, dict) else {}

    def log_error(self, message: str) -> None:
        import json

        path = self.globals.get("--log")
        if not path:
            sys.stderr.write(message + "\n")
            return
        entry = {"level": "error", "msg": message, "time": time.strftime("%FT%TZ")}
        with open(path, "a") as f:
            f.write(json.dumps(entry) + "\n")


def main(argv: list[str]) -> int:
    if argv[:1] in (["--version"], ["-v"]):
        sys.stdout.write(VERSION)
        return 0
    call = Call(argv)
    with open(os.path.join(call.here, CALLS_FILE), "ab") as f:
        f.write(marshal.dumps(argv))
    verb = VERBS.get(call.verb)
    try:
        if verb is None:
            raise Fail(f"unknown command {call.verb!r}")
        return verb(call)
    except Fail as err:
        call.log_error(str(err))
        return 1


# -- container state -----------------------------------------------------------------


def _dir(call: Call, container_id: str) -> str:
    return os.path.join(call.root, container_id)


def _load(call: Call) -> dict[str, Any]:
    try:
        with open(os.path.join(_dir(call, call.id), "state"), "rb") as f:
            state: dict[str, Any] = marshal.load(f)
    except FileNotFoundError:
        raise Fail("container does not exist") from None
    return state


def _save(call: Call, state: dict[str, Any]) -> None:
    path = os.path.join(_dir(call, state["id"]), "state")
    with open(path + ".tmp", "wb") as f:
        marshal.dump(state, f)
    os.rename(path + ".tmp", path)


def _destroy(call: Call, container_id: str) -> None:
    directory = _dir(call, container_id)
    for name in os.listdir(directory):
        os.unlink(os.path.join(directory, name))
    os.rmdir(directory)


def _write_pid_file(call: Call, pid: int) -> None:
    path = call.flags.get("--pid-file")
    if path:  # runc writes it atomically too
        with open(path + ".tmp", "w") as f:
            f.write(str(pid))
        os.rename(path + ".tmp", path)


def proc_stat(pid: int) -> tuple[str, int, int] | None:
    """(state letter, process group, start time) from /proc, or None if gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as f:
            data = f.read().decode(errors="replace")
    except OSError:
        return None
    fields = data[data.rindex(")") + 2 :].split()
    return fields[0], int(fields[2]), int(fields[19])


def _alive(pid: int, start: int) -> bool:
    stat = proc_stat(pid)
    return stat is not None and stat[0] not in "ZX" and stat[2] == start


def group_members(pgids: list[int]) -> list[int]:
    """Live (not zombie) processes of these process groups."""
    wanted = set(pgids)
    found = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            stat = proc_stat(int(name))
            if stat is not None and stat[1] in wanted and stat[0] not in "ZX":
                found.append(int(name))
    return sorted(found)


def _status(state: dict[str, Any]) -> str:
    if not _alive(state["pid"], state["start"]):
        return "stopped"
    return str(state["status"])


def _signal_groups(pgids: list[int], sig: int) -> None:
    for pgid in pgids:
        try:
            os.killpg(pgid, sig)
        except (ProcessLookupError, PermissionError):
            continue  # that group is gone (its pgid may even be someone else's now)


def _wait_for(done: Any, what: str) -> None:
    deadline = time.monotonic() + WAIT_SECONDS
    while not done():
        if time.monotonic() > deadline:
            raise Fail(f"timed out waiting for {what}")
        time.sleep(0.002)


def _kill_and_wait(state: dict[str, Any]) -> None:
    _signal_groups(state["pgids"], signal.SIGKILL)
    _wait_for(lambda: not group_members(state["pgids"]), "the container's processes to die")


def _read_spec(bundle: str) -> dict[str, Any]:
    import json

    try:
        with open(os.path.join(bundle, "config.json")) as f:
            spec: dict[str, Any] = json.load(f)
    except (OSError, ValueError) as err:
        raise Fail(f"cannot load the bundle's config.json: {err}") from None
    return spec


# -- starting processes --------------------------------------------------------------


def _which(program: str, env: dict[str, str]) -> str | None:
    if "/" in program:
        return program if os.access(program, os.X_OK) else None
    for directory in env.get("PATH", DEFAULT_PATH).split(":"):
        path = os.path.join(directory, program)
        if os.path.isfile(path) and os.access(path, os.X_OK):
            return path
    return None


def _spawn(
    call: Call, process: dict[str, Any], *, bundle: str, memory: str, fifo: str | None
) -> int:
    """Fork a session leader that (after ``fifo`` is read, if any) execs ``process``."""
    args = [str(a) for a in process.get("args") or []]
    if not args:
        raise Fail("args must not be empty")
    env = dict(str(item).partition("=")[::2] for item in process.get("env") or [])
    env[MEMORY_ENV] = memory
    program = _which(args[0], env)
    if program is None:
        raise Fail(
            "runc create failed: unable to start container process: exec: "
            f'"{args[0]}": executable file not found in $PATH'
        )
    cwd = str(process.get("cwd") or bundle)
    if not os.path.isdir(cwd):
        cwd = bundle
    console = call.flags.get("--console-socket")
    master = slave = None
    if console:
        master, slave = os.openpty()
    pid = os.fork()
    if pid == 0:
        _child(program, args, env, cwd, fifo, slave)
    with open(os.path.join(call.here, GROUPS_FILE), "a") as f:
        f.write(f"{pid}\n")
    if master is not None and slave is not None and console:
        import socket

        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.connect(console)
            socket.send_fds(s, [os.ttyname(slave).encode()], [master])
        os.close(master)
        os.close(slave)
    return pid


def _child(
    program: str, args: list[str], env: dict[str, str], cwd: str, fifo: str | None, tty: int | None
) -> None:
    try:
        os.setsid()
        # Python ignores these; the container's program must not inherit that.
        signal.signal(signal.SIGPIPE, signal.SIG_DFL)
        signal.signal(signal.SIGXFSZ, signal.SIG_DFL)
        if tty is not None:
            import fcntl
            import termios

            fcntl.ioctl(tty, termios.TIOCSCTTY, 0)
            for fd in (0, 1, 2):
                os.dup2(tty, fd)
        if fifo is not None:
            fd = os.open(fifo, os.O_WRONLY | os.O_CLOEXEC)  # blocks until `start`
            os.write(fd, b"0")
            os.close(fd)
        os.chdir(cwd)
        os.execve(program, args, env)
    except BaseException as err:
        try:
            os.write(2, f"fake runc: cannot run {program}: {err}\n".encode())
        finally:
            os._exit(127)


def _release(fifo: str, pid: int, start: int) -> None:
    """Let an init blocked on ``fifo`` exec its program (runc's exec.fifo handshake)."""
    fd = os.open(fifo, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    try:
        poller = select.poll()
        poller.register(fd, select.POLLIN)
        deadline = time.monotonic() + WAIT_SECONDS
        while True:
            if poller.poll(10) and os.read(fd, 1):
                break
            if not _alive(pid, start):
                raise Fail("cannot start a container that has stopped")
            if time.monotonic() > deadline:
                raise Fail("timed out waiting for the container's init")
    finally:
        os.close(fd)
    os.unlink(fifo)


def _new_state(container_id: str, bundle: str, pid: int, status: str) -> dict[str, Any]:
    stat = proc_stat(pid)
    return {
        "id": container_id,
        "bundle": bundle,
        "pid": pid,
        "start": stat[2] if stat else -1,
        "status": status,
        "pgids": [pid],
        "created": time.time(),
    }


def _make_dir(call: Call) -> str:
    directory = _dir(call, call.id)
    os.makedirs(call.root, mode=0o711, exist_ok=True)
    try:
        os.mkdir(directory, 0o711)
    except FileExistsError:
        raise Fail("container with given ID already exists") from None
    return directory


# -- verbs ---------------------------------------------------------------------------


def create(call: Call) -> int:
    bundle = os.path.abspath(call.flags.get("--bundle") or os.getcwd())
    spec = _read_spec(bundle)
    directory = _make_dir(call)
    try:
        fifo = os.path.join(directory, "exec.fifo")
        os.mkfifo(fifo, 0o600)
        memory = os.path.join(directory, "memory")
        pid = _spawn(call, spec.get("process") or {}, bundle=bundle, memory=memory, fifo=fifo)
    except BaseException:
        _destroy(call, call.id)
        raise
    _save(call, _new_state(call.id, bundle, pid, "created"))
    _write_pid_file(call, pid)
    return 0


def start(call: Call) -> int:
    state = _load(call)
    status = _status(state)
    if status == "stopped":
        raise Fail("cannot start a container that has stopped")
    if status != "created":
        raise Fail("cannot start an already running container")
    _release(os.path.join(_dir(call, call.id), "exec.fifo"), state["pid"], state["start"])
    state["status"] = "running"
    _save(call, state)
    return 0


def run(call: Call) -> int:
    create(call)
    return start(call)


def state(call: Call) -> int:
    import json

    current = _load(call)
    status = _status(current)
    out = {
        "ociVersion": "1.0.2-dev",
        "id": current["id"],
        "pid": 0 if status == "stopped" else current["pid"],
        "status": status,
        "bundle": current["bundle"],
        "rootfs": os.path.join(current["bundle"], "rootfs"),
        "created": time.strftime("%FT%TZ", time.gmtime(current["created"])),
        "owner": "",
    }
    sys.stdout.write(json.dumps(out, indent=2) + "\n")
    return 0


def _parse_signal(text: str) -> int:
    if text.isdigit():
        return int(text)
    name = text.upper()
    name = name if name.startswith("SIG") else "SIG" + name
    try:
        return int(signal.Signals[name])
    except KeyError:
        raise Fail(f"unknown signal {text!r}") from None


def kill(call: Call) -> int:
    current = _load(call)
    sig = _parse_signal(call.args[1] if len(call.args) > 1 else "SIGTERM")
    if "--all" in call.flags:
        _signal_groups(current["pgids"], sig)
        return 0
    if _status(current) == "stopped":
        raise Fail("container not running")
    try:
        os.kill(current["pid"], sig)
    except ProcessLookupError:
        raise Fail("container not running") from None
    return 0


def delete(call: Call) -> int:
    current = _load(call)
    status = _status(current)
    if status in ("running", "paused") and "--force" not in call.flags:
        raise Fail(f"cannot delete container {call.id} that is not stopped: {status}")
    _kill_and_wait(current)
    _destroy(call, call.id)
    return 0


def _wait_stopped(pgids: list[int]) -> None:
    def all_stopped() -> bool:
        states = (proc_stat(pid) for pid in group_members(pgids))
        return all(s is None or s[0] in "tT" for s in states)

    _wait_for(all_stopped, "the container to freeze")


def pause(call: Call) -> int:
    current = _load(call)
    if _status(current) != "running":
        raise Fail("container not running")
    _signal_groups(current["pgids"], signal.SIGSTOP)
    _wait_stopped(current["pgids"])
    current["status"] = "paused"
    _save(call, current)
    return 0


def resume(call: Call) -> int:
    current = _load(call)
    if _status(current) != "paused":
        raise Fail("container not paused")
    _signal_groups(current["pgids"], signal.SIGCONT)
    current["status"] = "running"
    _save(call, current)
    return 0


def ps(call: Call) -> int:
    current = _load(call)
    if call.flags.get("--format") != "json":
        raise Fail("only --format json is faked")
    sys.stdout.write("[" + ", ".join(map(str, group_members(current["pgids"]))) + "]\n")
    return 0


def exec_(call: Call) -> int:
    import json

    current = _load(call)
    status = _status(current)
    if status == "stopped":
        raise Fail("cannot exec in a stopped container")
    if status == "paused":
        raise Fail("cannot exec in a paused container (use --ignore-paused to override)")
    try:
        with open(call.flags["--process"]) as f:
            process = json.load(f)
    except (KeyError, OSError, ValueError) as err:
        raise Fail(f"exec needs a readable --process file: {err}") from None
    memory = os.path.join(_dir(call, call.id), "memory")
    pid = _spawn(call, process, bundle=current["bundle"], memory=memory, fifo=None)
    current["pgids"].append(pid)
    _save(call, current)
    _write_pid_file(call, pid)
    if "--detach" in call.flags:
        return 0
    _, status_word = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status_word) & 0xFF


def update(call: Call) -> int:
    current = _load(call)
    if _status(current) == "stopped":
        raise Fail("container not running")
    current["resources"] = sys.stdin.read()
    _save(call, current)
    return 0


def _criu_failed(call: Call, log_dir: str, log_name: str, kind: str, why: str) -> Fail:
    with open(os.path.join(log_dir, log_name), "a") as f:
        f.write(f"Error (criu/fake.c:1): {why}\n")
    return Fail(f"criu failed: type {kind} errno 0\nlog file: {os.path.join(log_dir, log_name)}")


def checkpoint(call: Call) -> int:
    current = _load(call)
    status = _status(current)
    if status not in ("running", "paused"):
        raise Fail(f"Container cannot be checkpointed in {status} state")
    control = call.control()
    image = call.flags.get("--image-path") or os.path.join(os.getcwd(), "checkpoint")
    work = call.flags.get("--work-path") or image
    os.makedirs(work, exist_ok=True)
    with open(os.path.join(work, "dump.log"), "a") as f:
        f.write(f"fake criu: dumping {call.id}\n")
    time.sleep(float(control.get("sleep", 0)))
    if control.get("error"):
        raise _criu_failed(call, work, "dump.log", "NOTIFY", str(control["error"]))
    memory = os.path.join(_dir(call, call.id), "memory")
    try:
        with open(memory, "rb") as f:
            pages = f.read()
    except FileNotFoundError:
        pages = b""
    os.makedirs(image, exist_ok=True)
    parent = call.flags.get("--parent-path")
    if parent:  # as runc and CRIU check it, then CRIU's link to it
        if os.path.isabs(parent) or not os.path.isdir(os.path.join(image, parent)):
            raise Fail(f"invalid --parent-path: {parent}")
        if control.get("error_with_parent"):
            raise _criu_failed(call, work, "dump.log", "NOTIFY", str(control["error_with_parent"]))
        os.symlink(parent, os.path.join(image, "parent"))
    inventory = {"id": call.id, "pid": current["pid"], "taken": time.time()}
    with open(os.path.join(image, INVENTORY_IMAGE), "wb") as f:
        marshal.dump(inventory, f)
    with open(os.path.join(image, PSTREE_IMAGE), "wb") as f:
        marshal.dump(group_members(current["pgids"]), f)
    with open(os.path.join(image, PAGES_IMAGE), "wb") as f:
        f.write(pages)
    if control.get("bad_images"):
        with open(os.path.join(image, BAD_MARKER), "w") as f:
            f.write("restoring these images fails\n")
    if "--leave-running" not in call.flags:
        _kill_and_wait(current)
        _destroy(call, call.id)
    return 0


def _action_script(spec: dict[str, Any]) -> str:
    """The CRIU config's action-script, as CRIU would read it through runc."""
    path = (spec.get("annotations") or {}).get(CRIU_CONFIG_ANNOTATION)
    if not path:
        return ""
    try:
        with open(path) as f:
            lines = f.read().splitlines()
    except FileNotFoundError:
        return ""
    for line in lines:
        key, _, value = line.strip().partition(" ")
        if key == "action-script":
            return value.strip()
    return ""


def _run_action_script(script: str, action: str) -> int:
    env = {**os.environ, "CRTOOLS_SCRIPT_ACTION": action}
    pid = os.posix_spawn(script, [script], env)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status)


def restore(call: Call) -> int:
    bundle = os.path.abspath(call.flags.get("--bundle") or os.getcwd())
    image = call.flags.get("--image-path") or os.path.join(os.getcwd(), "checkpoint")
    work = call.flags.get("--work-path") or image
    if os.path.exists(_dir(call, call.id)):
        raise Fail("container with given ID already exists")
    control = call.control()
    os.makedirs(work, exist_ok=True)
    with open(os.path.join(work, "restore.log"), "a") as f:
        f.write(f"fake criu: restoring {call.id} from {image}\n")
    time.sleep(float(control.get("sleep", 0)))
    if control.get("error"):
        raise _criu_failed(call, work, "restore.log", "RESTORE", str(control["error"]))
    if os.path.exists(os.path.join(image, BAD_MARKER)):
        raise _criu_failed(call, work, "restore.log", "RESTORE", "the images are marked bad")
    lazy = "--lazy-pages" in call.flags
    if lazy and not os.path.exists(os.path.join(work, LAZY_SOCKET)):
        why = f"uffd: connect to {LAZY_SOCKET} failed: No such file or directory"
        raise _criu_failed(call, work, "restore.log", "RESTORE", why)
    try:
        with open(os.path.join(image, PAGES_IMAGE), "rb") as f:
            pages = f.read()
        with open(os.path.join(image, INVENTORY_IMAGE), "rb") as f:
            marshal.load(f)
    except (OSError, ValueError) as err:
        why = f"no usable images: {err}"
        raise _criu_failed(call, work, "restore.log", "RESTORE", why) from None
    spec = _read_spec(bundle)
    directory = _make_dir(call)
    memory = os.path.join(directory, "memory")
    with open(memory, "wb") as f:
        f.write(pages)
    try:
        fifo = os.path.join(directory, "exec.fifo")
        os.mkfifo(fifo, 0o600)
        pid = _spawn(call, spec.get("process") or {}, bundle=bundle, memory=memory, fifo=fifo)
        started = _new_state(call.id, bundle, pid, "running")
        script = _action_script(spec)
        if script and _run_action_script(script, "post-restore") != 0:
            _kill_and_wait(started)
            raise _criu_failed(
                call, work, "restore.log", "RESTORE", "action script failed at post-restore"
            )
        _release(fifo, pid, started["start"])
    except BaseException:
        _destroy(call, call.id)
        raise
    started["restored_from"] = os.path.abspath(image)
    _save(call, started)
    _write_pid_file(call, pid)
    if lazy:
        with open(os.path.join(work, LAZY_FINISHED), "w"):
            pass
    return 0


def lazy_pages(call: Call) -> int:
    """``criu lazy-pages``: see the module docstring."""
    control = call.control()
    work = call.flags["--work-dir"]
    if control.get("error"):
        sys.stderr.write(f"Error (criu/uffd.c:1): {control['error']}\n")
        return 1
    os.makedirs(work, exist_ok=True)
    with open(os.path.join(work, LAZY_SOCKET), "w"):
        pass
    status_fd = int(call.flags["--status-fd"])
    os.write(status_fd, b"\0")
    os.close(status_fd)
    deadline = time.monotonic() + 600
    while not os.path.exists(os.path.join(work, LAZY_FINISHED)):
        if time.monotonic() > deadline:
            return 1
        time.sleep(0.005)
    time.sleep(float(control.get("sleep", 0)))
    if control.get("die"):
        sys.stderr.write(f"Error (criu/uffd.c:2): {control['die']}\n")
        return 1
    return 0


VERBS = {
    "create": create,
    "start": start,
    "run": run,
    "state": state,
    "kill": kill,
    "delete": delete,
    "pause": pause,
    "resume": resume,
    "ps": ps,
    "exec": exec_,
    "update": update,
    "checkpoint": checkpoint,
    "restore": restore,
    "lazy-pages": lazy_pages,
}


# -- the tests' side -----------------------------------------------------------------

WRAPPER = """#!{python} -S
import marshal
with open({code!r}, "rb") as f:
    code = marshal.load(f)
exec(code, {{"__name__": "__main__", "__file__": {source!r}}})
"""


class FakeRunc:
    """The fake installed in ``directory``: its executable, control file and state."""

    def __init__(self, directory: str) -> None:
        self.dir = directory
        self.binary = os.path.join(directory, "runc")
        self.criu = os.path.join(directory, "criu")  # only its lazy-pages
        self.root = os.path.join(directory, "root")

    @classmethod
    def install(cls, directory: str) -> FakeRunc:
        fake = cls(directory)
        os.makedirs(directory, exist_ok=True)
        source = os.path.abspath(__file__)
        code = os.path.join(directory, CODE_FILE)
        with open(source) as f:
            compiled = compile(f.read(), source, "exec")
        with open(code, "wb") as f:
            marshal.dump(compiled, f)
        for binary in (fake.binary, fake.criu):
            with open(binary, "w") as f:
                f.write(WRAPPER.format(python=sys.executable, code=code, source=source))
            os.chmod(binary, 0o755)
        return fake

    def control(self, **verbs: dict[str, Any]) -> None:
        """Replace the failure injection: ``control(restore={"error": "boom"})``."""
        with open(os.path.join(self.dir, CONTROL_FILE), "wb") as f:
            marshal.dump(verbs, f)

    def calls(self, verb: str | None = None) -> list[list[str]]:
        """Every call's argv (after the binary), oldest first; only ``verb``'s if given."""
        argvs: list[list[str]] = []
        try:
            with open(os.path.join(self.dir, CALLS_FILE), "rb") as f:
                while f.peek(1):
                    argvs.append(marshal.load(f))
        except FileNotFoundError:
            pass
        return [a for a in argvs if verb is None or Call(a).verb == verb]

    def verbs(self) -> list[str]:
        """The verb of every call, oldest first."""
        return [Call(argv).verb for argv in self.calls()]

    def state(self, container_id: str) -> dict[str, Any] | None:
        try:
            with open(os.path.join(self.root, container_id, "state"), "rb") as f:
                found: dict[str, Any] = marshal.load(f)
        except FileNotFoundError:
            return None
        return found

    def status(self, container_id: str) -> str | None:
        """The status the fake recorded (created, running, paused), None if unknown."""
        found = self.state(container_id)
        return None if found is None else str(found["status"])

    @staticmethod
    def process_state(pid: int) -> str:
        """The process's state letter from /proc (S, R, T, ...), "gone" without one."""
        found = proc_stat(pid)
        return "gone" if found is None else found[0]

    def memory_file(self, container_id: str) -> str:
        return os.path.join(self.root, container_id, "memory")

    def memory(self, container_id: str) -> str | None:
        try:
            with open(self.memory_file(container_id)) as f:
                return f.read()
        except FileNotFoundError:
            return None

    def set_memory(self, container_id: str, text: str) -> None:
        path = self.memory_file(container_id)
        with open(path + ".tmp", "w") as f:
            f.write(text)
        os.rename(path + ".tmp", path)

    def process_groups(self) -> list[int]:
        """Every process group the fake ever started (containers' inits and execs)."""
        try:
            with open(os.path.join(self.dir, GROUPS_FILE)) as f:
                return [int(line) for line in f]
        except FileNotFoundError:
            return []

    def live_pids(self, container_id: str | None = None) -> list[int]:
        """Live processes of one container (as the fake knows it), or of every one
        it ever started."""
        if container_id is None:
            return group_members(self.process_groups())
        found = self.state(container_id)
        return group_members(found["pgids"]) if found else []


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
