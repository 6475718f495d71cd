"""Property tests for the store's parsers: whatever is on disk, DataLoss or a valid value."""

from __future__ import annotations

import contextlib
import json
from datetime import UTC, datetime, timedelta
from typing import Any

import pytest
from cedana_shim import errors
from cedana_shim.checkpoint.store import layout
from cedana_shim.checkpoint.store.layout import (
    ANN_CHUNK_FILE,
    ANN_CHUNK_OFFSET,
    ANN_CHUNK_RAW_SIZE,
    ANN_CREATED,
    ANN_ID,
    ANN_LABEL,
    ANN_SCOPE,
    ANN_TITLE,
    MEDIA_TYPE_CONFIG,
    MEDIA_TYPE_CRIU,
    MEDIA_TYPE_MANIFEST,
    CheckpointRef,
    Descriptor,
    Index,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.examples import examples

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers()
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=12), children, max_size=4)
    ),
    max_leaves=20,
)
digests = st.text(alphabet="0123456789abcdef", min_size=64, max_size=64).map(
    lambda h: "sha256:" + h
)
media_types = st.from_regex(r"[a-z][a-z0-9.+-]{0,20}/[a-z][a-z0-9.+-]{0,30}", fullmatch=True)
names = st.from_regex(r"[A-Za-z0-9][A-Za-z0-9._-]{0,20}", fullmatch=True)
scopes = st.text(alphabet=st.characters(blacklist_categories=("Cc", "Cs")), min_size=1, max_size=30)
instants = st.datetimes(
    min_value=datetime(1970, 1, 1), max_value=datetime(9998, 12, 31), timezones=st.just(UTC)
)
ids = st.builds(
    lambda when, suffix: f"{when:%Y%m%dT%H%M%S}Z-{suffix}",
    instants,
    st.text(alphabet="0123456789abcdef", min_size=8, max_size=8),
)
annotation_maps = st.dictionaries(
    st.text(max_size=10).filter(lambda k: not k.startswith("cedana.ai/")),
    st.text(max_size=10),
    max_size=3,
)


def checkpoint_descriptors() -> st.SearchStrategy[Descriptor]:
    return st.builds(
        lambda digest, size, cid, scope, label, when, extra: Descriptor(
            MEDIA_TYPE_MANIFEST,
            digest,
            size,
            {
                **extra,
                ANN_ID: cid,
                ANN_SCOPE: scope,
                ANN_LABEL: label,
                ANN_CREATED: layout.format_created(when),
            },
        ),
        digests,
        st.integers(0, 2**40),
        ids,
        scopes,
        scopes,
        instants,
        annotation_maps,
    )


def foreign_descriptors() -> st.SearchStrategy[Descriptor]:
    return st.builds(Descriptor, media_types, digests, st.integers(0, 2**62), annotation_maps)


def only_data_loss(parse: Any, *args: Any) -> None:
    with contextlib.suppress(errors.DataLoss):
        parse(*args)


@settings(max_examples=examples(300), suppress_health_check=[HealthCheck.too_slow])
@given(json_values)
def test_any_json_document_is_parsed_or_data_loss(value: Any) -> None:
    data = json.dumps(value).encode()
    ref = CheckpointRef(
        "20261129T183000Z-3f9a1c2b",
        "ns",
        "x",
        "2026-11-29T18:30:00Z",
        datetime(2026, 11, 29, 18, 30, tzinfo=UTC),
        Descriptor(MEDIA_TYPE_MANIFEST, "sha256:" + "0" * 64, 1),
        0,
    )
    only_data_loss(layout.parse_index, data, "index.json")
    only_data_loss(layout.parse_manifest, data, "manifest")
    only_data_loss(layout.parse_config, data, "config", ref)
    only_data_loss(layout.parse_descriptor, value, "descriptor")
    only_data_loss(layout.parse_layout_file, data, "oci-layout")


@settings(max_examples=examples(300))
@given(st.binary(max_size=200))
def test_any_bytes_are_parsed_or_data_loss(data: bytes) -> None:
    only_data_loss(layout.parse_index, data, "index.json")
    only_data_loss(layout.parse_manifest, data, "manifest")


