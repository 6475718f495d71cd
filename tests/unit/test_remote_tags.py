"""Checkpoint tags in the registry: injective, sortable, always valid tags; hostile
tags are not mistaken for checkpoints."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from cedana_shim.checkpoint.remote.tags import (
    MAX_DIRECT_LABEL,
    PENDING_SUFFIX,
    encode_label,
    node_hash,
    parse_tag,
    tag_for,
)
from cedana_shim.checkpoint.store.layout import format_created
from cedana_shim.errors import InvalidArgument
from cedana_shim.registry import check_tag
from hypothesis import assume, given
from hypothesis import strategies as st

labels = st.from_regex(r"[A-Za-z0-9._-]{1,128}", fullmatch=True).filter(lambda s: ".." not in s)
instants = st.datetimes(
    min_value=datetime(2000, 1, 1), max_value=datetime(9999, 1, 1), timezones=st.just(UTC)
)
suffixes = st.from_regex(r"[0-9a-f]{8}", fullmatch=True)
nodes = st.from_regex(r"[a-z0-9]([a-z0-9.-]{0,60}[a-z0-9])?", fullmatch=True)


def _tag(label: str, when: datetime, suffix: str, node: str) -> str:
    return tag_for(label, format_created(when), f"{when:%Y%m%dT%H%M%S}Z-{suffix}", node).tag


@given(labels, instants, suffixes, nodes)
def test_every_tag_is_a_valid_tag_with_room_for_its_marker(
    label: str, when: datetime, suffix: str, node: str
) -> None:
    tag = _tag(label, when, suffix, node)
    check_tag(tag)
    check_tag(tag + PENDING_SUFFIX)
    parsed = parse_tag(tag)
    assert parsed is not None and not parsed.pending
    assert parsed.checkpoint_id == f"{when:%Y%m%dT%H%M%S}Z-{suffix}"
    assert parsed.created == when and parsed.created_text == format_created(when)
    assert parsed.node_hash == node_hash(node)
    assert parsed.label == (label if len(label) <= MAX_DIRECT_LABEL else None)
    marker = parse_tag(tag + PENDING_SUFFIX)
    assert marker is not None and marker.pending and marker.base == tag


@given(labels, labels)
def test_distinct_labels_get_distinct_label_parts(a: str, b: str) -> None:
    assume(a != b)
    assert encode_label(a) != encode_label(b)


@given(labels, instants, instants, suffixes, suffixes, nodes)
def test_within_a_label_tags_sort_as_their_checkpoints_were_created(
    label: str, t1: datetime, t2: datetime, s1: str, s2: str, node: str
) -> None:
    assume(t1 < t2)
    assert _tag(label, t1, s1, node) < _tag(label, t2, s2, node)


def test_a_long_label_is_hashed_and_a_short_one_kept() -> None:
    assert encode_label("trainer") == "trainer"
    long = "a" * 128
    part = encode_label(long)
    assert len(part) == MAX_DIRECT_LABEL and ".." in part and part.startswith("a" * 51)
    assert encode_label("a" * 127 + "b") != part


@pytest.mark.parametrize("label", ["", "a/b", "a..b", "a b", "x" * 129, "é"])
def test_a_label_no_container_could_have_is_refused(label: str) -> None:
    with pytest.raises(InvalidArgument, match="checkpoint label"):
        encode_label(label)


def test_an_id_that_does_not_start_with_its_created_time_cannot_be_tagged() -> None:
    with pytest.raises(InvalidArgument, match="does not start with its created time"):
        tag_for("app", "2026-11-29T18:30:00.000001Z", "20261129T183001Z-3f9a1c2b", "n")


@pytest.mark.parametrize(
    "tag",
    [
        "latest",
        "v1.0",
        "c.app",
        "c.app.20261129T183000123456Z.3f9a1c2b",  # no node hash
        "c.app.20261129T183000123456Z.3F9A1C2B.00000000",  # upper-case hex
        "c.app.20261399T183000123456Z.3f9a1c2b.00000000",  # month 13
        "c.app.20261129T253000123456Z.3f9a1c2b.00000000",  # hour 25
        "c.a..b.20261129T183000123456Z.3f9a1c2b.00000000",  # '..' but not a hash
        "c." + "a" * 78 + ".20261129T183000123456Z.3f9a1c2b.00000000",  # too long to be direct
        "c." + "a" * 49 + "..b" + "0" * 23 + ".20261129T183000123456Z.3f9a1c2b.00000000",
        "c.app.20261129T183000123456Z.3f9a1c2b.00000000.pending.pending",
        "c.app.20261129T183000123456Z.3f9a1c2b.00000000.done",
        "C.app.20261129T183000123456Z.3f9a1c2b.00000000",
    ],
)
def test_tags_that_are_not_checkpoint_tags_are_not_parsed(tag: str) -> None:
    assert parse_tag(tag) is None


def test_the_checkpoint_id_comes_from_the_tag() -> None:
    when = datetime(2026, 11, 29, 18, 30, tzinfo=UTC) + timedelta(microseconds=5)
    tag = parse_tag(_tag("web", when, "00c0ffee", "node-1"))
    assert tag is not None
    assert tag.checkpoint_id == "20261129T183000Z-00c0ffee"
    assert tag.created_text == "2026-11-29T18:30:00.000005Z"
