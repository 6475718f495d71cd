"""checkpoint/preflight.py on /proc trees laid out as the kernel shows them: a process
of another user is refused only where CRIU lacks CAP_SYS_RESOURCE (the rule of
prlimit(2): real, effective and saved uids and gids against CRIU's), an io_uring
instance always, and what cannot be read is left to CRIU. The real thing (a real
container of uid 1000, a real io_uring) is in tests/integration/test_checkpoint_faults.py."""

from __future__ import annotations

import logging
import os
from pathlib import Path

import pytest
from cedana_shim.checkpoint import preflight
from cedana_shim.errors import FailedPrecondition

WITH = 0x000001FFFFFFFFFF  # every capability
WITHOUT = WITH & ~(1 << preflight.CAP_SYS_RESOURCE)  # as on the machines tested on
ME = (os.getuid(), os.getgid())


class FakeProc:
    """A /proc with the shim itself (``self``) and a process tree."""

    def __init__(self, root: Path, bounding: int) -> None:
        self.root = root
        (root / "self").mkdir(parents=True)
        (root / "self" / "status").write_text(f"Name:\tshim\nCapBnd:\t{bounding:016x}\n")

    def process(
        self,
        pid: int,
        *,
        comm: str = "app",
        uids: tuple[int, int, int] = (ME[0],) * 3,
        gids: tuple[int, int, int] = (ME[1],) * 3,
        ns_pid: int | None = None,
        state: str = "S (sleeping)",
        children: dict[int, list[int]] | None = None,
        fds: dict[int, str] | None = None,
    ) -> None:
        """``children``: per thread id (the process's own by default), its children."""
        base = self.root / str(pid)
        base.mkdir()
        inner = f"\t{ns_pid}" if ns_pid is not None else ""
        (base / "status").write_text(
            f"Name:\t{comm}\nState:\t{state}\nTgid:\t{pid}\nPid:\t{pid}\n"
            f"Uid:\t{' '.join(map(str, uids))}\t{uids[0]}\n"
            f"Gid:\t{' '.join(map(str, gids))}\t{gids[0]}\n"
            f"NSpid:\t{pid}{inner}\n"
        )
        for tid, kids in (children or {pid: []}).items():
            (base / "task" / str(tid)).mkdir(parents=True)
            (base / "task" / str(tid) / "children").write_text(" ".join(map(str, kids)))
        (base / "fd").mkdir()
        for fd, target in (fds or {0: "/dev/null"}).items():
            os.symlink(target, base / "fd" / str(fd))

    def check(self, init: int = 100) -> None:
        preflight.check("c1", init, proc=str(self.root))


def test_a_process_of_another_user_is_refused_without_cap_sys_resource(tmp_path: Path) -> None:
    proc = FakeProc(tmp_path, WITHOUT)
    proc.process(100, comm="sh", children={100: [101]}, ns_pid=1)
    proc.process(101, comm="postgres", uids=(999, 999, 999), gids=(999, 999, 999), ns_pid=7)
    with pytest.raises(FailedPrecondition) as info:
        proc.check()
    message = str(info.value)
    assert message.startswith("checkpoint of container c1 refused, nothing was frozen: its ")
    assert "process 101 (postgres, pid 7 in the container) runs as uid 999, gid 999" in message
    assert "CAP_SYS_RESOURCE" in message and "bounding set" in message


def test_the_same_tree_is_dumped_where_the_capability_is_there(tmp_path: Path) -> None:
    proc = FakeProc(tmp_path, WITH)
    proc.process(100, children={100: [101]})
    proc.process(101, uids=(999, 999, 999), gids=(999, 999, 999))
    proc.check()


@pytest.mark.parametrize(
    ("uids", "gids", "said"),
    [
        (  # only the saved uid differs
            (ME[0], ME[0], 1000),
            (ME[1],) * 3,
            f"uids {ME[0]}, {ME[0]}, 1000 (real, effective, saved), gid {ME[1]}",
        ),
        (  # only the effective gid
            (ME[0],) * 3,
            (ME[1], 1000, ME[1]),
            f"uid {ME[0]}, gids {ME[1]}, 1000, {ME[1]} (real, effective, saved)",
        ),
    ],
)
def test_any_of_the_six_ids_counts(
    tmp_path: Path, uids: tuple[int, int, int], gids: tuple[int, int, int], said: str
) -> None:
    proc = FakeProc(tmp_path, WITHOUT)
    proc.process(100, uids=uids, gids=gids)
    with pytest.raises(FailedPrecondition) as info:
        proc.check()
    assert f"process 100 (app) runs as {said}, and CRIU" in str(info.value)


def test_processes_of_crius_own_user_and_zombies_pass(tmp_path: Path) -> None:
    proc = FakeProc(tmp_path, WITHOUT)
    proc.process(100, children={100: [101]})
    proc.process(101, uids=(1000,) * 3, gids=(1000,) * 3, state="Z (zombie)")
    proc.check()


def test_an_io_uring_below_another_thread_is_refused(tmp_path: Path) -> None:
    """The child of a non-leader thread (found through that thread's children), and a
    capability that does not matter for it."""
    proc = FakeProc(tmp_path, WITH)
    proc.process(100, children={100: [], 105: [120]}, ns_pid=1)
    proc.process(120, comm="uring-app", ns_pid=3, fds={0: "/dev/null", 4: preflight.IO_URING})
    with pytest.raises(FailedPrecondition) as info:
        proc.check()
    assert "process 120 (uring-app, pid 3 in the container) has an io_uring instance (fd 4)" in (
        str(info.value)
    )


def test_processes_gone_meanwhile_are_skipped(tmp_path: Path) -> None:
    proc = FakeProc(tmp_path, WITHOUT)
    proc.process(100, children={100: [101, 102]})
    proc.process(102)
    proc.check()  # 101 exited between its parent's children list and its status


def test_what_cannot_be_read_is_left_to_criu(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    proc = FakeProc(tmp_path, WITHOUT)
    proc.process(100)
    (tmp_path / "100" / "status").write_text("Name:\tapp\n")  # no Uid line
    with caplog.at_level(logging.WARNING):
        proc.check()
    (record,) = [r for r in caplog.records if r.name == "cedana_shim.checkpoint.preflight"]
    assert "CRIU will tell" in record.getMessage()


def test_the_bounding_set_is_this_process_s() -> None:
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    pr_capbset_read = 23
    expected = libc.prctl(pr_capbset_read, preflight.CAP_SYS_RESOURCE, 0, 0, 0)
    assert expected in (0, 1), ctypes.get_errno()
    assert preflight.has_sys_resource() is bool(expected)
