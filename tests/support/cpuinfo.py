"""A CRIU cpuinfo.img this machine's CPU does not fit, made from its own.

``criu cpuinfo dump`` writes the CPU's description (CRIU's image format: two magic
words, then a 4-byte length and a protobuf ``cpuinfo_entry`` whose field 1 is the
``cpuinfo_x86_entry``); here its ``xfeatures_mask`` (field 8) gains bit 62, an xsave
feature no CPU has, so ``criu cpuinfo check`` refuses it on any x86 machine
("CPU xfeatures has unsupported bits").
"""

from __future__ import annotations

import struct
import subprocess
from collections.abc import Iterator
from pathlib import Path

X86_ENTRY = 1
XFEATURES_MASK = 8
UNKNOWN_XFEATURE = 1 << 62


def this_cpu(images: Path) -> bytes:
    """This machine's cpuinfo.img, written by the real CRIU."""
    images.mkdir(parents=True, exist_ok=True)
    subprocess.run(["criu", "cpuinfo", "dump", "--images-dir", str(images)], check=True)
    return (images / "cpuinfo.img").read_bytes()


def unfit(image: bytes) -> bytes:
    """``image`` (a real x86 cpuinfo.img) claiming an xsave feature no CPU has."""
    magic, (size,) = image[:8], struct.unpack("<I", image[8:12])
    (outer,) = _fields(image[12 : 12 + size])
    assert outer[0] == X86_ENTRY, "not an x86 cpuinfo.img"
    assert isinstance(outer[2], bytes)
    x86 = [
        (number, wire, value | UNKNOWN_XFEATURE)
        if number == XFEATURES_MASK and isinstance(value, int)
        else (number, wire, value)
        for number, wire, value in _fields(outer[2])
    ]
    entry = _encode([(X86_ENTRY, 2, _encode(x86))])
    return magic + struct.pack("<I", len(entry)) + entry


def _varint(data: bytes, at: int) -> tuple[int, int]:
    value = shift = 0
    while True:
        byte = data[at]
        at += 1
        value |= (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            return value, at


def _fields(data: bytes) -> Iterator[tuple[int, int, int | bytes]]:
    """(field number, wire type, value) of a protobuf message of varints and bytes."""
    at = 0
    while at < len(data):
        key, at = _varint(data, at)
        if key & 7 == 0:
            value, at = _varint(data, at)
            yield key >> 3, 0, value
        elif key & 7 == 2:
            length, at = _varint(data, at)
            yield key >> 3, 2, data[at : at + length]
            at += length
        else:
            raise ValueError(f"wire type {key & 7} is not in a cpuinfo.img")


def _varint_bytes(value: int) -> bytes:
    out = bytearray()
    while True:
        low, value = value & 0x7F, value >> 7
        out.append(low | (0x80 if value else 0))
        if not value:
            return bytes(out)


def _encode(fields: list[tuple[int, int, int | bytes]]) -> bytes:
    out = bytearray()
    for number, wire, value in fields:
        out += _varint_bytes(number << 3 | wire)
        if isinstance(value, bytes):
            out += _varint_bytes(len(value)) + value
        else:
            out += _varint_bytes(value)
    return bytes(out)