@settings(max_examples=examples(200))
@given(
    st.lists(st.one_of(checkpoint_descriptors(), foreign_descriptors()), max_size=6).filter(
        lambda ds: (
            len({d.annotations.get(ANN_ID) for d in ds if ANN_ID in d.annotations})
            == sum(ANN_ID in d.annotations for d in ds)
        )
    )
)
def test_index_round_trips(descriptors: list[Descriptor]) -> None:
    empty = Index((), (), {"annotations": {"keep": "me"}})
    data = layout.dump_json(empty.to_json(descriptors))
    parsed = layout.parse_index(data, "index.json")
    assert list(parsed.descriptors) == descriptors
    assert parsed.extra["annotations"] == {"keep": "me"}
    ours = [d for d in descriptors if ANN_ID in d.annotations]
    assert [r.descriptor for r in parsed.checkpoints] == ours
    for ref in parsed.checkpoints:
        assert ref.scope == ref.descriptor.annotations[ANN_SCOPE]
        assert ref.created_at == layout.parse_created(ref.created)


@settings(max_examples=examples(200))
@given(st.lists(checkpoint_descriptors(), min_size=1, max_size=3), st.data())
def test_any_single_corruption_of_a_valid_index_is_caught_or_harmless(
    descriptors: list[Descriptor], data: st.DataObject
) -> None:
    doc = Index((), ()).to_json(descriptors)
    # Replace one leaf or subtree anywhere in the document with arbitrary JSON.
    node: Any = doc
    path: list[Any] = []
    while isinstance(node, dict | list) and node and data.draw(st.booleans()):
        key = data.draw(st.sampled_from(list(node) if isinstance(node, dict) else range(len(node))))
        path.append(key)
        node = node[key]
    if not path:
        return
    parent: Any = doc
    for key in path[:-1]:
        parent = parent[key]
    parent[path[-1]] = data.draw(json_values)
    try:
        index = layout.parse_index(layout.dump_json(doc), "index.json")
    except errors.DataLoss as err:
        assert "index.json" in str(err)
        return
    for ref in index.checkpoints:  # whatever survives must still be well formed
        assert layout.check_checkpoint_id(ref.id) is None
        assert layout.is_digest(ref.descriptor.digest)
        assert ref.descriptor.size >= 0


@given(instants)
def test_created_round_trips_to_the_microsecond(when: datetime) -> None:
    text = layout.format_created(when)
    assert text.endswith("Z")
    assert layout.parse_created(text) == when


@given(instants, st.integers(-23 * 60, 23 * 60))
def test_created_with_an_offset_names_the_same_instant(when: datetime, minutes: int) -> None:
    sign = "+" if minutes >= 0 else "-"
    local = when + timedelta(minutes=minutes)
    text = f"{local:%Y-%m-%dT%H:%M:%S.%f}{sign}{abs(minutes) // 60:02d}:{abs(minutes) % 60:02d}"
    if local.year > 9999 or local.year < 1:
        return
    assert layout.parse_created(text) == when


@pytest.mark.parametrize(
    "text",
    [
        "",
        "2026-11-29",
        "2026-13-01T00:00:00Z",
        "2026-11-29T18:30:00",
        "2026-02-30T00:00:00Z",
        "2026-11-29T25:00:00Z",
        "2026-11-29T18:30:00+24:00",
        "\uff12\uff10\uff12\uff16-11-29T18:30:00Z",
    ],
)
def test_bad_timestamps_are_rejected(text: str) -> None:
    assert layout.parse_created(text) is None


@given(ids)
def test_generated_ids_are_valid(cid: str) -> None:
    assert layout.check_checkpoint_id(cid) is None


@pytest.mark.parametrize(
    "bad", ["", "../x", "20261129T183000Z-3F9A1C2B", "20261129T183000Z-3f9a1c2", "x" * 25, None, 7]
)
def test_bad_ids_are_rejected(bad: object) -> None:
    assert layout.check_checkpoint_id(bad) is not None


