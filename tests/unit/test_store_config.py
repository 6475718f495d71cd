"""The node's store has one set of settings, whoever opens it: the shim daemon (and the
Slurm runner, built the same way), the node agent (its pushes and its metrics) and the
CLI all take them from the node config through StoreConfig.for_node. A push that the
node agent took over once compacted with the default level and threads, not the node's.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from cedana_shim.checkpoint.store import Store, StoreConfig
from cedana_shim.cli.admin_store import open_store
from cedana_shim.cli.wiring import build_pipeline
from cedana_shim.config import NodeConfig, load_node_config
from cedana_shim.node.hostfs import HostRoot
from cedana_shim.node.metrics import AgentMetrics
from cedana_shim.node.ops_spool import OpsObserver, node_store
from cedana_shim.node.pending_pushes import push_pending
from cedana_shim.runtime.reaper import Reaper

# Every store setting away from its default.
NODE_CONFIG = """\
store_path = "/var/lib/cedana/checkpoints"
compression_level = 7
compression_threads = 1
retain = 5
cache_raw = false
chunk_size = 1048576
registry = "/srv/shared-checkpoints"
"""
SHIM_CONFIG = "/etc/cedana/shim.toml"


@pytest.fixture
def host(tmp_path: Path) -> HostRoot:
    """A node's root as the node agent sees it: its config, its store with an outbox."""
    (tmp_path / "etc/cedana").mkdir(parents=True)
    (tmp_path / "etc/cedana/shim.toml").write_text(NODE_CONFIG)
    (tmp_path / "srv/shared-checkpoints").mkdir(parents=True, mode=0o700)
    Store(StoreConfig(root=str(tmp_path / "var/lib/cedana/checkpoints")))
    (tmp_path / "var/lib/cedana/checkpoints/outbox").mkdir(mode=0o700)
    return HostRoot(str(tmp_path))


def expected(host: HostRoot) -> StoreConfig:
    config = load_node_config(host.path(SHIM_CONFIG), env={})
    return StoreConfig.for_node(config, root=host.path(config.store_path))


def test_every_store_setting_comes_from_the_node_config() -> None:
    node = NodeConfig(
        compression_level=7, compression_threads=1, retain=5, cache_raw=False, chunk_size=1 << 20
    )
    built = StoreConfig.for_node(node, root="/store")
    default = StoreConfig()
    for field in dataclasses.fields(StoreConfig):
        if field.name != "root":
            # A store setting added without a node key would keep its default here.
            assert getattr(built, field.name) != getattr(default, field.name), field.name
    assert built.root == "/store"
    assert StoreConfig.for_node(node).root == node.store_path


def _opened_by_node_agent_push(host: HostRoot) -> None:
    assert push_pending(host, SHIM_CONFIG) == []  # the outbox is empty


def _opened_by_node_agent_metrics(host: HostRoot) -> None:
    store = node_store(host, SHIM_CONFIG)
    assert store is not None
    OpsObserver(None, AgentMetrics(), "node-1").refresh_store(store)


def _opened_by_cli(host: HostRoot) -> None:
    config = host.path(SHIM_CONFIG)
    args = argparse.Namespace(config=config, store=host.path("/var/lib/cedana/checkpoints"))
    open_store(args)


def _opened_by_daemon(host: HostRoot) -> None:
    node = load_node_config(host.path(SHIM_CONFIG), env={})
    node = dataclasses.replace(node, store_path=host.path(node.store_path))
    loop = asyncio.new_event_loop()
    try:
        build_pipeline(node, Reaper(loop))
    finally:
        loop.close()


@pytest.mark.parametrize(
    "opener",
    [_opened_by_node_agent_push, _opened_by_node_agent_metrics, _opened_by_cli, _opened_by_daemon],
)
def test_whoever_opens_the_store_uses_the_node_settings(
    host: HostRoot, monkeypatch: pytest.MonkeyPatch, opener: Callable[[HostRoot], None]
) -> None:
    opened: list[StoreConfig] = []
    real_init = Store.__init__

    def recording_init(self: Store, config: StoreConfig, *args: Any, **kwargs: Any) -> None:
        opened.append(config)
        real_init(self, config, *args, **kwargs)

    monkeypatch.setattr(Store, "__init__", recording_init)
    opener(host)
    assert opened, "the store was not opened"
    assert set(opened) == {expected(host)}
