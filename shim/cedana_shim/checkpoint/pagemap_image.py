"""CRIU's pagemap images: read, checked and written as CRIU 4.2 does.

The format (CRIU 4.2: images/pagemap.proto, criu/pagemap.c, criu/page-xfer.c):
``pagemap-<pid>.img`` / ``pagemap-shmem-<id>.img`` is IMG_COMMON_MAGIC and
PAGEMAP_MAGIC (u32 LE each), then length-prefixed (u32 LE) protobuf messages: a
PagemapHead naming ``pages-<pages_id>.img``, then one PagemapEntry per run of
pages in ascending address order. The pages image is raw: the pages of the
``PE_PRESENT`` runs, in pagemap order. Entries are read the way CRIU reads them
(``in_parent`` of old images is ``PE_PARENT``, no flags at all is ``PE_PRESENT``,
``compat_nr_pages`` counts where ``nr_pages`` is absent) and written the way CRIU
4.2 writes them (flags and nr_pages set, the required compat_nr_pages 0). A
malformed image raises :class:`~cedana_shim.errors.DataLoss` naming the file and
what is wrong.

Flattening a dump against its parents' images is :mod:`.pagemap`'s. Only the stdlib
and the store's fsutil at import; the generated protobuf module is imported on first
use.
"""

from __future__ import annotations

import mmap
import os
import re
import stat
import struct
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Final

from ..errors import DataLoss
from .store import fsutil

__all__ = [
    "IMG_COMMON_MAGIC",
    "MAX_ENTRIES",
    "MAX_ENTRY_BYTES",
    "PAGEMAP_MAGIC",
    "PAGE_SIZE",
    "PE_LAZY",
    "PE_PARENT",
    "PE_PRESENT",
    "Pagemap",
    "PagemapEntry",
    "decode",
    "encode",
    "is_pagemap_name",
    "open_image",
    "pages_name",
    "read_pagemap",
    "read_pagemap_at",
    "write_image",
    "write_pagemap",
]

PAGE_SIZE: Final = mmap.PAGESIZE
IMG_COMMON_MAGIC: Final = 0x54564319
PAGEMAP_MAGIC: Final = 0x56084025  # SHMEM_PAGEMAP_MAGIC is the same
PE_PARENT: Final = 1 << 0  # the pages are in the parent dump
PE_LAZY: Final = 1 << 1  # the pages may be restored lazily
PE_PRESENT: Final = 1 << 2  # the pages are in this dump's pages image

# An entry is at most ~36 bytes (five fields, two of them 64-bit varints).
MAX_ENTRY_BYTES: Final = 1024
# Runs of pages in one image: a process with millions of mappings is far off this.
MAX_ENTRIES: Final = 1 << 22
MAX_IMAGE_BYTES: Final = 256 << 20

_MAGICS: Final = struct.Struct("<II")
_LENGTH: Final = struct.Struct("<I")
_ADDRESS_LIMIT: Final = 1 << 64
_UINT32_LIMIT: Final = 1 << 32
_PAGEMAP_NAME: Final = re.compile(r"pagemap-(?:shmem-)?[0-9]+\.img")


@dataclass(frozen=True, slots=True)
class PagemapEntry:
    """One run of ``nr_pages`` pages from ``vaddr`` (an offset in the segment, for a
    shmem pagemap), with its ``PE_*`` flags."""

    vaddr: int
    nr_pages: int
    flags: int

    @property
    def end(self) -> int:
        return self.vaddr + self.nr_pages * PAGE_SIZE

    @property
    def in_parent(self) -> bool:
        return bool(self.flags & PE_PARENT)

    @property
    def present(self) -> bool:
        return bool(self.flags & PE_PRESENT)


@dataclass(frozen=True, slots=True)
class Pagemap:
    """A pagemap image: the id of its pages image and its runs, in address order."""

    pages_id: int
    entries: tuple[PagemapEntry, ...]

    @property
    def present_pages(self) -> int:
        """Pages in the pages image (the sum over ``PE_PRESENT`` runs)."""
        return sum(e.nr_pages for e in self.entries if e.flags & PE_PRESENT)

    @property
    def parent_pages(self) -> int:
        return sum(e.nr_pages for e in self.entries if e.flags & PE_PARENT)


