"""Dirty-page tracking: a dump of a container dumped before writes only what changed.

Where the kernel tracks soft-dirty pages (``CONFIG_MEM_SOFT_DIRTY``; ``criu check
--feature mem_dirty_track``) and the node config leaves ``dirty_tracking = "auto"``:

- every dump runs with CRIU's ``track-mem`` (in the CRIU config file): after the
  dump CRIU clears the soft-dirty bits of the tasks it leaves running;
- a dump of a container whose previous checkpoint this daemon took of the same
  processes, and committed, names that checkpoint's raw images as its parent (runc
  ``--parent-path``): CRIU writes only the pages written since, and the freeze
  lasts for those pages only. Where those raw images are gone (``cache_raw`` off, or
  a newer checkpoint of the label took the cache), the dump is a full one.

The parent is forgotten when a dump starts and remembered again only once that
dump is committed. A dump that cleared the soft-dirty bits and then failed would
otherwise leave a parent older than what the bits describe, and the next dump
would take pages that changed in between from that older parent.

Without the kernel feature nothing changes: every dump is full, and periodic
checkpoints still store and upload only the chunks that changed (chunks.py).
"""

from __future__ import annotations

import logging
from typing import Final

from ..runtime.runc import Runc

__all__ = ["DirtyTracking"]

log = logging.getLogger(__name__)

FEATURE: Final = "mem_dirty_track"


class DirtyTracking:
    """Whether this node's dumps track dirty pages, and each container's parent."""

    def __init__(self, mode: str, *, available: bool | None = None) -> None:
        """``available``: the answer, when it is known without asking CRIU."""
        self.mode = mode
        self._available = available
        # container id -> (its init pid, the checkpoint id of its last committed
        # tracked dump)
        self._parents: dict[str, tuple[int, str]] = {}

    async def available(self, runc: Runc) -> bool:
        """The kernel and CRIU track dirty pages and the node config allows it; asked
        of CRIU once per daemon (one ``criu check``, ~30 ms)."""
        if self.mode == "off":
            return False
        if self._available is None:
            argv = [runc.criu or "criu", "check", "--feature", FEATURE]
            try:
                ended = await runc.reaper.spawn(argv).wait()
                self._available = ended.status == 0
            except OSError as err:
                log.warning("criu check --feature %s failed to run: %s", FEATURE, err)
                self._available = False
        return self._available

    def take_parent(self, container_id: str, pid: int) -> str | None:
        """The checkpoint a dump of ``container_id`` (init ``pid``) may name as its
        parent; forgotten until this dump is committed (see remember)."""
        pid_and_parent = self._parents.pop(container_id, None)
        if pid_and_parent is None or pid_and_parent[0] != pid:
            return None
        return pid_and_parent[1]

    def remember(self, container_id: str, pid: int, checkpoint_id: str) -> None:
        """A tracked dump of ``container_id`` was committed as ``checkpoint_id``."""
        self._parents[container_id] = (pid, checkpoint_id)
