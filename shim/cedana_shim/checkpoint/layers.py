"""What a checkpoint holds, layer by layer, and where in a container each comes from.

Shared by the pipeline (which writes the layers) and the restore session (which
reads them back): the layer names, their media types, and the container paths
that are not the writable layer's own content.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any

from .store.layout import MEDIA_TYPE_CRIU, MEDIA_TYPE_ROOTFS_DIFF, MEDIA_TYPE_SHM

CRIU_LAYER = "criu"
ROOTFS_LAYER = "rootfs-diff"
SHM_LAYER = "shm"
MEDIA_TYPES = {
    CRIU_LAYER: MEDIA_TYPE_CRIU,
    ROOTFS_LAYER: MEDIA_TYPE_ROOTFS_DIFF,
    SHM_LAYER: MEDIA_TYPE_SHM,
}


def spec_mounts(spec: Mapping[str, Any]) -> list[Mapping[str, Any]]:
    return [m for m in spec.get("mounts") or [] if isinstance(m, Mapping)]


def mount_destinations(spec: Mapping[str, Any]) -> list[str]:
    """Everything mounted over the rootfs: its content is not the layer's to save."""
    destinations = (str(m.get("destination", "")) for m in spec_mounts(spec))
    return sorted({d for d in destinations if d.startswith("/")})


def shm_source(spec: Mapping[str, Any]) -> str | None:
    """The host directory behind the container's /dev/shm when it is a bind mount
    (the CRI shares the sandbox's shm between a pod's containers); CRIU saves a
    tmpfs it mounts itself, but not a bind mount's content."""
    for m in spec_mounts(spec):
        options = m.get("options") or []
        if m.get("destination") == "/dev/shm" and ("bind" in options or "rbind" in options):
            source = m.get("source")
            if isinstance(source, str) and os.path.isdir(source):
                return source
    return None
