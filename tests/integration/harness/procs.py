"""Read-only probes of the host: processes (/proc), mounts (/proc/self/mountinfo) and
cgroups, used both by assertions and by the teardown sweep."""

from __future__ import annotations

import contextlib
import os
import re
from dataclasses import dataclass
from pathlib import Path

_SHIM_PREFIX = "containerd-shim-"
_ACTIONS = {"start", "delete"}


@dataclass(frozen=True)
class ProcInfo:
    pid: int
    ppid: int
    argv: tuple[str, ...]


@dataclass(frozen=True)
class ShimProcess:
    """A shim process as seen in /proc, with its Go-style single-dash flags parsed."""

    pid: int
    binary: str  # basename, e.g. containerd-shim-runc-v2
    flags: dict[str, str]
    action: str | None  # "start"/"delete" for the short-lived invocations, None for a daemon

    @property
    def id(self) -> str | None:
        return self.flags.get("id")

    @property
    def namespace(self) -> str | None:
        return self.flags.get("namespace")

    @property
    def address(self) -> str | None:
        return self.flags.get("address")

    @property
    def is_daemon(self) -> bool:
        return self.action is None


def read_argv(pid: int) -> tuple[str, ...] | None:
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return None
    return tuple(a.decode(errors="replace") for a in raw.split(b"\0") if a)


def read_ppid(pid: int) -> int | None:
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # comm (field 2) may contain spaces and parentheses: split after the last ')'.
    return int(stat.rsplit(")", 1)[1].split()[1])


