"""A pin reaches the registry: no node's registry retention deletes a pinned
checkpoint, and an unpinned one goes by the ordinary rule (real stores, the remote
store's own push and prune, a shared directory standing for the registry)."""

from __future__ import annotations

import os
from datetime import UTC, datetime
from pathlib import Path

from cedana_shim.checkpoint.remote import RemoteStore
from cedana_shim.checkpoint.remote.pins import pinned_bases, set_pin
from cedana_shim.checkpoint.remote.shared_dir import SharedDirectory
from cedana_shim.checkpoint.remote.tags import parse_pin_tag, parse_tag, pin_tag, tag_for
from cedana_shim.checkpoint.store.layout import format_created
from cedana_shim.registry import check_tag
from hypothesis import given
from hypothesis import strategies as st
from support.checkpoints import SCOPE, commit_checkpoint, open_store

labels = st.from_regex(r"[A-Za-z0-9._-]{1,128}", fullmatch=True).filter(lambda s: ".." not in s)
instants = st.datetimes(
    min_value=datetime(2000, 1, 1), max_value=datetime(9999, 1, 1), timezones=st.just(UTC)
)
suffixes = st.from_regex(r"[0-9a-f]{8}", fullmatch=True)
nodes = st.from_regex(r"[a-z0-9]([a-z0-9.-]{0,60}[a-z0-9])?", fullmatch=True)


def _files() -> dict[str, bytes]:
    return {"pages-1.img": os.urandom(64 << 10), "core-1.img": b"core" * 100}


def test_pin_tags_are_the_checkpoint_tags_twin_and_never_a_checkpoint_tag() -> None:
    tag = tag_for("trainer", "2026-12-04T20:00:00.000001Z", "20261204T200000Z-3f9a1c2b", "n")
    pin = pin_tag(tag)
    assert pin.startswith("p.") and len(pin) == len(tag.tag)
    assert parse_pin_tag(pin) == tag and parse_tag(pin) is None
    assert parse_pin_tag(tag.tag) is None and parse_pin_tag(pin + ".pending") is None


def test_no_nodes_retention_deletes_a_checkpoint_pinned_in_the_registry(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o700)
    store_a = open_store(tmp_path / "a")
    node_a = RemoteStore(store_a, SharedDirectory(str(shared)), "node-a")
    node_b = RemoteStore(open_store(tmp_path / "b"), SharedDirectory(str(shared)), "node-b")
    ids = [node_a.push(commit_checkpoint(store_a, _files()).id).checkpoint_id for _ in range(3)]
    assert set_pin(node_a.client, SCOPE, ids[0], True, "node-a")
    assert set_pin(node_a.client, SCOPE, ids[0], True, "node-a"), "pinning again is a no-op"
    assert not set_pin(node_a.client, SCOPE, "20200101T000000Z-00000000", True, "node-a")

    # Another node's retention (it never saw the pin in its own store) keeps it too,
    # and does not count it: the newest unpinned one is kept beside it.
    assert node_b.prune(SCOPE, "trainer", keep=1) == [ids[1]]
    listed = {c.checkpoint_id for c in node_a.candidates(SCOPE, "trainer")}
    assert listed == {ids[0], ids[2]}
    assert node_a.prune(SCOPE, "trainer", keep=0) == [ids[2]]
    assert [c.checkpoint_id for c in node_b.candidates(SCOPE, "trainer")] == [ids[0]]

    assert set_pin(node_b.client, SCOPE, ids[0], False, "node-b")
    assert node_b.prune(SCOPE, "trainer", keep=0) == [ids[0]]
    assert os.listdir(shared / SCOPE / "tags") == []


@given(labels, instants, suffixes, nodes)
def test_every_checkpoint_tag_has_a_valid_pin_tag_that_names_it_back(
    label: str, when: datetime, suffix: str, node: str
) -> None:
    tag = tag_for(label, format_created(when), f"{when:%Y%m%dT%H%M%S}Z-{suffix}", node)
    pin = pin_tag(tag)
    check_tag(pin)
    assert parse_pin_tag(pin) == tag, "the pin names exactly its checkpoint"
    assert parse_tag(pin) is None and parse_pin_tag(tag.tag) is None, "never confused"
    assert pinned_bases([pin, tag.tag, tag.tag + ".pending"]) == {tag.base}
