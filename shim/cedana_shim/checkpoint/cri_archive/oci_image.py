"""An exported archive pushed as a checkpoint image: one uncompressed layer holding the
archive's files (what Podman's ``--create-image`` and CRI-O's checkpoint images hold),
and the ``org.criu.checkpoint.*`` annotations checkpointctl and the engines read (plus
CRI-O's ``io.kubernetes.cri-o.annotations.checkpoint.name``) on the manifest.

The registry is the node config's own (``registry`` and its ``registry_*`` keys: the
credentials, the CA, plain HTTP or not): a reference to another host is refused, so a
checkpoint never goes where the operator has not configured the node to send it.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from collections.abc import Mapping
from typing import IO, Any, Final

from cedana_shim import __version__, errors

from ...config import NodeConfig
from ...registry import RegistryClient, RegistryConfig
from ...registry.reference import check_repository, check_tag, parse_registry
from ..store.model import Entry
from .documents import RUNTIME_TYPE

__all__ = ["push_image"]

MEDIA_MANIFEST: Final = "application/vnd.oci.image.manifest.v1+json"
MEDIA_CONFIG: Final = "application/vnd.oci.image.config.v1+json"
MEDIA_LAYER: Final = "application/vnd.oci.image.layer.v1.tar"
_REF: Final = re.compile(r"(?P<host>[^/]+)/(?P<repo>[^:@]+)(?::(?P<tag>[^:@/]+))?")


def image_annotations(entry: Entry) -> dict[str, str]:
    meta = entry.metadata
    recorded = meta.get("versions")
    versions: Mapping[str, Any] = recorded if isinstance(recorded, Mapping) else {}
    pairs = {
        "org.criu.checkpoint.engine.name": "cedana",
        "org.criu.checkpoint.engine.version": __version__,
        "org.criu.checkpoint.container.name": meta.get("container") or meta.get("containerId"),
        "org.criu.checkpoint.pod.name": meta.get("pod"),
        "org.criu.checkpoint.pod.namespace": entry.scope,
        "org.criu.checkpoint.rootfsImageName": meta.get("image"),
        "org.criu.checkpoint.rootfsImageSha": meta.get("imageDigest"),
        "org.criu.checkpoint.runtime.name": RUNTIME_TYPE,
        "org.criu.checkpoint.runtime.version": versions.get("runc"),
        "org.criu.checkpoint.criu.version": versions.get("criu"),
        "org.criu.checkpoint.host.arch": versions.get("arch"),
        "org.criu.checkpoint.host.kernel": versions.get("kernel"),
        "io.kubernetes.cri-o.annotations.checkpoint.name": meta.get("container"),
        "io.cedana.checkpoint.id": entry.id,
        "io.cedana.checkpoint.label": entry.label,
    }
    return {k: str(v)[:1024] for k, v in pairs.items() if isinstance(v, str) and v}


def push_image(config: NodeConfig, reference: str, entry: Entry, archive: str) -> str:
    """Push ``archive`` (an export of ``entry``) as the image ``reference``
    (``host[:port]/repo[:tag]``); returns the manifest digest."""
    m = _REF.fullmatch(reference)
    if m is None:
        raise errors.InvalidArgument(
            f"image reference {reference!r}: write host[:port]/repository[:tag]"
        )
    host, repo, tag = m.group("host"), m.group("repo"), m.group("tag") or "latest"
    check_repository(repo)
    check_tag(tag)
    if not config.registry or config.registry.startswith("/"):
        raise errors.FailedPrecondition(
            "no registry configured: --image pushes to the node config's `registry` (with "
            "its credentials and CA); set it, or export to a file with -o"
        )
    configured = parse_registry(config.registry).host
    if host != configured:
        raise errors.InvalidArgument(
            f"image reference {reference!r} names registry {host}, but this node is "
            f"configured for {configured}: push to {configured}/<repository>[:tag]"
        )
    client = RegistryClient(
        RegistryConfig(
            registry=config.registry,
            auth_file=config.registry_auth_file,
            ca_file=config.registry_ca,
            insecure=config.registry_insecure,
            timeout=config.registry_timeout,
        )
    )
    digest, size = _file_digest(archive)

    def open_source(offset: int) -> IO[bytes]:
        f = open(archive, "rb")  # noqa: SIM115 (the client closes it)
        f.seek(offset)
        return f

    client.push_blob(repo, digest, size, open_source)
    image_config = json.dumps(_image_config(entry, digest), sort_keys=True).encode()
    config_digest = "sha256:" + hashlib.sha256(image_config).hexdigest()
    client.push_blob(repo, config_digest, len(image_config), lambda off: _bytes(image_config, off))
    manifest = {
        "schemaVersion": 2,
        "mediaType": MEDIA_MANIFEST,
        "config": {"mediaType": MEDIA_CONFIG, "digest": config_digest, "size": len(image_config)},
        "layers": [{"mediaType": MEDIA_LAYER, "digest": digest, "size": size}],
        "annotations": image_annotations(entry),
    }
    return client.put_manifest(
        repo, tag, json.dumps(manifest, sort_keys=True).encode(), MEDIA_MANIFEST
    )


def _image_config(entry: Entry, layer_digest: str) -> dict[str, Any]:
    versions = entry.metadata.get("versions")
    arch = versions.get("arch") if isinstance(versions, Mapping) else None
    goarch = {"x86_64": "amd64", "aarch64": "arm64"}.get(str(arch or os.uname().machine))
    return {
        "architecture": goarch or str(arch or os.uname().machine),
        "os": "linux",
        "created": entry.created,
        "rootfs": {"type": "layers", "diff_ids": [layer_digest]},
        "config": {"Labels": image_annotations(entry)},
    }


def _bytes(data: bytes, offset: int) -> IO[bytes]:
    import io

    return io.BytesIO(data[offset:])


def _file_digest(path: str) -> tuple[str, int]:
    h = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        while block := f.read(1 << 20):
            h.update(block)
            size += len(block)
    return "sha256:" + h.hexdigest(), size
