"""Find the cgroup a process lives in, as directories the shim can read.

``/proc/<pid>/cgroup`` names a cgroup by its path *inside a hierarchy*; where that
hierarchy is visible in our filesystem is only known from ``/proc/self/mountinfo``.
containerd's cgroups library hard-codes ``/sys/fs/cgroup/<controller>``; we resolve
through the mount table instead so unusual mount points and nested mounts (a mount
whose root is a sub-cgroup, as inside a container) map to the right directory.

A node is treated as cgroup v1 when the process belongs to at least one mounted v1
hierarchy with a real controller (legacy and hybrid nodes, like containerd's
``cgroups.Mode() != Unified``); otherwise as cgroup v2.
"""

from __future__ import annotations

import errno
import posixpath
import re
import types
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Literal

from cedana_shim.errors import NotFound

__all__ = [
    "Cgroup",
    "CgroupLine",
    "Mount",
    "load_cgroup",
    "parse_mountinfo",
    "parse_proc_cgroup",
    "resolve_cgroup",
]


@dataclass(frozen=True, slots=True)
class Cgroup:
    """One process's cgroup.

    ``version == 1``: ``controllers`` maps each controller name (``"memory"``,
    ``"cpu"``, ``"cpuacct"``, ``"name=systemd"``, ...) to the absolute directory of
    the cgroup in that controller's hierarchy; controllers mounted together
    (``cpu,cpuacct``) map to the same directory. ``path`` is empty.

    ``version == 2``: ``path`` is the absolute directory in the unified hierarchy and
    ``controllers`` is empty.
    """

    version: Literal[1, 2]
    path: str = ""
    # hash=False: a mapping is not hashable; equality still compares it.
    controllers: Mapping[str, str] = field(default_factory=dict, hash=False)

    def __post_init__(self) -> None:
        if self.version == 1:
            if self.path:
                raise ValueError("a cgroup v1 Cgroup has per-controller directories, not path")
        elif self.version == 2:
            if not self.path or self.controllers:
                raise ValueError("a cgroup v2 Cgroup needs exactly one path")
        else:
            raise ValueError(f"unknown cgroup version {self.version!r}")
        # Copy so a caller's later mutation cannot change a "frozen" value.
        object.__setattr__(self, "controllers", types.MappingProxyType(dict(self.controllers)))

    @classmethod
    def v1(cls, controllers: Mapping[str, str]) -> Cgroup:
        return cls(version=1, controllers=controllers)

    @classmethod
    def v2(cls, path: str) -> Cgroup:
        return cls(version=2, path=path)

    def controller_dir(self, controller: str) -> str | None:
        """The directory holding ``controller``'s files, or None when it is not mounted."""
        if self.version == 2:
            return self.path
        return self.controllers.get(controller)

    @property
    def memory_dir(self) -> str | None:
        return self.controller_dir("memory")

    @property
    def dirs(self) -> frozenset[str]:
        """Every distinct directory of this cgroup."""
        if self.version == 2:
            return frozenset((self.path,))
        return frozenset(self.controllers.values())


@dataclass(frozen=True, slots=True)
class CgroupLine:
    """One line of ``/proc/<pid>/cgroup``: ``hierarchy-id:controllers:path``."""

    hierarchy_id: int
    controllers: frozenset[str]  # empty for the v2 line "0::/path"
    path: str


@dataclass(frozen=True, slots=True)
class Mount:
    """A cgroup or cgroup2 entry of ``/proc/self/mountinfo``."""

    root: str  # the hierarchy path shown at mount_point (field 4)
    mount_point: str  # field 5
    fstype: str  # "cgroup" or "cgroup2"
    super_options: frozenset[str]  # for v1 these name the controllers, e.g. "cpu", "name=systemd"


def parse_proc_cgroup(text: str) -> list[CgroupLine]:
    lines: list[CgroupLine] = []
    for raw in text.splitlines():
        if not raw:
            continue
        parts = raw.split(":", 2)
        if len(parts) != 3:
            raise ValueError(f"invalid cgroup entry: {raw!r}")
        hid, ctrls, path = parts
        try:
            hierarchy_id = int(hid)
        except ValueError as err:
            raise ValueError(f"invalid cgroup entry: {raw!r}") from err
        controllers = frozenset(c for c in ctrls.split(",") if c)
        lines.append(CgroupLine(hierarchy_id, controllers, path))
    return lines


