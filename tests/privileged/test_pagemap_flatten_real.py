"""flatten() (checkpoint/pagemap.py) against the real CRIU.

This kernel has no soft-dirty tracking, so CRIU cannot take a tracked dump here.
The test takes two full dumps of a process (fixtures/page_writer.c: 64 MiB of known
pages, 10 % of them rewritten between the dumps) and synthesizes what a tracked
second dump would be: dump 2 with every run of pages identical to dump 1's at the
same address made a PE_PARENT run (absent from its pages image), and a ``parent``
link to dump 1. Then:

(a) the real ``criu restore`` restores that chain, reading from the parent, and the
    process's memory is byte for byte what it was at dump 2 (so the synthesis is
    one CRIU itself accepts);
(b) flatten() of it holds the same vaddr -> bytes as dump 2, and the link is gone;
(c) the real ``criu restore`` of the flattened dump, with dump 1 moved away, runs the
    process on with its memory intact (and it rewrites and checks it once more).

Needs root, criu and gcc; a missing one fails the test (it does not skip it).
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
from cedana_shim.checkpoint.pagemap import PARENT_LINK, flatten
from cedana_shim.checkpoint.pagemap_image import (
    PAGE_SIZE,
    PE_PARENT,
    Pagemap,
    PagemapEntry,
    is_pagemap_name,
    pages_name,
    read_pagemap,
    write_pagemap,
)
from cedana_shim.runtime.reaper import set_child_subreaper
from support.pagemaps import own_pages, pagemap_names, resolved_pages

SOURCE = Path(__file__).parent / "fixtures" / "page_writer.c"
MIB = 64
PR_SET_CHILD_SUBREAPER = 36
UNIT_WORDS = PAGE_SIZE // 16
MASK64 = (1 << 64) - 1


def rewritten(i: int) -> bool:
    """The pages page_writer rewrites on SIGUSR1 (its rewritten())."""
    return ((i >> 3) * 7 + 3) % 10 == 0 or i % 997 == 5


def expected_buffer(pages: int, generation: int) -> bytes:
    """page_writer's buffer once ``generation`` rewrites have run (its fill())."""
    out = []
    for i in range(pages):
        g = generation if generation and rewritten(i) else 0
        a = (i * 0x9E3779B97F4A7C15) & MASK64
        b = (~i ^ (g << 48)) & MASK64
        out.append((a.to_bytes(8, "little") + b.to_bytes(8, "little")) * UNIT_WORDS)
    return b"".join(out)


def word_sum(data: bytes) -> int:
    return sum(memoryview(data).cast("Q")) & MASK64


@dataclass
class Host:
    tmp: Path
    criu: str
    binary: Path
    status: Path
    pids: list[int] = field(default_factory=list)

    def run_criu(self, action: str, *args: str, work: Path) -> str:
        """``criu <action> ...`` with a debug log in ``work``; its log on failure."""
        work.mkdir()
        argv = [self.criu, action, *args, "--work-dir", str(work), "-o", f"{action}.log", "-v4"]
        done = subprocess.run(argv, capture_output=True, text=True, timeout=120, check=False)
        log = (work / f"{action}.log").read_text(errors="replace")
        assert done.returncode == 0, (
            f"{' '.join(argv)} exited {done.returncode}: {done.stderr}\n{log[-6000:]}"
        )
        return log

    def answer(self, prefix: str, timeout: float = 30.0) -> list[str]:
        """page_writer's status once it starts with ``prefix``."""
        deadline = time.monotonic() + timeout
        while True:
            with contextlib.suppress(FileNotFoundError):
                words = self.status.read_text().split()
                if words and words[0] == "bad":
                    pytest.fail(f"page_writer found page {words[1]} wrong")
                if words and words[0] == prefix:
                    self.status.unlink()
                    return words[1:]
            assert time.monotonic() < deadline, f"page_writer never answered {prefix!r}"
            time.sleep(0.01)

    def ask(self, pid: int, sig: int, prefix: str) -> list[str]:
        os.kill(pid, sig)
        return self.answer(prefix)

    def kill(self, pid: int) -> None:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)  # ours: started by us, or restored under us (subreaper)
        self.pids.remove(pid)


@pytest.fixture
def host(tmp_path: Path) -> Iterator[Host]:
    criu = shutil.which("criu")
    assert criu, "criu is not installed (make setup installs CRIU 4.2.1)"
    gcc = shutil.which("gcc")
    assert gcc, "gcc is not installed"
    binary = tmp_path / "page_writer"
    subprocess.run([gcc, "-O2", "-Wall", "-Werror", "-o", str(binary), str(SOURCE)], check=True)
    h = Host(tmp_path, criu, binary, tmp_path / "status")
    # `criu restore -d` leaves the restored process to the nearest subreaper: us.
    set_child_subreaper()
    try:
        yield h
    finally:
        for pid in list(h.pids):
            with contextlib.suppress(ProcessLookupError, ChildProcessError):
                h.kill(pid)
        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0)


