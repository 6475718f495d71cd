"""Where a task's page lives among a checkpoint's chunks.

CRIU's lazy-pages daemon asks for pages by (pid, vaddr, nr_pages)
(page_protocol.py). ``pagemap-<pid>.img`` (pagemap_image.py) names the task's pages
image and lists its runs of pages in address order; the ``PE_PRESENT`` runs' pages
lie in that image one after the other, in pagemap order. The store keeps each page
image as chunks of its bytes (store/chunks.py, ``Chunk``: file, offset, raw size).
So a request maps to a range of one pages image (never past the end of the run it
starts in: CRIU takes fewer pages than it asked for), and that range to the chunks
that cover it.

What CRIU's restore reads itself, rather than its lazy-pages daemon, must be in the
pages images before the restore starts: the present runs not marked ``PE_LAZY``
(``eager_chunks``), and every pages image no task's pagemap names (shared memory's).
Pure: built from decoded pagemaps and the manifest's chunks.
"""

from __future__ import annotations

import bisect
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass

from cedana_shim.errors import DataLoss

from ..pagemap_image import PAGE_SIZE, PE_LAZY, PE_PRESENT, Pagemap, pages_name
from ..store.layout import Chunk

__all__ = ["PageMap", "PageRun", "TaskPages"]


@dataclass(frozen=True, slots=True)
class PageRun:
    """``nr_pages`` pages at byte ``offset`` of pages image ``file``."""

    file: str
    offset: int
    nr_pages: int

    @property
    def end(self) -> int:
        return self.offset + self.nr_pages * PAGE_SIZE


class TaskPages:
    """One task's present runs: address -> offset in its pages image."""

    def __init__(self, pagemap: Pagemap) -> None:
        self.file = pages_name(pagemap.pages_id)
        self._starts: list[int] = []
        self._runs: list[tuple[int, int, int, bool]] = []  # vaddr, nr_pages, offset, lazy
        offset = 0
        for entry in pagemap.entries:
            if not entry.flags & PE_PRESENT:
                continue
            self._starts.append(entry.vaddr)
            self._runs.append((entry.vaddr, entry.nr_pages, offset, bool(entry.flags & PE_LAZY)))
            offset += entry.nr_pages * PAGE_SIZE
        self.size = offset

    def locate(self, vaddr: int, nr_pages: int) -> PageRun | None:
        """The pages from ``vaddr`` on, at most ``nr_pages`` and not past the end of
        the present run holding ``vaddr``; None when no present run holds it."""
        if nr_pages <= 0 or vaddr % PAGE_SIZE:
            return None
        i = bisect.bisect_right(self._starts, vaddr) - 1
        if i < 0:
            return None
        start, count, offset, _ = self._runs[i]
        skip = (vaddr - start) // PAGE_SIZE
        if skip >= count:
            return None
        return PageRun(self.file, offset + skip * PAGE_SIZE, min(nr_pages, count - skip))

    def eager_runs(self) -> list[PageRun]:
        """The present runs CRIU's restore reads itself (not lazy)."""
        return [PageRun(self.file, off, n) for _, n, off, lazy in self._runs if not lazy]


class PageMap:
    """Every task's pages, and the chunks of every pages image."""

    def __init__(self, pagemaps: Mapping[int, Pagemap], chunks: Iterable[Chunk]) -> None:
        self.tasks = {pid: TaskPages(pm) for pid, pm in pagemaps.items()}
        by_file: dict[str, list[Chunk]] = {}
        for chunk in chunks:
            by_file.setdefault(chunk.file, []).append(chunk)
        self._chunks = {f: sorted(cs, key=lambda c: c.offset) for f, cs in by_file.items()}
        self._offsets = {f: [c.offset for c in cs] for f, cs in self._chunks.items()}
        for pid, task in self.tasks.items():
            have = self.file_size(task.file)
            if task.size > have:
                raise DataLoss(
                    f"pagemap-{pid}.img: {task.size} bytes of pages, its {task.file} has "
                    f"{have} in the checkpoint's chunks"
                )

    def file_size(self, file: str) -> int:
        chunks = self._chunks.get(file, [])
        return chunks[-1].offset + chunks[-1].raw_size if chunks else 0

    def files(self) -> dict[str, int]:
        """Every chunked pages image and its size."""
        return {f: self.file_size(f) for f in self._chunks}

    def locate(self, pid: int, vaddr: int, nr_pages: int) -> PageRun | None:
        task = self.tasks.get(pid)
        return None if task is None else task.locate(vaddr, nr_pages)

    def covering(self, run: PageRun) -> list[Chunk]:
        """The chunks holding the bytes of ``run``, in order; DataLoss when some of its
        bytes are in none (the chunks do not tile the file)."""
        chunks = self._chunks.get(run.file, [])
        offsets = self._offsets.get(run.file, [])
        i = max(0, bisect.bisect_right(offsets, run.offset) - 1)
        found: list[Chunk] = []
        at = run.offset
        while at < run.end and i < len(chunks):
            chunk = chunks[i]
            if chunk.offset > at:
                break
            if chunk.offset + chunk.raw_size > at:
                found.append(chunk)
                at = chunk.offset + chunk.raw_size
            i += 1
        if at < run.end:
            raise DataLoss(f"{run.file}: bytes {at}..{run.end} are in none of its chunks")
        return found

    def eager_chunks(self) -> list[Chunk]:
        """What must be in the pages images before CRIU's restore starts: the chunks of
        non-lazy present runs, and every chunk of a pages image no task names."""
        named = {task.file for task in self.tasks.values()}
        want: dict[tuple[str, int], Chunk] = {}
        for file, chunks in self._chunks.items():
            if file not in named:
                want.update(((c.file, c.offset), c) for c in chunks)
        for task in self.tasks.values():
            for run in task.eager_runs():
                want.update(((c.file, c.offset), c) for c in self.covering(run))
        return [want[k] for k in sorted(want)]

    def in_order(self) -> Sequence[Chunk]:
        """Every chunk, file by file in address order (a task's pages image follows its
        addresses): the order the rest streams in behind the faults."""
        return [c for file in sorted(self._chunks) for c in self._chunks[file]]
