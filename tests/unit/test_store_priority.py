"""Background work lowers its daemon's autogroup while no foreground work runs."""

from __future__ import annotations

import re
import threading
from pathlib import Path

import pytest
from cedana_shim.checkpoint.store import priority
from cedana_shim.checkpoint.store.compactor import run_niced


@pytest.fixture
def autogroup(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    """A stand-in for /proc/self/autogroup: the kernel's format on read, a number
    written (as the kernel takes it)."""
    path = tmp_path / "autogroup"
    path.write_text("/autogroup-7 nice 0\n")
    real_write = priority._write

    def write(nice: int) -> None:
        real_write(nice)
        path.write_text(f"/autogroup-7 nice {path.read_text().strip()}\n")

    monkeypatch.setattr(priority, "_AUTOGROUP", str(path))
    monkeypatch.setattr(priority, "_write", write)
    monkeypatch.setattr(priority, "_can_raise", lambda: True)
    return path


def test_background_lowers_the_autogroup_until_it_ends(autogroup: Path) -> None:
    with priority.background():
        assert priority.autogroup_nice() == 19
        with priority.background():  # a second compaction
            assert priority.autogroup_nice() == 19
        assert priority.autogroup_nice() == 19
    assert priority.autogroup_nice() == 0


def test_foreground_work_gets_the_old_priority_back_meanwhile(autogroup: Path) -> None:
    with priority.background():
        with priority.foreground():
            assert priority.autogroup_nice() == 0
        assert priority.autogroup_nice() == 19
    with priority.foreground(), priority.background():
        assert priority.autogroup_nice() == 0
    assert priority.autogroup_nice() == 0


def test_an_operator_s_own_autogroup_nice_is_what_comes_back(autogroup: Path) -> None:
    autogroup.write_text("/autogroup-7 nice 5\n")
    with priority.background():
        assert priority.autogroup_nice() == 19
    assert priority.autogroup_nice() == 5


def test_without_cap_sys_nice_or_autogroups_nothing_is_written(
    autogroup: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(priority, "_can_raise", lambda: False)
    with priority.background():
        assert priority.autogroup_nice() == 0
    monkeypatch.setattr(priority, "_AUTOGROUP", str(autogroup.parent / "absent"))
    with priority.background():
        assert priority.autogroup_nice() is None


def test_a_niced_compaction_counts_as_background_and_a_urgent_one_not(autogroup: Path) -> None:
    seen: list[int | None] = []
    run_niced(lambda: seen.append(priority.autogroup_nice()))
    run_niced(lambda: seen.append(priority.autogroup_nice()), 0)
    assert seen == [19, 0]
    assert priority.autogroup_nice() == 0


def test_this_kernel_s_format_is_read() -> None:
    # The file is absent without CONFIG_SCHED_AUTOGROUP and empty for a task outside
    # the root cpu cgroup (a CI container): both mean "no autogroup".
    path = Path("/proc/self/autogroup")
    text = path.read_text() if path.exists() else ""
    match = re.fullmatch(r"/autogroup-\d+ nice (-?\d+)\n", text)
    assert match or text == "", text
    assert priority.autogroup_nice() == (int(match.group(1)) if match else None)


def test_counts_stay_balanced_across_threads(autogroup: Path) -> None:
    def work() -> None:
        for _ in range(200):
            with priority.background(), priority.foreground():
                pass

    threads = [threading.Thread(target=work) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert priority._counts == {"background": 0, "foreground": 0}
    assert priority.autogroup_nice() == 0
