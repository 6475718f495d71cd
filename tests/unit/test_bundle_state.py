"""The delete mark the daemon leaves in a bundle, as the `delete` command reads it."""

from __future__ import annotations

from pathlib import Path

import pytest
from cedana_shim.bundle_state import DELETED_MARK, mark_deleted, read_deleted
from cedana_shim.wire import delete_response


def test_the_mark_holds_the_delete_response(tmp_path: Path) -> None:
    mark_deleted(str(tmp_path), 4242, 137, 1700000000.25)
    text = (tmp_path / DELETED_MARK).read_text()
    assert text.endswith("\n") and text.count("\n") == 1
    assert read_deleted(str(tmp_path)) == delete_response(4242, 137, 1700000000.25)


def test_no_mark_is_no_answer(tmp_path: Path) -> None:
    assert read_deleted(str(tmp_path)) is None


def test_a_mark_from_before_the_shells_fast_path_still_reads(tmp_path: Path) -> None:
    (tmp_path / DELETED_MARK).write_text("4242 137 1700000000.25\n")
    assert read_deleted(str(tmp_path)) == delete_response(4242, 137, 1700000000.25)


@pytest.mark.parametrize(
    "mark", ["\\101\\1\n", "\\101\\\n", "\\477\n", "\\1011\n", "\\10a\n", "12 x 1.0\n", "\\"]
)
def test_a_damaged_mark_is_no_answer(tmp_path: Path, mark: str) -> None:
    """The `delete` command then does the full cleanup, which is always right."""
    (tmp_path / DELETED_MARK).write_text(mark)
    assert read_deleted(str(tmp_path)) is None
