"""The registry commands of `cedana checkpoints`: their parser and their progress line."""

from __future__ import annotations

import pytest
from cedana_shim.cli import admin
from cedana_shim.cli.admin_common import render_transfer


def test_the_registry_subcommands_are_registered() -> None:
    parser = admin.build_parser()
    args = parser.parse_args(["checkpoints", "list", "--remote", "--json", "-n", "team-a"])
    assert args.remote and args.json and args.namespace == "team-a"
    assert parser.parse_args(["checkpoints", "push", "2026", "--json"]).id == "2026"
    pull = parser.parse_args(["checkpoints", "pull", "team-a/c.x", "--namespace", "n"])
    assert (pull.ref, pull.namespace) == ("team-a/c.x", "n")
    assert not parser.parse_args(["checkpoints", "sync"]).json
    assert not parser.parse_args(["checkpoints", "list"]).remote


def test_pull_needs_a_ref(capsys: pytest.CaptureFixture[str]) -> None:
    assert admin.main(["checkpoints", "pull"]) == 2
    assert "REF" in capsys.readouterr().err


def test_the_transfer_line_shows_bytes_and_rate_and_never_wraps() -> None:
    line = render_transfer("pushing 20261129T183000Z-3f9a1c2b", 50 << 20, 100 << 20, 2.0, 120)
    assert line == (
        "pushing 20261129T183000Z-3f9a1c2b  [======      ]  50.0 MiB / 100.0 MiB  26.2 MB/s"
    )
    narrow = render_transfer("pushing 20261129T183000Z-3f9a1c2b", 1, 2, 0.0, 60)
    assert len(narrow) <= 59 and narrow.startswith("pushing 2026") and "..." in narrow
    assert render_transfer("x", 5, 0, 1.0, 80).startswith("x  [============]")
