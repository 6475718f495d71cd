"""Helpers for the rootfs diff tests (tests/unit and tests/privileged): tree snapshots
and hand-built archives."""

from __future__ import annotations

import hashlib
import io
import os
import stat
import tarfile
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from cedana_shim.runtime.mount import Mount, mount_all, mountpoints_under, unmount_all

Record = dict[str, Any]
Member = tuple[tarfile.TarInfo, bytes | None]


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


def reg(name: str, data: bytes = b"x", **fields: object) -> Member:
    """A regular file member; ``fields`` set TarInfo attributes (uid, mode, pax_headers...)."""
    info = tarfile.TarInfo(name)
    info.size = len(data)
    for key, value in fields.items():
        setattr(info, key, value)
    return info, data


def node(name: str, kind: bytes, linkname: str = "", **fields: object) -> Member:
    """A member without data: a directory, link or device of type ``kind``."""
    info = tarfile.TarInfo(name)
    info.type = kind
    info.linkname = linkname
    for key, value in fields.items():
        setattr(info, key, value)
    return info, None


def archive(*members: Member, fmt: int = tarfile.PAX_FORMAT, **kw: object) -> io.BytesIO:
    """A tar of ``members`` after a harmless first one (a refusal must come before
    that one is written too), owned by whoever runs the test."""
    benign = reg("aaa-benign", b"fine", uid=os.getuid(), gid=os.getgid())
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=fmt, **kw) as tf:  # type: ignore[call-overload]
        for info, data in [benign, *members]:
            tf.addfile(info, io.BytesIO(data) if data is not None else None)
    buf.seek(0)
    return buf


class Unseekable(io.RawIOBase):
    """A pipe-like stream over ``data``: readable, not seekable (a decompressor)."""

    def __init__(self, data: bytes) -> None:
        self._data = io.BytesIO(data)
        self.delivered = 0

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        n = self._data.readinto(b)
        self.delivered += n
        return n


@contextmanager
def overlay(tmp: Path, name: str, lower: Path) -> Iterator[tuple[Path, Path]]:
    """A mounted overlay of ``lower`` with a fresh upper: (merged, upper). Needs root."""
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