def test_manifest_with_duplicate_layer_names_is_data_loss() -> None:
    layer = {
        "mediaType": "a/b",
        "digest": "sha256:" + "1" * 64,
        "size": 1,
        "annotations": {ANN_TITLE: "criu"},
    }
    doc = {
        "schemaVersion": 2,
        "mediaType": MEDIA_TYPE_MANIFEST,
        "config": {"mediaType": MEDIA_TYPE_CONFIG, "digest": "sha256:" + "2" * 64, "size": 2},
        "layers": [layer, layer],
    }
    with pytest.raises(errors.DataLoss, match="'criu' appears twice"):
        layout.parse_manifest(json.dumps(doc).encode(), "manifest")
    doc["layers"] = [layer]
    assert layout.parse_manifest(json.dumps(doc).encode(), "m").layer_names() == ("criu",)


@pytest.mark.parametrize("constant", [b"NaN", b"Infinity", b"-Infinity"])
def test_non_json_constants_are_data_loss(constant: bytes) -> None:
    with pytest.raises(errors.DataLoss, match="not valid JSON"):
        layout.parse_index(b'{"schemaVersion": 2, "manifests": [], "x": ' + constant + b"}", "i")


# --------------------------------------------------------------------------- chunks


def chunk_json(file: str, offset: int, raw: int, size: int = 10) -> dict[str, Any]:
    return layout.Chunk(file, offset, raw, "sha256:" + "3" * 64, size).descriptor("criu").to_json()


def chunked_manifest(chunks: list[dict[str, Any]]) -> bytes:
    tar = {
        "mediaType": MEDIA_TYPE_CRIU,
        "digest": "sha256:" + "1" * 64,
        "size": 1,
        "annotations": {ANN_TITLE: "criu"},
    }
    doc = {
        "schemaVersion": 2,
        "mediaType": MEDIA_TYPE_MANIFEST,
        "config": {"mediaType": MEDIA_TYPE_CONFIG, "digest": "sha256:" + "2" * 64, "size": 2},
        "layers": [tar, *chunks],
    }
    return json.dumps(doc).encode()


def test_a_manifest_with_chunks_parses_them_per_layer() -> None:
    manifest = layout.parse_manifest(
        chunked_manifest(
            [
                chunk_json("pages-1.img", 0, 100),
                chunk_json("pages-1.img", 100, 50),
                chunk_json("pages-2.img", 0, 7),
            ]
        ),
        "m",
    )
    assert manifest.layer_names() == ("criu",)
    digest = "sha256:" + "3" * 64
    assert manifest.chunks == {
        "criu": (
            layout.Chunk("pages-1.img", 0, 100, digest, 10),
            layout.Chunk("pages-1.img", 100, 50, digest, 10),
            layout.Chunk("pages-2.img", 0, 7, digest, 10),
        )
    }


def with_annotation(chunk: dict[str, Any], key: str, value: str | None) -> dict[str, Any]:
    annotations = dict(chunk["annotations"])
    if value is None:
        del annotations[key]
    else:
        annotations[key] = value
    return {**chunk, "annotations": annotations}


@pytest.mark.parametrize(
    ("chunks", "why"),
    [
        ([chunk_json("pages-1.img", 100, 50)], "expected one at 0"),
        (
            [chunk_json("pages-1.img", 0, 100), chunk_json("pages-1.img", 90, 50)],
            "chunk of pages-1.img at offset 90, expected one at 100",
        ),
        (
            [chunk_json("pages-1.img", 0, 100), chunk_json("pages-1.img", 200, 50)],
            "a chunk is missing or out of order",
        ),
        (
            [
                chunk_json("pages-1.img", 0, 100),
                chunk_json("pages-2.img", 0, 1),
                chunk_json("pages-1.img", 100, 1),
            ],
            "the chunks of pages-1.img are not together",
        ),
        ([chunk_json("core-1.img", 0, 100)], "'core-1.img' is not a page image name"),
        ([chunk_json("../pages-1.img", 0, 100)], "is not a page image name"),
        ([chunk_json("pages-1.img", 0, 0)], "claims 0 bytes"),
        ([chunk_json("pages-1.img", 0, (256 << 20) + 1)], "1..268435456 allowed"),
        ([chunk_json("pages-1.img", 0, 100, size=0)], "impossible for 100 bytes compressed"),
        ([chunk_json("pages-1.img", 0, 100, size=1 << 20)], "1048576 bytes stored, impossible"),
        (
            [with_annotation(chunk_json("pages-1.img", 0, 1), ANN_CHUNK_OFFSET, "00")],
            "'00' is not a decimal size",
        ),
        (
            [with_annotation(chunk_json("pages-1.img", 0, 1), ANN_CHUNK_RAW_SIZE, "-1")],
            "'-1' is not a decimal size",
        ),
        (
            [with_annotation(chunk_json("pages-1.img", 0, 1), ANN_CHUNK_FILE, None)],
            "None is not a page image name",
        ),
        (
            [with_annotation(chunk_json("pages-1.img", 0, 1), ANN_TITLE, "rootfs-diff")],
            "a chunk of layer 'rootfs-diff' that does not follow that layer's descriptor",
        ),
        (
            [with_annotation(chunk_json("pages-1.img", 0, 1), ANN_CHUNK_OFFSET, "9" * 19)],
            "out of range",
        ),
    ],
)
def test_bad_chunk_descriptors_are_data_loss(chunks: list[dict[str, Any]], why: str) -> None:
    with pytest.raises(errors.DataLoss) as info:
        layout.parse_manifest(chunked_manifest(chunks), "manifest m")
    assert str(info.value).startswith("manifest m: ")
    assert why in str(info.value)