_OCTAL_ESCAPE = re.compile(r"\\([0-7]{3})")


def _unescape(field_text: str) -> str:
    # The kernel writes space, tab, newline and backslash in mount paths as \ooo.
    return _OCTAL_ESCAPE.sub(lambda m: chr(int(m.group(1), 8)), field_text)


def parse_mountinfo(text: str) -> list[Mount]:
    """The cgroup and cgroup2 mounts in ``text`` (the format of ``proc(5)`` mountinfo)."""
    mounts: list[Mount] = []
    for raw in text.splitlines():
        fields = raw.split(" ")
        try:
            # Optional fields (shared:N, master:N, ...) vary in number; "-" ends them.
            sep = fields.index("-", 6)
        except ValueError:
            continue
        if len(fields) < sep + 4:
            continue
        fstype = fields[sep + 1]
        if fstype not in ("cgroup", "cgroup2"):
            continue
        mounts.append(
            Mount(
                root=_unescape(fields[3]),
                mount_point=_unescape(fields[4]),
                fstype=fstype,
                super_options=frozenset(fields[sep + 3].split(",")),
            )
        )
    return mounts


def _relative(path: str, root: str) -> str | None:
    """``path`` relative to ``root`` ("." for itself), or None if it is not inside."""
    path = posixpath.normpath(path)
    root = posixpath.normpath(root)
    if path == root:
        return "."
    prefix = root if root.endswith("/") else root + "/"
    if not path.startswith(prefix):
        return None
    return path[len(prefix) :]


def _locate(path: str, candidates: Iterable[Mount]) -> str | None:
    """The directory of hierarchy path ``path`` through the best of ``candidates``.

    The same hierarchy may be mounted several times (bind mounts, or a container's
    view at a sub-cgroup); the mount whose root is the deepest ancestor of ``path``
    shows it.
    """
    best: tuple[int, str] | None = None
    for mount in candidates:
        rel = _relative(path, mount.root)
        if rel is None:
            continue
        depth = len(posixpath.normpath(mount.root))
        if best is None or depth > best[0]:
            directory = mount.mount_point if rel == "." else posixpath.join(mount.mount_point, rel)
            best = (depth, directory)
    return None if best is None else best[1]


def resolve_cgroup(proc_cgroup: str, mountinfo: str) -> Cgroup:
    """Pure core of :func:`load_cgroup`: the texts of ``/proc/<pid>/cgroup`` and mountinfo."""
    lines = parse_proc_cgroup(proc_cgroup)
    mounts = parse_mountinfo(mountinfo)
    v1_mounts = [m for m in mounts if m.fstype == "cgroup"]
    v2_mounts = [m for m in mounts if m.fstype == "cgroup2"]

    controllers: dict[str, str] = {}
    has_real_controller = False
    for line in lines:
        if not line.controllers:
            continue
        matching = [m for m in v1_mounts if line.controllers <= m.super_options]
        directory = _locate(line.path, matching)
        if directory is None:
            continue
        for name in line.controllers:
            controllers[name] = directory
            if not name.startswith("name="):
                has_real_controller = True
    if has_real_controller:
        return Cgroup.v1(controllers)

    for line in lines:
        if line.hierarchy_id == 0 and not line.controllers:
            directory = _locate(line.path, v2_mounts)
            if directory is not None:
                return Cgroup.v2(directory)
            raise NotFound(f"cgroup2 path {line.path!r} is not visible under any cgroup2 mount")
    raise NotFound("the process is in no mounted cgroup hierarchy")


def load_cgroup(pid: int, *, proc: str = "/proc") -> Cgroup:
    """The cgroup of process ``pid``.

    Raises :class:`~cedana_shim.errors.NotFound` when the process is gone or none of
    its hierarchies is mounted here.
    """
    try:
        with open(posixpath.join(proc, str(pid), "cgroup"), encoding="utf-8") as f:
            proc_cgroup = f.read()
    except OSError as err:
        if err.errno in (errno.ENOENT, errno.ESRCH):
            raise NotFound(f"process {pid} does not exist") from err
        raise
    with open(posixpath.join(proc, "self", "mountinfo"), encoding="utf-8") as f:
        mountinfo = f.read()
    return resolve_cgroup(proc_cgroup, mountinfo)