def pid_alive(pid: int) -> bool:
    """True while `pid` exists and is not a zombie."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return False
    return stat.rsplit(")", 1)[1].split()[0] != "Z"


def list_processes() -> list[ProcInfo]:
    procs = []
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        pid = int(entry)
        argv = read_argv(pid)
        ppid = read_ppid(pid)
        if argv is None or ppid is None:
            continue
        procs.append(ProcInfo(pid, ppid, argv))
    return procs


def descendants(roots: set[int], procs: list[ProcInfo] | None = None) -> set[int]:
    """All processes below `roots` (excluding the roots themselves)."""
    procs = list_processes() if procs is None else procs
    children: dict[int, list[int]] = {}
    for p in procs:
        children.setdefault(p.ppid, []).append(p.pid)
    found: set[int] = set()
    stack = list(roots)
    while stack:
        for child in children.get(stack.pop(), []):
            if child not in found:
                found.add(child)
                stack.append(child)
    return found - roots


def _parse_shim_argv(pid: int, argv: tuple[str, ...]) -> ShimProcess | None:
    # A Python console script runs as `python .../containerd-shim-cedana-v2 ...`, a Go
    # shim as the binary itself: take the first argument that names a shim.
    for i, arg in enumerate(argv[:3]):
        base = os.path.basename(arg)
        if base.startswith(_SHIM_PREFIX):
            rest = argv[i + 1 :]
            break
    else:
        return None
    flags: dict[str, str] = {}
    action: str | None = None
    j = 0
    while j < len(rest):
        arg = rest[j]
        if arg.startswith("-"):
            name = arg.lstrip("-")
            if "=" in name:
                key, value = name.split("=", 1)
                flags[key] = value
            elif name in ("debug", "v", "version", "info") or j + 1 >= len(rest):
                flags[name] = "true"
            else:
                flags[name] = rest[j + 1]
                j += 1
        elif arg in _ACTIONS:
            action = arg
        j += 1
    return ShimProcess(pid=pid, binary=base, flags=flags, action=action)


def shim_processes(
    *, address: str | None = None, binary: str | None = None, daemons_only: bool = True
) -> list[ShimProcess]:
    """Shim processes on the host, optionally only those talking to the containerd at
    `address` (its gRPC socket path, as passed in `-address`) and of one binary."""
    found = []
    for p in list_processes():
        shim = _parse_shim_argv(p.pid, p.argv)
        if shim is None:
            continue
        if address is not None and shim.address != address:
            continue
        if binary is not None and shim.binary != binary:
            continue
        if daemons_only and not shim.is_daemon:
            continue
        if not pid_alive(p.pid):
            continue
        found.append(shim)
    return found


_OCTAL = re.compile(r"\\([0-7]{3})")


def _unescape_mountinfo(field: str) -> str:
    return _OCTAL.sub(lambda m: chr(int(m.group(1), 8)), field)


def mounts_under(path: Path | str, mountinfo: str = "/proc/self/mountinfo") -> list[str]:
    """Mount points at or below `path`, deepest first (the order to unmount them in)."""
    base = os.path.realpath(path)
    points = []
    with open(mountinfo) as f:
        for line in f:
            point = _unescape_mountinfo(line.split()[4])
            if point == base or point.startswith(base.rstrip("/") + "/"):
                points.append(point)
    return sorted(points, key=lambda p: p.count("/"), reverse=True)


def criu_root_mounts(
    state_root: Path | str, owner: Path | str, mountinfo: str = "/proc/self/mountinfo"
) -> list[str]:
    """`<state_root>/<ns>/<id>/criu-root` mounts (the rootfs `runc restore` binds for CRIU;
    a runc killed mid-restore leaves it) of containers whose rootfs lives under `owner`.

    runc's state root is shared by every containerd on the host; the mount is told apart
    by its filesystem's options (an overlay rootfs names its layers, under containerd's
    root), or for a bind of a plain directory by its source path."""
    base = os.path.realpath(state_root).rstrip("/") + "/"
    owned = os.path.realpath(owner)
    found = []
    with open(mountinfo) as f:
        for line in f:
            fields = line.split()
            point = _unescape_mountinfo(fields[4])
            rel = point.removeprefix(base)
            if rel == point or rel.count("/") != 2 or not rel.endswith("/criu-root"):
                continue
            after_dash = line.split(" - ", 1)[1].split() if " - " in line else []
            described = " ".join([_unescape_mountinfo(fields[3]), *after_dash[1:]])
            if owned in described:
                found.append(point)
    return found


def cgroup_dir(pid: int, controller: str) -> Path:
    """The cgroup v1 directory of `pid` for `controller` (this host mounts v1 controllers
    under /sys/fs/cgroup/<controller>; runc uses them)."""
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        _, controllers, path = line.split(":", 2)
        if controller in controllers.split(","):
            return Path("/sys/fs/cgroup") / controller / path.lstrip("/")
    raise LookupError(f"pid {pid} has no {controller} cgroup")


def container_cgroups(cgroups_path: str) -> list[Path]:
    """The cgroup directories of an OCI `linux.cgroupsPath` that exist: one per v1
    controller, or the unified one."""
    inner = cgroups_path.strip("/")
    found = [*Path("/sys/fs/cgroup").glob(f"*/{inner}"), Path("/sys/fs/cgroup", inner)]
    return sorted(path for path in found if path.is_dir())


def read_int(path: Path) -> int:
    return int(path.read_text().strip())


def kill_quietly(pid: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, sig)


_SO_ACCEPTCON = 0x00010000
_SS_UNCONNECTED = "01"


def unix_listener_inodes(path: str) -> set[int]:
    """Inodes of listening unix sockets bound to `path` (from /proc/net/unix)."""
    inodes = set()
    with open("/proc/net/unix") as f:
        next(f)
        for line in f:
            cols = line.split()
            if len(cols) < 8 or cols[7] != path:
                continue
            if int(cols[3], 16) & _SO_ACCEPTCON and cols[5] == _SS_UNCONNECTED:
                inodes.add(int(cols[6]))
    return inodes


def listening_unix_paths(pid: int) -> set[str]:
    """Filesystem paths of the listening unix sockets `pid` holds."""
    inodes = set()
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            with contextlib.suppress(OSError):
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
                if target.startswith("socket:["):
                    inodes.add(int(target[8:-1]))
    except OSError:
        return set()
    paths = set()
    with open("/proc/net/unix") as f:
        next(f)
        for line in f:
            cols = line.split()
            if (
                len(cols) >= 8
                and int(cols[6]) in inodes
                and int(cols[3], 16) & _SO_ACCEPTCON
                and cols[7].startswith("/")
            ):
                paths.add(cols[7])
    return paths


def socket_holders(inodes: set[int]) -> set[int]:
    """Processes that hold any of these socket inodes open."""
    if not inodes:
        return set()
    wanted = {f"socket:[{i}]" for i in inodes}
    holders = set()
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            fds = os.listdir(f"/proc/{entry}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                if os.readlink(f"/proc/{entry}/fd/{fd}") in wanted:
                    holders.add(int(entry))
                    break
            except OSError:
                continue
    return holders


def serving_pids(address: str) -> set[int]:
    """The live processes listening on a shim's ttrpc address (`unix:///path`).

    This identifies a shim daemon by what it does, not by its command line: a daemon
    forked from a warm template process carries the template's argv.
    """
    path = address.removeprefix("unix://")
    return {p for p in socket_holders(unix_listener_inodes(path)) if pid_alive(p)}
