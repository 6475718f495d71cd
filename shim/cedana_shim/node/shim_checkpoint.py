"""An on-demand checkpoint asked of a container's shim, for the node agent's API.

The shim serves ``cedana.shim.v1.Checkpoint`` on its ttrpc socket, whose address is
in the task's bundle (``<state>/io.containerd.runtime.v2.task/<ns>/<id>/address``, or
containerd 2.x's ``bootstrap.json``) -- the same call as ``cedana checkpoint``
(cli/admin_checkpoint.py), made here without its terminal progress; the agent finds
the container through the CRI (kubelet's names) and the bundle in the ``k8s.io``
containerd namespace.
"""

from __future__ import annotations

import asyncio
import json
import os
from dataclasses import dataclass
from typing import Final

from ..errors import ShimError

TASK_STATE_SUBDIR: Final = "io.containerd.runtime.v2.task"
CRI_NAMESPACE: Final = "k8s.io"
SERVICE: Final = "cedana.shim.v1.Checkpoint"


class ShimCallError(Exception):
    """The shim could not be found or refused: the message says which and why."""


@dataclass(frozen=True)
class Taken:
    checkpoint_id: str
    scope: str
    label: str
    size: int


def shim_address(state_dir: str, container_id: str, namespace: str = CRI_NAMESPACE) -> str:
    bundle = os.path.join(state_dir, TASK_STATE_SUBDIR, namespace, os.path.basename(container_id))
    try:
        with open(os.path.join(bundle, "address")) as f:
            address = f.read(4096).strip()
    except FileNotFoundError:
        address = ""
    if not address:
        try:
            with open(os.path.join(bundle, "bootstrap.json")) as f:
                address = str(json.load(f).get("address") or "")
        except (OSError, ValueError, AttributeError):
            address = ""
    if not address:
        raise ShimCallError(
            f"container {container_id}: no shim address in {bundle} (is containerd's state "
            "directory right? `cedana node run --containerd-state`)"
        )
    return address


def checkpoint(address: str, container_id: str, *, leave_running: bool, timeout: float) -> Taken:
    """Ask the shim at ``address`` for a checkpoint of ``container_id``; blocks."""
    from ..api.cedana.v1 import cedana_pb2
    from ..ttrpc.client import Client

    async def call() -> cedana_pb2.CheckpointResponse:
        async with await Client.connect(address) as client:
            return await client.call(
                SERVICE,
                "Checkpoint",
                cedana_pb2.CheckpointRequest(
                    container_id=container_id, leave_running=leave_running
                ),
                cedana_pb2.CheckpointResponse,
                timeout=timeout,
            )

    try:
        response = asyncio.run(call())
    except ShimError as err:
        raise ShimCallError(f"checkpoint of container {container_id} failed: {err}") from None
    return Taken(response.checkpoint_id, response.scope, response.label, response.size)
