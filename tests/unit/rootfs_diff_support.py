"""Helpers for the rootfs diff tests: tree snapshots and throwaway overlays."""

from __future__ import annotations

import hashlib
import os
import stat
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from cedana_shim.runtime.mount import Mount, mount_all, mountpoints_under, unmount_all

Record = dict[str, Any]


def need_root() -> None:
    # Fail, not skip: these tests are the only proof the diff round-trips on a
    # real overlay, and CI runs them as root.
    assert os.geteuid() == 0, "rootfs diff tests need root (overlay mounts, chown, xattrs)"


def _xattrs(path: bytes) -> dict[str, bytes]:
    out = {}
    for name in os.listxattr(path, follow_symlinks=False):
        if name.startswith("user.") or name == "security.capability":
            out[name] = os.getxattr(path, name, follow_symlinks=False)
    return out


def record(path: bytes) -> Record:
    st = os.lstat(path)
    rec: Record = {
        "type": stat.S_IFMT(st.st_mode),
        "mode": oct(stat.S_IMODE(st.st_mode)),
        "owner": (st.st_uid, st.st_gid),
        "mtime_ns": st.st_mtime_ns,
    }
    if stat.S_ISREG(st.st_mode):
        with open(path, "rb") as f:
            rec["sha256"] = hashlib.sha256(f.read()).hexdigest()
        rec["size"] = st.st_size
        rec["nlink"] = st.st_nlink
        rec["xattrs"] = _xattrs(path)
    elif stat.S_ISLNK(st.st_mode):
        rec["target"] = os.readlink(path)
    elif stat.S_ISDIR(st.st_mode):
        rec["xattrs"] = _xattrs(path)
    return rec


def snapshot(root: Path | str, *, ignore: Iterable[str] = ()) -> dict[bytes, Record]:
    """Every path under ``root`` (not root itself) -> its metadata and content digest."""
    base = os.fsencode(root)
    skip = {os.fsencode(p.strip("/")) for p in ignore}
    out: dict[bytes, Record] = {}
    for dirpath, dirnames, filenames in os.walk(base):
        for name in [*dirnames, *filenames]:
            full = os.path.join(dirpath, name)
            rel = os.path.relpath(full, base)
            if any(rel == s or rel.startswith(s + b"/") for s in skip):
                continue
            out[rel] = record(full)
    return out


def diff_snapshots(a: dict[bytes, Record], b: dict[bytes, Record]) -> list[str]:
    """Human-readable differences, empty when equal."""
    problems = []
    for key in sorted(a.keys() | b.keys()):
        if key not in b:
            problems.append(f"only in first: {key!r}")
        elif key not in a:
            problems.append(f"only in second: {key!r}")
        elif a[key] != b[key]:
            problems.append(f"{key!r}: {a[key]} != {b[key]}")
    return problems


@contextmanager
def overlay(tmp: Path, name: str, lower: Path) -> Iterator[tuple[Path, Path]]:
    """A mounted overlay of ``lower`` with a fresh upper: (merged, upper)."""
    upper, work, merged = (tmp / f"{name}-{p}" for p in ("upper", "work", "merged"))
    for d in (upper, work, merged):
        d.mkdir()
    options = (f"lowerdir={lower}", f"upperdir={upper}", f"workdir={work}")
    mount_all([Mount("overlay", "overlay", "", options)], str(merged))
    try:
        yield merged, upper
    finally:
        unmount_all(str(merged))
        assert not mountpoints_under(os.path.realpath(merged))
