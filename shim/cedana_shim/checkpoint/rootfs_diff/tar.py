"""A strict, bytes-native tar reader and a streaming pax writer for rootfs diffs.

Why not :mod:`tarfile`: its reader silently stops at a damaged header (a
truncated or tampered diff would apply half-way), reads pax headers of any
size into memory, honours global headers that rename every later member, and
decodes names through the locale. This reader knows exactly the member types a
diff may hold, refuses the rest by name, bounds every header, and treats a
missing end-of-archive marker as data loss. The writer emits POSIX pax
archives that GNU tar, Go's archive/tar and :mod:`tarfile` all read (the tests
check the last).
"""

from __future__ import annotations

import errno
import os
import re
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import BinaryIO, Final

from .types import ArchiveCorrupt, Limits, refuse

__all__ = ["DIR", "LNK", "REG", "SYM", "Member", "TarWriter", "read_members"]

BLOCK: Final = 512
RECORD: Final = 20 * BLOCK
REG: Final = b"0"
LNK: Final = b"1"
SYM: Final = b"2"
DIR: Final = b"5"
_MEMBER_TYPES: Final = frozenset({REG, b"\0", LNK, SYM, DIR})
_REFUSED_TYPES: Final = {
    b"3": "a character device node",
    b"4": "a block device node",
    b"6": "a FIFO",
    b"7": "a contiguous file",
    b"S": "a GNU sparse file",
    b"g": "a pax global header (it would rename every later member)",
}
_ZERO: Final = bytes(BLOCK)
_NS: Final = 1_000_000_000
_MTIME: Final = re.compile(rb"(-?)([0-9]{1,20})(?:\.([0-9]{0,30}))?")
_SMALL_FILE: Final = 256 << 10
_CHUNK: Final = 1 << 20
_FALLBACK_ERRNOS: Final = frozenset(
    {errno.EXDEV, errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.EBADF}
)


@dataclass(slots=True)
class Member:
    """One archive member as stored; the plan module decides if it is allowed."""

    name: bytes
    typeflag: bytes
    mode: int
    uid: int
    gid: int
    mtime_ns: int
    size: int
    offset: int
    linkname: bytes
    xattrs: tuple[tuple[bytes, bytes], ...]


def _corrupt(offset: int, what: str) -> ArchiveCorrupt:
    detail = f"corrupt at byte {offset}: {what}"
    return ArchiveCorrupt(
        f"rootfs diff archive is {detail}; the checkpoint is damaged, restore from an earlier one",
        detail,
    )


def _read_exact(f: BinaryIO, n: int) -> bytes:
    chunks = []
    while n > 0:
        chunk = f.read(n)
        if not chunk:
            break
        chunks.append(chunk)
        n -= len(chunk)
    return b"".join(chunks)


def _nts(field: bytes) -> bytes:
    return field.split(b"\0", 1)[0]


def _octal(field: bytes, offset: int) -> int:
    if field[0] == 0xFF:
        raise _corrupt(offset, "negative base-256 number")
    if field[0] & 0x80:  # GNU base-256, for values the octal field cannot hold
        return int.from_bytes(bytes([field[0] & 0x7F]) + field[1:], "big")
    digits = _nts(field).strip(b" ")
    if not digits:
        return 0
    if digits.strip(b"01234567"):
        raise _corrupt(offset, f"bad octal field {field!r}")
    return int(digits, 8)


def _decimal(value: bytes, key: bytes, name: bytes) -> int:
    if not value.isdigit() or len(value) > 20:
        raise refuse(name, f"has a bad pax {key.decode(errors='replace')} value {value[:40]!r}")
    return int(value)


def parse_mtime(value: bytes, name: bytes) -> int:
    """A pax ``mtime`` ("-12.5", "1700000000.123456789") as integer nanoseconds."""
    match = _MTIME.fullmatch(value)
    if match is None:
        raise refuse(name, f"has a bad pax mtime {value[:40]!r}")
    sign, whole, frac = match.groups()
    ns = int(whole) * _NS + int((frac or b"")[:9].ljust(9, b"0"))
    return -ns if sign else ns


