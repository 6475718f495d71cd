"""In-flight markers count only while a push is really in flight: its pusher keeps the
marker fresh (a heartbeat, put again every few seconds), removes it when the push ends,
and a marker that stopped being refreshed or is dated in the future delays nobody.
The remote store's real code over a shared directory."""

from __future__ import annotations

import io
import json
import os
import threading
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from cedana_shim.checkpoint.remote import RemoteStore
from cedana_shim.checkpoint.remote.manifest import (
    ANN_PUSH_HEARTBEAT,
    CLOCK_SKEW_S,
    EMPTY_CONFIG,
    EMPTY_DIGEST,
    MARKER_FRESH_S,
    PENDING_ARTIFACT_TYPE,
    marker_manifest,
    parse_marker,
)
from cedana_shim.checkpoint.remote.shared_dir import SharedDirectory
from cedana_shim.checkpoint.remote.tags import PENDING_SUFFIX, parse_tag, tag_for
from cedana_shim.checkpoint.store.layout import MEDIA_TYPE_MANIFEST, format_created
from support.checkpoints import NODE, SCOPE, MiB, commit_checkpoint, open_store

LABEL = "trainer"


def wait_until(predicate: Callable[[], object], what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


@pytest.fixture
def shared(tmp_path: Path) -> SharedDirectory:
    path = tmp_path / "shared"
    path.mkdir(mode=0o700)
    return SharedDirectory(str(path))


def put_marker(
    client: SharedDirectory,
    created: datetime,
    *,
    started: datetime,
    heartbeat: datetime | None,
    suffix: str = "0000abcd",
    scope: str = SCOPE,
    label: str = LABEL,
) -> str:
    """A marker as a pusher writes it (``heartbeat`` None: as a shim that did not beat;
    put it again to beat) for a checkpoint created at ``created``; its checkpoint id."""
    cid = f"{created:%Y%m%dT%H%M%S}Z-{suffix}"
    tag = tag_for(label, format_created(created), cid, NODE)
    repo = client.repository_for(scope)
    client.push_blob(repo, EMPTY_DIGEST, len(EMPTY_CONFIG), lambda _: io.BytesIO(EMPTY_CONFIG))
    marker = marker_manifest(cid, scope, label, NODE, started, heartbeat)
    if heartbeat is None:
        document = json.loads(marker)
        del document["annotations"][ANN_PUSH_HEARTBEAT]
        marker = json.dumps(document).encode()
    client.put_manifest(repo, tag.tag + PENDING_SUFFIX, marker, MEDIA_TYPE_MANIFEST)
    return cid


def _in_flight(remote: RemoteStore, now: datetime | None = None) -> list[str]:
    return [r.checkpoint_id for r in remote.in_flight(SCOPE, LABEL, now=now)]


def test_only_a_marker_its_pusher_keeps_fresh_counts(
    shared: SharedDirectory, tmp_path: Path
) -> None:
    watcher = RemoteStore(open_store(tmp_path / "b"), shared, "node-b")
    now = datetime.now(UTC)
    hour = timedelta(hours=1)
    # A push that failed five minutes ago and left its marker (well within the
    # checkpoint_timeout a start used to wait for: 600 s).
    put_marker(shared, now - 2 * hour, started=now - timedelta(minutes=5),
                heartbeat=now - timedelta(minutes=5), suffix="00000001")  # fmt: skip
    assert _in_flight(watcher) == []
    # A marker dated an hour ahead (its checkpoint, its push, its heartbeat): believed
    # by no one.
    put_marker(shared, now + hour, started=now + hour, heartbeat=now + hour,
                suffix="00000002")  # fmt: skip
    assert _in_flight(watcher) == []
    # A live push, its heartbeat a second old; counted until it stops beating.
    live = put_marker(shared, now - hour, started=now - timedelta(minutes=20),
                       heartbeat=now - timedelta(seconds=1), suffix="00000003")  # fmt: skip
    assert _in_flight(watcher) == [live]
    later = now + timedelta(seconds=MARKER_FRESH_S + 1)
    assert _in_flight(watcher, later) == []
    # A clock a little ahead of ours is forgiven.
    assert _in_flight(watcher, now - timedelta(seconds=CLOCK_SKEW_S - 5)) == [live]


def test_a_marker_of_a_shim_that_did_not_beat_counts_only_just_after_its_start(
    shared: SharedDirectory, tmp_path: Path
) -> None:
    watcher = RemoteStore(open_store(tmp_path / "b"), shared, "node-b")
    now = datetime.now(UTC)
    cid = put_marker(shared, now - timedelta(minutes=1), started=now, heartbeat=None)
    assert _in_flight(watcher) == [cid]
    assert _in_flight(watcher, now + timedelta(seconds=MARKER_FRESH_S + 1)) == []


def _marker_manifests(shared: SharedDirectory) -> list[bytes]:
    blobs = Path(shared.path, shared.repository_for(SCOPE), "blobs", "sha256")
    found = []
    for path in blobs.iterdir():
        if path.stat().st_size < 4096 and PENDING_ARTIFACT_TYPE.encode() in path.read_bytes():
            found.append(path.read_bytes())
    return found


def test_a_push_refreshes_its_marker_and_leaves_none_behind(
    shared: SharedDirectory, tmp_path: Path
) -> None:
    store = open_store(tmp_path / "a", chunk_size=256 << 10)
    entry = commit_checkpoint(store, {"pages-1.img": os.urandom(2 * MiB), "core-1.img": b"c"})
    pusher = RemoteStore(store, shared, NODE)
    pusher.heartbeat_s = 0.05
    watcher = RemoteStore(open_store(tmp_path / "b"), shared, "node-b")
    repo = shared.repository_for(SCOPE)
    tag = tag_for(LABEL, entry.created, entry.id, NODE).tag + PENDING_SUFFIX
    beats: list[datetime] = []
    held = threading.Event()

    def heartbeat() -> datetime:
        data, _, _ = shared.get_manifest(repo, tag)
        parsed = parse_tag(tag)
        assert parsed is not None
        return parse_marker(data, tag, parsed).heartbeat

    def progress(done: int, total: int) -> None:
        if held.is_set():
            return
        held.set()  # the push is held here until its marker has been put again twice
        beats.append(heartbeat())
        wait_until(
            lambda: heartbeat() > beats[0] and len(_marker_manifests(shared)) == 1,
            "a fresher marker, the one before it deleted",
        )
        beats.append(heartbeat())
        assert _in_flight(watcher) == [entry.id]

    pusher.push(entry.id, progress)
    assert len(beats) == 2 and beats[1] > beats[0]
    assert _in_flight(watcher) == []
    # Every marker the beats put is deleted: not one lingers untagged in the registry.
    assert _marker_manifests(shared) == []
    assert not [t for t in shared.list_tags(repo) if t.endswith(PENDING_SUFFIX)]
