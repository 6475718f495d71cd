"""Pins in the registry: a checkpoint pinned on a node is kept by every node's retention.

A node's pin (store/maintenance.py) exempts a checkpoint from that node's own
retention; the registry's retention runs on whichever node synced last
(``RemoteStore.prune``), so the pin must be in the registry too. It is a tag beside
the checkpoint's: ``p.`` + the checkpoint's tag without ``c.`` (tags.pin_tag),
naming a manifest of its own (the empty config, no layers, annotations saying what
it pins and who). A manifest of its own because a registry deletes by digest: a
second tag on the checkpoint's manifest could not be removed without removing the
checkpoint. Retention reads the tag list it reads anyway and keeps every checkpoint
a pin tag names, whichever node runs it; unpinning deletes the pin's manifest. A
registry that refuses deletes keeps the pin (logged): unpin there by hand.
"""

from __future__ import annotations

import io
import logging
from collections.abc import Iterable
from typing import IO, Final

from cedana_shim import errors
from cedana_shim.checkpoint.store.layout import ANN_ID, MEDIA_TYPE_MANIFEST, dump_json
from cedana_shim.registry import Registry
from cedana_shim.registry.push import OpenSource

from .manifest import EMPTY_CONFIG, EMPTY_DIGEST, MEDIA_TYPE_EMPTY
from .tags import CheckpointTag, parse_pin_tag, parse_tag, pin_tag

__all__ = ["PIN_ARTIFACT_TYPE", "pin_manifest", "pinned_bases", "set_pin"]

PIN_ARTIFACT_TYPE: Final = "application/vnd.cedana.checkpoint.pin.v1"
ANN_PIN_OF: Final = "cedana.ai/pin.of"
ANN_PINNED_BY: Final = "cedana.ai/pin.node"

log = logging.getLogger(__name__)


def pin_manifest(tag: CheckpointTag, node: str) -> bytes:
    """The manifest a pin tag names (distinct per checkpoint: it names the tag)."""
    return dump_json(
        {
            "schemaVersion": 2,
            "mediaType": MEDIA_TYPE_MANIFEST,
            "artifactType": PIN_ARTIFACT_TYPE,
            "config": {
                "mediaType": MEDIA_TYPE_EMPTY,
                "digest": EMPTY_DIGEST,
                "size": len(EMPTY_CONFIG),
            },
            "layers": [],
            "annotations": {ANN_ID: tag.checkpoint_id, ANN_PIN_OF: tag.base, ANN_PINNED_BY: node},
        }
    )


def pinned_bases(names: Iterable[str]) -> set[str]:
    """The checkpoint tags (bases) that the pin tags among ``names`` pin."""
    return {p.base for p in map(parse_pin_tag, names) if p is not None}


def set_pin(client: Registry, scope: str, checkpoint_id: str, pinned: bool, node: str) -> bool:
    """Pin the checkpoint in the registry, or end that; False when the registry does
    not hold it (nothing to pin there). Idempotent. A registry that refuses deletes
    raises FailedPrecondition on unpin."""
    repo = client.repository_for(scope)
    try:
        names = list(client.list_tags(repo))
    except errors.NotFound:
        return False
    tags = [t for t in map(parse_tag, names) if t is not None and not t.pending]
    found = [t for t in tags if t.checkpoint_id == checkpoint_id]
    if not found:
        return False
    for tag in found:  # one per pushing node's hash; all of them are this checkpoint
        name = pin_tag(tag)
        if pinned:
            client.push_blob(repo, EMPTY_DIGEST, len(EMPTY_CONFIG), _bytes(EMPTY_CONFIG))
            client.put_manifest(repo, name, pin_manifest(tag, node), MEDIA_TYPE_MANIFEST)
        elif name in names:
            _, _, digest = client.get_manifest(repo, name)
            if not client.delete_manifest(repo, digest):
                raise errors.FailedPrecondition(
                    f"registry {client.host} refuses deletes: the pin {repo}:{name} stays "
                    "(delete it with the registry's own tools)"
                )
    return True


def _bytes(data: bytes) -> OpenSource:
    def open_at(offset: int) -> IO[bytes]:
        stream = io.BytesIO(data)
        stream.seek(offset)
        return stream

    return open_at
