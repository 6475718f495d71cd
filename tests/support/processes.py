"""Process helpers shared by tests/unit and tests/privileged: a loop whose SIGCHLD
belongs to a Reaper, and the processes /proc lists."""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable, Coroutine, Iterator
from pathlib import Path
from typing import Any, TypeVar

from cedana_shim.runtime.reaper import Reaper

T = TypeVar("T")


def run_with_reaper(
    fn: Callable[[Reaper], Coroutine[Any, Any, T]], *, timeout: float | None = None
) -> T:
    """Run ``fn`` in a fresh loop whose SIGCHLD belongs to a Reaper (within ``timeout``)."""

    async def main() -> T:
        reaper = Reaper()
        reaper.install()
        try:
            async with asyncio.timeout(timeout):
                return await fn(reaper)
        finally:
            reaper.close()

    return asyncio.run(main())


def proc_stats() -> Iterator[tuple[int, list[str]]]:
    """(pid, the fields of /proc/<pid>/stat after the command name: state, ppid, pgrp,
    ...) of every process that is still there when read."""
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            stat = Path(f"/proc/{entry}/stat").read_text()
        except OSError:
            continue
        yield int(entry), stat.rsplit(")", 1)[1].split()
