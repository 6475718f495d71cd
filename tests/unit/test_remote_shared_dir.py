"""A shared directory as the remote checkpoint store: real stores, real checkpoints,
the remote store's own push/list/pull/prune code, a directory standing for the
filesystem every node mounts (two stores standing for two nodes)."""

from __future__ import annotations

import filecmp
import hashlib
import io
import json
import os
import shutil
import stat
import time
from pathlib import Path
from typing import IO, Any

import pytest
from cedana_shim.checkpoint.remote import Outbox, RemoteCheckpoint, RemoteStore, sync
from cedana_shim.checkpoint.remote.shared_dir import STALE_UPLOAD_S, SharedDirectory
from cedana_shim.checkpoint.store import Store
from cedana_shim.checkpoint.store.layout import MEDIA_TYPE_MANIFEST
from cedana_shim.config import NodeConfig
from cedana_shim.errors import (
    DataLoss,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    PermissionDenied,
)
from cedana_shim.registry import PushResult
from support.checkpoints import NODE, SCOPE, MiB, commit_checkpoint, open_store, staging_dirs

PAGES = 4 * MiB


class CountingDirectory(SharedDirectory):
    def __init__(self, path: str) -> None:
        super().__init__(path)
        self.pushes: list[PushResult] = []
        self.pulled: list[str] = []

    def push_blob(self, *args: Any, **kw: Any) -> PushResult:
        result = super().push_blob(*args, **kw)
        self.pushes.append(result)
        return result

    def pull_blob(self, repo: str, digest: str, *args: Any, **kw: Any) -> None:
        self.pulled.append(digest)
        super().pull_blob(repo, digest, *args, **kw)

    @property
    def sent(self) -> int:
        return sum(p.sent for p in self.pushes)


@pytest.fixture
def shared(tmp_path: Path) -> Path:
    path = tmp_path / "shared"
    path.mkdir(mode=0o700)
    return path


@pytest.fixture
def store(tmp_path: Path) -> Store:
    return open_store(tmp_path / "store-a", chunk_size=256 << 10)


def _node(store: Store, shared: Path, node: str = NODE) -> RemoteStore:
    return RemoteStore(store, CountingDirectory(str(shared)), node)


def _dir(remote: RemoteStore) -> CountingDirectory:
    assert isinstance(remote.client, CountingDirectory)
    return remote.client


def _files(pages: bytes) -> dict[str, bytes]:
    return {"pages-1.img": pages, "core-1.img": b"core" * 1000, "inventory.img": b"inv"}


def test_a_checkpoint_pushed_on_one_node_is_pulled_whole_on_another(
    store: Store, shared: Path, tmp_path: Path
) -> None:
    entry = commit_checkpoint(store, _files(os.urandom(PAGES)))
    remote = _node(store, shared)
    pushed = remote.push(entry.id)
    assert pushed.complete and pushed.repository == SCOPE
    assert remote.push(entry.id) == pushed  # idempotent: the tag is there
    other = open_store(tmp_path / "store-b", chunk_size=256 << 10)
    remote_b = _node(other, shared, "node-b")
    (found,) = remote_b.candidates(SCOPE, "trainer")
    assert found.checkpoint_id == entry.id and found.tag == pushed.tag
    assert remote_b.fetch_metadata(found)["pod"] == "trainer-0"
    pulled = remote_b.pull(found)
    assert pulled.id == entry.id and pulled.state == "compacted"
    other.reader.verify(pulled, deep=True)
    a, b = tmp_path / "a", tmp_path / "b"
    store.reader.extract_layer(store.catalog.get(entry.id), "criu", str(a))
    other.reader.extract_layer(pulled, "criu", str(b))
    match, mismatch, errors = filecmp.cmpfiles(a, b, sorted(_files(b"")), shallow=False)
    assert (mismatch, errors) == ([], []) and len(match) == 3
    assert staging_dirs(other) == []
    # The layout: content-addressed blobs, the tag a link to its manifest, nothing
    # half written, nothing readable by others.
    repo = shared / SCOPE
    tag = repo / "tags" / pushed.tag
    manifest = json.loads(tag.read_bytes())
    assert manifest["mediaType"] == MEDIA_TYPE_MANIFEST
    assert tag.stat().st_nlink == 2  # the tag and the manifest's blob
    assert sorted(os.listdir(repo / "tags")) == [pushed.tag]  # the marker is gone
    # The same manifest put under its tag again leaves no second name behind.
    remote.client.put_manifest(SCOPE, pushed.tag, tag.read_bytes(), MEDIA_TYPE_MANIFEST)
    assert sorted(os.listdir(repo / "tags")) == [pushed.tag]
    assert os.listdir(repo / "uploads") == []
    for path in [repo, *repo.rglob("*")]:
        mode = stat.S_IMODE(path.stat().st_mode)
        assert mode == (0o700 if path.is_dir() else 0o600), path


