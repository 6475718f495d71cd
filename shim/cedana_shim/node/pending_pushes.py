"""The node agent's share of the registry: pushes a shim did not finish.

A checkpoint committed on the node is recorded in the store's outbox before its
push starts (see checkpoint.remote). The shim that took it pushes it; if that shim
exits, is killed, or the registry is away meanwhile, the record stays. The node agent
(`cedana node run`, the chart's helper pod) takes pending records up every round,
each under its own lock, so a push is never lost and never made twice at once. It
reads the node config the shims use, from the host root.
"""

from __future__ import annotations

import logging
import os
import platform
from dataclasses import replace

from ..checkpoint.delivery import Delivery
from ..checkpoint.remote.shared_dir import names_shared_dir
from ..config import NodeConfig, load_node_config
from ..errors import ShimError
from .hostfs import HostRoot

log = logging.getLogger(__name__)


def host_view(host: HostRoot, config: NodeConfig) -> NodeConfig:
    """The node config with the store's and the registry's paths as this process
    sees them (the config's are the host's; they are under the host root here)."""
    return replace(
        config,
        store_path=host.path(config.store_path),
        registry=host.path(config.registry)
        if names_shared_dir(config.registry)
        else config.registry,
        registry_auth_file=host.path(config.registry_auth_file)
        if config.registry_auth_file
        else "",
        registry_ca=host.path(config.registry_ca) if config.registry_ca else "",
    )


def push_pending(host: HostRoot, shim_config: str) -> list[str]:
    """Push what the node's outbox holds; the ids pushed. Never raises for a registry
    or store problem (logged; the next round retries)."""
    try:
        config = load_node_config(host.path(shim_config), env={})
    except ShimError as err:
        log.warning("pending pushes: cannot read the node config: %s", err)
        return []
    if not config.registry:
        return []
    store_root = host.path(config.store_path)
    if not os.path.isdir(os.path.join(store_root, "outbox")):
        return []  # nothing was ever recorded on this node
    config = host_view(host, config)
    try:
        delivery = Delivery.for_node(
            config, root=store_root, node_name=os.environ.get("NODE_NAME") or platform.node()
        )
        result = delivery.push()
    except (ShimError, OSError) as err:
        log.warning("pending pushes: %s", err)
        return []
    for checkpoint_id in result.pushed:
        log.info("pushed pending checkpoint %s to %s", checkpoint_id, config.registry)
    for checkpoint_id, why in result.failed:
        log.warning("pending checkpoint %s not pushed yet: %s", checkpoint_id, why)
    return result.pushed
