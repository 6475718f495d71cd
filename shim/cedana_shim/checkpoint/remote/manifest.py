"""The manifests a checkpoint has in the registry, written and read back strictly.

A checkpoint's manifest there is its store manifest (the same config and layer
descriptors, so the same blobs) plus ``artifactType`` and annotations a generic tool
can read: ``org.opencontainers.image.created``, the ``org.criu.checkpoint.*`` keys that
checkpointctl defines, where the checkpoint's metadata has their value, and ours
(``cedana.ai/checkpoint.id``, ``.scope``, ``.namespace``, ``.label``, ``.node``).

The in-flight marker of a push is a tiny manifest of its own (an empty config, no
layers) under ``<tag>.pending``, whose annotations say who pushes what since when,
and when the pusher last said it is still at it (``cedana.ai/push.heartbeat``: it
puts the marker again every HEARTBEAT_S, heartbeat.py). :meth:`Marker.why_not_live`
says whether a marker stands for a push really in flight.

Everything read from the registry is untrusted: :func:`parse_checkpoint_manifest`
allows only the keys written here, parses with the store's strict parsers and checks
that the manifest is the checkpoint its tag and repository say it is.
"""

from __future__ import annotations

import hashlib
import re
from collections.abc import Mapping
from dataclasses import dataclass
from datetime import datetime, timedelta
from typing import Any, Final

from cedana_shim import errors
from cedana_shim.checkpoint.store.layout import (
    ANN_CREATED,
    ANN_ID,
    ANN_LABEL,
    ANN_SCOPE,
    MEDIA_TYPE_MANIFEST,
    Descriptor,
    Manifest,
    dump_json,
    format_created,
    load_json,
    parse_created,
    parse_descriptor,
    parse_manifest,
)

from .tags import CheckpointTag, encode_label, node_hash

__all__ = [
    "ANN_NAMESPACE",
    "ANN_NODE",
    "ANN_PUSH_HEARTBEAT",
    "ANN_PUSH_STARTED",
    "ARTIFACT_TYPE",
    "CLOCK_SKEW_S",
    "EMPTY_CONFIG",
    "EMPTY_DIGEST",
    "HEARTBEAT_S",
    "MARKER_FRESH_S",
    "PENDING_ARTIFACT_TYPE",
    "Marker",
    "check_node",
    "checkpoint_manifest",
    "marker_manifest",
    "parse_checkpoint_manifest",
    "parse_marker",
]

ARTIFACT_TYPE: Final = "application/vnd.cedana.checkpoint.v1"
PENDING_ARTIFACT_TYPE: Final = "application/vnd.cedana.checkpoint.pending.v1"
ANN_NAMESPACE: Final = "cedana.ai/checkpoint.namespace"
ANN_NODE: Final = "cedana.ai/checkpoint.node"
ANN_PUSH_STARTED: Final = "cedana.ai/push.started"
ANN_PUSH_HEARTBEAT: Final = "cedana.ai/push.heartbeat"
# A pusher puts its marker again this often; one not refreshed for MARKER_FRESH_S lost
# its pusher (or the pusher its registry), and one dated more than CLOCK_SKEW_S ahead
# of this node's clock is not believed. Fresh allows for a put taking a few registry
# timeouts and a clock CLOCK_SKEW_S behind: far shorter than a checkpoint_timeout.
HEARTBEAT_S: Final = 10.0
MARKER_FRESH_S: Final = 60.0
CLOCK_SKEW_S: Final = 30.0
MEDIA_TYPE_EMPTY: Final = "application/vnd.oci.empty.v1+json"
EMPTY_CONFIG: Final = b"{}"
EMPTY_DIGEST: Final = "sha256:" + hashlib.sha256(EMPTY_CONFIG).hexdigest()
_MANIFEST_KEYS: Final = frozenset(
    {"schemaVersion", "mediaType", "artifactType", "config", "layers", "annotations"}
)
# A Kubernetes node name (DNS-1123 subdomain) or a hostname.
_NODE_RE: Final = re.compile(r"[A-Za-z0-9](?:[A-Za-z0-9._-]{0,251}[A-Za-z0-9])?")
# checkpointctl's annotation (org.criu.checkpoint.*) -> where our config has its value.
_CRIU_ANNOTATIONS: Final = (
    ("org.criu.checkpoint.container.name", ("container",)),
    ("org.criu.checkpoint.pod.name", ("pod",)),
    ("org.criu.checkpoint.pod.namespace", ("namespace",)),
    ("org.criu.checkpoint.rootfsImageName", ("image",)),
    ("org.criu.checkpoint.engine.version", ("versions", "shim")),
    ("org.criu.checkpoint.runtime.version", ("versions", "runc")),
    ("org.criu.checkpoint.criu.version", ("versions", "criu")),
    ("org.criu.checkpoint.host.arch", ("versions", "arch")),
    ("org.criu.checkpoint.host.kernel", ("versions", "kernel")),
)
_MAX_ANNOTATION: Final = 1024


