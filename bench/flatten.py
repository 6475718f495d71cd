"""What making a dirty-tracked dump whole costs: ``pagemap.flatten`` against a plain copy.

On a node whose kernel tracks dirty pages, a container's dump after a committed one
writes only the pages written since (CRIU ``--track-mem`` with the previous
checkpoint as parent), and the shim then copies the unchanged pages in from the
parent's raw images (checkpoint/pagemap.py), after the thaw. This kernel has no
soft-dirty tracking, so CRIU cannot make such a dump here; this script builds the
pair CRIU would leave, at CRIU's own layout: a parent dump of ``--size-mib`` MiB
(one pagemap, runs of 256 pages as CRIU writes them, pages of random and repeated
bytes), and a child in which one contiguous tenth was rewritten (present) and the
rest are ``PE_PARENT`` runs, linked to the parent as CRIU links it.

Each run, interleaved (the order alternates):
    flatten     a fresh copy of the child (its own small pages image, its pagemap,
                the link) flattened: the new 1 GiB pages image, then an fdatasync
                of it (what the publish then waits for);
    copy        the parent's pages image copied with copy_file_range into a new file
                on the same disk, then an fdatasync: the floor for writing that many
                bytes, what any full dump must also put on the disk.

Both read the parent from the page cache (it is read once before the runs). On the
root disk (``CEDANA_BENCH_TMPDIR``, default /var/tmp).

    python bench/flatten.py [--runs 5] [--size-mib 1024] [--out f.json]
"""

from __future__ import annotations

import argparse
import os
import shutil
import sys
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from _common import Report, ensure_venv, load_average, print_table, ratio, summarize, work_root

ensure_venv()

from cedana_shim.checkpoint.pagemap import PARENT_LINK, flatten  # noqa: E402
from cedana_shim.checkpoint.pagemap_image import (  # noqa: E402
    PAGE_SIZE,
    PE_PARENT,
    PE_PRESENT,
    Pagemap,
    PagemapEntry,
    pages_name,
    write_pagemap,
)

MIB = 1 << 20
RUN_PAGES = 256  # CRIU's page pipe buffers: the runs of a real dump
VADDR = 0x7F0000000000
PAGEMAP = "pagemap-1.img"


