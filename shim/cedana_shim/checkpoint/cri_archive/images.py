"""Checks of an imported ``checkpoint/`` directory before it becomes a checkpoint.

CRIU itself refuses malformed images at restore, but a store lists only what can be
restored: so an import checks what can be checked without CRIU. The images a restore
needs are there (``inventory.img``, ``pstree.img``); every ``*.img`` but the raw ones
(``pages-*.img``, the tmpfs tarballs) starts with CRIU's magic (the inventory with its
own); every pagemap decodes, names a pages image of exactly the size its present runs
need, and has no run in a parent dump (an archive stands alone); no pages image is left
that no pagemap names.
"""

from __future__ import annotations

import os
import re
import struct
from typing import Final

from cedana_shim import errors

from ..pagemap_image import (
    IMG_COMMON_MAGIC,
    PAGE_SIZE,
    is_pagemap_name,
    pages_name,
    read_pagemap_at,
)

__all__ = ["IMAGE_NAME", "check_images"]

# What CRIU (and runc beside it) write into an images dir: flat, plain names.
IMAGE_NAME: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
REQUIRED: Final = ("inventory.img", "pstree.img")
IMG_SERVICE_MAGIC: Final = 0x55105940
INVENTORY_MAGIC: Final = 0x58313116  # the one image without the common magic before it
_RAW: Final = re.compile(r"pages-[0-9]+\.img|.*\.tar\.gz\.img|.*-pages-[0-9]+\.img")
_MAGIC: Final = struct.Struct("<I")


def check_images(dir_fd: int, archive: str) -> None:
    """Raise InvalidArgument naming the first thing wrong with the images in ``dir_fd``."""
    names = sorted(os.listdir(dir_fd))
    for required in REQUIRED:
        if required not in names:
            raise errors.InvalidArgument(
                f"{archive}: checkpoint/{required} is missing: not a CRIU dump"
            )
    pages_named: set[str] = set()
    for name in names:
        if not name.endswith(".img") or _RAW.fullmatch(name):
            continue
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=dir_fd)
        try:
            head = os.pread(fd, _MAGIC.size, 0)
        finally:
            os.close(fd)
        if len(head) < _MAGIC.size or _MAGIC.unpack(head)[0] not in (
            IMG_COMMON_MAGIC,
            IMG_SERVICE_MAGIC,
            INVENTORY_MAGIC,
        ):
            raise errors.InvalidArgument(f"{archive}: checkpoint/{name} is not a CRIU image")
        if is_pagemap_name(name):
            pages_named.add(_check_pagemap(dir_fd, name, archive))
    for name in names:
        if re.fullmatch(r"pages-[0-9]+\.img", name) and name not in pages_named:
            raise errors.InvalidArgument(
                f"{archive}: checkpoint/{name} belongs to no pagemap image"
            )


def _check_pagemap(dir_fd: int, name: str, archive: str) -> str:
    label = f"{archive}: checkpoint/{name}"
    try:
        pagemap = read_pagemap_at(name, dir_fd, label)
    except errors.DataLoss as err:
        raise errors.InvalidArgument(str(err)) from None
    if pagemap.parent_pages:
        raise errors.InvalidArgument(
            f"{label}: {pagemap.parent_pages} pages are in a parent dump the archive does not "
            "hold (an incremental dump): export it self-contained"
        )
    pages = pages_name(pagemap.pages_id)
    try:
        size = os.stat(pages, dir_fd=dir_fd, follow_symlinks=False).st_size
    except FileNotFoundError:
        size = 0
    want = pagemap.present_pages * PAGE_SIZE
    if size != want:
        raise errors.InvalidArgument(
            f"{label}: its present runs need {want} bytes in checkpoint/{pages}, which has "
            f"{size}: the pages are truncated or not this dump's"
        )
    return pages
