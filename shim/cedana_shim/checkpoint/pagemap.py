"""Flattening a dirty-tracked dump into a self-contained one.

A dump CRIU takes with ``--track-mem`` against a previous one (``--prev-images-dir``;
runc ``--parent-path``) writes only the pages written since: its pagemap images
(:mod:`.pagemap_image`) mark the runs of pages it did not write with ``PE_PARENT``,
and those pages stay in the previous dump, which CRIU finds through the ``parent``
symlink it leaves in the images dir (that dump may have a parent of its own). The
shim stores every checkpoint self-contained (a checkpoint must restore, upload and be
deleted on its own), so after such a dump :func:`flatten` copies the pages the chain
holds into this dump and removes the link.

Flattening keeps every entry as it is (no merging of adjacent runs: CRIU writes
adjacent runs itself and restores them alike) and only turns ``PE_PARENT`` into
``PE_PRESENT``, other bits (``PE_LAZY``) kept. Everything is read, checked and
copied into temp files in the images dir before anything there is replaced, so a
malformed chain or a page the chain lacks raises
:class:`~cedana_shim.errors.DataLoss` with the images dir as it was. The renames
that follow replace each pages image and then its pagemap with new inodes; nothing
is fsynced here (the caller's publish fsyncs and checksums every file), but the
copied bytes' writeback starts as they are copied (so that the rename over the old
image does not flush it all at once; bench/flatten.py measures it), and a dump whose
flatten raised is not to be published. Bulk bytes move with ``copy_file_range`` (in
the kernel, or a reflink), read/write where a file system or kernel does not support
it.
"""

from __future__ import annotations

import bisect
import contextlib
import errno
import os
import secrets
import stat
import time
from dataclasses import dataclass, field, replace
from typing import Final

from ..errors import DataLoss
from .pagemap_image import (
    PAGE_SIZE,
    PE_PARENT,
    PE_PRESENT,
    Pagemap,
    PagemapEntry,
    encode,
    is_pagemap_name,
    open_image,
    pages_name,
    read_pagemap_at,
    write_image,
)
from .store import fsutil

__all__ = ["MAX_PARENT_DEPTH", "PARENT_LINK", "FlattenStats", "flatten"]

PARENT_LINK: Final = "parent"  # CR_PARENT_LINK
# Parents above a dump: deeper chains are refused, and so is a link loop.
MAX_PARENT_DEPTH: Final = 8

_COPY_CHUNK: Final = 8 << 20
# copy_file_range refuses these where the kernel or a file system cannot copy: a
# copy between file systems (EXDEV), an old kernel (ENOSYS), a file system without
# it (EOPNOTSUPP, EINVAL), a seccomp filter (EPERM).
_NO_IN_KERNEL_COPY: Final = frozenset(
    {errno.EXDEV, errno.ENOSYS, errno.EOPNOTSUPP, errno.EINVAL, errno.EPERM}
)


@dataclass(frozen=True, slots=True)
class FlattenStats:
    """What :func:`flatten` did. ``files_rewritten`` counts pagemap and pages images
    replaced (two per pagemap that had runs in the parent); ``pages_from_parents``
    are the pages copied in from the chain, ``pages_own`` those of this dump copied
    along into the rewritten pages images; ``bytes_written`` covers both images."""

    files_rewritten: int
    pages_from_parents: int
    pages_own: int
    bytes_written: int
    seconds: float


@dataclass(slots=True)
class _Image:
    """A pagemap of one dump of the chain, with its pages image open."""

    label: str
    pagemap: Pagemap
    pages_fd: int
    pages_label: str
    starts: list[int]  # each entry's vaddr, for bisect
    offsets: list[int]  # each entry's offset in the pages image


class _Dump:
    """One images dir of the chain: depth 0 is the dump being flattened, each
    parent opened (once) when a run needs it."""

    def __init__(self, dir_fd: int, label: str, depth: int) -> None:
        self.dir_fd = dir_fd
        self.label = label
        self.depth = depth
        self.parent: _Dump | None = None

    def open_parent(self, needed_by: str) -> _Dump:
        if self.parent is not None:
            return self.parent
        label = os.path.join(self.label, PARENT_LINK)
        if self.depth >= MAX_PARENT_DEPTH:
            raise DataLoss(
                f"{needed_by}: the parent chain goes deeper than {MAX_PARENT_DEPTH} dumps "
                f"(or loops): {label}"
            )
        try:
            # As CRIU's open_parent: the link as the kernel resolves it from this dir.
            fd = os.open(
                PARENT_LINK, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=self.dir_fd
            )
        except OSError as err:
            raise DataLoss(f"{needed_by}: has pages in {label}: {err.strerror}") from err
        self.parent = _Dump(fd, label, self.depth + 1)
        return self.parent

    def close_parents(self) -> None:
        parent, self.parent = self.parent, None
        while parent is not None:
            os.close(parent.dir_fd)
            parent = parent.parent


