"""Find the cgroup a process lives in, as directories the shim can read.

``/proc/<pid>/cgroup`` names a cgroup by its path *inside a hierarchy*; where that
hierarchy is visible in our filesystem is only known from ``/proc/self/mountinfo``.
containerd's cgroups library hard-codes ``/sys/fs/cgroup/<controller>``; we resolve
through the mount table instead so unusual mount points and nested mounts (a mount
whose root is a sub-cgroup, as inside a container) map to the right directory.

A node is treated as cgroup v1 when the process belongs to at least one mounted v1
hierarchy with a real controller (legacy and hybrid nodes, like containerd's
``cgroups.Mode() != Unified``); otherwise as cgroup v2.

:func:`remove_cgroup` removes a container's empty cgroup from every hierarchy, as
``runc delete`` would: after a ``runc restore`` killed before it wrote its state
(runc made the cgroups first), ``runc delete`` finds no container and leaves them.
"""

from __future__ import annotations

import errno
import os
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
    "cgroup_dirs",
    "load_cgroup",
    "parse_mountinfo",
    "parse_proc_cgroup",
    "remove_cgroup",
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


def cgroup_dirs(path: str, mountinfo: str) -> list[str]:
    """The directories of hierarchy path ``path`` in every mounted hierarchy (one per
    v1 hierarchy, the unified one), whether they exist or not; each strictly below the
    mount point that shows it."""
    hierarchies: dict[tuple[str, frozenset[str]], list[Mount]] = {}
    for mount in parse_mountinfo(mountinfo):
        # The same hierarchy mounted twice shows the same super options.
        hierarchies.setdefault((mount.fstype, mount.super_options), []).append(mount)
    found: set[str] = set()
    for mounts in hierarchies.values():
        directory = _locate(path, mounts)
        if directory is not None and any(_below(directory, m.mount_point) for m in mounts):
            found.add(directory)
    return sorted(found)


def _below(directory: str, mount_point: str) -> bool:
    directory, mount_point = posixpath.normpath(directory), posixpath.normpath(mount_point)
    return directory != mount_point and posixpath.commonpath([directory, mount_point]) == (
        mount_point
    )


def remove_cgroup(cgroups_path: str, *, proc: str = "/proc") -> list[str]:
    """Remove the cgroup of an OCI ``linux.cgroupsPath`` (the cgroupfs driver's, an
    absolute hierarchy path) and the cgroups below it, deepest first, where they are
    empty, in every hierarchy; the directories left (a process still in them).

    Only a path naming a cgroup below a hierarchy's root is acted on: a relative one
    (runc's is relative to its own cgroup), one with ``..`` and a systemd driver's
    ``slice:prefix:name`` are left alone (systemd removes the cgroup of a scope whose
    processes are all gone). Nothing outside the cgroup filesystem is touched."""
    parts = [part for part in cgroups_path.split("/") if part not in ("", ".")]
    if not cgroups_path.startswith("/") or not parts or ".." in parts:
        return []
    with open(posixpath.join(proc, "self", "mountinfo"), encoding="utf-8") as f:
        mountinfo = f.read()
    left: list[str] = []
    for top in cgroup_dirs("/" + "/".join(parts), mountinfo):
        try:
            device = os.stat(posixpath.dirname(top)).st_dev
        except FileNotFoundError:
            continue
        for directory, _, _ in os.walk(top, topdown=False):
            try:
                if os.stat(directory).st_dev != device:
                    continue  # a mount below the cgroup: not a cgroup of it
                os.rmdir(directory)
            except FileNotFoundError:
                pass
            except OSError:  # EBUSY: a process (or a cgroup that could not go) inside
                left.append(directory)
    return left
