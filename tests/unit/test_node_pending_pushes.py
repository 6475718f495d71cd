"""The node agent's round over the outbox: nothing to do without a registry or without
an outbox; a broken node config is logged, never raised (the helper keeps running)."""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
from cedana_shim.node.hostfs import HostRoot
from cedana_shim.node.pending_pushes import push_pending


def _host(tmp_path: Path, config: str) -> HostRoot:
    (tmp_path / "etc/cedana").mkdir(parents=True)
    (tmp_path / "etc/cedana/shim.toml").write_text(config)
    return HostRoot(str(tmp_path))


def test_nothing_without_a_registry(tmp_path: Path) -> None:
    host = _host(tmp_path, 'store_path = "/var/lib/cedana/checkpoints"\n')
    assert push_pending(host, "/etc/cedana/shim.toml") == []


def test_nothing_without_an_outbox(tmp_path: Path) -> None:
    host = _host(tmp_path, 'registry = "127.0.0.1:1/cedana"\n')
    assert push_pending(host, "/etc/cedana/shim.toml") == []
    assert not (tmp_path / "var/lib/cedana/checkpoints").exists()  # nothing created


def test_a_broken_node_config_is_logged(tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    host = _host(tmp_path, "registry = \n")
    with caplog.at_level(logging.WARNING):
        assert push_pending(host, "/etc/cedana/shim.toml") == []
    assert "cannot read the node config" in caplog.text