def test_a_second_checkpoint_that_rewrote_a_tenth_writes_little(store: Store, shared: Path) -> None:
    pages = bytearray(os.urandom(PAGES))
    first = commit_checkpoint(store, _files(bytes(pages)))
    remote = _node(store, shared)
    remote.push(first.id)
    first_sent = _dir(remote).sent
    assert first_sent > PAGES
    pages[PAGES // 3 : PAGES // 3 + PAGES // 10] = os.urandom(PAGES // 10)
    second = commit_checkpoint(store, _files(bytes(pages)))
    _dir(remote).pushes.clear()
    remote.push(second.id)
    assert _dir(remote).sent <= 0.15 * first_sent
    assert [c.checkpoint_id for c in remote.candidates(SCOPE, "trainer")] == [second.id, first.id]


def test_a_push_that_fails_half_way_removes_its_marker_and_leaves_no_tag(
    store: Store, shared: Path, tmp_path: Path
) -> None:
    entry = commit_checkpoint(store, _files(os.urandom(PAGES)))
    remote = _node(store, shared)
    watcher = _node(open_store(tmp_path / "store-b"), shared, "node-b")
    failing = _dir(remote)
    real_push = SharedDirectory.push_blob
    calls: list[str] = []
    seen: list[list[RemoteCheckpoint]] = []

    def dies_on_the_fourth_blob(repo: str, digest: str, *args: Any, **kw: Any) -> PushResult:
        calls.append(digest)
        if len(calls) == 4:
            seen.append(watcher.in_flight(SCOPE, "trainer"))  # while the push runs
            raise OSError(5, "Input/output error")
        return real_push(failing, repo, digest, *args, **kw)

    failing.push_blob = dies_on_the_fourth_blob  # type: ignore[method-assign]
    with pytest.raises(OSError, match="Input/output"):
        remote.push(entry.id)
    (marker,) = seen[0]
    assert marker.checkpoint_id == entry.id and marker.node == NODE and not marker.complete
    # Failed: its marker is gone (before, it stayed and starts waited for it).
    assert watcher.candidates(SCOPE, "trainer") == []
    assert watcher.in_flight(SCOPE, "trainer") == []
    assert not [t for t in failing.list_tags(failing.repository_for(SCOPE)) if "pending" in t]
    del failing.push_blob
    remote.push(entry.id)  # taken up again: only what is missing is written
    assert watcher.in_flight(SCOPE, "trainer") == []
    assert [c.checkpoint_id for c in watcher.candidates(SCOPE, "trainer")] == [entry.id]


def test_a_blob_whose_source_changes_underneath_is_never_written(shared: Path) -> None:
    directory = SharedDirectory(str(shared))
    data = os.urandom(MiB)
    digest = "sha256:" + hashlib.sha256(data).hexdigest()

    def changed(offset: int) -> IO[bytes]:
        return io.BytesIO(data[offset:-1] + b"x")

    with pytest.raises(DataLoss, match="changed underneath"):
        directory.push_blob(SCOPE, digest, len(data), changed)
    assert os.listdir(shared / SCOPE / "blobs" / "sha256") == []
    assert os.listdir(shared / SCOPE / "uploads") == []
    # A blob a dead writer left a day ago is swept by the next push.
    stale = shared / SCOPE / "uploads" / "abc.0123"
    stale.write_bytes(b"half")
    os.utime(stale, (time.time() - STALE_UPLOAD_S - 60,) * 2)
    directory.push_blob(SCOPE, digest, len(data), lambda offset: io.BytesIO(data[offset:]))
    assert os.listdir(shared / SCOPE / "uploads") == []


# -- what the directory holds is not trusted ---------------------------------------------


def test_a_corrupt_blob_fails_the_pull_and_leaves_nothing(
    store: Store, shared: Path, tmp_path: Path
) -> None:
    entry = commit_checkpoint(store, _files(os.urandom(2 * MiB)))
    pushed = _node(store, shared).push(entry.id)
    chunk = entry.layer("criu").chunks[3].digest
    with open(shared / SCOPE / "blobs" / "sha256" / chunk[7:], "r+b") as blob:
        blob.seek(100)
        byte = blob.read(1)
        blob.seek(100)
        blob.write(bytes([byte[0] ^ 0xFF]))
    other = open_store(tmp_path / "store-b")
    with pytest.raises(DataLoss, match="damaged"):
        _node(other, shared).pull(pushed)
    assert other.catalog.list() == [] and staging_dirs(other) == []
    assert not os.path.exists(os.path.join(other.root, "raw", entry.id))


def test_a_manifest_announcing_a_huge_blob_is_refused_before_any_read(
    store: Store, shared: Path, tmp_path: Path
) -> None:
    entry = commit_checkpoint(store, _files(os.urandom(MiB)))
    remote = _node(store, shared)
    pushed = remote.push(entry.id)
    data, _, _ = remote.client.get_manifest(pushed.repository, pushed.tag)
    document = json.loads(data)
    document["layers"][0]["size"] = 1 << 50
    remote.client.put_manifest(
        pushed.repository, pushed.tag, json.dumps(document).encode(), MEDIA_TYPE_MANIFEST
    )
    other = open_store(tmp_path / "store-b")
    puller = _node(other, shared)
    with pytest.raises(DataLoss, match="announces"):
        puller.pull(pushed)
    assert _dir(puller).pulled == [] and other.catalog.list() == []


def test_a_namespace_never_gets_another_namespaces_checkpoint(
    store: Store, shared: Path, tmp_path: Path
) -> None:
    entry = commit_checkpoint(store, _files(os.urandom(MiB)))
    remote = _node(store, shared)
    remote.push(entry.id)
    # Someone with root on a node copies team-a's checkpoint into team-b's directory.
    (shared / "team-b").mkdir(mode=0o700)
    for name in ("blobs", "tags"):
        shutil.copytree(shared / SCOPE / name, shared / "team-b" / name, symlinks=True)
    puller = _node(open_store(tmp_path / "store-b"), shared)
    (stolen,) = puller.candidates("team-b", "trainer")
    with pytest.raises(DataLoss, match="another's name"):
        puller.pull(stolen)


def test_hostile_names_and_links_are_refused(store: Store, shared: Path) -> None:
    entry = commit_checkpoint(store, _files(os.urandom(64 << 10)))
    remote = _node(store, shared)
    pushed = remote.push(entry.id)
    directory = remote.client
    for ref in ("../team-b", ".hidden", "a/b", "sha256:../../x"):
        with pytest.raises(InvalidArgument):
            directory.get_manifest(SCOPE, ref)
    with pytest.raises(InvalidArgument):
        directory.list_tags("../etc")
    tags = shared / SCOPE / "tags"
    (tags / "planted").symlink_to("/etc/passwd")
    (tags / ".in-flight.1234").write_bytes(b"{}")  # a link being renamed: not a tag
    with pytest.raises(DataLoss, match="symbolic link"):
        directory.get_manifest(SCOPE, "planted")
    assert sorted(directory.list_tags(SCOPE)) == sorted([pushed.tag, "planted"])
    # The remote store skips what is not a checkpoint tag, with a warning.
    assert [c.checkpoint_id for c in remote.candidates(SCOPE, "trainer")] == [entry.id]


def test_prune_removes_superseded_manifests_and_their_tags(store: Store, shared: Path) -> None:
    remote = _node(store, shared)
    ids = [
        remote.push(commit_checkpoint(store, _files(os.urandom(64 << 10))).id).checkpoint_id
        for _ in range(3)
    ]
    assert remote.prune(SCOPE, "trainer", keep=1) == [ids[1], ids[0]]
    assert remote.prune(SCOPE, "trainer", keep=1) == []
    assert [c.checkpoint_id for c in remote.candidates(SCOPE, "trainer")] == [ids[2]]
    (kept,) = os.listdir(shared / SCOPE / "tags")
    assert os.stat(shared / SCOPE / "tags" / kept).st_nlink == 2


@pytest.mark.parametrize(("retain", "kept"), [(0, 3), (2, 2)])
def test_whoever_syncs_keeps_the_nodes_retain_per_label(
    store: Store, shared: Path, retain: int, kept: int
) -> None:
    """The node agent and the CLI sync as a shim does: retention applies (0: none)."""
    config = NodeConfig(registry=str(shared), retain=max(retain, 1))
    remote = RemoteStore.from_config(store, config, "node-a")
    assert remote is not None and remote.retain == max(retain, 1)
    remote.retain = retain
    outbox = Outbox(store.root)
    ids = [commit_checkpoint(store, _files(os.urandom(64 << 10))).id for _ in range(3)]
    for checkpoint_id in ids:
        outbox.add(checkpoint_id)
    result = sync(remote, outbox)
    assert sorted(result.pushed) == sorted(ids) and outbox.pending() == []
    listed = [c.checkpoint_id for c in remote.candidates(SCOPE, "trainer")]
    assert len(listed) == kept and set(listed) <= set(ids)
    assert len(os.listdir(shared / SCOPE / "tags")) == kept


def test_the_directory_must_exist_and_be_the_nodes_alone(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgument, match="absolute"):
        SharedDirectory("relative/dir")
    with pytest.raises(InvalidArgument, match="normalised"):
        SharedDirectory(str(tmp_path) + "/../x")
    with pytest.raises(FailedPrecondition, match="does not exist: mount it"):
        list(SharedDirectory(str(tmp_path / "missing")).list_tags(SCOPE))
    open_dir = tmp_path / "open"
    open_dir.mkdir()
    open_dir.chmod(0o777)
    with pytest.raises(PermissionDenied, match="chmod 0700"):
        list(SharedDirectory(str(open_dir)).list_tags(SCOPE))
    shared = tmp_path / "ok"
    shared.mkdir(mode=0o700)
    with pytest.raises(NotFound):
        list(SharedDirectory(str(shared)).list_tags(SCOPE))  # never written


def test_the_node_config_selects_the_directory_by_an_absolute_path(
    store: Store, shared: Path
) -> None:
    remote = RemoteStore.from_config(store, NodeConfig(registry=str(shared)), "node-a")
    assert remote is not None and isinstance(remote.client, SharedDirectory)
    assert remote.client.host == str(shared)
    ghost = RemoteCheckpoint(SCOPE, "c.x", "id", SCOPE, "trainer", "", "", True)
    with pytest.raises(InvalidArgument):
        remote.pull(ghost)