def is_node_name(node: object) -> bool:
    return isinstance(node, str) and _NODE_RE.fullmatch(node) is not None


def check_node(node: str) -> str:
    if not is_node_name(node):
        raise errors.InvalidArgument(
            f"node name {node!r} is not a host name: it names who pushed a checkpoint"
        )
    return node


def _metadata_value(metadata: Mapping[str, Any], path: tuple[str, ...]) -> str | None:
    value: Any = metadata
    for key in path:
        if not isinstance(value, Mapping):
            return None
        value = value.get(key)
    if not isinstance(value, str) or not value or len(value) > _MAX_ANNOTATION:
        return None
    return value


def checkpoint_manifest(local: bytes, metadata: Mapping[str, Any], scope: str, node: str) -> bytes:
    """The registry manifest of a checkpoint, from its store manifest and config."""
    document = load_json(local, "the store manifest")
    annotations: dict[str, str] = {"org.criu.checkpoint.engine.name": "cedana-shim"}
    for key, path in _CRIU_ANNOTATIONS:
        value = _metadata_value(metadata, path)
        if value is not None:
            annotations[key] = value
    if "org.criu.checkpoint.runtime.version" in annotations:
        annotations["org.criu.checkpoint.runtime.name"] = "runc"
    annotations.update(document.get("annotations", {}))
    annotations[ANN_NAMESPACE] = scope
    annotations[ANN_NODE] = node
    return dump_json(
        {
            "schemaVersion": 2,
            "mediaType": MEDIA_TYPE_MANIFEST,
            "artifactType": ARTIFACT_TYPE,
            "config": document["config"],
            "layers": document["layers"],
            "annotations": annotations,
        }
    )


def parse_checkpoint_manifest(
    data: bytes, where: str, *, scope: str, tag: CheckpointTag, label: str | None
) -> Manifest:
    """A checkpoint manifest read from the registry, checked against where it was found.

    ``scope``: the namespace of the repository; ``label``: the full label when the
    caller knows it (a hashed tag's label is checked against its hash either way).
    """
    document = load_json(data, where)
    if not isinstance(document, dict):
        raise errors.DataLoss(f"{where}: not a JSON object")
    unknown = sorted(set(document) - _MANIFEST_KEYS)
    if unknown:
        raise errors.DataLoss(f"{where}: unexpected keys {', '.join(unknown[:5])}")
    if document.get("artifactType") != ARTIFACT_TYPE:
        raise errors.DataLoss(
            f"{where}: artifactType is {document.get('artifactType')!r}, not {ARTIFACT_TYPE}"
        )
    manifest = parse_manifest(data, where)
    ann = manifest.annotations
    expected = {ANN_ID: tag.checkpoint_id, ANN_SCOPE: scope, ANN_NAMESPACE: scope}
    for key, value in expected.items():
        if ann.get(key) != value:
            raise errors.DataLoss(
                f"{where}: annotation {key} is {ann.get(key)!r}, but the tag and repository "
                f"say {value!r}: refusing a checkpoint found under another's name"
            )
    found_label = ann.get(ANN_LABEL, "")
    try:
        part = encode_label(found_label)
    except errors.InvalidArgument as err:
        raise errors.DataLoss(f"{where}: annotation {ANN_LABEL}: {err}") from None
    if part != tag.label_part or (label is not None and found_label != label):
        raise errors.DataLoss(
            f"{where}: annotation {ANN_LABEL} is {found_label!r}, which the tag does not name"
        )
    if parse_created(ann.get(ANN_CREATED)) != tag.created:
        raise errors.DataLoss(
            f"{where}: annotation {ANN_CREATED} {ann.get(ANN_CREATED)!r} is not the tag's "
            f"time {tag.created_text}"
        )
    node = ann.get(ANN_NODE, "")
    if not _NODE_RE.fullmatch(node) or node_hash(node) != tag.node_hash:
        raise errors.DataLoss(f"{where}: annotation {ANN_NODE} {node!r} is not the tag's node")
    return manifest


