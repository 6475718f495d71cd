"""Tests written for one cgroup version skip, saying why, on a host of the other.

A test that reads cgroup v1 files (``memory.limit_in_bytes``, ``freezer.state``,
per-controller hierarchies) carries ``@pytest.mark.cgroup_v1``; one that needs the
unified hierarchy alone (tests/vm, run in a cgroup v2 VM) ``@pytest.mark.cgroup_v2``.
Each suite's ``pytest_runtest_setup`` calls :func:`skip_other_version`, so that `make
test` passes on a node of either kind. Nothing else may skip: a test that cannot run
fails.
"""

from __future__ import annotations

import os

import pytest

# What runc and containerd call unified mode: the hierarchy's root is cgroup2 (a
# hybrid node mounts cgroup2 at /sys/fs/cgroup/unified and counts as cgroup v1).
_UNIFIED_ROOT = "/sys/fs/cgroup/cgroup.controllers"
MARKERS = {"cgroup_v1": 1, "cgroup_v2": 2}


def host_cgroup_version() -> int:
    return 2 if os.path.exists(_UNIFIED_ROOT) else 1


def skip_other_version(item: pytest.Item) -> None:
    """Skip ``item`` when it is marked for the cgroup version this host does not run."""
    host = host_cgroup_version()
    for marker, version in MARKERS.items():
        if item.get_closest_marker(marker) is not None and version != host:
            pytest.skip(
                f"written for cgroup v{version}; this host runs cgroup v{host} "
                f"({'the unified hierarchy at /sys/fs/cgroup' if host == 2 else 'v1 hierarchies'})"
            )
