"""The `cedana node` hook the admin CLI wires in: register(subparsers) and run(args)."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest
from cedana_shim.node import cli


def admin_like_parser() -> argparse.ArgumentParser:
    # The shape of cedana_shim/cli/admin.py: subcommands carry `handler`.
    parser = argparse.ArgumentParser(prog="cedana")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND")
    cli.register(commands)
    return parser


def test_register_sets_the_handler_the_admin_cli_dispatches(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    args = admin_like_parser().parse_args(
        ["node", "status", "--host-root", str(tmp_path), "--no-cri", "--json"]
    )
    assert args.handler is cli.run
    assert args.handler(args) == 1  # nothing installed in an empty root
    assert '"installed": false' in capsys.readouterr().out


def test_node_without_subcommand_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    args = admin_like_parser().parse_args(["node"])
    assert cli.run(args) == 2
    assert "a subcommand is required" in capsys.readouterr().err


def test_help_names_every_subcommand(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(["--help"]) == 0
    out = capsys.readouterr().out
    for sub in ("install", "uninstall", "status", "bundle", "run"):
        assert sub in out


def test_bad_host_root_is_reported(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    missing = tmp_path / "nope"
    assert cli.main(["install", "--host-root", str(missing), "--verify", "none"]) == 1
    assert f"--host-root {missing} is not a directory" in capsys.readouterr().err
