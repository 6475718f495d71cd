"""The image a container was made from, as containerd knows it: its target digest.

containerd records each container's image name (Containers service) and each image's
target, the manifest or index it was pulled as (Images service); neither reaches the
shim in the OCI spec (the CRI's ``io.kubernetes.cri.image-name`` annotation is a name,
a tag that can move; ``ctr`` sets none). The shim asks containerd's gRPC API on the
socket it was started with (``-address``), in its namespace, only where a checkpoint
may move between nodes: recording the image of a checkpoint taken with a registry
configured (while CRIU dumps), and checking a checkpoint from another node before it
is pulled. Never on start, delete or any Task RPC: grpc is imported on first use.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any, Final

from cedana_shim import errors

__all__ = ["ContainerdImages"]

TIMEOUT: Final = 5.0  # seconds per call: containerd answers these from its metadata db
_NAMESPACE_HEADER: Final = "containerd-namespace"
_DIGEST: Final = re.compile(r"sha256:[0-9a-f]{64}")


@dataclass(frozen=True)
class ContainerdImages:
    """containerd at ``address`` (its gRPC socket), in ``namespace``."""

    address: str
    namespace: str
    timeout: float = TIMEOUT

    def target_digest(self, container_id: str) -> str:
        """The digest of the image container ``container_id`` was made from ("" when it
        was made without one). Blocking; Unavailable when containerd cannot say."""
        grpc, containers, images = _modules()
        metadata = ((_NAMESPACE_HEADER, self.namespace),)
        target = "unix://" + self.address.removeprefix("unix://")
        doing = f"asking containerd ({self.address}) for the image of container {container_id}"
        try:
            with grpc.insecure_channel(target) as channel:
                found = containers.ContainersStub(channel).Get(
                    containers.GetContainerRequest(id=container_id),
                    metadata=metadata,
                    timeout=self.timeout,
                )
                name = str(found.container.image)
                if not name:
                    return ""
                image = images.ImagesStub(channel).Get(
                    images.GetImageRequest(name=name), metadata=metadata, timeout=self.timeout
                )
        except grpc.RpcError as err:
            code, details = getattr(err, "code", None), getattr(err, "details", None)
            why = f"{code().name}: {details()}" if callable(code) and callable(details) else err
            raise errors.Unavailable(f"{doing}: {why}") from None
        digest = str(image.image.target.digest)
        if not _DIGEST.fullmatch(digest):
            raise errors.Unavailable(f"{doing}: image {name!r} has target digest {digest!r}")
        return digest


def _modules() -> tuple[Any, Any, Any]:
    """grpc and containerd's containers and images services (messages and stubs)."""
    try:
        import grpc  # type: ignore[import-untyped]
    except ImportError as err:  # a dependency of the package: a broken install
        raise errors.Unavailable(f"cannot ask containerd for a container's image: {err}") from err

    from ..api.containerd.services import (
        containers_pb2,
        containers_pb2_grpc,
        images_pb2,
        images_pb2_grpc,
    )

    containers = SimpleNamespace(
        ContainersStub=containers_pb2_grpc.ContainersStub,
        GetContainerRequest=containers_pb2.GetContainerRequest,
    )
    images = SimpleNamespace(
        ImagesStub=images_pb2_grpc.ImagesStub, GetImageRequest=images_pb2.GetImageRequest
    )
    return grpc, containers, images