def synthesize(first: Path, second: Path, child: Path) -> int:
    """``child``: ``second`` as a dump tracked against ``first`` would be (runs of
    pages identical to ``first``'s at the same address in the parent), linked to
    ``first`` as CRIU links it; the number of pages left to the parent."""
    child.mkdir()
    names = pagemap_names(second)
    own = {pages_name(read_pagemap(str(second / n)).pages_id) for n in names}
    for entry in os.scandir(second):
        if not is_pagemap_name(entry.name) and entry.name not in own:
            shutil.copy2(entry.path, child / entry.name)
    in_parent = 0
    for name in names:
        before = own_pages(first, name)[0] if (first / name).exists() else {}
        now, none = own_pages(second, name)
        assert none == []
        pagemap = read_pagemap(str(second / name))
        entries: list[PagemapEntry] = []
        data: list[bytes] = []
        for e in pagemap.entries:
            for i in range(e.nr_pages):
                vaddr = e.vaddr + i * PAGE_SIZE
                same = e.present and before.get(vaddr) == now[vaddr]
                flags = PE_PARENT if same else e.flags  # a hole is PE_PARENT alone
                last = entries[-1] if entries else None
                if last and last.flags == flags and last.end == vaddr:
                    entries[-1] = PagemapEntry(last.vaddr, last.nr_pages + 1, flags)
                else:
                    entries.append(PagemapEntry(vaddr, 1, flags))
                if same:
                    in_parent += 1
                elif e.present:
                    data.append(now[vaddr])
        write_pagemap(str(child / name), Pagemap(pagemap.pages_id, tuple(entries)))
        (child / pages_name(pagemap.pages_id)).write_bytes(b"".join(data))
    (child / PARENT_LINK).symlink_to(os.path.relpath(first, child))
    return in_parent


def memory(pid: int, address: int, length: int) -> bytes:
    with open(f"/proc/{pid}/mem", "rb", buffering=0) as mem:
        mem.seek(address)
        return mem.read(length)


def test_criu_restores_a_flattened_chain(host: Host) -> None:
    started = time.monotonic()
    tmp = host.tmp
    proc = subprocess.Popen(
        [str(host.binary), str(host.status), str(MIB)],
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,  # its own session: no --shell-job
    )
    pid = proc.pid
    host.pids.append(pid)
    address_hex, pages_text, page_size = host.answer("ready")
    address, pages = int(address_hex, 16), int(pages_text)
    assert int(page_size) == PAGE_SIZE and pages == MIB * 1024 * 1024 // PAGE_SIZE
    length = pages * PAGE_SIZE
    generation0, generation1 = expected_buffer(pages, 0), expected_buffer(pages, 1)
    assert memory(pid, address, length) == generation0

    first, second, child = tmp / "dump1", tmp / "dump2", tmp / "child"
    for d in (first, second):
        d.mkdir()
    host.run_criu("dump", "-t", str(pid), "-D", str(first), "--leave-running", work=tmp / "w1")
    generation, count = host.ask(pid, signal.SIGUSR1, "wrote")
    assert generation == "1" and int(count) == sum(map(rewritten, range(pages)))
    host.run_criu("dump", "-t", str(pid), "-D", str(second), "--leave-running", work=tmp / "w2")
    assert memory(pid, address, length) == generation1
    proc.kill()
    proc.wait()
    host.pids.remove(pid)

    in_parent = synthesize(first, second, child)
    [name] = pagemap_names(child)
    dump2 = own_pages(second, name)[0]
    # the buffer's pages not rewritten are left to the parent, the rewritten ones not
    kept, parent_runs = own_pages(child, name)
    buffer = range(address, address + length, PAGE_SIZE)
    assert sorted(v for v in parent_runs if v in buffer) == [
        v for i, v in enumerate(buffer) if not rewritten(i)
    ]
    assert all(v in kept for i, v in enumerate(buffer) if rewritten(i))
    assert in_parent == len(parent_runs) >= pages - int(count)
    assert resolved_pages(child, name) == dump2

    # (a) CRIU restores the synthesized chain, taking pages from the parent
    log = host.run_criu("restore", "-D", str(child), "-d", work=tmp / "r1")
    assert re.search(r"Opened local page read \d+ \(parent [1-9]", log), "no parent page read"
    host.pids.append(pid)
    assert memory(pid, address, length) == generation1
    assert host.ask(pid, signal.SIGUSR2, "ok") == ["1", f"{word_sum(generation1):x}"]
    host.kill(pid)

    # (b) flatten: dump 2's pages at dump 2's addresses, and no link
    pages_file = pages_name(read_pagemap(str(child / name)).pages_id)
    stats = flatten(str(child))
    assert stats is not None
    assert not os.path.lexists(child / PARENT_LINK)
    assert stats.files_rewritten == 2 and stats.pages_from_parents == in_parent
    assert own_pages(child, name) == (dump2, [])
    # the same pages in the same order as CRIU's own full dump 2
    assert (child / pages_file).read_bytes() == (second / pages_file).read_bytes()
    assert not any(e.in_parent for e in read_pagemap(str(child / name)).entries)

    # (c) CRIU restores the flattened dump on its own, and the process goes on
    first.rename(tmp / "dump1-moved-away")
    log = host.run_criu("restore", "-D", str(child), "-d", work=tmp / "r2")
    assert not re.search(r"\(parent [1-9]", log)
    host.pids.append(pid)
    assert memory(pid, address, length) == generation1
    assert host.ask(pid, signal.SIGUSR2, "ok") == ["1", f"{word_sum(generation1):x}"]
    generation, _ = host.ask(pid, signal.SIGUSR1, "wrote")
    assert generation == "2"
    generation2 = expected_buffer(pages, 2)
    assert host.ask(pid, signal.SIGUSR2, "ok") == ["2", f"{word_sum(generation2):x}"]
    assert memory(pid, address, length) == generation2
    host.kill(pid)
    print(
        f"flatten: {stats}; {in_parent} pages synthesized in the parent; "
        f"test {time.monotonic() - started:.1f} s"
    )