def test_a_chunk_before_any_layer_is_data_loss() -> None:
    doc = json.loads(chunked_manifest([]))
    doc["layers"] = [chunk_json("pages-1.img", 0, 1)]
    with pytest.raises(errors.DataLoss, match="does not follow that layer's descriptor"):
        layout.parse_manifest(json.dumps(doc).encode(), "m")


def test_split_files_must_be_exactly_what_the_chunks_hold() -> None:
    digest = "sha256:" + "3" * 64
    chunks = [
        layout.Chunk("pages-1.img", 0, 100, digest, 9),
        layout.Chunk("pages-1.img", 100, 5, digest, 9),
    ]
    files = [
        layout.SplitFile("pages-1.img", 105, 0o600, 0),
        layout.SplitFile("pages-2.img", 0, 0o600, 0),
    ]
    layout.match_split_files(chunks, files, "w")
    with pytest.raises(
        errors.DataLoss, match=r"w: the chunks of pages-1\.img hold 100 bytes, the config says 105"
    ):
        layout.match_split_files(chunks[:1], files, "w")
    with pytest.raises(errors.DataLoss, match=r"w: the manifest has chunks of pages-1\.img"):
        layout.match_split_files(chunks, files[1:], "w")


@pytest.mark.parametrize(
    ("split_files", "why"),
    [
        ("x", "split_files: expected a list"),
        ([{"path": "core.img", "size": 1, "mode": 0, "mtime": 0}], "is not a page image name"),
        ([{"path": "pages-1.img", "size": -1, "mode": 0, "mtime": 0}], "size: expected a size"),
        ([{"path": "pages-1.img", "size": 1, "mode": 0o10000, "mtime": 0}], "mode: expected"),
        ([{"path": "pages-1.img", "size": 1, "mode": 0, "mtime": "0"}], "mtime: expected"),
        (
            [{"path": "pages-1.img", "size": 1, "mode": 0, "mtime": 0}] * 2,
            "pages-1.img is listed twice",
        ),
    ],
)
def test_bad_split_files_in_a_config_are_data_loss(split_files: Any, why: str) -> None:
    ref = CheckpointRef(
        "20261129T183000Z-3f9a1c2b",
        "ns",
        "x",
        "2026-11-29T18:30:00Z",
        datetime(2026, 11, 29, 18, 30, tzinfo=UTC),
        Descriptor(MEDIA_TYPE_MANIFEST, "sha256:" + "0" * 64, 1),
        0,
    )
    config = {
        "id": ref.id,
        "scope": "ns",
        "label": "x",
        "created": ref.created,
        "sizes": {"raw": 1, "stored": 1},
        "layers": [
            {
                "name": "criu",
                "media_type": MEDIA_TYPE_CRIU,
                "digest": "sha256:" + "1" * 64,
                "size": 1,
                "raw_size": 1,
                "split_files": split_files,
            }
        ],
    }
    with pytest.raises(errors.DataLoss) as info:
        layout.parse_config(json.dumps(config).encode(), "config c", ref)
    assert str(info.value).startswith("config c: layers[0]: split_files")
    assert why in str(info.value)
