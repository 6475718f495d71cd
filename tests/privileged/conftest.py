"""Tests that need root on the host but no containerd: real mounts, cgroups,
network namespaces, chown and trusted.* xattrs, runc and CRIU driven directly.

They live apart from tests/unit so that `make unit` runs as any user, and run
in `make integration` (as root, like the rest of that suite). Every test here
carries the ``root`` marker, and fails (never skips) without root: a check
that cannot run must say so loudly. Only a test written for the other cgroup
version skips (support/cgroup_version.py).
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from support.cgroup_version import skip_other_version

_HERE = Path(__file__).parent


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        if _HERE in Path(str(item.path)).parents:
            item.add_marker(pytest.mark.root)


def pytest_runtest_setup(item: pytest.Item) -> None:
    skip_other_version(item)
    if os.geteuid() != 0:
        pytest.fail(
            f"{item.nodeid} needs root (mounts, cgroups, namespaces, chown): run "
            "tests/privileged as root, as `make integration` does"
        )
