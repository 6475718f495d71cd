"""The composition root's parts: what the daemon builds once and hands to the service.

The node config is read once per config file and read again only when the file
changes (its inode, size or mtime), so a Create costs one ``stat``; the store,
hooks and GPU steps behind it are built once per config.
"""

from __future__ import annotations

import os

from ..checkpoint.gpu_steps import GpuSteps
from ..checkpoint.pipeline import Pipeline
from ..checkpoint.store import Store, StoreConfig
from ..config import DEFAULT_PATH, NodeConfig, Stamp, file_stamp, load_node_config
from ..hooks import ProcessHookRunner, reaper_spawn
from ..runtime.reaper import Reaper


def build_pipeline(config: NodeConfig, reaper: Reaper) -> Pipeline:
    store = Store(StoreConfig.for_node(config))
    hooks = ProcessHookRunner(
        tuple(d for d in config.hooks_dirs.split(":") if d), spawn=reaper_spawn(reaper)
    )
    return Pipeline(store, config, hooks, GpuSteps(config, reaper))


class NodePipelines:
    """The checkpoint pipeline for each node config file a container names."""

    def __init__(self, reaper: Reaper) -> None:
        self.reaper = reaper
        self._configs: dict[str, tuple[Stamp, NodeConfig]] = {}
        self._built: dict[str, Pipeline] = {}

    def config(self, config_path: str) -> NodeConfig:
        """The node config in ``config_path`` ("" = the default file), read again only
        when the file changed."""
        stamp = file_stamp(config_path or os.environ.get("CEDANA_CONFIG") or DEFAULT_PATH)
        known = self._configs.get(config_path)
        if known is not None and known[0] == stamp:
            return known[1]
        config = load_node_config(config_path or None)
        self._configs[config_path] = (stamp, config)
        return config

    def get(self, config_path: str) -> Pipeline:
        config = self.config(config_path)
        pipeline = self._built.get(config_path)
        if pipeline is None or pipeline.config != config:
            pipeline = self._built[config_path] = build_pipeline(config, self.reaper)
        return pipeline
