"""CRIU pagemap images (checkpoint/pagemap_image.py): the codec round-trips, reads old
images as CRIU does, and refuses what is malformed, naming the file."""

from __future__ import annotations

import os
import struct
from pathlib import Path

import pytest
from cedana_shim.api.criu import pagemap_pb2
from cedana_shim.checkpoint import pagemap_image
from cedana_shim.checkpoint.pagemap_image import (
    MAX_ENTRY_BYTES,
    PAGE_SIZE,
    PE_LAZY,
    PE_PARENT,
    PE_PRESENT,
    Pagemap,
    PagemapEntry,
    decode,
    encode,
    read_pagemap,
    write_pagemap,
)
from cedana_shim.errors import DataLoss
from hypothesis import given, settings
from hypothesis import strategies as st
from support.examples import examples
from support.pagemaps import entry, raw_image

PS = PAGE_SIZE
BASE = 0x7F00_0000_0000


@st.composite
def pagemaps(draw: st.DrawFn) -> Pagemap:
    entries: list[PagemapEntry] = []
    vaddr = draw(st.one_of(st.integers(0, 1 << 36), st.integers(0, (1 << 52) - 1))) * PS
    for _ in range(draw(st.integers(0, 30))):
        vaddr += draw(st.integers(0, 1 << 20)) * PS
        nr = draw(st.integers(1, 1 << 33))
        kind = draw(st.sampled_from([PE_PRESENT, PE_PARENT, PE_PRESENT | PE_LAZY, PE_LAZY, 0]))
        extra = draw(st.integers(0, 0xFFFF_FFFF)) & ~(PE_PARENT | PE_PRESENT | PE_LAZY)
        if vaddr + nr * PS > 1 << 64:
            break
        entries.append(PagemapEntry(vaddr, nr, kind | (extra if draw(st.booleans()) else 0)))
        vaddr += nr * PS
    return Pagemap(draw(st.integers(0, 0xFFFF_FFFF)), tuple(entries))


@settings(max_examples=examples(300), deadline=None)
@given(pagemaps())
def test_a_pagemap_reads_back_as_written(pm: Pagemap) -> None:
    data = encode(pm)
    assert decode(data) == pm
    assert encode(decode(data)) == data


def test_entries_are_written_as_criu_4_2_writes_them() -> None:
    pm = Pagemap(3, (PagemapEntry(BASE, 5, PE_PRESENT), PagemapEntry(BASE + 5 * PS, 2, PE_PARENT)))
    assert encode(pm) == raw_image(3, entry(BASE, 5), entry(BASE + 5 * PS, 2, PE_PARENT))
    wire = pagemap_pb2.PagemapEntry()
    data = encode(pm)
    (length,) = struct.unpack_from("<I", data, 8 + 4 + 2)
    wire.ParseFromString(data[8 + 4 + 2 + 4 : 8 + 4 + 2 + 4 + length])
    # the required compat_nr_pages is on the wire (0), as protobuf-c writes it
    assert wire.HasField("compat_nr_pages") and wire.compat_nr_pages == 0
    assert wire.HasField("flags") and wire.HasField("nr_pages")


def test_old_images_read_as_criu_reads_them() -> None:
    """init_compat_pagemap_entry: in_parent is PE_PARENT, no flags is PE_PRESENT,
    compat_nr_pages counts where nr_pages is absent."""
    data = raw_image(
        1,
        {"vaddr": BASE, "compat_nr_pages": 3},
        {"vaddr": BASE + 3 * PS, "compat_nr_pages": 2, "in_parent": True},
        {"vaddr": BASE + 5 * PS, "compat_nr_pages": 1, "in_parent": False},
        {"vaddr": BASE + 6 * PS, "compat_nr_pages": 9, "nr_pages": 4, "flags": PE_LAZY},
    )
    assert decode(data).entries == (
        PagemapEntry(BASE, 3, PE_PRESENT),
        PagemapEntry(BASE + 3 * PS, 2, PE_PARENT),
        PagemapEntry(BASE + 5 * PS, 1, PE_PRESENT),
        PagemapEntry(BASE + 6 * PS, 4, PE_LAZY),
    )


def umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def test_files_read_and_write_without_following_links(tmp_path: Path) -> None:
    pm = Pagemap(7, (PagemapEntry(0, 1, PE_PRESENT),))
    write_pagemap(str(tmp_path / "pagemap-1.img"), pm)
    assert read_pagemap(str(tmp_path / "pagemap-1.img")) == pm
    assert (tmp_path / "pagemap-1.img").stat().st_mode & 0o777 == 0o644 & ~umask()
    with pytest.raises(FileExistsError):
        write_pagemap(str(tmp_path / "pagemap-1.img"), pm)
    (tmp_path / "pagemap-2.img").symlink_to("pagemap-1.img")
    with pytest.raises(DataLoss, match=r"pagemap-2\.img: cannot open"):
        read_pagemap(str(tmp_path / "pagemap-2.img"))
    with pytest.raises(DataLoss, match=r"pagemap-3\.img: no such"):
        read_pagemap(str(tmp_path / "pagemap-3.img"))