def page_bytes(n: int, seed: int) -> bytes:
    """``n`` pages, each half random and half a repeated pattern (as bench/memhog.c)."""
    out = bytearray()
    for i in range(n):
        out += os.urandom(PAGE_SIZE // 2)
        out += bytes([(seed + i) & 0xFF]) * (PAGE_SIZE // 2)
    return bytes(out)


def make_parent(path: Path, pages: int) -> None:
    path.mkdir(parents=True)
    runs = [
        PagemapEntry(VADDR + i * PAGE_SIZE, min(RUN_PAGES, pages - i), PE_PRESENT)
        for i in range(0, pages, RUN_PAGES)
    ]
    write_pagemap(str(path / PAGEMAP), Pagemap(1, tuple(runs)))
    with open(path / pages_name(1), "wb") as f:
        block = page_bytes(RUN_PAGES, 0)  # 1 MiB, repeated: the copy cost does not
        for _ in range(0, pages, RUN_PAGES):  # depend on the bytes
            f.write(block)


def make_child(path: Path, parent: Path, pages: int) -> int:
    """A child with the middle tenth of the pages present (rewritten), the rest in
    the parent; returns the number of present pages."""
    path.mkdir(parents=True)
    first, last = pages * 45 // 100, pages * 55 // 100
    runs: list[PagemapEntry] = []
    for i in range(0, pages, RUN_PAGES):
        n = min(RUN_PAGES, pages - i)
        present = first <= i < last
        runs.append(PagemapEntry(VADDR + i * PAGE_SIZE, n, PE_PRESENT if present else PE_PARENT))
    write_pagemap(str(path / PAGEMAP), Pagemap(1, tuple(runs)))
    own = sum(e.nr_pages for e in runs if e.flags & PE_PRESENT)
    with open(path / pages_name(1), "wb") as f:
        f.write(page_bytes(own, 7))
    os.symlink(os.path.relpath(parent, path), path / PARENT_LINK)
    return own


def fdatasync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fdatasync(fd)
    finally:
        os.close(fd)


def timed_flatten(template: Path, work: Path) -> dict[str, Any]:
    shutil.copytree(template, work, symlinks=True)
    os.sync()
    t0 = time.perf_counter()
    stats = flatten(str(work))
    t_flat = time.perf_counter() - t0
    fdatasync_file(work / pages_name(1))
    total = time.perf_counter() - t0
    assert stats is not None and not (work / PARENT_LINK).exists()
    shutil.rmtree(work)
    return {
        "flatten_s": t_flat,
        "with_fdatasync_s": total,
        "pages_from_parents": stats.pages_from_parents,
    }


def timed_copy(source: Path, dest: Path) -> dict[str, Any]:
    os.sync()
    t0 = time.perf_counter()
    with open(source, "rb") as src, open(dest, "wb") as dst:
        left = os.fstat(src.fileno()).st_size
        while left:
            left -= os.copy_file_range(src.fileno(), dst.fileno(), min(left, 64 * MIB))
    t_copy = time.perf_counter() - t0
    fdatasync_file(dest)
    total = time.perf_counter() - t0
    dest.unlink()
    return {"copy_s": t_copy, "with_fdatasync_s": total}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--size-mib", type=int, default=1024)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    report = Report("flatten", {"runs": args.runs, "size_mib": args.size_mib})
    pages = args.size_mib * MIB // PAGE_SIZE
    root = work_root()  # a fresh cedana-bench-* dir, removed at the end
    try:
        parent, child = root / "parent", root / "child"
        make_parent(parent, pages)
        own = make_child(child, parent, pages)
        with open(parent / pages_name(1), "rb") as f:  # into the page cache
            while f.read(64 * MIB):
                pass
        runs: list[dict[str, Any]] = []
        for i in range(args.runs):
            sample: dict[str, Any] = {"load_1min": load_average()[0]}
            order = ("flatten", "copy") if i % 2 == 0 else ("copy", "flatten")
            for side in order:
                if side == "flatten":
                    sample["flatten"] = timed_flatten(child, root / "work")
                else:
                    sample["copy"] = timed_copy(parent / pages_name(1), root / "copy.img")
            runs.append(sample)
            print(
                f"run {i + 1}/{args.runs}: flatten {sample['flatten']['flatten_s']:.2f}s "
                f"(+fdatasync {sample['flatten']['with_fdatasync_s']:.2f}s) / copy "
                f"{sample['copy']['copy_s']:.2f}s (+fdatasync "
                f"{sample['copy']['with_fdatasync_s']:.2f}s)"
            )
    finally:
        shutil.rmtree(root, ignore_errors=True)
    flat = summarize([r["flatten"]["flatten_s"] for r in runs])
    flat_d = summarize([r["flatten"]["with_fdatasync_s"] for r in runs])
    copy = summarize([r["copy"]["copy_s"] for r in runs])
    copy_d = summarize([r["copy"]["with_fdatasync_s"] for r in runs])

    def cell(s: Any) -> str:
        return f"{s.median:.2f}s ({s.min:.2f}-{s.max:.2f})"

    print(f"\n{args.size_mib} MiB, {own} of {pages} pages rewritten, {args.runs} runs")
    print_table(
        ["measure", "flatten", "copy", "flatten/copy"],
        [
            [
                "into the page cache",
                cell(flat),
                cell(copy),
                f"{ratio(flat.median, copy.median):.2f}",
            ],
            [
                "and on the disk (fdatasync)",
                cell(flat_d),
                cell(copy_d),
                f"{ratio(flat_d.median, copy_d.median):.2f}",
            ],
        ],
    )
    report.results = {
        "unit": "seconds",
        "pages": pages,
        "pages_rewritten": own,
        "flatten": flat.as_dict(),
        "flatten_with_fdatasync": flat_d.as_dict(),
        "copy": copy.as_dict(),
        "copy_with_fdatasync": copy_d.as_dict(),
        "runs": runs,
    }
    report.write(args.out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
