"""Every rule a rootfs diff archive must pass before one byte of it is applied.

A diff can come from another node's store or a shared registry, so it is
untrusted input that is about to be written as root. :func:`make_plan` reads
all headers once, checks each member against the rules below and returns the
validated plan; applying then uses only the plan (headers are never re-read,
so an archive rewritten between the two steps cannot slip a new name in).

Rules, each refused with :class:`errors.InvalidArgument` naming the member:

* names are relative, without ``..``, ``.`` or empty components, no NUL, at
  most PATH_MAX/NAME_MAX bytes and ``limits.max_depth`` levels;
* only regular files, directories, symlinks and hard links (device nodes,
  FIFOs, sparse files and global headers are refused by the reader);
* no name twice, so no member can replace an earlier one (a symlink swapped in
  for a file that a hard link then names, for instance);
* nothing lies under a path the archive makes a non-directory (``evil -> /``
  then ``evil/pwned``); where the rootfs already has a non-directory on the
  way, :func:`write.preflight` refuses before writing;
* a hard link names a regular file earlier in the same archive: never an
  absolute path, a ``..`` path, a symlink or a file only the rootfs has;
* whiteouts are empty regular files named ``.wh.<name>`` with a real name (not
  empty, ``.``, ``..`` or another ``.wh.`` name); an opaque marker sits in a
  directory the archive contains, never at the top (that would empty the rootfs);
* only the extended attributes :func:`xattr_allowed` names, each bounded;
* member count, each file's size and the total are within :class:`Limits`.

Symlink *targets* are data: absolute or ``..``-laden targets are normal in
images (``/etc/localtime -> /usr/share/zoneinfo/UTC``) and resolve inside the
container's own root when the container uses them. The danger is the applier
following one, which it never does (see the write module).
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field

from cedana_shim import errors

from .tar import DIR, LNK, REG, SYM, Member
from .types import (
    NAME_MAX,
    OPAQUE_MARKER,
    PATH_MAX,
    WHITEOUT_PREFIX,
    Limits,
    refuse,
    show,
    xattr_allowed,
)

__all__ = ["Entry", "Parts", "Plan", "make_plan", "split_path"]

Parts = tuple[bytes, ...]
_KIND = {REG: "regular file", LNK: "hard link", SYM: "symlink", DIR: "directory"}
_MAX_ID = 0xFFFF_FFFE  # (uid_t)-1 means "leave unchanged" to chown(2)


@dataclass(slots=True)
class Entry:
    """A validated file, directory, symlink or hard link to create."""

    parts: Parts
    member: Member
    link: Parts = ()


@dataclass(slots=True)
class Plan:
    entries: list[Entry] = field(default_factory=list)
    # Deletions of what the rootfs had before, applied before any entry:
    # whiteouts remove a path, opaque markers empty a directory.
    whiteouts: list[Parts] = field(default_factory=list)
    opaques: list[Parts] = field(default_factory=list)
    dirs: set[Parts] = field(default_factory=set)
    _deleted: set[Parts] = field(default_factory=set)
    _emptied: set[Parts] = field(default_factory=set)

    def removed(self, parts: Parts) -> bool:
        """Whether the deletions take ``parts`` itself out of the rootfs."""
        return parts in self._deleted or parts[:-1] in self._emptied

    def delete(self, parts: Parts) -> None:
        self.whiteouts.append(parts)
        self._deleted.add(parts)

    def empty(self, parts: Parts) -> None:
        self.opaques.append(parts)
        self._emptied.add(parts)


def split_path(raw: bytes, limits: Limits, *, directory: bool = False) -> Parts:
    """``raw`` as validated components; ``()`` is the archive root."""
    if b"\0" in raw:
        raise refuse(raw, "has a NUL byte in its name")
    if raw.startswith(b"/"):
        raise refuse(raw, "is an absolute path; members must be relative to the rootfs")
    if len(raw) > PATH_MAX:
        raise refuse(raw, f"has a name longer than {PATH_MAX} bytes")
    name = raw
    while name.startswith(b"./"):
        name = name[2:]
    if directory:
        name = name.rstrip(b"/")
    elif name.endswith(b"/"):
        raise refuse(raw, "ends in '/' but is not a directory")
    if name in (b"", b"."):
        return ()
    parts = tuple(name.split(b"/"))
    for part in parts:
        if part == b"..":
            raise refuse(raw, "has a '..' component, which could climb out of the rootfs")
        if part in (b"", b"."):
            raise refuse(raw, "has an empty or '.' component")
        if len(part) > NAME_MAX:
            raise refuse(raw, f"has a component longer than {NAME_MAX} bytes")
    if len(parts) > limits.max_depth:
        raise refuse(raw, f"is nested more than {limits.max_depth} directories deep")
    return parts


def make_plan(members: Iterable[Member], limits: Limits, *, whiteouts: bool) -> Plan:
    """Validate every member; ``whiteouts`` reads ``.wh.`` names as OCI deletions."""
    plan = Plan()
    declared: dict[Parts, bytes] = {}
    markers: set[Parts] = set()
    count = total = 0
    for m in members:
        count += 1
        if count > limits.max_members:
            raise refuse(m.name, f"is past the limit of {limits.max_members} members")
        parts = split_path(m.name, limits, directory=m.typeflag == DIR)
        if not parts:
            if m.typeflag != DIR:
                raise refuse(m.name, "names the rootfs itself but is not a directory")
            continue  # "./": the rootfs root keeps the new container's own metadata
        _check_xattrs(m, limits)
        if m.typeflag == REG:
            if m.size > limits.max_member_bytes:
                raise refuse(m.name, f"is {m.size} bytes, over the {limits.max_member_bytes} limit")
            total += m.size
            if total > limits.max_total_bytes:
                raise refuse(m.name, f"takes the content past {limits.max_total_bytes} bytes")
        if m.uid > _MAX_ID or m.gid > _MAX_ID:
            raise refuse(m.name, f"has an impossible owner {m.uid}:{m.gid}")
        if whiteouts and any(p.startswith(WHITEOUT_PREFIX) for p in parts[:-1]):
            raise refuse(m.name, "has a whiteout name as a directory")
        if whiteouts and parts[-1].startswith(WHITEOUT_PREFIX):
            _whiteout(plan, m, parts, markers)
            continue
        if parts in declared:
            raise refuse(m.name, "appears twice in the archive")
        entry = Entry(parts, m)
        if m.typeflag == LNK:
            entry.link = _link_target(m, limits, declared)
        elif m.typeflag == SYM and (
            not m.linkname or b"\0" in m.linkname or len(m.linkname) > PATH_MAX
        ):
            raise refuse(m.name, "is a symlink with an empty, NUL-bearing or over-long target")
        elif m.typeflag == DIR:
            plan.dirs.add(parts)
        declared[parts] = m.typeflag
        plan.entries.append(entry)
    _check_parents(plan, declared)
    for opaque in plan.opaques:
        if declared.get(opaque) != DIR:
            raise refuse(
                b"/".join((*opaque, OPAQUE_MARKER)),
                "is an opaque marker for a directory the archive does not contain",
            )
    return plan


def _check_xattrs(m: Member, limits: Limits) -> None:
    for name, value in m.xattrs:
        if not xattr_allowed(name) or b"\0" in name or len(name) > NAME_MAX:
            shown = name.decode("utf-8", "backslashreplace")
            raise refuse(m.name, f"carries xattr {shown!r}, which a rootfs diff may not set")
        if len(value) > limits.max_xattr_bytes:
            raise refuse(m.name, f"has a {len(value)}-byte xattr (limit {limits.max_xattr_bytes})")


def _whiteout(plan: Plan, m: Member, parts: Parts, markers: set[Parts]) -> None:
    if m.typeflag != REG or m.size:
        raise refuse(m.name, "has a whiteout name but is not an empty regular file")
    if parts in markers:
        raise refuse(m.name, "appears twice in the archive")
    markers.add(parts)
    if parts[-1] == OPAQUE_MARKER:
        if len(parts) == 1:
            raise refuse(m.name, "is an opaque marker at the top, which would empty the rootfs")
        plan.empty(parts[:-1])
        return
    target = parts[-1][len(WHITEOUT_PREFIX) :]
    if target in (b"", b".", b"..") or target.startswith(WHITEOUT_PREFIX):
        raise refuse(m.name, "is a whiteout that names no ordinary file ('', '.', '..' or .wh.)")
    plan.delete((*parts[:-1], target))


def _link_target(m: Member, limits: Limits, declared: dict[Parts, bytes]) -> Parts:
    if m.linkname.startswith(b"/") or b"\0" in m.linkname:
        raise refuse(m.name, "is a hard link to an absolute path, outside the archive")
    try:
        target = split_path(m.linkname, limits)
    except errors.InvalidArgument as err:
        raise refuse(m.name, "is a hard link whose target leaves the archive root") from err
    if declared.get(target) != REG:
        raise refuse(
            m.name,
            f"is a hard link to {show(b'/'.join(target))!r}, which is not a regular file "
            "earlier in this archive",
        )
    return target


def _check_parents(plan: Plan, declared: dict[Parts, bytes]) -> None:
    ok: set[Parts] = set()
    paths = [e.parts for e in plan.entries] + plan.whiteouts + plan.opaques
    for parts in paths:
        for i in range(len(parts) - 1, 0, -1):
            prefix = parts[:i]
            if prefix in ok:
                break
            kind = declared.get(prefix)
            if kind is not None and kind != DIR:
                raise refuse(
                    b"/".join(parts),
                    f"lies under {show(b'/'.join(prefix))!r}, which this archive makes a "
                    f"{_KIND[kind]}; writing through it could leave the rootfs",
                )
            ok.add(prefix)