def _pax_records(buf: bytes, offset: int) -> Iterator[tuple[bytes, bytes]]:
    pos = 0
    while pos < len(buf):
        if not buf[pos:].strip(b"\0"):  # some writers pad the header with NULs
            return
        space = buf.find(b" ", pos, pos + 21)
        length_text = buf[pos:space] if space > pos else b""
        if not length_text.isdigit():
            raise _corrupt(offset, "bad pax record length")
        end = pos + int(length_text)
        if end > len(buf) or end <= space + 1 or buf[end - 1] != 0x0A:
            raise _corrupt(offset, "pax record overruns its header")
        key, eq, value = buf[space + 1 : end - 1].partition(b"=")
        if not eq or not key:
            raise _corrupt(offset, "pax record without key=value")
        yield key, value
        pos = end


@dataclass(slots=True)
class _Extended:
    """What pax and GNU long-name headers say about the member that follows."""

    path: bytes | None = None
    linkpath: bytes | None = None
    size: int | None = None
    uid: int | None = None
    gid: int | None = None
    mtime_ns: int | None = None
    xattrs: tuple[tuple[bytes, bytes], ...] = ()
    seen: bytes = b""

    def add_pax(self, buf: bytes, offset: int) -> None:
        xattrs = list(self.xattrs)
        for key, value in _pax_records(buf, offset):
            label = self.path or b""
            if key.startswith(b"SCHILY.xattr."):
                xattrs.append((key[len(b"SCHILY.xattr.") :], value))
            elif key.startswith(b"GNU.sparse."):
                raise refuse(label, "is a sparse file (not supported in a rootfs diff)")
            elif key.startswith(b"LIBARCHIVE.xattr."):
                raise refuse(label, "carries libarchive-encoded xattrs (not supported)")
            elif not value:
                continue  # pax: an empty value unsets the keyword
            elif key == b"path":
                self.path = value
            elif key == b"linkpath":
                self.linkpath = value
            elif key == b"size":
                self.size = _decimal(value, key, label)
            elif key == b"uid":
                self.uid = _decimal(value, key, label)
            elif key == b"gid":
                self.gid = _decimal(value, key, label)
            elif key == b"mtime":
                self.mtime_ns = parse_mtime(value, label)
            # atime, ctime, uname, gname, hdrcharset, comment: nothing to apply.
        self.xattrs = tuple(xattrs)


