"""Flattening (checkpoint/pagemap.py): flatten() turns synthetic dirty-tracked chains
into self-contained dumps holding exactly the pages the chain held, or leaves the dump
untouched."""

from __future__ import annotations

import errno
import hashlib
import os
import tempfile
from dataclasses import dataclass
from pathlib import Path

import pytest
from cedana_shim.checkpoint.pagemap import MAX_PARENT_DEPTH, PARENT_LINK, FlattenStats, flatten
from cedana_shim.checkpoint.pagemap_image import (
    PAGE_SIZE,
    PE_LAZY,
    PE_PARENT,
    PE_PRESENT,
    pages_name,
    read_pagemap,
)
from cedana_shim.errors import DataLoss
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.examples import examples
from support.pagemaps import entry, own_pages, raw_image, resolved_pages

PS = PAGE_SIZE
BASE = 0x7F00_0000_0000


# --- synthetic dumps -----------------------------------------------------------------


def page(name: str, generation: int, vaddr: int) -> bytes:
    seed = hashlib.blake2b(f"{name}:{generation}:{vaddr:#x}".encode()).digest()
    return (seed * (PS // len(seed) + 1))[:PS]


@dataclass
class Layer:
    """One dump's pagemap of one file: its runs (vaddr, nr_pages, flags) and the bytes
    of its present pages, and whether its entries are written the old way."""

    pages_id: int
    runs: list[tuple[int, int, int]]
    pages: dict[int, bytes]
    old_style: bool = False


def write_layer(images: Path, name: str, layer: Layer) -> None:
    entries: list[dict[str, int | bool]] = []
    data: list[bytes] = []
    for vaddr, nr, flags in layer.runs:
        if layer.old_style:
            assert flags in (PE_PRESENT, PE_PARENT)
            entries.append({"vaddr": vaddr, "compat_nr_pages": nr, "in_parent": flags == PE_PARENT})
        else:
            entries.append(entry(vaddr, nr, flags))
        if flags & PE_PRESENT:
            data += [layer.pages[vaddr + i * PS] for i in range(nr)]
    (images / name).write_bytes(raw_image(layer.pages_id, *entries))
    (images / pages_name(layer.pages_id)).write_bytes(b"".join(data))


def runs_of(pages: list[tuple[int, int]], splits: list[bool]) -> list[tuple[int, int, int]]:
    """(vaddr, flags) pages in address order -> runs: a run ends where the addresses or
    flags change, and where ``splits`` says (adjacent runs, as CRIU writes them too)."""
    runs: list[tuple[int, int, int]] = []
    for (vaddr, flags), split in zip(pages, splits, strict=True):
        if runs and not split:
            v, n, f = runs[-1]
            if f == flags and v + n * PS == vaddr:
                runs[-1] = (v, n + 1, f)
                continue
        runs.append((vaddr, 1, flags))
    return runs


@dataclass
class Chain:
    """Dumps d0 (the oldest) .. d<depth> (the newest, whose ``parent`` links d<depth-1>)
    of a few files; ``expected`` is what the newest holds, file -> vaddr -> bytes."""

    root: Path
    depth: int
    layers: dict[str, list[Layer]]
    expected: dict[str, dict[int, bytes]]

    @property
    def top(self) -> Path:
        return self.root / f"d{self.depth}"


FILES = {"pagemap-1.img": BASE, "pagemap-42.img": BASE + (1 << 30), "pagemap-shmem-9.img": 0}


@st.composite
def chains(draw: st.DrawFn) -> dict[str, list[tuple[list[tuple[int, int]], list[bool], bool]]]:
    """file -> per dump, oldest first: its (page index, flags) pages, the run splits,
    and whether it is written old-style."""
    depth = draw(st.integers(1, 2))
    out: dict[str, list[tuple[list[tuple[int, int]], list[bool], bool]]] = {}
    for name in FILES:
        size = draw(st.integers(1, 24))
        mapped_before: set[int] = set()
        dumps = []
        for generation in range(depth + 1):
            mask = draw(st.lists(st.booleans(), min_size=size, max_size=size))
            old = draw(st.booleans()) if generation < depth else False
            pages: list[tuple[int, int]] = []
            for i in range(size):
                if not mask[i]:
                    continue
                kind = PE_PRESENT
                if i in mapped_before and draw(st.booleans()):
                    kind = PE_PARENT
                if not old and draw(st.integers(0, 4)) == 0:
                    kind |= PE_LAZY
                pages.append((i, kind))
            splits = draw(st.lists(st.booleans(), min_size=len(pages), max_size=len(pages)))
            dumps.append((pages, splits, old))
            mapped_before = {i for i, _ in pages}
        out[name] = dumps
    return out


def build_chain(
    root: Path, spec: dict[str, list[tuple[list[tuple[int, int]], list[bool], bool]]]
) -> Chain:
    depth = len(next(iter(spec.values()))) - 1
    layers: dict[str, list[Layer]] = {}
    expected: dict[str, dict[int, bytes]] = {}
    for g in range(depth + 1):
        (root / f"d{g}").mkdir()
        if g:
            (root / f"d{g}" / PARENT_LINK).symlink_to(f"../d{g - 1}")
    for index, (name, dumps) in enumerate(spec.items()):
        holds: dict[int, bytes] = {}
        layers[name] = []
        for g, (pages, splits, old) in enumerate(dumps):
            addressed = [(FILES[name] + i * PS, kind) for i, kind in pages]
            present = {v: page(name, g, v) for v, kind in addressed if kind & PE_PRESENT}
            # pages_id differ from dump to dump: the head names the pages image
            layer = Layer(10 * g + index + 1, runs_of(addressed, splits), present, old)
            write_layer(root / f"d{g}", name, layer)
            layers[name].append(layer)
            holds = {v: present[v] if v in present else holds[v] for v, _ in addressed}
        expected[name] = holds
    return Chain(root, depth, layers, expected)


def snapshot(d: Path) -> dict[str, tuple[int, bytes]]:
    """name -> (inode, content, link target or b"dir") of everything in ``d``."""
    out = {}
    for entry_ in os.scandir(d):
        st_ = entry_.stat(follow_symlinks=False)
        if entry_.is_symlink():
            body = os.readlink(entry_.path).encode()
        elif entry_.is_dir(follow_symlinks=False):
            body = b"dir"
        else:
            body = Path(entry_.path).read_bytes()
        out[entry_.name] = (st_.st_ino, body)
    return out


def check_flattened(
    chain: Chain, stats: FlattenStats | None, before: dict[str, tuple[int, bytes]]
) -> None:
    top = chain.top
    assert stats is not None
    assert not os.path.lexists(top / PARENT_LINK)
    after = snapshot(top)
    assert set(after) == set(before) - {PARENT_LINK}, "temp files left behind or files lost"
    affected = [
        n for n, ls in chain.layers.items() if any(f & PE_PARENT for _, _, f in ls[-1].runs)
    ]
    assert stats.files_rewritten == 2 * len(affected)
    rewritten = 0
    for name, layers in chain.layers.items():
        top_layer = layers[-1]
        pm = read_pagemap(str(top / name))
        # no merging: the same runs, parent ones made present, other bits kept
        assert [(e.vaddr, e.nr_pages, e.flags) for e in pm.entries] == [
            (v, n, (f & ~PE_PARENT) | PE_PRESENT if f & PE_PARENT else f)
            for v, n, f in top_layer.runs
        ]
        pages, in_parent = own_pages(top, name)
        assert in_parent == []
        assert pages == chain.expected[name]
        pages_file = pages_name(top_layer.pages_id)
        moved = name in affected
        assert (after[name][0] != before[name][0]) is moved
        assert (after[pages_file][0] != before[pages_file][0]) is moved
        if moved:
            rewritten += len(after[name][1]) + len(after[pages_file][1])
    assert stats.bytes_written == rewritten
    assert stats.pages_from_parents == sum(
        n for ls in chain.layers.values() for _, n, f in ls[-1].runs if f & PE_PARENT
    )
    assert stats.pages_own == sum(
        n for name in affected for _, n, f in chain.layers[name][-1].runs if f & PE_PRESENT
    )
    assert stats.seconds >= 0


@settings(
    max_examples=examples(150),
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(chains(), st.booleans())
def test_flatten_holds_what_the_chain_held(
    spec: dict[str, list[tuple[list[tuple[int, int]], list[bool], bool]]], in_kernel: bool
) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        chain = build_chain(Path(tmp), spec)
        for name in chain.layers:  # the independent page-by-page reader agrees
            assert resolved_pages(chain.top, name) == chain.expected[name]
        parents = {g: snapshot(chain.root / f"d{g}") for g in range(chain.depth)}
        before = snapshot(chain.top)
        if in_kernel:
            stats = flatten(str(chain.top))
        else:
            with pytest.MonkeyPatch.context() as mp:
                mp.setattr(os, "copy_file_range", no_copy_file_range)
                stats = flatten(str(chain.top))
        check_flattened(chain, stats, before)
        assert {g: snapshot(chain.root / f"d{g}") for g in range(chain.depth)} == parents


def no_copy_file_range(*args: object) -> int:
    raise OSError(errno.EXDEV, "Invalid cross-device link")


def fixed_chain(root: Path, depth: int = 2) -> Chain:
    """pagemap-1: the newest dump's parent run (pages 1..4) spans several runs of its
    parent: d0's two (split at page 3) at depth 1; at depth 2, d1's present, parent
    (pages 2..3, in d0) and present runs. pagemap-shmem-9: one parent run.
    pagemap-42: no parent run at all."""
    present, parent = PE_PRESENT, PE_PARENT
    oldest = [(list(enumerate([present] * 8)), [False, False, False, True] + [False] * 4, False)]
    middle = [
        (
            [(0, present), (1, present), (2, parent), (3, parent), (4, present), (5, present)],
            [False] * 6,
            False,
        )
    ]
    newest = [
        (
            [(0, present), (1, parent), (2, parent), (3, parent), (4, parent), (6, present)],
            [False] * 6,
            False,
        )
    ]
    layers = [*oldest, *middle, *newest] if depth == 2 else [*oldest, *newest]
    spec = {
        "pagemap-1.img": layers,
        "pagemap-42.img": [([(0, present), (1, present)], [False, False], False)] * (depth + 1),
        "pagemap-shmem-9.img": [([(0, present)], [False], False)] * depth
        + [([(0, parent), (1, present)], [False, False], False)],
    }
    return build_chain(root, spec)


@pytest.mark.parametrize("depth", [1, 2])
def test_flatten_of_a_fixed_chain(tmp_path: Path, depth: int) -> None:
    chain = fixed_chain(tmp_path, depth)
    before = snapshot(chain.top)
    stats = flatten(str(chain.top))
    check_flattened(chain, stats, before)
    assert stats is not None and stats.files_rewritten == 4
    assert stats.pages_from_parents == 5 and stats.pages_own == 3
    assert chain.expected["pagemap-1.img"][BASE + 3 * PS] == page("pagemap-1.img", 0, BASE + 3 * PS)
    if depth == 2:  # from the middle dump, and from the oldest through it
        assert chain.expected["pagemap-1.img"][BASE + PS] == page("pagemap-1.img", 1, BASE + PS)
    assert flatten(str(chain.top)) is None  # the second time: nothing to do


def test_an_absolute_parent_link_is_followed(tmp_path: Path) -> None:
    chain = fixed_chain(tmp_path, 2)
    link = chain.top / PARENT_LINK
    link.unlink()
    link.symlink_to(tmp_path / "d1")
    before = snapshot(chain.top)
    check_flattened(chain, flatten(str(chain.top)), before)


def test_no_parent_link_is_none_and_nothing_changes(tmp_path: Path) -> None:
    chain = fixed_chain(tmp_path, 1)
    (chain.top / PARENT_LINK).unlink()
    before = snapshot(chain.top)
    assert flatten(str(chain.top)) is None
    assert snapshot(chain.top) == before


def test_a_link_and_no_parent_runs_only_loses_the_link(tmp_path: Path) -> None:
    chain = fixed_chain(tmp_path, 1)
    for name in ("pagemap-1.img", "pagemap-shmem-9.img"):
        (chain.top / name).unlink()
    before = snapshot(chain.top)
    stats = flatten(str(chain.top))
    assert stats is not None and stats.files_rewritten == 0 and stats.bytes_written == 0
    after = snapshot(chain.top)
    assert after == {k: v for k, v in before.items() if k != PARENT_LINK}


def refused(chain: Chain, why: str) -> DataLoss:
    """flatten raises DataLoss matching ``why``, and the whole chain is as it was."""
    before = {g: snapshot(chain.root / f"d{g}") for g in range(chain.depth + 1)}
    with pytest.raises(DataLoss, match=why) as raised:
        flatten(str(chain.top))
    assert {g: snapshot(chain.root / f"d{g}") for g in range(chain.depth + 1)} == before
    return raised.value


def rewrite_layer(chain: Chain, g: int, name: str, **changes: object) -> None:
    layer = chain.layers[name][g]
    for key, value in changes.items():
        setattr(layer, key, value)
    d = chain.root / f"d{g}"
    os.unlink(d / pages_name(layer.pages_id))
    write_layer(d, name, layer)


def test_a_page_missing_from_the_parent_is_data_loss(tmp_path: Path) -> None:
    chain = fixed_chain(tmp_path, 1)
    # pagemap-shmem-9 (the last file flattened): its parent run at 0 is gone from d0
    rewrite_layer(chain, 0, "pagemap-shmem-9.img", runs=[], pages={})
    err = refused(
        chain, r"pagemap-shmem-9.img: page 0x0 is in no run of .*d1/parent/pagemap-shmem-9.img"
    )
    assert str(chain.top / "pagemap-shmem-9.img") in str(err)


def test_a_hole_in_the_parent_under_a_parent_run_is_data_loss(tmp_path: Path) -> None:
    chain = fixed_chain(tmp_path, 1)
    # d1's parent run is pages 1..4; d0 holds 0..1 and 4..7, not 2..3
    layer = chain.layers["pagemap-1.img"][0]
    runs = [(BASE, 2, PE_PRESENT), (BASE + 4 * PS, 4, PE_PRESENT)]
    pages = {v: b for v, b in layer.pages.items() if not BASE + 2 * PS <= v < BASE + 4 * PS}
    rewrite_layer(chain, 0, "pagemap-1.img", runs=runs, pages=pages)
    refused(chain, rf"d1/pagemap-1.img: page {BASE + 2 * PS:#x} is in no run of .*d1/parent/")


def test_a_page_missing_from_the_grandparent_is_data_loss(tmp_path: Path) -> None:
    chain = fixed_chain(tmp_path, 2)
    # d1's run at page 3 is in d0: make d0 end at page 2
    layer = chain.layers["pagemap-1.img"][0]
    pages = {v: b for v, b in layer.pages.items() if v < BASE + 3 * PS}
    rewrite_layer(chain, 0, "pagemap-1.img", runs=[(BASE, 3, PE_PRESENT)], pages=pages)
    refused(
        chain,
        rf"pagemap-1.img: page {BASE + 3 * PS:#x} is in no run of .*parent/parent/pagemap-1.img",
    )


def test_a_parent_without_the_pagemap_is_data_loss(tmp_path: Path) -> None:
    chain = fixed_chain(tmp_path, 1)
    os.unlink(chain.root / "d0" / "pagemap-shmem-9.img")
    refused(chain, r"d1/pagemap-shmem-9.img: has pages in the parent, and there is no .*/parent/")


def test_a_truncated_parent_pages_image_is_data_loss(tmp_path: Path) -> None:
    chain = fixed_chain(tmp_path, 1)
    pages = chain.root / "d0" / pages_name(chain.layers["pagemap-1.img"][0].pages_id)
    os.truncate(pages, 8 * PS - 1)
    refused(chain, rf"parent/{pages.name}: truncated: {8 * PS - 1} bytes")


def test_a_truncated_own_pages_image_is_data_loss(tmp_path: Path) -> None:
    chain = fixed_chain(tmp_path, 1)
    pages = chain.top / pages_name(chain.layers["pagemap-1.img"][-1].pages_id)
    os.truncate(pages, PS)
    refused(chain, rf"d1/{pages.name}: truncated")


def test_a_lazy_only_run_in_the_parent_is_data_loss(tmp_path: Path) -> None:
    chain = fixed_chain(tmp_path, 1)
    rewrite_layer(chain, 0, "pagemap-shmem-9.img", runs=[(0, 1, PE_LAZY)], pages={})
    refused(chain, r"page 0x0 is not in the pages of .*flags 0x2")


def test_a_symlinked_image_in_the_parent_is_refused(tmp_path: Path) -> None:
    chain = fixed_chain(tmp_path, 1)
    d0 = chain.root / "d0"
    os.rename(d0 / "pagemap-1.img", tmp_path / "elsewhere.img")
    (d0 / "pagemap-1.img").symlink_to(tmp_path / "elsewhere.img")
    refused(chain, "parent/pagemap-1.img: cannot open")


def test_a_dangling_parent_link_is_data_loss(tmp_path: Path) -> None:
    chain = fixed_chain(tmp_path, 1)
    os.rename(chain.root / "d0", chain.root / "gone")
    before = snapshot(chain.top)
    with pytest.raises(DataLoss, match=r"has pages in .*d1/parent"):
        flatten(str(chain.top))
    assert snapshot(chain.top) == before


def test_a_parent_dir_that_is_no_link_is_refused(tmp_path: Path) -> None:
    chain = fixed_chain(tmp_path, 1)
    (chain.top / PARENT_LINK).unlink()
    (chain.top / PARENT_LINK).mkdir()
    refused(chain, "not a symlink")


def test_a_parent_link_loop_stops_at_the_depth_cap(tmp_path: Path) -> None:
    chain = fixed_chain(tmp_path, 1)
    (chain.top / PARENT_LINK).unlink()
    (chain.top / PARENT_LINK).symlink_to(".")
    refused(chain, f"deeper than {MAX_PARENT_DEPTH} dumps")


def test_a_chain_deeper_than_the_cap_is_refused(tmp_path: Path) -> None:
    """MAX_PARENT_DEPTH parents are followed, one more is refused."""
    spec_one = ([(0, PE_PRESENT)], [False], False)
    spec_parent = ([(0, PE_PARENT)], [False], False)
    for depth, ok in ((MAX_PARENT_DEPTH, True), (MAX_PARENT_DEPTH + 1, False)):
        root = tmp_path / str(depth)
        root.mkdir()
        chain = build_chain(root, {"pagemap-1.img": [spec_one] + [spec_parent] * depth})
        if ok:
            before = snapshot(chain.top)
            check_flattened(chain, flatten(str(chain.top)), before)
        else:
            refused(chain, "deeper than")


def test_two_pagemaps_sharing_a_pages_image_are_refused(tmp_path: Path) -> None:
    chain = fixed_chain(tmp_path, 1)
    data = (chain.top / "pagemap-42.img").read_bytes()
    (chain.top / "pagemap-43.img").write_bytes(data)
    refused(chain, "pagemap-43.img: shares pages-")


def test_other_copy_errors_are_not_swallowed(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    chain = fixed_chain(tmp_path, 1)

    def full(*args: object) -> int:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(os, "copy_file_range", full)
    before = snapshot(chain.top)
    with pytest.raises(OSError, match="No space"):
        flatten(str(chain.top))
    assert snapshot(chain.top) == before
