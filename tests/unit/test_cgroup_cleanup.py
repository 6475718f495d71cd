"""task/cgroups.remove_cgroup on hierarchies mounted as mountinfo says (here: plain
directories standing in for them): the container's cgroup goes from every hierarchy
with what is below it, and nothing else does, whatever the path. The real thing: the
killed-restore tests of tests/integration (test_shim_robustness.py,
test_checkpoint_faults.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from cedana_shim.task.cgroups import cgroup_dirs, remove_cgroup


def _mountinfo(root: Path) -> str:
    """A hybrid node: cpu,cpuacct together, memory, name=systemd, the unified one,
    memory mounted a second time (as inside a container, at a sub-cgroup)."""
    lines = [
        f"30 25 0:26 / {root}/cpu,cpuacct rw shared:9 - cgroup cgroup rw,cpu,cpuacct",
        f"31 25 0:27 / {root}/memory rw shared:10 - cgroup cgroup rw,memory",
        f"32 25 0:28 /k8s {root}/memory-view rw - cgroup cgroup rw,memory",
        f"33 25 0:29 / {root}/systemd rw - cgroup cgroup rw,xattr,name=systemd",
        f"34 25 0:30 / {root}/unified rw - cgroup2 cgroup2 rw,nsdelegate",
        f"35 25 0:31 / {root}/tmp rw - tmpfs tmpfs rw",
    ]
    return "\n".join(lines) + "\n"


@pytest.fixture(autouse=True)
def rmdir_only_below(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A regression must fail here, not remove the empty directories of this machine
    (a path that resolved to "/" once walked the whole filesystem)."""
    real = os.rmdir

    def rmdir(path: str) -> None:
        if not Path(path).resolve().is_relative_to(tmp_path / "cg"):
            raise AssertionError(f"rmdir outside the test's hierarchies: {path}")
        real(path)

    monkeypatch.setattr(os, "rmdir", rmdir)


@pytest.fixture
def proc(tmp_path: Path) -> Path:
    (tmp_path / "proc" / "self").mkdir(parents=True)
    (tmp_path / "proc" / "self" / "mountinfo").write_text(_mountinfo(tmp_path / "cg"))
    for hierarchy in ("cpu,cpuacct", "memory", "systemd", "unified"):
        (tmp_path / "cg" / hierarchy / "ns" / "other").mkdir(parents=True)
    return tmp_path / "proc"


def test_one_directory_per_hierarchy(tmp_path: Path) -> None:
    dirs = cgroup_dirs("/ns/c1", _mountinfo(tmp_path))
    # memory once, through the mount that shows its whole hierarchy; no tmpfs.
    assert dirs == [
        f"{tmp_path}/{hierarchy}/ns/c1"
        for hierarchy in ("cpu,cpuacct", "memory", "systemd", "unified")
    ]


def test_the_cgroup_and_what_is_below_go_in_every_hierarchy(proc: Path) -> None:
    cg = proc.parent / "cg"
    for hierarchy in ("cpu,cpuacct", "memory", "systemd", "unified"):
        (cg / hierarchy / "ns" / "c1" / "nested").mkdir(parents=True)
    assert remove_cgroup("/ns/c1", proc=str(proc)) == []
    assert not list(cg.glob("*/ns/c1"))
    # The parent (shared with other containers) and its other children stay.
    assert len(list(cg.glob("*/ns/other"))) == 4


def test_a_cgroup_in_use_stays(proc: Path) -> None:
    busy = proc.parent / "cg" / "memory" / "ns" / "c1"
    busy.mkdir()
    (busy / "cgroup.procs").write_text("42\n")  # rmdir fails, as on a cgroup in use
    (proc.parent / "cg" / "systemd" / "ns" / "c1").mkdir()
    assert remove_cgroup("/ns/c1", proc=str(proc)) == [str(busy)]
    assert not (proc.parent / "cg" / "systemd" / "ns" / "c1").exists()


@pytest.mark.parametrize(
    "path", ["/", "", "//", "/./", "/ns/..", "/ns/../..", "ns/c1", "pod.slice:cri:c1"]
)
def test_no_path_removes_more_than_one_container_s_cgroup(proc: Path, path: str) -> None:
    """The hierarchy's root, a relative path (runc's is relative to its own cgroup) and
    a systemd driver's slice:prefix:name (systemd cleans up after its scopes)."""
    assert remove_cgroup(path, proc=str(proc)) == []
    assert len(list((proc.parent / "cg").glob("*/ns/other"))) == 4