@dataclass(slots=True)
class _Plan:
    """What goes, in order, into a new pages image: (fd, offset, length, label) ranges,
    adjacent ones of one file joined."""

    segments: list[tuple[int, int, int, str]] = field(default_factory=list)
    own: int = 0
    from_parents: int = 0

    def add(self, fd: int, offset: int, length: int, label: str) -> None:
        if self.segments:
            last_fd, last_offset, last_length, last_label = self.segments[-1]
            if last_fd == fd and last_offset + last_length == offset:
                self.segments[-1] = (fd, last_offset, last_length + length, last_label)
                return
        self.segments.append((fd, offset, length, label))


class _Chain:
    """One pagemap name down the chain of dumps: its image in each dump, open while
    its new pages image is planned and copied."""

    def __init__(self, top: _Dump, name: str, pagemap: Pagemap) -> None:
        self.top = top
        self.name = name
        self.child = os.path.join(top.label, name)
        self.images: dict[int, _Image] = {}
        self.images[0] = self._open(top, pagemap)

    def close(self) -> None:
        for image in self.images.values():
            os.close(image.pages_fd)
        self.images.clear()

    def _open(self, dump: _Dump, pagemap: Pagemap) -> _Image:
        label = os.path.join(dump.label, self.name)
        pages_label = os.path.join(dump.label, pages_name(pagemap.pages_id))
        try:
            pages_fd = open_image(pages_name(pagemap.pages_id), dump.dir_fd, pages_label)
        except FileNotFoundError:
            raise DataLoss(f"{label}: its pages image {pages_label} is missing") from None
        starts: list[int] = []
        offsets: list[int] = []
        offset = 0
        for entry in pagemap.entries:
            starts.append(entry.vaddr)
            offsets.append(offset)
            if entry.flags & PE_PRESENT:
                offset += entry.nr_pages * PAGE_SIZE
        size = os.fstat(pages_fd).st_size
        if size < offset:
            os.close(pages_fd)
            raise DataLoss(f"{pages_label}: truncated: {size} bytes where {label} needs {offset}")
        return _Image(label, pagemap, pages_fd, pages_label, starts, offsets)

    def image(self, dump: _Dump) -> _Image:
        if dump.depth not in self.images:
            label = os.path.join(dump.label, self.name)
            try:
                pagemap = read_pagemap_at(self.name, dump.dir_fd, label)
            except FileNotFoundError:
                raise DataLoss(
                    f"{self.child}: has pages in the parent, and there is no {label}"
                ) from None
            self.images[dump.depth] = self._open(dump, pagemap)
        return self.images[dump.depth]

    def resolve(self, dump: _Dump, vaddr: int, nr_pages: int, plan: _Plan) -> None:
        """Add to ``plan`` where ``dump`` (a parent) holds ``nr_pages`` from ``vaddr``;
        as CRIU's read_parent_page, a run may span several of the parent's runs, each
        present there or in the parent's parent."""
        image = self.image(dump)
        entries = image.pagemap.entries
        addr, end = vaddr, vaddr + nr_pages * PAGE_SIZE
        i = bisect.bisect_right(image.starts, addr) - 1
        if i < 0 or entries[i].end <= addr:
            i += 1
        while addr < end:
            if i >= len(entries) or entries[i].vaddr > addr:
                raise DataLoss(f"{self.child}: page {addr:#x} is in no run of {image.label}")
            entry = entries[i]
            stop = min(end, entry.end)
            count = (stop - addr) // PAGE_SIZE
            if entry.flags & PE_PARENT:
                self.resolve(dump.open_parent(image.label), addr, count, plan)
            elif entry.flags & PE_PRESENT:
                offset = image.offsets[i] + (addr - entry.vaddr)
                plan.add(image.pages_fd, offset, count * PAGE_SIZE, image.pages_label)
            else:
                raise DataLoss(
                    f"{self.child}: page {addr:#x} is not in the pages of {image.label} "
                    f"(flags {entry.flags:#x})"
                )
            addr = stop
            i += 1

    def plan(self) -> tuple[_Plan, Pagemap]:
        """The new pages image's plan, and the new pagemap: parent runs made present."""
        image = self.images[0]
        plan = _Plan()
        entries: list[PagemapEntry] = []
        for i, entry in enumerate(image.pagemap.entries):
            if entry.flags & PE_PARENT:
                self.resolve(self.top.open_parent(self.child), entry.vaddr, entry.nr_pages, plan)
                plan.from_parents += entry.nr_pages
                entry = replace(entry, flags=(entry.flags & ~PE_PARENT) | PE_PRESENT)
            elif entry.flags & PE_PRESENT:
                plan.add(
                    image.pages_fd, image.offsets[i], entry.nr_pages * PAGE_SIZE, image.pages_label
                )
                plan.own += entry.nr_pages
            entries.append(entry)
        return plan, Pagemap(image.pagemap.pages_id, tuple(entries))