@dataclass(frozen=True)
class Marker:
    """What an in-flight marker says (``created``: its checkpoint's, from the tag)."""

    checkpoint_id: str
    node: str
    started: datetime
    heartbeat: datetime  # the push's start, for a marker of a shim that did not beat
    created: datetime

    def why_not_live(self, now: datetime) -> str:
        """Why this marker stands for no push in flight at ``now``; "" when it does."""
        ahead = max(self.created, self.started, self.heartbeat) - now
        if ahead > timedelta(seconds=CLOCK_SKEW_S):
            return f"dated {ahead.total_seconds():.0f}s in the future"
        silent = (now - self.heartbeat).total_seconds()
        if silent > MARKER_FRESH_S:
            return (
                f"its pusher {self.node} has not refreshed it for {silent:.0f}s "
                "(it died, or failed)"
            )
        return ""


def marker_manifest(
    checkpoint_id: str,
    scope: str,
    label: str,
    node: str,
    started: datetime,
    heartbeat: datetime | None = None,
) -> bytes:
    config = Descriptor(MEDIA_TYPE_EMPTY, EMPTY_DIGEST, len(EMPTY_CONFIG))
    return dump_json(
        {
            "schemaVersion": 2,
            "mediaType": MEDIA_TYPE_MANIFEST,
            "artifactType": PENDING_ARTIFACT_TYPE,
            "config": config.to_json(),
            "layers": [],
            "annotations": {
                ANN_ID: checkpoint_id,
                ANN_NAMESPACE: scope,
                ANN_LABEL: label,
                ANN_NODE: node,
                ANN_PUSH_STARTED: format_created(started),
                ANN_PUSH_HEARTBEAT: format_created(heartbeat or started),
            },
        }
    )


def parse_marker(data: bytes, where: str, tag: CheckpointTag) -> Marker:
    document = load_json(data, where)
    if not isinstance(document, dict) or set(document) - _MANIFEST_KEYS:
        raise errors.DataLoss(f"{where}: not an in-flight marker")
    if document.get("artifactType") != PENDING_ARTIFACT_TYPE:
        raise errors.DataLoss(f"{where}: artifactType {document.get('artifactType')!r}")
    parse_descriptor(document.get("config"), f"{where}: config")
    annotations = document.get("annotations")
    if not isinstance(annotations, dict):
        raise errors.DataLoss(f"{where}: no annotations")
    if annotations.get(ANN_ID) != tag.checkpoint_id:
        raise errors.DataLoss(f"{where}: marker of {annotations.get(ANN_ID)!r}, not its tag's")
    node = annotations.get(ANN_NODE)
    if not isinstance(node, str) or not _NODE_RE.fullmatch(node):
        raise errors.DataLoss(f"{where}: annotation {ANN_NODE} {node!r}")
    started = parse_created(annotations.get(ANN_PUSH_STARTED))
    if started is None:
        raise errors.DataLoss(f"{where}: annotation {ANN_PUSH_STARTED} is not RFC 3339")
    beat = annotations.get(ANN_PUSH_HEARTBEAT)
    heartbeat = started if beat is None else parse_created(beat)
    if heartbeat is None:
        raise errors.DataLoss(f"{where}: annotation {ANN_PUSH_HEARTBEAT} is not RFC 3339")
    return Marker(tag.checkpoint_id, node, started, heartbeat, tag.created)