def read_members(f: BinaryIO, limits: Limits) -> Iterator[Member]:
    """Members of the archive at ``f``'s position (``f`` must be seekable)."""
    pos = f.tell()
    ext = _Extended()
    while True:
        block = _read_exact(f, BLOCK)
        if len(block) < BLOCK:
            raise _corrupt(pos, "archive ends without an end-of-archive marker (truncated)")
        if block == _ZERO:
            if ext.seen:
                raise _corrupt(pos, "extended header without a member after it")
            return
        checksum = _octal(block[148:156], pos)
        stored = sum(block[:148]) + 256 + sum(block[156:])
        # Some old writers summed signed chars; accept either, as tar(1) does.
        if checksum != stored and checksum != stored - 256 * sum(
            1 for b in block[:148] + block[156:] if b > 127
        ):
            raise _corrupt(pos, "header checksum mismatch")
        posix = block[257:263] == b"ustar\x00"
        if not posix and block[257:265] != b"ustar  \x00":
            raise _corrupt(pos, "not a ustar/pax header")
        typeflag = block[156:157]
        size = _octal(block[124:136], pos)
        data = pos + BLOCK
        end = data + -(-size // BLOCK) * BLOCK
        field_name = _nts(block[0:100])
        if posix and block[345]:
            field_name = _nts(block[345:500]) + b"/" + field_name
        if typeflag in (b"x", b"L", b"K"):
            label = ext.path or field_name
            if typeflag in ext.seen:
                raise _corrupt(pos, "two extended headers of one kind for one member")
            if size > limits.max_header_bytes:
                raise refuse(
                    label, f"has a {size}-byte extended header (limit {limits.max_header_bytes})"
                )
            payload = _read_exact(f, size)
            if len(payload) < size:
                raise _corrupt(pos, "archive truncated inside an extended header")
            ext.seen += typeflag
            if typeflag == b"x":
                ext.add_pax(payload, pos)
            elif typeflag == b"L" and ext.path is None:
                ext.path = _nts(payload)
            elif typeflag == b"K" and ext.linkpath is None:
                ext.linkpath = _nts(payload)
            f.seek(end)
            pos = end
            continue
        name = ext.path if ext.path is not None else field_name
        if typeflag in _REFUSED_TYPES:
            raise refuse(
                name,
                f"is {_REFUSED_TYPES[typeflag]}; a rootfs diff holds only "
                "files, directories, symlinks and hard links",
            )
        if typeflag not in _MEMBER_TYPES:
            raise refuse(name, f"has unsupported tar type {typeflag!r}")
        if ext.size is not None:
            size = ext.size
            end = data + -(-size // BLOCK) * BLOCK
        if typeflag not in (REG, b"\0") and size:
            raise refuse(name, "is not a regular file but carries data")
        mtime_ns = ext.mtime_ns
        if mtime_ns is None:
            mtime_ns = _octal(block[136:148], pos) * _NS
        yield Member(
            name=name,
            typeflag=REG if typeflag == b"\0" else typeflag,
            mode=_octal(block[100:108], pos) & 0o7777,
            uid=ext.uid if ext.uid is not None else _octal(block[108:116], pos),
            gid=ext.gid if ext.gid is not None else _octal(block[116:124], pos),
            mtime_ns=mtime_ns,
            size=size,
            offset=data,
            linkname=ext.linkpath if ext.linkpath is not None else _nts(block[157:257]),
            xattrs=ext.xattrs,
        )
        ext = _Extended()
        f.seek(end)
        pos = end


# ---------------------------------------------------------------------------
# Writer


def _pax_record(key: bytes, value: bytes) -> bytes:
    body = b" " + key + b"=" + value + b"\n"
    digits = len(str(len(body)))
    if len(str(len(body) + digits)) > digits:
        digits += 1
    return str(len(body) + digits).encode() + body


def _fmt_ns(ns: int) -> bytes:
    sign = "-" if ns < 0 else ""
    whole, frac = divmod(abs(ns), _NS)
    return f"{sign}{whole}.{frac:09d}".rstrip("0").encode()


def _field(value: int, width: int) -> bytes:
    return b"%0*o\0" % (width - 1, value)


def _fits(value: int, width: int) -> bool:
    return 0 <= value < 1 << (3 * (width - 1))


def _ustar(
    name: bytes,
    typeflag: bytes,
    mode: int,
    uid: int,
    gid: int,
    size: int,
    mtime: int,
    linkname: bytes,
) -> bytes:
    h = bytearray(BLOCK)
    h[0:100] = name[:100].ljust(100, b"\0")
    h[100:108] = _field(mode & 0o7777, 8)
    h[108:116] = _field(uid if _fits(uid, 8) else 0, 8)
    h[116:124] = _field(gid if _fits(gid, 8) else 0, 8)
    h[124:136] = _field(size if _fits(size, 12) else 0, 12)
    h[136:148] = _field(mtime if _fits(mtime, 12) else 0, 12)
    h[148:156] = b" " * 8
    h[156:157] = typeflag
    h[157:257] = linkname[:100].ljust(100, b"\0")
    h[257:265] = b"ustar\x0000"
    h[148:156] = b"%06o\0 " % sum(h)
    return bytes(h)


class TarWriter:
    """Streams members to a file descriptor (or a binary file object)."""

    def __init__(self, out: int | BinaryIO) -> None:
        self._fd = out if isinstance(out, int) else None
        self._file = None if isinstance(out, int) else out
        self._buf = bytearray()
        self._written = 0
        self._kernel_copy = self._fd is not None

    def add(
        self,
        name: bytes,
        typeflag: bytes,
        *,
        mode: int,
        uid: int,
        gid: int,
        mtime_ns: int,
        size: int = 0,
        linkname: bytes = b"",
        xattrs: Sequence[tuple[bytes, bytes]] = (),
    ) -> None:
        """Write one header; a regular file's content must follow via :meth:`content`."""
        records = []
        for key, value in ((b"path", name), (b"linkpath", linkname)):
            if len(value) > 100 or not value.isascii():
                records.append(_pax_record(key, value))
        for key, number, width in ((b"uid", uid, 8), (b"gid", gid, 8), (b"size", size, 12)):
            if not _fits(number, width):
                records.append(_pax_record(key, str(number).encode()))
        mtime, frac = divmod(mtime_ns, _NS)
        if frac or not _fits(mtime, 12):
            records.append(_pax_record(b"mtime", _fmt_ns(mtime_ns)))
        for xname, xvalue in xattrs:
            records.append(_pax_record(b"SCHILY.xattr." + xname, xvalue))
        if records:
            try:
                (name + linkname).decode("utf-8")
            except UnicodeDecodeError:  # POSIX: raw bytes must be declared as such
                records.insert(0, _pax_record(b"hdrcharset", b"BINARY"))
            payload = b"".join(records)
            self._put(_ustar(b"././@PaxHeader", b"x", 0o644, 0, 0, len(payload), 0, b""))
            self._put(payload)
            self._pad(len(payload))
        self._put(_ustar(name, typeflag, mode, uid, gid, size, max(mtime, 0), linkname))

    def content(self, src_fd: int, size: int, offset: int = 0) -> int:
        """Copy exactly ``size`` bytes of ``src_fd`` (from ``offset``) as the member's data.

        A file that shrank while being read is padded with zeros so the archive
        stays well formed; returns how many bytes really came from the file.
        """
        got = 0
        if size <= _SMALL_FILE or self._fd is None:
            while got < size:
                chunk = os.pread(src_fd, min(size - got, _CHUNK), offset + got)
                if not chunk:
                    break
                self._put(chunk)
                got += len(chunk)
        else:
            self._flush()
            got = self._copy_fd(src_fd, self._fd, size, offset)
            self._written += got
        if got < size:
            self._put(bytes(size - got))
        self._pad(size)
        return got

    def _copy_fd(self, src: int, dst: int, size: int, offset: int) -> int:
        got = 0
        while got < size and self._kernel_copy:
            try:
                n = os.copy_file_range(src, dst, size - got, offset + got)
            except OSError as err:
                if err.errno not in _FALLBACK_ERRNOS:
                    raise
                self._kernel_copy = False
                break
            if n == 0:
                return got
            got += n
        while got < size:
            chunk = os.pread(src, min(size - got, _CHUNK), offset + got)
            if not chunk:
                break
            _write_all(dst, chunk)
            got += len(chunk)
        return got

    def close(self) -> None:
        """End-of-archive marker, padded to a whole record as tar(1) writes it."""
        self._put(bytes(2 * BLOCK))
        total = self._written + len(self._buf)
        self._put(bytes(-total % RECORD))
        self._flush()

    def _pad(self, size: int) -> None:
        if size % BLOCK:
            self._put(bytes(BLOCK - size % BLOCK))

    def _put(self, data: bytes) -> None:
        self._buf += data
        if len(self._buf) >= _CHUNK:
            self._flush()

    def _flush(self) -> None:
        if not self._buf:
            return
        if self._fd is not None:
            _write_all(self._fd, self._buf)
        else:
            assert self._file is not None
            self._file.write(self._buf)
        self._written += len(self._buf)
        self._buf = bytearray()


def _write_all(fd: int, data: bytes | bytearray) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]
