"""The digest of one container's image, recorded in its checkpoints when they may move
between nodes (a registry is configured): the node that restores one compares its own.

It is asked of containerd (runtime/containerd_images.py, through a child process that
imports grpc) in the background, a while after the Create (off it, and off the stop),
and again beside a dump when it was not known by then; a stop waits for it at most
:data:`GRACE` after the dump.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from ..errors import DeadlineExceeded, ShimError

log = logging.getLogger(__name__)

GRACE = 1.0  # seconds a stop waits for its image digest after the dump
ImageDigest = Callable[[str], Awaitable[str]]  # container id -> its image's digest


class ImageDigestLookup:
    def __init__(self, container_id: str, lookup: ImageDigest) -> None:
        self.container_id = container_id
        self._lookup = lookup
        self._task: asyncio.Task[str] | None = None

    def later(self, delay: float) -> None:
        """Ask in the background, ``delay`` seconds from now."""

        async def ask() -> str:
            await asyncio.sleep(delay)
            return await self._lookup(self.container_id)

        self._start(ask())

    def for_dump(self) -> asyncio.Task[str]:
        """The lookup whose answer a dump records: the background one when it succeeded,
        else one started now."""
        known = self._task
        if known is not None and known.done() and not known.cancelled() and not known.exception():
            return known
        if known is not None:
            known.cancel()
        return self._start(self._ask_now())

    async def settled(self, task: asyncio.Task[str]) -> str:
        """The digest looked up, or "" (logged): a slow containerd never holds up the
        stop by more than GRACE after the dump."""
        try:
            async with asyncio.timeout(GRACE):
                return await asyncio.shield(task)
        except TimeoutError:
            task.cancel()
            err: BaseException = DeadlineExceeded(f"containerd did not answer within {GRACE:g}s")
        except (ShimError, OSError) as failure:
            err = failure
        log.warning(
            "cannot tell the container's image digest; the checkpoint records its name only",
            extra={"container": self.container_id, "error": str(err)},
        )
        return ""

    def cancel(self) -> None:
        if self._task is not None:
            self._task.cancel()

    async def _ask_now(self) -> str:
        return await self._lookup(self.container_id)

    def _start(self, coro: Any) -> asyncio.Task[str]:
        self._task = asyncio.get_running_loop().create_task(coro)
        self._task.add_done_callback(_retrieved)
        return self._task


def _retrieved(task: asyncio.Task[Any]) -> None:
    """A background lookup's failure is reported by whoever uses it, or by nobody."""
    if not task.cancelled():
        task.exception()
