"""Labels whose stop waits for the registry, whatever the node's ``registry_sync``.

A namespace policy with ``beforeEviction: checkpoint`` (node/policies.py) asks that
a covered workload evicted or drained off its node resume elsewhere: its stop
checkpoint must be in the registry before the container exits. The shim decides
that at the stop (lifecycle/checkpointing.py) from the node config and from this
file, ``<store root>/push-before-exit.json``, which the node agent rewrites every
round with the (namespace, label) pairs the policies cover on its node::

    {"labels": [["team-a", "trainer"], ...]}

A missing or unreadable file asks nothing (the node config decides alone). A pair
stays until the agent's next round after its policy changes or is deleted.
"""

from __future__ import annotations

import contextlib
import json
import os
import tempfile
from collections.abc import Iterable
from typing import Final

__all__ = ["FILE", "read_labels", "wants_push_before_exit", "write_labels"]

FILE: Final = "push-before-exit.json"
_MAX_BYTES: Final = 4 << 20

Pair = tuple[str, str]


def read_labels(store_root: str) -> set[Pair]:
    try:
        with open(os.path.join(store_root, FILE), "rb") as f:
            doc = json.loads(f.read(_MAX_BYTES + 1)[:_MAX_BYTES])
        pairs = doc["labels"]
        return {(str(p[0]), str(p[1])) for p in pairs if isinstance(p, list) and len(p) == 2}
    except (OSError, ValueError, KeyError, TypeError):
        return set()


def wants_push_before_exit(store_root: str, scope: str, label: str) -> bool:
    return (scope, label) in read_labels(store_root)


def write_labels(store_root: str, pairs: Iterable[Pair]) -> bool:
    """Replace the file (atomically) when its pairs change; True when it was written."""
    wanted = sorted(set(pairs))
    if set(wanted) == read_labels(store_root) and (
        wanted or not os.path.exists(os.path.join(store_root, FILE))
    ):
        return False
    data = json.dumps({"labels": [list(p) for p in wanted]}).encode()
    fd, tmp = tempfile.mkstemp(prefix=f".{FILE}.", dir=store_root)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, 0o600)  # as every file of the store
        os.replace(tmp, os.path.join(store_root, FILE))
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return True
