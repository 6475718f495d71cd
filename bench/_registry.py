"""The shared store the cross-node benchmarks push to and pull from: one real
docker-registry on loopback (TLS from a throwaway CA, htpasswd auth, as
tests/integration/test_across_nodes.py runs it), or a shared directory.

Used by across_nodes.py and lazy_across_nodes.py (its own module so that each can
import the other's steps).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from _common import Cleanup, ensure_venv

ensure_venv()

from cedana_shim.checkpoint.remote.shared_dir import SharedDirectory  # noqa: E402
from cedana_shim.checkpoint.remote.tags import parse_tag  # noqa: E402
from cedana_shim.registry import Registry as RegistryLike  # noqa: E402
from cedana_shim.registry import RegistryClient, RegistryConfig  # noqa: E402
from checkpoint_restore import MIB, NAMESPACE, du_bytes  # noqa: E402

from tests.integration.harness.registry import (  # noqa: E402
    PASSWORD,
    USER,
    Registry,
    make_test_ca,
    write_auth_file,
)

__all__ = ["PREFIX", "Remote", "shared_directory", "start_registry"]

PREFIX = "cedana"


@dataclass
class Remote:
    client: RegistryLike
    blobs: Path  # where its blobs lie on this host (its storage, for their bytes)
    registry: Registry | None = None  # None: a shared directory, no registry process

    @property
    def repo(self) -> str:
        return self.client.repository_for(NAMESPACE)

    def complete_tags(self) -> dict[str, str]:
        """Checkpoint id -> its tag, for every complete (not in-flight) one."""
        tags = ((t, parse_tag(t)) for t in self.client.list_tags(self.repo))
        return {p.checkpoint_id: t for t, p in tags if p is not None and not p.pending}

    def layers(self, checkpoint_id: str) -> dict[str, tuple[str, int]]:
        """A pushed checkpoint's blobs, from its manifest in the registry: digest ->
        (what it is: a layer's title, or a chunk's "<file>@<offset MiB>", size)."""
        tag = self.complete_tags()[checkpoint_id]
        manifest = json.loads(self.client.get_manifest(self.repo, tag)[0])
        blobs = {manifest["config"]["digest"]: ("config", int(manifest["config"]["size"]))}
        for layer in manifest["layers"]:
            notes = layer.get("annotations") or {}
            what = str(notes.get("org.opencontainers.image.title", "?"))
            if "cedana.ai/chunk.file" in notes:
                offset = int(notes["cedana.ai/chunk.offset"]) // MIB
                what = f"{notes['cedana.ai/chunk.file']}@{offset}MiB"
            blobs[layer["digest"]] = (what, int(layer["size"]))
        return blobs

    def stored_bytes(self) -> int:
        """What the registry stores (blobs and manifests), from its filesystem."""
        return du_bytes(self.blobs)


def start_registry(root: Path, cleanup: Cleanup) -> tuple[Remote, dict[str, str]]:
    """The registry, and the node config (CEDANA_<KEY>) that points a node at it."""
    tls = make_test_ca(root / "tls")
    registry = Registry(root / "registry", tls=tls)
    registry.start()
    cleanup.push("stop the registry", registry.stop)
    auth = write_auth_file(root / "registry-auth.json", registry.host, USER, PASSWORD)
    env = {
        "CEDANA_REGISTRY": f"{registry.host}/{PREFIX}",
        "CEDANA_REGISTRY_AUTH_FILE": str(auth),
        "CEDANA_REGISTRY_CA": str(tls.ca_cert),
        "CEDANA_REGISTRY_SYNC": "before-exit",
    }
    config = RegistryConfig(
        registry=env["CEDANA_REGISTRY"], auth_file=str(auth), ca_file=str(tls.ca_cert)
    )
    blobs = registry.storage / "docker" / "registry" / "v2" / "blobs"
    return Remote(RegistryClient(config), blobs, registry), env


def shared_directory(root: Path) -> tuple[Remote, dict[str, str]]:
    """A directory as the shared store (``registry`` = its path), on the same disk."""
    path = root / "shared"
    path.mkdir(mode=0o700)
    env = {"CEDANA_REGISTRY": str(path), "CEDANA_REGISTRY_SYNC": "before-exit"}
    return Remote(SharedDirectory(str(path)), path), env
