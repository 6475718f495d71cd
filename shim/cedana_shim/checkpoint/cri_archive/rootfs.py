"""The writable layer's changes, between the store's form and the archive's.

The store keeps them as an OCI layer (deletions as ``.wh.`` whiteouts, rootfs_diff). An
archive may hold that too (containerd writes its snapshot diff, gzip), or a plain tar of
what was added and changed with the deleted paths listed in ``deleted.files`` (CRI-O,
Podman). Exports write the second form, which every engine's reader applies, and keep
opaque-directory markers in the tar (no list can say "everything below was replaced");
imports accept both, and turn ``deleted.files`` back into whiteouts.
"""

from __future__ import annotations

import os
import tarfile
from collections.abc import Iterable
from typing import BinaryIO, Final

from cedana_shim import errors, untrusted_json

from ..rootfs_diff.plan import make_plan, split_path
from ..rootfs_diff.tar import REG, Member, TarWriter, read_members
from ..rootfs_diff.types import (
    DEFAULT_LIMITS,
    OPAQUE_MARKER,
    WHITEOUT_PREFIX,
    ArchiveCorrupt,
    ArchiveRefused,
)

__all__ = ["DELETED_FILES", "MAX_DELETED_FILES_BYTES", "from_archive", "to_archive"]

DELETED_FILES: Final = "deleted.files"
MAX_DELETED_FILES_BYTES: Final = 16 << 20
_WHITEOUT: Final = WHITEOUT_PREFIX.decode()
_OPAQUE: Final = OPAQUE_MARKER.decode()


def to_archive(layer: BinaryIO, out: BinaryIO) -> list[str]:
    """Copy the store's layer tar ``layer`` (trusted: verified as it is read) to ``out``
    without its whiteouts; returns the deleted paths, for ``deleted.files``."""
    deleted: list[str] = []
    with (
        tarfile.open(fileobj=layer, mode="r|") as source,
        tarfile.open(fileobj=out, mode="w|", format=tarfile.PAX_FORMAT) as sink,
    ):
        for member in source:
            head, _, base = member.name.rstrip("/").rpartition("/")
            if base.startswith(_WHITEOUT) and base != _OPAQUE:
                deleted.append("/" + "/".join(p for p in (head, base[len(_WHITEOUT) :]) if p))
                continue
            data = source.extractfile(member) if member.isreg() else None
            sink.addfile(member, data)
    return deleted


def parse_deleted(data: bytes, archive: str) -> list[str]:
    try:
        doc = untrusted_json.loads(data)
    except (ValueError, UnicodeDecodeError) as err:
        raise errors.InvalidArgument(f"{archive}: {DELETED_FILES} is not JSON ({err})") from None
    if not isinstance(doc, list) or not all(isinstance(p, str) for p in doc):
        raise errors.InvalidArgument(f"{archive}: {DELETED_FILES} is not a list of paths")
    return doc


def from_archive(src: BinaryIO, deleted: Iterable[str], out_path: str, archive: str) -> None:
    """Check the archive's layer tar ``src`` (seekable; hostile) by the rules a restore
    applies it with, and write it to ``out_path`` in the store's form: its members, then a
    whiteout for each of ``deleted``. Refuses with nothing kept at ``out_path``."""
    limits = DEFAULT_LIMITS
    try:
        members = list(read_members(src, limits))
        whiteouts = [_whiteout(path, archive) for path in deleted]
        make_plan([*members, *whiteouts], limits, whiteouts=True)
    except (ArchiveRefused, ArchiveCorrupt) as err:
        raise errors.InvalidArgument(f"{archive}: rootfs-diff.tar refused: {err.detail}") from None
    fd = os.open(out_path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
    try:
        with os.fdopen(fd, "wb", closefd=False) as out:
            writer = TarWriter(out)
            for m in [*members, *whiteouts]:
                writer.add(
                    m.name, m.typeflag, mode=m.mode, uid=m.uid, gid=m.gid,
                    mtime_ns=m.mtime_ns, size=m.size, linkname=m.linkname, xattrs=m.xattrs,
                )  # fmt: skip
                if m.typeflag == REG and m.size:
                    writer.content(src.fileno(), m.size, m.offset)
            writer.close()
    except BaseException:
        os.unlink(out_path)
        raise
    finally:
        os.close(fd)


def _whiteout(path: str, archive: str) -> Member:
    raw = os.fsencode(path.lstrip("/"))
    try:
        parts = split_path(raw, DEFAULT_LIMITS)
    except ArchiveRefused as err:
        raise errors.InvalidArgument(f"{archive}: {DELETED_FILES} refused: {err.detail}") from None
    if not parts:
        raise errors.InvalidArgument(f"{archive}: {DELETED_FILES} names the root directory")
    name = b"/".join((*parts[:-1], WHITEOUT_PREFIX + parts[-1]))
    return Member(
        name=name, typeflag=REG, mode=0, uid=0, gid=0, mtime_ns=0, size=0, offset=0,
        linkname=b"", xattrs=(),
    )  # fmt: skip
