"""What the registry holds, as the remote store reports it."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

__all__ = ["RemoteCheckpoint"]


@dataclass(frozen=True)
class RemoteCheckpoint:
    """A checkpoint in the registry: its tag, or the in-flight marker of its push."""

    repository: str  # <prefix>/<namespace>
    tag: str  # the checkpoint's tag (a marker's without ".pending")
    checkpoint_id: str  # the same id as in the pushing node's store
    scope: str  # the namespace
    label: str
    created: str  # RFC 3339 UTC, the checkpoint's own created time
    node: str  # the pushing node's name; "" when only the tag was read (see node_hash)
    complete: bool  # False: a push in flight (its marker)
    node_hash: str = ""  # 8 hex digits of the sha256 of the node's name, from the tag

    @property
    def ref(self) -> str:
        """``<namespace>/<tag>``: what `cedana checkpoints pull` takes."""
        return f"{self.scope}/{self.tag}"

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.checkpoint_id,
            "namespace": self.scope,
            "label": self.label,
            "created": self.created,
            "repository": self.repository,
            "tag": self.tag,
            "ref": self.ref,
            "node": self.node or None,
            "nodeHash": self.node_hash,
            "complete": self.complete,
        }
