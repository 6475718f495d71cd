"""The archive's JSON files: written from a checkpoint's metadata, read from an archive.

What the engines write and what ``checkpointctl`` reads: ``config.dump`` is checkpointctl's
``ContainerConfig`` (id, name, rootfsImage/Ref/Name, runtime, created/checkpointed times);
``spec.dump`` an OCI spec whose annotations tell the engine and name the container, pod and
namespace (containerd's ``io.kubernetes.cri.*``; CRI-O's ``io.kubernetes.cri-o.*``, with
``io.kubernetes.cri-o.Annotations`` and ``…Metadata`` as JSON strings); ``status.dump``
the CRI ContainerStatus. The store keeps no container spec, so an export's ``spec.dump``
carries what the metadata knows: the annotations, the terminal flag and the mount
destinations. Read back, every field is checked before it reaches the metadata.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Final

from cedana_shim import __version__, errors, untrusted_json

from ..store.model import Entry

__all__ = [
    "CONFIG_DUMP",
    "MAX_DOCUMENT_BYTES",
    "SPEC_DUMP",
    "STATUS_DUMP",
    "ArchiveFacts",
    "config_dump",
    "read_facts",
    "spec_dump",
    "status_dump",
]

CONFIG_DUMP: Final = "config.dump"
SPEC_DUMP: Final = "spec.dump"
STATUS_DUMP: Final = "status.dump"
MAX_DOCUMENT_BYTES: Final = 4 << 20
RUNTIME_TYPE: Final = "io.containerd.cedana.v2"

# containerd's CRI annotations (checkpointctl reads the containerd engine from these).
CRI_CONTAINER_NAME: Final = "io.kubernetes.cri.container-name"
CRI_CONTAINER_TYPE: Final = "io.kubernetes.cri.container-type"
CRI_IMAGE_NAME: Final = "io.kubernetes.cri.image-name"
CRI_SANDBOX_NAME: Final = "io.kubernetes.cri.sandbox-name"
CRI_SANDBOX_NAMESPACE: Final = "io.kubernetes.cri.sandbox-namespace"
# CRI-O's: its readers take the container's metadata and annotations from these two.
CRIO_ANNOTATIONS: Final = "io.kubernetes.cri-o.Annotations"
CRIO_METADATA: Final = "io.kubernetes.cri-o.Metadata"
CRIO_MANAGER: Final = "io.container.manager"
POD_NAME: Final = "io.kubernetes.pod.name"
POD_NAMESPACE: Final = "io.kubernetes.pod.namespace"
# Ours: where an export came from.
CEDANA_ID: Final = "io.cedana.checkpoint.id"
CEDANA_LABEL: Final = "io.cedana.checkpoint.label"
CEDANA_NAMESPACE: Final = "io.cedana.checkpoint.namespace"

# Go's zero time: what the engines write for a time they do not know.
_ZERO_TIME: Final = "0001-01-01T00:00:00Z"
_MAX_TEXT: Final = 1024
_IMAGE_DIGEST: Final = re.compile(r"@(sha256:[0-9a-f]{64})$")
_CONTROL: Final = re.compile(r"[\x00-\x1f\x7f]")


def _go_time(created: str) -> str:
    """A store timestamp (RFC 3339) as Go's time.Time marshals it."""
    try:
        when = datetime.fromisoformat(created.replace("Z", "+00:00"))
    except ValueError:
        return _ZERO_TIME
    return when.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def _text(meta: Mapping[str, Any], key: str) -> str:
    value = meta.get(key)
    return value if isinstance(value, str) else ""


def config_dump(entry: Entry) -> dict[str, Any]:
    meta = entry.metadata
    image = _text(meta, "image")
    return {
        "id": _text(meta, "containerId") or entry.id,
        "name": _text(meta, "container") or _text(meta, "containerId") or entry.label,
        "rootfsImage": image,
        "rootfsImageRef": _text(meta, "imageDigest"),
        "rootfsImageName": image,
        "runtime": RUNTIME_TYPE,
        # The store does not record when the container was made.
        "createdTime": _ZERO_TIME,
        "checkpointedTime": _go_time(entry.created),
        "restoredTime": _ZERO_TIME,
        "restored": False,
    }


def spec_dump(entry: Entry) -> dict[str, Any]:
    meta = entry.metadata
    container = _text(meta, "container") or _text(meta, "containerId")
    pod = _text(meta, "pod")
    annotations = {
        CRI_CONTAINER_NAME: container,
        CRI_CONTAINER_TYPE: "container",
        CRI_IMAGE_NAME: _text(meta, "image"),
        CRI_SANDBOX_NAME: pod,
        CRI_SANDBOX_NAMESPACE: entry.scope,
        POD_NAME: pod,
        POD_NAMESPACE: entry.scope,
        CEDANA_ID: entry.id,
        CEDANA_LABEL: entry.label,
        CEDANA_NAMESPACE: entry.scope,
    }
    annotations[CRIO_METADATA] = json.dumps({"name": container})
    annotations[CRIO_ANNOTATIONS] = json.dumps(dict(annotations), sort_keys=True)
    mounts = meta.get("mounts")
    destinations = mounts if isinstance(mounts, list) else []
    return {
        "ociVersion": "1.0.2",
        "process": {"terminal": bool(meta.get("terminal"))},
        "mounts": [{"destination": d} for d in destinations if isinstance(d, str)],
        "annotations": annotations,
    }


