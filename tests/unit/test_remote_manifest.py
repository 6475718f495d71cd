"""Manifests read from the registry are untrusted: anything but a checkpoint manifest
of the tag and repository it was found under is DataLoss."""

from __future__ import annotations

import json
from collections.abc import Callable
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from cedana_shim.checkpoint.remote.manifest import (
    ARTIFACT_TYPE,
    checkpoint_manifest,
    marker_manifest,
    parse_checkpoint_manifest,
    parse_marker,
)
from cedana_shim.checkpoint.remote.tags import CheckpointTag, parse_tag, tag_for
from cedana_shim.checkpoint.store import Entry, Store
from cedana_shim.errors import DataLoss
from store_support import make_store, stage

NODE = "node-a"


@pytest.fixture
def checkpoint(tmp_path: Path) -> tuple[Store, Entry]:
    store = make_store(tmp_path, chunk_size=4096)
    entry = store.commit(stage(store, "trainer", scope="team-a"))
    return store, entry


def _manifest(store: Store, entry: Entry) -> tuple[dict[str, Any], CheckpointTag]:
    data = checkpoint_manifest(
        store.adopter.checkpoint_manifest(entry), entry.metadata, "team-a", NODE
    )
    return json.loads(data), tag_for(entry.label, entry.created, entry.id, NODE)


def _parse(document: dict[str, Any], tag: CheckpointTag, scope: str = "team-a") -> None:
    parse_checkpoint_manifest(
        json.dumps(document).encode(), "test", scope=scope, tag=tag, label=None
    )


def test_the_registry_manifest_is_the_store_manifest_plus_annotations(
    checkpoint: tuple[Store, Entry],
) -> None:
    store, entry = checkpoint
    document, tag = _manifest(store, entry)
    local = json.loads(store.adopter.checkpoint_manifest(entry))
    assert document["config"] == local["config"] and document["layers"] == local["layers"]
    assert document["artifactType"] == ARTIFACT_TYPE
    ann = document["annotations"]
    assert ann["cedana.ai/checkpoint.id"] == entry.id
    assert ann["cedana.ai/checkpoint.namespace"] == "team-a"
    assert ann["cedana.ai/checkpoint.node"] == NODE
    assert ann["org.criu.checkpoint.container.name"] == "c1"
    assert ann["org.criu.checkpoint.engine.name"] == "cedana-shim"
    _parse(document, tag)


def _set(path: tuple[str, ...], value: Any) -> Callable[[dict[str, Any]], None]:
    def edit(document: dict[str, Any]) -> None:
        target = document
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value

    return edit


@pytest.mark.parametrize(
    ("edit", "why"),
    [
        (_set(("artifactType",), "application/x"), "artifactType"),
        (
            _set(("subject",), {"mediaType": "a/b", "digest": "sha256:" + "0" * 64, "size": 1}),
            "unexpected keys",
        ),
        (
            _set(("annotations", "cedana.ai/checkpoint.id"), "20200101T000000Z-00000000"),
            "another's name",
        ),
        (_set(("annotations", "cedana.ai/checkpoint.scope"), "team-b"), "another's name"),
        (_set(("annotations", "cedana.ai/checkpoint.label"), "other"), "does not name"),
        (_set(("annotations", "cedana.ai/checkpoint.label"), "a/b"), "checkpoint label"),
        (
            _set(("annotations", "org.opencontainers.image.created"), "2001-01-01T00:00:00Z"),
            "not the tag's time",
        ),
        (_set(("annotations", "cedana.ai/checkpoint.node"), "node-b"), "not the tag's node"),
        (_set(("annotations", "cedana.ai/checkpoint.node"), "\x00"), "not the tag's node"),
        (_set(("annotations", "cedana.ai/checkpoint.node"), 7), "not a string"),
        (_set(("layers",), "none"), "not a list"),
        (_set(("config", "size"), -1), "size"),
    ],
)
def test_a_manifest_that_lies_is_refused(
    checkpoint: tuple[Store, Entry], edit: Callable[[dict[str, Any]], None], why: str
) -> None:
    document, tag = _manifest(*checkpoint)
    edit(document)
    with pytest.raises(DataLoss, match=why):
        _parse(document, tag)


def test_a_manifest_found_in_another_namespace_is_refused(
    checkpoint: tuple[Store, Entry],
) -> None:
    document, tag = _manifest(*checkpoint)
    with pytest.raises(DataLoss, match="another's name"):
        _parse(document, tag, scope="team-b")


def test_the_full_label_is_checked_when_the_caller_knows_it(
    checkpoint: tuple[Store, Entry],
) -> None:
    document, tag = _manifest(*checkpoint)
    with pytest.raises(DataLoss, match="does not name"):
        parse_checkpoint_manifest(
            json.dumps(document).encode(), "t", scope="team-a", tag=tag, label="other"
        )


@pytest.mark.parametrize("data", [b"", b"[]", b"{", b'{"a":1,"a":2}', b"\xff"])
def test_garbage_is_not_a_manifest(checkpoint: tuple[Store, Entry], data: bytes) -> None:
    _, tag = _manifest(*checkpoint)
    with pytest.raises(DataLoss):
        parse_checkpoint_manifest(data, "t", scope="team-a", tag=tag, label=None)


def test_a_marker_says_who_pushes_since_when() -> None:
    tag = parse_tag("c.app.20261129T183000000001Z.3f9a1c2b.00000000.pending")
    assert tag is not None
    started = datetime(2026, 11, 29, 18, 31, tzinfo=UTC)
    data = marker_manifest(tag.checkpoint_id, "team-a", "app", NODE, started)
    marker = parse_marker(data, "t", tag)
    assert (marker.checkpoint_id, marker.node, marker.started) == (
        tag.checkpoint_id,
        NODE,
        started,
    )
    other = parse_tag("c.app.20261129T183000000001Z.00000000.00000000.pending")
    assert other is not None
    with pytest.raises(DataLoss, match="not its tag's"):
        parse_marker(data, "t", other)
    document = json.loads(data)
    document["annotations"]["cedana.ai/push.started"] = "yesterday"
    with pytest.raises(DataLoss, match="RFC 3339"):
        parse_marker(json.dumps(document).encode(), "t", tag)
