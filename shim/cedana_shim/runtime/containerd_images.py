"""The image a container was made from, as containerd knows it: its target digest.

containerd records each container's image name (Containers service) and each image's
target, the manifest or index it was pulled as (Images service); neither reaches the
shim in the OCI spec (the CRI's ``io.kubernetes.cri.image-name`` annotation is a name,
a tag that can move; ``ctr`` sets none). The shim asks containerd's gRPC API on the
socket it was started with (``-address``), in its namespace, only where a checkpoint
may move between nodes: recording the image of a checkpoint taken with a registry
configured (while CRIU dumps), and checking a checkpoint from another node before it
is pulled. Never on start, delete or any Task RPC.

A shim daemon asks through a child process (:func:`target_digest_in_child`, which
runs this module): grpc would otherwise stay in the daemon for the pod's whole life,
~14 MiB of RSS in every labelled pod's shim on a node with a registry.
"""

from __future__ import annotations

import asyncio
import os
import re
import sys
from dataclasses import dataclass
from types import SimpleNamespace
from typing import TYPE_CHECKING, Any, Final

from cedana_shim import errors

if TYPE_CHECKING:
    from .reaper import Reaper

__all__ = ["ContainerdImages", "target_digest_in_child"]

TIMEOUT: Final = 5.0  # seconds per call: containerd answers these from its metadata db
_NAMESPACE_HEADER: Final = "containerd-namespace"
_DIGEST: Final = re.compile(r"sha256:[0-9a-f]{64}")
_OUTPUT_MAX: Final = 4096


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


async def target_digest_in_child(
    images: ContainerdImages, reaper: Reaper, container_id: str
) -> str:
    """:meth:`ContainerdImages.target_digest`, asked by a child process started through
    the daemon's reaper (it must reap every child itself). The child sees the
    daemon's own ``sys.path``."""
    prelude = f"import sys; sys.path[:] = {sys.path!r}; "
    code = prelude + "from cedana_shim.runtime.containerd_images import main; sys.exit(main())"
    argv = [sys.executable, "-sS", "-c", code, images.address, images.namespace, container_id]
    out = os.memfd_create("image-digest", os.MFD_CLOEXEC)
    err = os.memfd_create("image-digest-err", os.MFD_CLOEXEC)
    try:
        child = reaper.spawn(argv, stdout=out, stderr=err)
        try:
            async with asyncio.timeout(2 * images.timeout + 10):
                status = (await child.wait()).status
        except BaseException:
            await child.terminate(grace=1.0)
            raise
        answer = os.pread(out, _OUTPUT_MAX, 0).decode(errors="replace").strip()
        why = os.pread(err, _OUTPUT_MAX, 0).decode(errors="replace").strip()
    except TimeoutError:
        raise errors.Unavailable(
            f"asking containerd ({images.address}) for the image of container "
            f"{container_id}: no answer"
        ) from None
    finally:
        os.close(out)
        os.close(err)
    if status != 0:
        lines = why.splitlines()
        raise errors.Unavailable(lines[-1] if lines else f"image digest lookup exited {status}")
    if answer and not _DIGEST.fullmatch(answer):
        raise errors.Unavailable(f"image digest lookup printed {answer[:100]!r}")
    return answer


def main(argv: list[str] | None = None) -> int:
    """``ADDRESS NAMESPACE CONTAINER_ID``: print the digest ("" without an image)."""
    args = sys.argv[1:] if argv is None else argv
    if len(args) != 3:
        print("usage: containerd_images ADDRESS NAMESPACE CONTAINER_ID", file=sys.stderr)
        return 2
    try:
        print(ContainerdImages(args[0], args[1]).target_digest(args[2]))
    except errors.ShimError as err:
        print(err, file=sys.stderr)
        return 1
    return 0
