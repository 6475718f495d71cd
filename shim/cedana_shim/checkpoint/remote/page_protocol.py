"""The wire format of CRIU's page server, as its lazy-pages daemon speaks it.

CRIU 4.2 (criu/page-xfer.c): every message starts with ``struct page_server_iov``
-- ``u32 cmd; u64 nr_pages; u64 vaddr; u64 dst_id`` in the host's byte order and
C layout (x86-64 and arm64: 4 bytes of padding after ``cmd``, 32 bytes in all). The
low 16 bits of ``cmd`` are the command, the high 16 its flags (``encode_ps_cmd``).

``criu lazy-pages --page-server`` (criu/uffd.c, criu/pagemap.c) sends only:

- ``PS_IOV_GET(nr_pages, vaddr, dst_id)``: ``dst_id`` is the task's pid as its
  pagemap image names it (``pagemap-<pid>.img``), not encoded with a type. The answer
  is ``PS_IOV_ADD_F`` with flags ``PE_PRESENT``, the same vaddr and dst_id and the
  number of pages that follow (no more than asked, at least one), then those pages.
- ``PS_IOV_CLOSE`` once it is done: the answer is an ``int32`` status, 0.

Pure functions over bytes, stdlib only: the page server (page_server.py) and its
tests share them.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Final

__all__ = [
    "HEADER",
    "PS_IOV_ADD_F",
    "PS_IOV_CLOSE",
    "PS_IOV_FORCE_CLOSE",
    "PS_IOV_GET",
    "PageIov",
    "close_reply",
    "decode",
    "encode",
    "pages_reply",
]

# "@" would be the host's own layout; "=" with the padding spelled out says the
# same for x86-64 and arm64 and stays the same size under any compiler flags.
HEADER: Final = struct.Struct("=I4xQQQ")
_CMD_BITS: Final = 16
_CMD_MASK: Final = (1 << _CMD_BITS) - 1
_STATUS: Final = struct.Struct("=i")

PS_IOV_ADD_F: Final = 6
PS_IOV_GET: Final = 7
PS_IOV_CLOSE: Final = 0x1023
PS_IOV_FORCE_CLOSE: Final = 0x1024
PE_PRESENT: Final = 1 << 2  # images/pagemap.proto's flag, as pagemap_image.PE_PRESENT

_U16: Final = 1 << 16
_U64: Final = 1 << 64


@dataclass(frozen=True, slots=True)
class PageIov:
    """One ``struct page_server_iov``: ``command`` and ``flags`` are ``cmd`` split."""

    command: int
    flags: int
    nr_pages: int
    vaddr: int
    dst_id: int

    def __post_init__(self) -> None:
        if not (0 <= self.command < _U16 and 0 <= self.flags < _U16):
            raise ValueError(f"command {self.command} / flags {self.flags} out of 16 bits")
        for name in ("nr_pages", "vaddr", "dst_id"):
            if not 0 <= getattr(self, name) < _U64:
                raise ValueError(f"{name} out of 64 bits")


def encode(iov: PageIov) -> bytes:
    return HEADER.pack(iov.flags << _CMD_BITS | iov.command, iov.nr_pages, iov.vaddr, iov.dst_id)


def decode(data: bytes | bytearray | memoryview) -> PageIov:
    """The header in ``data`` (exactly HEADER.size bytes); ValueError otherwise."""
    if len(data) != HEADER.size:
        raise ValueError(f"a page server header is {HEADER.size} bytes, got {len(data)}")
    cmd, nr_pages, vaddr, dst_id = HEADER.unpack(data)
    return PageIov(cmd & _CMD_MASK, cmd >> _CMD_BITS, nr_pages, vaddr, dst_id)


def pages_reply(request: PageIov, nr_pages: int) -> bytes:
    """The header answering GET ``request`` with ``nr_pages`` pages (they follow it)."""
    if not 0 < nr_pages <= request.nr_pages:
        raise ValueError(f"{nr_pages} pages answer a request for {request.nr_pages}")
    return encode(PageIov(PS_IOV_ADD_F, PE_PRESENT, nr_pages, request.vaddr, request.dst_id))


def close_reply() -> bytes:
    """The status CLOSE waits for: all is well."""
    return _STATUS.pack(0)