class _Copier:
    """copy_file_range until the kernel says it cannot here, then read/write. The
    writeback of what was copied starts as it goes (as the early seal does for CRIU's
    own page images): the publish's fsync then finds little left, and a rename over
    the old image (ext4 flushes a file renamed over another) none."""

    def __init__(self) -> None:
        self.in_kernel = True

    def copy(self, src: int, dst: int, offset: int, length: int, label: str) -> None:
        while length > 0:
            want = min(length, _COPY_CHUNK)
            at = os.lseek(dst, 0, os.SEEK_CUR)
            if self.in_kernel:
                try:
                    n = os.copy_file_range(src, dst, want, offset)
                except OSError as err:
                    if err.errno not in _NO_IN_KERNEL_COPY:
                        raise
                    self.in_kernel = False
                    continue
            else:
                chunk = os.pread(src, want, offset)
                fsutil.write_all(dst, chunk)
                n = len(chunk)
            if n == 0:
                raise DataLoss(f"{label}: ends at {offset} while its pages were being copied")
            fsutil.start_writeback(dst, at, n)
            offset += n
            length -= n


def _scan(dir_fd: int, label: str) -> dict[str, Pagemap]:
    """Every pagemap image of the dump, by name, checked not to share a pages image."""
    pagemaps: dict[str, Pagemap] = {}
    owners: dict[int, str] = {}
    for name in sorted(n for n in os.listdir(dir_fd) if is_pagemap_name(n)):
        path = os.path.join(label, name)
        try:
            pagemap = read_pagemap_at(name, dir_fd, path)
        except FileNotFoundError:
            continue
        if pagemap.pages_id in owners:
            raise DataLoss(
                f"{path}: shares {pages_name(pagemap.pages_id)} with {owners[pagemap.pages_id]}"
            )
        owners[pagemap.pages_id] = name
        pagemaps[name] = pagemap
    return pagemaps


def _temp_name(name: str) -> str:
    return f".{name}.flatten-{secrets.token_hex(4)}"


def flatten(images_dir: str) -> FlattenStats | None:
    """Make the dump in ``images_dir`` self-contained: copy every page its pagemaps
    leave to the parent chain into its own pages images and remove its ``parent``
    link. None, with nothing touched, where there is no link; :class:`DataLoss`,
    with nothing touched, where the chain does not hold what the dump needs."""
    link = os.path.join(images_dir, PARENT_LINK)
    try:
        if not stat.S_ISLNK(os.lstat(link).st_mode):
            raise DataLoss(f"{link}: not a symlink (CRIU links the parent images dir)")
    except FileNotFoundError:
        return None
    started = time.monotonic()
    dir_fd = os.open(images_dir, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    top = _Dump(dir_fd, images_dir, 0)
    temps: list[str] = []
    try:
        copier = _Copier()
        renames: list[tuple[str, str]] = []
        own = from_parents = written = 0
        for name, pagemap in _scan(dir_fd, images_dir).items():
            if not pagemap.parent_pages:
                continue
            chain = _Chain(top, name, pagemap)
            try:
                plan, flat = chain.plan()
                pages = pages_name(flat.pages_id)
                pages_temp = _temp_name(pages)
                mode = stat.S_IMODE(os.fstat(chain.images[0].pages_fd).st_mode)
                fd = os.open(
                    pages_temp,
                    os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                    mode,
                    dir_fd=dir_fd,
                )
                temps.append(pages_temp)
                try:
                    for src, offset, length, label in plan.segments:
                        copier.copy(src, fd, offset, length, label)
                        written += length
                finally:
                    os.close(fd)
            finally:
                chain.close()
            data = encode(flat, chain.child)
            map_temp = _temp_name(name)
            map_mode = stat.S_IMODE(os.stat(name, dir_fd=dir_fd, follow_symlinks=False).st_mode)
            temps.append(map_temp)
            write_image(map_temp, dir_fd, data, map_mode)
            written += len(data)
            own += plan.own
            from_parents += plan.from_parents
            # The pages image first, its pagemap (which names it) last.
            renames += [(pages_temp, pages), (map_temp, name)]
        for temp, final in renames:
            os.rename(temp, final, src_dir_fd=dir_fd, dst_dir_fd=dir_fd)
            temps.remove(temp)
        os.unlink(PARENT_LINK, dir_fd=dir_fd)
        return FlattenStats(
            files_rewritten=len(renames),
            pages_from_parents=from_parents,
            pages_own=own,
            bytes_written=written,
            seconds=round(time.monotonic() - started, 6),
        )
    finally:
        for temp in temps:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(temp, dir_fd=dir_fd)
        top.close_parents()
        os.close(dir_fd)
