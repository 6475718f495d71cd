"""CRIU pagemap images read page by page, for tests/unit and tests/privileged: what a
dump (through its ``parent`` links, if any) holds at each address, read independently
of the copying in cedana_shim.checkpoint.pagemap.flatten; and images built field by
field, independently of the codec's encoder."""

from __future__ import annotations

import os
import struct
from pathlib import Path

from cedana_shim.api.criu import pagemap_pb2
from cedana_shim.checkpoint.pagemap import PARENT_LINK
from cedana_shim.checkpoint.pagemap_image import (
    IMG_COMMON_MAGIC,
    PAGE_SIZE,
    PAGEMAP_MAGIC,
    PE_PARENT,
    PE_PRESENT,
    is_pagemap_name,
    pages_name,
    read_pagemap,
)


def raw_image(pages_id: int | None, *entries: dict[str, int | bool]) -> bytes:
    """An image built field by field (old-style entries, missing fields, ...)."""
    parts = [struct.pack("<II", IMG_COMMON_MAGIC, PAGEMAP_MAGIC)]
    messages: list[bytes] = []
    if pages_id is not None:
        messages.append(pagemap_pb2.PagemapHead(pages_id=pages_id).SerializeToString())
    messages += [pagemap_pb2.PagemapEntry(**e).SerializePartialToString() for e in entries]
    for body in messages:
        parts += [struct.pack("<I", len(body)), body]
    return b"".join(parts)


def entry(vaddr: int, nr: int, flags: int = PE_PRESENT) -> dict[str, int | bool]:
    return {"vaddr": vaddr, "compat_nr_pages": 0, "flags": flags, "nr_pages": nr}


def pagemap_names(images: Path) -> list[str]:
    return sorted(n for n in os.listdir(images) if is_pagemap_name(n))


def own_pages(images: Path, name: str) -> tuple[dict[int, bytes], list[int]]:
    """vaddr -> bytes of each page in the dump's own pages image, and the vaddrs of
    its pages in the parent."""
    pagemap = read_pagemap(str(images / name))
    data = (images / pages_name(pagemap.pages_id)).read_bytes()
    pages: dict[int, bytes] = {}
    in_parent: list[int] = []
    offset = 0
    for entry in pagemap.entries:
        for i in range(entry.nr_pages):
            vaddr = entry.vaddr + i * PAGE_SIZE
            if entry.flags & PE_PARENT:
                in_parent.append(vaddr)
            elif entry.flags & PE_PRESENT:
                page = data[offset : offset + PAGE_SIZE]
                assert len(page) == PAGE_SIZE, f"{name}: pages image ends at {vaddr:#x}"
                pages[vaddr] = page
                offset += PAGE_SIZE
    assert offset == len(data), f"{name}: {len(data) - offset} bytes past the last page"
    return pages, in_parent


def resolved_pages(images: Path, name: str, depth: int = 0) -> dict[int, bytes]:
    """vaddr -> bytes of every page the dump holds, parent pages looked up page by
    page down the chain of ``parent`` links."""
    assert depth <= 8, f"{images}: parent chain too deep"
    pages, in_parent = own_pages(images, name)
    if in_parent:
        parent = resolved_pages(images / PARENT_LINK, name, depth + 1)
        for vaddr in in_parent:
            assert vaddr in parent, f"{images / name}: {vaddr:#x} not in the parent chain"
            pages[vaddr] = parent[vaddr]
    return dict(sorted(pages.items()))