def is_pagemap_name(name: str) -> bool:
    """``pagemap-<pid>.img`` or ``pagemap-shmem-<id>.img``."""
    return _PAGEMAP_NAME.fullmatch(name) is not None


def pages_name(pages_id: int) -> str:
    return f"pages-{pages_id}.img"


def _check_entry(entry: PagemapEntry, name: str, index: int, prev_end: int) -> None:
    where = f"{name}: entry {index} ({entry.vaddr:#x}, {entry.nr_pages} pages)"
    if entry.vaddr % PAGE_SIZE:
        raise DataLoss(f"{where}: address not page-aligned")
    if entry.nr_pages <= 0:
        raise DataLoss(f"{where}: no pages")
    if entry.end > _ADDRESS_LIMIT:
        raise DataLoss(f"{where}: run overflows the 64-bit address space")
    if entry.vaddr < prev_end:
        raise DataLoss(f"{where}: overlaps or precedes the run before it (ends {prev_end:#x})")
    if entry.flags & PE_PARENT and entry.flags & PE_PRESENT:
        raise DataLoss(f"{where}: both in the parent and present")
    if not 0 <= entry.flags < _UINT32_LIMIT:
        raise DataLoss(f"{where}: flags {entry.flags:#x} out of range")


def _records(data: bytes, name: str) -> Iterator[tuple[int, bytes]]:
    """(offset, message bytes) of each length-prefixed record after the magics."""
    pos = _MAGICS.size
    while pos < len(data):
        if len(data) - pos < _LENGTH.size:
            raise DataLoss(f"{name}: truncated length at offset {pos}")
        (length,) = _LENGTH.unpack_from(data, pos)
        if length > MAX_ENTRY_BYTES:
            raise DataLoss(f"{name}: entry at offset {pos} claims {length} bytes")
        start = pos + _LENGTH.size
        if start + length > len(data):
            raise DataLoss(
                f"{name}: truncated entry at offset {pos} "
                f"({length} bytes claimed, {len(data) - start} left)"
            )
        yield pos, data[start : start + length]
        pos = start + length


def decode(data: bytes, name: str = "pagemap") -> Pagemap:
    """The pagemap in ``data`` (a whole image), validated; :class:`DataLoss` naming
    ``name`` and what is wrong otherwise."""
    from google.protobuf.message import DecodeError

    from ..api.criu import pagemap_pb2

    if len(data) > MAX_IMAGE_BYTES:
        raise DataLoss(f"{name}: {len(data)} bytes, over the {MAX_IMAGE_BYTES} a pagemap may be")
    if len(data) < _MAGICS.size:
        raise DataLoss(f"{name}: {len(data)} bytes, shorter than the image magics")
    common, magic = _MAGICS.unpack_from(data)
    if common != IMG_COMMON_MAGIC or magic != PAGEMAP_MAGIC:
        raise DataLoss(f"{name}: magic {common:#x} {magic:#x} is not a pagemap image's")
    records = _records(data, name)
    head = pagemap_pb2.PagemapHead()
    try:
        offset, body = next(records)
        head.ParseFromString(body)
    except StopIteration:
        raise DataLoss(f"{name}: no pagemap head") from None
    except DecodeError as err:
        raise DataLoss(f"{name}: head at offset {offset} is corrupt: {err}") from err
    if not head.IsInitialized():
        raise DataLoss(f"{name}: head at offset {offset} lacks pages_id")
    entries: list[PagemapEntry] = []
    prev_end = 0
    pe = pagemap_pb2.PagemapEntry()
    for offset, body in records:
        if len(entries) >= MAX_ENTRIES:
            raise DataLoss(f"{name}: more than {MAX_ENTRIES} entries")
        try:
            pe.ParseFromString(body)
        except DecodeError as err:
            raise DataLoss(f"{name}: entry at offset {offset} is corrupt: {err}") from err
        if not pe.IsInitialized():
            raise DataLoss(f"{name}: entry at offset {offset} lacks a required field")
        # As CRIU's init_compat_pagemap_entry reads it.
        flags = pe.flags if pe.HasField("flags") else 0
        if pe.HasField("in_parent") and pe.in_parent:
            flags |= PE_PARENT
        elif not pe.HasField("flags"):
            flags = PE_PRESENT
        nr_pages = pe.nr_pages if pe.HasField("nr_pages") else pe.compat_nr_pages
        entry = PagemapEntry(pe.vaddr, nr_pages, flags)
        _check_entry(entry, name, len(entries), prev_end)
        entries.append(entry)
        prev_end = entry.end
    return Pagemap(head.pages_id, tuple(entries))