GOOD = raw_image(1, entry(BASE, 2), entry(BASE + 2 * PS, 1, PE_PARENT))

MALFORMED: dict[str, tuple[bytes, str]] = {
    "empty": (b"", "shorter than the image magics"),
    "bad common magic": (b"\x00\x00\x00\x00" + GOOD[4:], "is not a pagemap image's"),
    "bad pagemap magic": (GOOD[:4] + b"\x01\x02\x03\x04" + GOOD[8:], "is not a pagemap image's"),
    "stats image": (struct.pack("<II", 0x55105940, 0x57093306) + GOOD[8:], "magic"),
    "no head": (GOOD[:8], "no pagemap head"),
    "truncated entry": (GOOD[:-1], "truncated entry"),
    "truncated length": (GOOD + b"\x05\x00", "truncated length"),
    "huge length": (GOOD + struct.pack("<I", 0xFFFF_FFFF) + b"\x00" * 64, "claims 4294967295"),
    "length just over the bound": (
        GOOD + struct.pack("<I", MAX_ENTRY_BYTES + 1) + b"\x00" * (MAX_ENTRY_BYTES + 1),
        "claims",
    ),
    "corrupt protobuf": (GOOD + b"\x02\x00\x00\x00\x08\x80", "is corrupt"),
    "head lacks pages_id": (raw_image(None, entry(BASE, 1))[:8] + b"\x00\x00\x00\x00", "lacks"),
    "entry lacks vaddr": (raw_image(1, {"compat_nr_pages": 1}), "lacks a required field"),
    "overlapping runs": (raw_image(1, entry(BASE, 2), entry(BASE + PS, 2)), "overlaps"),
    "runs out of order": (raw_image(1, entry(BASE + 4 * PS, 1), entry(BASE, 1)), "precedes"),
    "duplicate run": (raw_image(1, entry(BASE, 1), entry(BASE, 1)), "overlaps"),
    "unaligned vaddr": (raw_image(1, entry(BASE + 8, 1)), "not page-aligned"),
    "no pages": (raw_image(1, entry(BASE, 0)), "no pages"),
    "old entry with no pages": (raw_image(1, {"vaddr": BASE, "compat_nr_pages": 0}), "no pages"),
    "overflow": (raw_image(1, entry((1 << 64) - PS, 2)), "overflows"),
    "huge nr_pages": (raw_image(1, entry(BASE, (1 << 64) - 1)), "overflows"),
    "parent and present": (raw_image(1, entry(BASE, 1, PE_PARENT | PE_PRESENT)), "both"),
    "in_parent and present": (
        raw_image(1, {**entry(BASE, 1), "in_parent": True}),
        "both in the parent and present",
    ),
}


@pytest.mark.parametrize("case", MALFORMED)
def test_a_malformed_image_is_refused_naming_the_file(tmp_path: Path, case: str) -> None:
    data, why = MALFORMED[case]
    path = tmp_path / "pagemap-12.img"
    path.write_bytes(data)
    with pytest.raises(DataLoss, match=why) as raised:
        read_pagemap(str(path))
    assert str(path) in str(raised.value)


def test_too_many_entries_are_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pagemap_image, "MAX_ENTRIES", 3)
    decode(raw_image(1, *(entry(BASE + i * PS, 1) for i in range(3))))
    with pytest.raises(DataLoss, match="x: more than 3 entries"):
        decode(raw_image(1, *(entry(BASE + i * PS, 1) for i in range(4))), "x")
    with pytest.raises(DataLoss, match="more than 3 entries"):
        encode(Pagemap(1, tuple(PagemapEntry(BASE + i * PS, 1, PE_PRESENT) for i in range(4))))


def test_an_oversized_image_is_refused(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(pagemap_image, "MAX_IMAGE_BYTES", len(GOOD) - 1)
    (tmp_path / "pagemap-1.img").write_bytes(GOOD)
    with pytest.raises(DataLoss, match="over the"):
        read_pagemap(str(tmp_path / "pagemap-1.img"))


@pytest.mark.parametrize(
    "bad",
    [
        Pagemap(1, (PagemapEntry(BASE, 2, PE_PRESENT), PagemapEntry(BASE + PS, 1, PE_PRESENT))),
        Pagemap(1, (PagemapEntry(BASE + 1, 1, PE_PRESENT),)),
        Pagemap(1, (PagemapEntry(BASE, 0, PE_PRESENT),)),
        Pagemap(1 << 32, ()),
        Pagemap(1, (PagemapEntry(BASE, 1, 1 << 32),)),
    ],
)
def test_what_decode_refuses_is_not_encoded(bad: Pagemap) -> None:
    with pytest.raises(DataLoss):
        encode(bad)
