"""The cgroup a restore must put its tasks in, on a cgroup v2 node, handed to CRIU.

For a restore runc moves CRIU into the new container's cgroup, and on cgroup v1 also
tells CRIU that this cgroup is the root to restore the dumped tree into (its
``CgRoot``s). runc 1.1 (Debian 12's, and what many nodes run) skips that on a cgroup
v2 node, so CRIU recreates the *checkpointed* container's cgroup path and puts the
restored tasks there: outside the new container's cgroup, its limits, accounting,
``memory.events`` and ``runc kill --all``, and (when that container's scope is gone)
in a cgroup nobody removes. Newer runc passes CRIU the unified hierarchy's root
(controller ``""``) as the cgroup CRIU is in.

This module works out that same cgroup beforehand, from the spec, the way runc's
cgroup managers name it, and writes it as CRIU's ``cgroup-root :<path>`` into a
config file that ``runc restore`` hands CRIU through ``CRIU_CONFIG_FILE``. Where a
newer runc passes the root itself the two agree (were they to differ, CRIU would refuse
the restore, "CG paths mismatch", rather than restore elsewhere). CRIU's cgroup
namespace handling then roots a restored cgroup namespace at the new cgroup (the CRI's
containers have one on cgroup v2).
"""

from __future__ import annotations

import os
import posixpath
from collections.abc import Mapping
from typing import Any, Final

__all__ = ["CONFIG_FILE", "container_cgroup", "own_cgroup", "unified", "write_config"]

# runc's fs2 and systemd v2 managers find the hierarchy here; so does this module.
UNIFIED_MOUNT: Final = "/sys/fs/cgroup"
CONFIG_FILE: Final = "cedana-cgroup-root.conf"


def unified(mount: str = UNIFIED_MOUNT) -> bool:
    """Whether this node runs cgroup v2 only (runc's IsCgroup2UnifiedMode)."""
    return os.path.exists(posixpath.join(mount, "cgroup.controllers"))


def expand_slice(slice_name: str) -> str:
    """systemd's path of a slice: ``a-b.slice`` -> ``/a.slice/a-b.slice``."""
    suffix = ".slice"
    if not slice_name.endswith(suffix) or "/" in slice_name or slice_name == suffix:
        raise ValueError(f"invalid systemd slice name {slice_name!r}")
    stem = slice_name[: -len(suffix)]
    if stem == "-":
        return "/"
    path = prefix = ""
    for part in stem.split("-"):
        if not part:
            raise ValueError(f"invalid systemd slice name {slice_name!r}")
        path += f"/{prefix}{part}{suffix}"
        prefix += f"{part}-"
    return path


def _systemd(cgroups_path: str, container_id: str) -> str:
    if not cgroups_path:
        parent, prefix, name = "system.slice", "runc", container_id
    else:
        parts = cgroups_path.split(":")
        if len(parts) != 3:
            raise ValueError(
                f'cgroupsPath {cgroups_path!r} is not "slice:prefix:name" (systemd cgroups)'
            )
        parent, prefix, name = parts
    if name.endswith(".slice"):
        unit = name
    else:
        unit = f"{prefix}-{name}.scope" if prefix else f"{name}.scope"
    return posixpath.join(expand_slice(parent or "system.slice"), unit)


def _cgroupfs(cgroups_path: str, container_id: str, own_cgroup: str) -> str:
    # (normpath keeps a leading "//": POSIX leaves its meaning open.)
    inner = posixpath.normpath("/" + (cgroups_path or container_id).lstrip("/"))
    if cgroups_path.startswith("/"):
        return inner
    # runc's fs2: a relative path is under the parent of runc's own cgroup (which it
    # inherits from us), since that cgroup itself has processes in it.
    return posixpath.normpath(posixpath.join(posixpath.dirname(own_cgroup), inner.lstrip("/")))


def container_cgroup(
    spec: Mapping[str, Any], container_id: str, *, systemd: bool, own_cgroup: str = ""
) -> str:
    """The unified-hierarchy path of the cgroup runc makes for ``spec``'s container
    (``/default/c1``, ``/kubepods.slice/…/cri-containerd-<id>.scope``).

    ``own_cgroup`` is the caller's own cgroup (``0::`` of /proc/self/cgroup), needed
    only for a relative ``cgroupsPath`` with the cgroupfs driver.
    """
    if not isinstance(spec, Mapping):
        raise ValueError("the spec is not a JSON object")
    linux = spec.get("linux")
    path = linux.get("cgroupsPath") if isinstance(linux, Mapping) else None
    path = path if isinstance(path, str) else ""
    if systemd:
        return _systemd(path, container_id)
    return _cgroupfs(path, container_id, own_cgroup)


def own_cgroup(proc: str = "/proc") -> str:
    """This process's cgroup v2 path (the ``0::`` line)."""
    with open(posixpath.join(proc, "self", "cgroup"), encoding="utf-8") as f:
        for line in f:
            if line.startswith("0::"):
                return line[3:].strip()
    return "/"


def write_config(directory: str, cgroup: str) -> str:
    """The CRIU config file naming ``cgroup`` the unified hierarchy's root (controller
    ``""``: named v1 hierarchies a v2 node may still mount stay untouched)."""
    if any(c.isspace() for c in cgroup):
        raise ValueError(f"unsupported cgroup path for CRIU's config: {cgroup!r}")
    path = os.path.join(directory, CONFIG_FILE)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(f"cgroup-root :{cgroup}\n")
    return path