def encode(pagemap: Pagemap, name: str = "pagemap") -> bytes:
    """The image of ``pagemap``, entries as CRIU 4.2 writes them (write_pagemap_loc:
    flags and nr_pages, compat_nr_pages 0); :class:`DataLoss` for a pagemap that
    :func:`decode` would refuse."""
    from ..api.criu import pagemap_pb2

    if not 0 <= pagemap.pages_id < _UINT32_LIMIT:
        raise DataLoss(f"{name}: pages_id {pagemap.pages_id} out of range")
    if len(pagemap.entries) > MAX_ENTRIES:
        raise DataLoss(f"{name}: more than {MAX_ENTRIES} entries")
    parts = [_MAGICS.pack(IMG_COMMON_MAGIC, PAGEMAP_MAGIC)]
    body = pagemap_pb2.PagemapHead(pages_id=pagemap.pages_id).SerializeToString()
    parts += (_LENGTH.pack(len(body)), body)
    prev_end = 0
    for index, entry in enumerate(pagemap.entries):
        _check_entry(entry, name, index, prev_end)
        prev_end = entry.end
        body = pagemap_pb2.PagemapEntry(
            vaddr=entry.vaddr, compat_nr_pages=0, flags=entry.flags, nr_pages=entry.nr_pages
        ).SerializeToString()
        parts += (_LENGTH.pack(len(body)), body)
    data = b"".join(parts)
    if len(data) > MAX_IMAGE_BYTES:
        raise DataLoss(f"{name}: {len(data)} bytes, over the {MAX_IMAGE_BYTES} a pagemap may be")
    return data


def open_image(name: str, dir_fd: int | None, label: str) -> int:
    """A read-only fd of the regular file ``name``, never through a symlink."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
    except FileNotFoundError:
        raise
    except OSError as err:
        raise DataLoss(f"{label}: cannot open: {err.strerror}") from err
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise DataLoss(f"{label}: not a regular file")
    return fd


def _read_all(fd: int, label: str) -> bytes:
    size = os.fstat(fd).st_size
    if size > MAX_IMAGE_BYTES:
        raise DataLoss(f"{label}: {size} bytes, over the {MAX_IMAGE_BYTES} a pagemap may be")
    chunks: list[bytes] = []
    left = MAX_IMAGE_BYTES + 1
    while left > 0:
        chunk = os.read(fd, min(left, 1 << 20))
        if not chunk:
            break
        chunks.append(chunk)
        left -= len(chunk)
    return b"".join(chunks)


def read_pagemap_at(name: str, dir_fd: int | None, label: str) -> Pagemap:
    """The pagemap image ``name`` in ``dir_fd`` (not followed if a symlink), validated,
    ``label`` naming it in errors; FileNotFoundError where there is none."""
    fd = open_image(name, dir_fd, label)
    try:
        return decode(_read_all(fd, label), label)
    finally:
        os.close(fd)


def read_pagemap(path: str) -> Pagemap:
    """The pagemap image at ``path`` (not followed if a symlink), validated."""
    try:
        return read_pagemap_at(path, None, path)
    except FileNotFoundError as err:
        raise DataLoss(f"{path}: no such pagemap image") from err


def write_image(name: str, dir_fd: int | None, data: bytes, mode: int) -> None:
    """Write ``data`` to ``name`` in ``dir_fd``, a file that must not exist yet."""
    fd = os.open(
        name,
        os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
        mode,
        dir_fd=dir_fd,
    )
    try:
        fsutil.write_all(fd, data)
    finally:
        os.close(fd)


def write_pagemap(path: str, pagemap: Pagemap) -> None:
    """Write ``pagemap`` to ``path``, a file that must not exist yet (mode 0644 less
    the umask, CRIU's CR_FD_PERM)."""
    write_image(path, None, encode(pagemap, path), 0o644)