def status_dump(entry: Entry) -> dict[str, Any]:
    """The CRI ContainerStatus (protobuf JSON names, as containerd writes it)."""
    meta = entry.metadata
    return {
        "id": _text(meta, "containerId") or entry.id,
        "metadata": {"name": _text(meta, "container") or _text(meta, "containerId")},
        "state": 1,  # CONTAINER_RUNNING: what was checkpointed
        "image": {"image": _text(meta, "image")},
        "image_ref": _text(meta, "imageDigest"),
        "annotations": {"io.cedana.checkpoint.engine-version": __version__},
    }


@dataclass
class ArchiveFacts:
    """What an archive's documents say about the checkpointed container, checked."""

    engine: str = ""
    container_id: str = ""
    container: str = ""
    pod: str = ""
    namespace: str = ""
    image: str = ""
    image_digest: str = ""
    terminal: bool = False
    mounts: list[str] = field(default_factory=list)

    def metadata(self) -> dict[str, Any]:
        """The fields of a stored checkpoint's metadata these facts fill."""
        return {
            "containerId": self.container_id,
            "pod": self.pod,
            "container": self.container,
            "image": self.image,
            "imageDigest": self.image_digest,
            "terminal": self.terminal,
            "mounts": self.mounts,
        }


def _document(data: bytes, name: str, archive: str) -> dict[str, Any]:
    try:
        doc = untrusted_json.loads(data)
    except (ValueError, UnicodeDecodeError) as err:
        raise errors.InvalidArgument(f"{archive}: {name} is not JSON ({err})") from None
    if not isinstance(doc, dict):
        raise errors.InvalidArgument(f"{archive}: {name} is not a JSON object")
    return doc


def _field(doc: Mapping[str, Any], key: str, name: str, archive: str) -> str:
    value = doc.get(key, "")
    if value is None:
        return ""
    if not isinstance(value, str) or len(value) > _MAX_TEXT or _CONTROL.search(value):
        raise errors.InvalidArgument(
            f"{archive}: {name} field {key!r} is not a short single-line string"
        )
    return value


def read_facts(config: bytes, spec: bytes, archive: str) -> ArchiveFacts:
    """The checked facts of ``config.dump`` and ``spec.dump``."""
    conf = _document(config, CONFIG_DUMP, archive)
    doc = _document(spec, SPEC_DUMP, archive)
    annotations = doc.get("annotations") or {}
    if not isinstance(annotations, dict):
        raise errors.InvalidArgument(f"{archive}: {SPEC_DUMP} annotations are not an object")
    facts = ArchiveFacts()
    facts.container_id = _field(conf, "id", CONFIG_DUMP, archive)
    facts.image = _field(conf, "rootfsImageName", CONFIG_DUMP, archive) or _field(
        conf, "rootfsImage", CONFIG_DUMP, archive
    )
    ref = _field(conf, "rootfsImageRef", CONFIG_DUMP, archive)
    # A manifest digest (name@sha256:…) is what a node compares; an image id is not.
    m = _IMAGE_DIGEST.search(ref)
    facts.image_digest = m.group(1) if m else ""
    manager = _field(annotations, CRIO_MANAGER, SPEC_DUMP, archive)
    if manager == "cri-o":
        facts.engine = "CRI-O"
        facts.pod = _field(annotations, POD_NAME, SPEC_DUMP, archive)
        facts.namespace = _field(annotations, POD_NAMESPACE, SPEC_DUMP, archive)
        raw = _field(annotations, CRIO_METADATA, SPEC_DUMP, archive)
        meta = _document(raw.encode(), CRIO_METADATA, archive) if raw else {}
        facts.container = _field(meta, "name", CRIO_METADATA, archive)
    else:
        facts.engine = "Podman" if manager == "libpod" else "containerd"
        facts.container = _field(annotations, CRI_CONTAINER_NAME, SPEC_DUMP, archive)
        facts.pod = _field(annotations, CRI_SANDBOX_NAME, SPEC_DUMP, archive)
        facts.namespace = _field(annotations, CRI_SANDBOX_NAMESPACE, SPEC_DUMP, archive)
    if _field(annotations, CEDANA_ID, SPEC_DUMP, archive):
        facts.engine = "cedana"
    process = doc.get("process") or {}
    facts.terminal = isinstance(process, dict) and process.get("terminal") is True
    mounts = doc.get("mounts") or []
    if not isinstance(mounts, list):
        raise errors.InvalidArgument(f"{archive}: {SPEC_DUMP} mounts are not a list")
    for mount in mounts[:4096]:
        if isinstance(mount, dict):
            destination = _field(mount, "destination", SPEC_DUMP, archive)
            if destination.startswith("/"):
                facts.mounts.append(destination)
    return facts
