"""The remote checkpoint store against a real registry (Debian's docker-registry with TLS
and htpasswd), with real stores holding real compacted checkpoints. Needs no
containerd; the full-disk test mounts a tmpfs (root)."""

from __future__ import annotations

import filecmp
import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
from collections.abc import Iterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from cedana_shim.checkpoint.remote import Outbox, RemoteCheckpoint, RemoteStore, sync
from cedana_shim.checkpoint.remote.encryption import Encryption
from cedana_shim.checkpoint.remote.manifest import ARTIFACT_TYPE, MARKER_FRESH_S
from cedana_shim.checkpoint.remote.tags import PENDING_SUFFIX, tag_for
from cedana_shim.checkpoint.store import Entry, Store
from cedana_shim.checkpoint.store.layout import MEDIA_TYPE_CRIU, MEDIA_TYPE_MANIFEST
from cedana_shim.cli import admin
from cedana_shim.errors import DataLoss, NotFound, ResourceExhausted, ShimError
from cedana_shim.registry import PushResult, RegistryConfig
from support.forged import RECORDED_TAR_BYTES, forge, push_forged, zstd_bomb

from .harness.registry import Registry, TlsFiles, skopeo
from .harness.remote_support import (
    NODE,
    SCOPE,
    CountingClient,
    MiB,
    commit_checkpoint,
    open_store,
    registry_config,
    remote_store,
    staging_dirs,
    tmpfs,
)

PAGES = 8 * MiB


def _running(workdir: Path, tls: TlsFiles, **kwargs: object) -> Iterator[Registry]:
    registry = Registry(workdir, tls=tls, **kwargs)  # type: ignore[arg-type]
    registry.start()
    try:
        yield registry
    finally:
        registry.stop()


@pytest.fixture
def registry(tmp_path: Path, tls: TlsFiles) -> Iterator[Registry]:
    yield from _running(tmp_path / "registry", tls)


@pytest.fixture
def settings(registry: Registry, tls: TlsFiles, tmp_path: Path) -> RegistryConfig:
    return registry_config(registry, tls, tmp_path, chunk_size=1 * MiB)


@pytest.fixture
def store(tmp_path: Path) -> Store:
    return open_store(tmp_path / "store-a", chunk_size=256 << 10)


def _files(pages: bytes) -> dict[str, bytes]:
    return {"pages-1.img": pages, "core-1.img": b"core" * 1000, "inventory.img": b"inv"}


def _client(remote: RemoteStore) -> CountingClient:
    assert isinstance(remote.client, CountingClient)
    return remote.client


def _extract(store: Store, checkpoint_id: str, dest: Path) -> Path:
    store.reader.extract_layer(store.catalog.get(checkpoint_id), "criu", str(dest))
    return dest


# -- push, pull, skopeo -------------------------------------------------------------------


def test_push_then_pull_into_an_empty_store_gives_the_same_checkpoint(
    store: Store, settings: RegistryConfig, registry: Registry, tls: TlsFiles, tmp_path: Path
) -> None:
    entry = commit_checkpoint(store, _files(os.urandom(PAGES)))
    remote = remote_store(store, settings)
    pushed = remote.push(entry.id)
    assert pushed.complete and pushed.checkpoint_id == entry.id
    assert pushed.repository == f"cedana/{SCOPE}" and pushed.created == entry.created
    assert remote.push(entry.id) == pushed  # idempotent: the tag is there
    other = open_store(tmp_path / "store-b", chunk_size=256 << 10)
    remote_b = remote_store(other, settings, node="node-b")
    (found,) = remote_b.candidates(SCOPE, "trainer")
    assert found.checkpoint_id == entry.id and found.tag == pushed.tag
    metadata = remote_b.fetch_metadata(found)
    assert metadata["id"] == entry.id and metadata["pod"] == "trainer-0"
    pulled = remote_b.pull(found)
    assert pulled.id == entry.id and pulled.created == entry.created and pulled.state == "compacted"
    other.reader.verify(pulled, deep=True)
    # The page images came out as they arrived: a restore runs CRIU from them at once.
    assert other.raw.raw_images(pulled, "criu") == os.path.join(other.root, "raw", entry.id, "criu")
    other.raw.verify_raw(pulled, "criu")
    a = _extract(store, entry.id, tmp_path / "a")
    b = _extract(other, entry.id, tmp_path / "b")
    match, mismatch, errors = filecmp.cmpfiles(a, b, sorted(_files(b"")), shallow=False)
    assert (mismatch, errors) == ([], []) and len(match) == 3
    assert staging_dirs(other) == []
    # A second pull finds it local: nothing is downloaded.
    _client(remote_b).pulled.clear()
    assert remote_b.pull(found).id == entry.id
    assert _client(remote_b).pulled == []
    # A generic tool reads the manifest.
    auth = tmp_path / "auth.json"
    result = skopeo(
        "inspect", "--raw", "--cert-dir", str(tls.cert_dir), "--authfile", str(auth),
        f"docker://{registry.host}/cedana/{SCOPE}:{pushed.tag}",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    manifest = json.loads(result.stdout)
    assert manifest["artifactType"] == ARTIFACT_TYPE
    assert manifest["mediaType"] == MEDIA_TYPE_MANIFEST
    annotations = manifest["annotations"]
    assert annotations["org.opencontainers.image.created"] == entry.created
    assert annotations["cedana.ai/checkpoint.id"] == entry.id
    assert annotations["cedana.ai/checkpoint.label"] == "trainer"
    assert annotations["cedana.ai/checkpoint.namespace"] == SCOPE
    assert annotations["cedana.ai/checkpoint.node"] == NODE
    assert annotations["org.criu.checkpoint.container.name"] == "trainer"
    assert annotations["org.criu.checkpoint.pod.name"] == "trainer-0"
    assert annotations["org.criu.checkpoint.criu.version"] == "4.2"


def test_a_checkpoint_that_rewrote_a_tenth_of_its_memory_sends_little(
    store: Store, settings: RegistryConfig
) -> None:
    pages = bytearray(os.urandom(PAGES))
    first = commit_checkpoint(store, _files(bytes(pages)))
    remote = remote_store(store, settings)
    remote.push(first.id)
    first_sent = _client(remote).sent
    assert first_sent > PAGES  # random pages do not compress
    start = PAGES // 3
    pages[start : start + PAGES // 10] = os.urandom(PAGES // 10)
    second = commit_checkpoint(store, _files(bytes(pages)))
    _client(remote).pushes.clear()
    remote.push(second.id)
    assert _client(remote).sent <= 0.15 * first_sent
    assert [c.checkpoint_id for c in remote.candidates(SCOPE, "trainer")] == [second.id, first.id]


def test_a_push_the_registry_refused_stays_in_the_outbox_until_sync(
    store: Store, settings: RegistryConfig, registry: Registry
) -> None:
    entry = commit_checkpoint(store, _files(os.urandom(MiB)))
    outbox = Outbox(store.root)
    outbox.add(entry.id)
    remote = remote_store(store, settings)
    registry.stop()
    result = sync(remote, outbox)
    assert result.pushed == [] and [i for i, _ in result.failed] == [entry.id]
    assert registry.host in result.failed[0][1]
    assert outbox.pending() == [entry.id]
    registry.start()
    result = sync(remote, outbox)
    assert result.pushed == [entry.id] and result.failed == []
    assert outbox.pending() == []
    assert [c.checkpoint_id for c in remote.candidates(SCOPE, "trainer")] == [entry.id]


_KILLED_PUSH = """
import os, signal, sys
from cedana_shim.checkpoint.remote import RemoteStore
from cedana_shim.checkpoint.store import Store, StoreConfig
from cedana_shim.registry import RegistryClient, RegistryConfig

from cedana_shim.checkpoint.remote.encryption import Encryption

root, registry, auth, ca, checkpoint_id, kill_at, *keys = sys.argv[1:]
store = Store(StoreConfig(root=root, chunk_size=0))
config = RegistryConfig(registry=registry, auth_file=auth, ca_file=ca, chunk_size=1 << 20)
client = RegistryClient(config, upload_state_dir=os.path.join(root, "outbox", "uploads"))

def progress(done, total):
    if done >= int(kill_at):
        os.kill(os.getpid(), signal.SIGKILL)

encryption = Encryption.from_config(f"jwe:{keys[0]}", keys[1]) if keys else None
RemoteStore(store, client, "node-a.example", encryption=encryption).push(checkpoint_id, progress)
"""


def test_a_push_killed_half_way_is_resumed_by_sync(
    tmp_path: Path, settings: RegistryConfig
) -> None:
    store = open_store(tmp_path / "store-k", chunk_size=0)  # one 8 MiB blob: resumable
    entry = commit_checkpoint(store, _files(os.urandom(PAGES)))
    outbox = Outbox(store.root)
    outbox.add(entry.id)
    child = subprocess.run(
        [
            sys.executable, "-c", textwrap.dedent(_KILLED_PUSH), store.root, settings.registry,
            settings.auth_file, settings.ca_file, entry.id, str(3 * MiB),
        ],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert child.returncode == -signal.SIGKILL, child.stderr
    remote = remote_store(store, settings)
    # Killed, it could not remove its marker: counted until it would have beaten again.
    (marker,) = remote.in_flight(SCOPE, "trainer")
    assert marker.checkpoint_id == entry.id and not marker.complete and marker.node == NODE
    silent = datetime.now(UTC) + timedelta(seconds=MARKER_FRESH_S + 1)
    assert remote.in_flight(SCOPE, "trainer", now=silent) == []  # its pusher is gone
    assert remote.candidates(SCOPE, "trainer") == []
    result = sync(remote, outbox)
    assert result.pushed == [entry.id]
    layer = entry.layer("criu")
    resumed = [p for p in _client(remote).pushes if not p.existed and p.resumed_from]
    assert len(resumed) == 1 and resumed[0].resumed_from >= 2 * MiB
    assert _client(remote).sent <= layer.size - resumed[0].resumed_from + MiB
    assert remote.in_flight(SCOPE, "trainer") == []  # the tag superseded it
    other = open_store(tmp_path / "store-b")
    other.reader.verify(remote_store(other, settings).pull(remote.candidates(SCOPE, "trainer")[0]))


def _publish_raw(store: Store, files: dict[str, bytes]) -> Entry:
    """A durable, raw checkpoint: what a stop commits; its push compacts it on the way."""
    ingest = store.writer.begin(scope=SCOPE, label="trainer", metadata={"container": "t"})
    images = Path(ingest.dir("criu"))
    for name, data in files.items():
        (images / name).write_bytes(data)
    ingest.add_dir_layer("criu", str(images), MEDIA_TYPE_CRIU)
    entry = store.writer.publish(ingest)
    assert entry.state == "raw"
    return entry


class KillsTheRegistry(CountingClient):
    """Kills the registry as the ``at``-th blob push starts (the others in flight)."""

    def __init__(self, settings: RegistryConfig, registry: Registry, at: int, **kw: object):
        super().__init__(settings, **kw)
        self._registry, self._at, self._started = registry, at, 0
        self._kill_lock = threading.Lock()

    def push_blob(self, *args: object, **kw: object) -> PushResult:
        with self._kill_lock:
            self._started += 1
            if self._started == self._at:
                self._registry.kill()
        return super().push_blob(*args, **kw)


def test_a_registry_killed_mid_pipeline_leaves_no_tag_and_the_next_push_resumes(
    tmp_path: Path, registry: Registry, settings: RegistryConfig
) -> None:
    """A raw checkpoint's push compresses and uploads at once; the registry dies while
    chunks are going up and more are being compressed: nothing is tagged, the local
    checkpoint is whole, and the next push sends only what the registry lacks."""
    store = open_store(tmp_path / "store-p", chunk_size=256 << 10)
    entry = _publish_raw(store, _files(os.urandom(PAGES)))
    uploads = os.path.join(store.root, "outbox", "uploads")
    remote = remote_store(store, settings)
    remote.client = KillsTheRegistry(settings, registry, at=8, upload_state_dir=uploads)
    with pytest.raises(ShimError):
        remote.push(entry.id)
    registry.start()
    again = remote_store(store, settings)
    assert again.candidates(SCOPE, "trainer") == []
    store.reader.verify(store.catalog.get(entry.id))
    again.push(entry.id)
    pushes = _client(again).pushes
    assert any(p.existed for p in pushes)  # what went up before the kill stays
    stored = store.catalog.get(entry.id)
    assert _client(again).sent < stored.size
    (found,) = again.candidates(SCOPE, "trainer")
    other = open_store(tmp_path / "store-b")
    other.reader.verify(remote_store(other, settings).pull(found))


def test_a_compression_failure_mid_pipeline_tags_nothing(
    tmp_path: Path, settings: RegistryConfig
) -> None:
    """A raw file damaged since its commit (its CRC-32 no longer matches) fails the
    compaction after its first chunks went up: no tag, no marker, the checkpoint stays
    raw (and restorable as it is: the damage is reported, not hidden)."""
    store = open_store(tmp_path / "store-c", chunk_size=256 << 10)
    entry = _publish_raw(store, _files(os.urandom(PAGES)))
    (pages,) = Path(store.root, "raw", entry.id).rglob("pages-1.img")
    with pages.open("r+b") as handle:
        handle.seek(PAGES - 10)
        handle.write(b"damaged!")
    remote = remote_store(store, settings)
    with pytest.raises(DataLoss):
        remote.push(entry.id)
    tags = list(_client(remote).list_tags(f"cedana/{SCOPE}"))
    assert tags == [], tags
    assert store.catalog.get(entry.id).state == "raw"


def test_an_encrypted_push_killed_half_way_resumes_its_upload_by_content(
    tmp_path: Path, settings: RegistryConfig
) -> None:
    """An encrypted chunk's digest is learned at its upload's commit, so its upload is
    remembered under a key derived from the plain chunk: a new process with the same
    keys encrypts the same bytes and resumes where the killed one stopped."""
    private, public = tmp_path / "enc.key", tmp_path / "enc.pub"
    subprocess.run(
        ["openssl", "genpkey", "-algorithm", "EC", "-pkeyopt", "ec_paramgen_curve:P-256",
         "-out", str(private)], check=True, capture_output=True,
    )  # fmt: skip
    private.chmod(0o600)
    subprocess.run(
        ["openssl", "pkey", "-in", str(private), "-pubout", "-out", str(public)],
        check=True, capture_output=True,
    )  # fmt: skip
    store = open_store(tmp_path / "store-e", chunk_size=0)  # one 8 MiB blob: resumable
    entry = commit_checkpoint(store, _files(os.urandom(PAGES)))
    outbox = Outbox(store.root)
    outbox.add(entry.id)
    child = subprocess.run(
        [
            sys.executable, "-c", textwrap.dedent(_KILLED_PUSH), store.root, settings.registry,
            settings.auth_file, settings.ca_file, entry.id, str(3 * MiB), str(public),
            str(private),
        ],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert child.returncode == -signal.SIGKILL, child.stderr
    remote = remote_store(store, settings)
    remote.encryption = Encryption.from_config(f"jwe:{public}", str(private))
    assert sync(remote, outbox).pushed == [entry.id]
    layer = entry.layer("criu")
    resumed = [p for p in _client(remote).pushes if not p.existed and p.resumed_from]
    assert len(resumed) == 1 and resumed[0].resumed_from >= 2 * MiB
    assert resumed[0].digest != layer.digest  # the encrypted blob, committed by content
    assert _client(remote).sent <= layer.size - resumed[0].resumed_from + MiB
    other = open_store(tmp_path / "store-b")
    puller = remote_store(other, settings)
    puller.encryption = Encryption.from_config("", str(private))
    other.reader.verify(puller.pull(puller.candidates(SCOPE, "trainer")[0]))


def test_the_in_flight_marker_is_visible_while_a_push_runs(
    store: Store, settings: RegistryConfig
) -> None:
    entry = commit_checkpoint(store, _files(os.urandom(PAGES)))
    remote = remote_store(store, settings)
    watcher = remote_store(open_store(Path(store.root)), settings, node="node-b")
    seen: list[list[RemoteCheckpoint]] = []

    def progress(done: int, total: int) -> None:
        if not seen:
            seen.append(watcher.in_flight(SCOPE, "trainer"))

    remote.push(entry.id, progress)
    (marker,) = seen[0]
    assert marker.checkpoint_id == entry.id and marker.node == NODE and not marker.complete
    assert watcher.in_flight(SCOPE, "trainer") == []
    listed = watcher.list(SCOPE)
    assert [(r.checkpoint_id, r.complete) for r in listed] == [(entry.id, True)]


def test_a_push_that_fails_removes_its_marker(
    store: Store, settings: RegistryConfig, tmp_path: Path
) -> None:
    """The registry answers but the push fails (a chunk of the checkpoint is damaged on
    this node, so its upload is refused): the marker goes with it, and no start on
    another node waits for a push that will not land. Before, it stayed, and every start
    of the label waited label_wait_timeout for it."""
    entry = commit_checkpoint(store, _files(os.urandom(2 * MiB)))
    chunk = entry.layer("criu").chunks[1]
    blob = Path(store.root, "blobs", "sha256", chunk.digest.removeprefix("sha256:"))
    damaged = bytearray(blob.read_bytes())
    damaged[10] ^= 0xFF
    blob.write_bytes(bytes(damaged))
    remote = remote_store(store, settings)
    watcher = remote_store(open_store(tmp_path / "store-b"), settings, node="node-b")
    seen: list[list[RemoteCheckpoint]] = []

    def progress(done: int, total: int) -> None:
        if not seen:
            seen.append(watcher.in_flight(SCOPE, "trainer"))

    with pytest.raises(ShimError):
        remote.push(entry.id, progress)
    assert [m.checkpoint_id for m in seen[0]] == [entry.id]  # it was there during the push
    tags = list(_client(remote).list_tags(f"cedana/{SCOPE}"))
    assert not [t for t in tags if t.endswith(PENDING_SUFFIX)], tags
    assert watcher.in_flight(SCOPE, "trainer") == []
    assert watcher.candidates(SCOPE, "trainer") == []


# -- what the registry sends is not trusted ----------------------------------------------------


def test_a_zstd_bomb_is_refused_at_its_recorded_size_and_fills_no_disk(
    store: Store, settings: RegistryConfig, tmp_path: Path
) -> None:
    """Someone able to push published a newer checkpoint whose CRIU layer's tar is a
    zstd bomb (a few KiB that expand to 256 MiB, recorded as 4 KiB). Pulled onto a node
    whose store has 128 MiB: refused at the recorded size while the pull unpacks that
    tar, nothing of it left. Before, the unpacking filled the disk (ResourceExhausted)."""
    entry = commit_checkpoint(store, _files(os.urandom(MiB)))
    newer = datetime.fromisoformat(entry.created) + timedelta(minutes=1)
    forged = forge(store, entry, newer, bomb=zstd_bomb(256 * MiB))
    assert len(forged.blobs) == 2 and max(len(b) for b in forged.blobs.values()) < 64 << 10
    push_forged(remote_store(store, settings).client, store, forged, NODE, scope=SCOPE)
    with tmpfs(tmp_path / "small", 128) as small:
        other = open_store(small / "store")
        puller = remote_store(other, settings, node="node-b")
        (candidate,) = puller.candidates(SCOPE, "trainer")
        assert candidate.checkpoint_id == forged.id
        with pytest.raises(DataLoss, match=f"more than the {RECORDED_TAR_BYTES} bytes recorded"):
            puller.pull(candidate)
        assert other.catalog.list() == [] and staging_dirs(other) == []
        assert not os.listdir(os.path.join(other.root, "blobs", "sha256"))


def test_a_corrupt_blob_in_the_registry_fails_the_pull_and_leaves_nothing(
    store: Store, settings: RegistryConfig, registry: Registry, tmp_path: Path
) -> None:
    entry = commit_checkpoint(store, _files(os.urandom(2 * MiB)))
    remote = remote_store(store, settings)
    pushed = remote.push(entry.id)
    registry.corrupt_blob(entry.layer("criu").chunks[3].digest, offset=100)
    other = open_store(tmp_path / "store-b")
    with pytest.raises(DataLoss, match="damaged"):
        remote_store(other, settings).pull(pushed)
    assert other.catalog.list() == [] and staging_dirs(other) == []
    assert not os.listdir(os.path.join(other.root, "blobs", "sha256"))
    # The page images streamed out before the bad chunk was found: none of them stay.
    assert not os.path.exists(os.path.join(other.root, "raw", entry.id))


def test_a_registry_that_dies_mid_pull_fails_it_as_unavailable_and_leaves_nothing(
    store: Store, settings: RegistryConfig, registry: Registry, tmp_path: Path
) -> None:
    """SIGKILLed once a quarter of the bytes are in (from the pull's own progress, so no
    clock is raced): the pull fails as the registry's fault, not the checkpoint's (a
    restore then does not record the checkpoint as failed), and nothing of it stays."""
    entry = commit_checkpoint(store, _files(os.urandom(PAGES)))
    pushed = remote_store(store, settings).push(entry.id)
    other = open_store(tmp_path / "store-b")
    killed: list[int] = []

    def progress(done: int, total: int) -> None:
        if not killed and done * 4 >= total:
            killed.append(done)
            registry.kill()

    with pytest.raises(ShimError) as failed:
        remote_store(other, settings).pull(pushed, progress)
    assert killed, "the registry was never killed: the pull reported no progress"
    assert not isinstance(failed.value, DataLoss), failed.value
    assert other.catalog.list() == [] and staging_dirs(other) == []
    assert not os.listdir(os.path.join(other.root, "blobs", "sha256"))
    assert not os.path.exists(os.path.join(other.root, "raw", entry.id))


def _rewrite_manifest(remote: RemoteStore, pushed: RemoteCheckpoint, edit: object) -> None:
    data, _, _ = remote.client.get_manifest(pushed.repository, pushed.tag)
    document = json.loads(data)
    edit(document)  # type: ignore[operator]
    remote.client.put_manifest(
        pushed.repository, pushed.tag, json.dumps(document).encode(), MEDIA_TYPE_MANIFEST
    )


def test_a_manifest_announcing_a_huge_blob_is_refused_before_any_download(
    store: Store, settings: RegistryConfig, tmp_path: Path
) -> None:
    entry = commit_checkpoint(store, _files(os.urandom(MiB)))
    remote = remote_store(store, settings)
    pushed = remote.push(entry.id)

    def huge(document: dict[str, list[dict[str, object]]]) -> None:
        document["layers"][0]["size"] = 1 << 50

    _rewrite_manifest(remote, pushed, huge)
    other = open_store(tmp_path / "store-b")
    puller = remote_store(other, settings)
    with pytest.raises(DataLoss, match="announces"):
        puller.pull(pushed)
    assert _client(puller).pulled == []
    assert other.catalog.list() == [] and staging_dirs(other) == []


def test_a_full_disk_during_a_pull_fails_cleanly(
    store: Store, settings: RegistryConfig, tmp_path: Path
) -> None:
    entry = commit_checkpoint(store, _files(os.urandom(24 * MiB)))
    pushed = remote_store(store, settings).push(entry.id)
    with tmpfs(tmp_path / "small", 16) as small:
        other = open_store(small / "store")
        puller = remote_store(other, settings)
        # Known too big before a byte is downloaded:
        with pytest.raises(ResourceExhausted, match="nothing was downloaded"):
            puller.pull(pushed)
        assert _client(puller).pulled == []
    with tmpfs(tmp_path / "fills", 128) as fills:
        other = open_store(fills / "store")
        puller = remote_store(other, settings)
        filled: list[bool] = []

        def fill_the_disk(done: int, total: int) -> None:
            if not filled:  # someone else takes the space while the pull runs
                filled.append(True)
                with open(fills / "ballast", "wb") as ballast:
                    try:
                        while True:
                            ballast.write(b"\0" * MiB)
                            ballast.flush()
                    except OSError:
                        pass

        with pytest.raises(ResourceExhausted, match="full"):
            puller.pull(pushed, fill_the_disk)
        os.unlink(fills / "ballast")
        assert other.catalog.list() == [] and staging_dirs(other) == []
        assert not os.listdir(os.path.join(other.root, "blobs", "sha256"))


def test_thousands_of_tags_are_listed_without_reading_manifests(
    store: Store, settings: RegistryConfig, registry: Registry, caplog: pytest.LogCaptureFixture
) -> None:
    entry = commit_checkpoint(store, _files(os.urandom(MiB)))
    remote = remote_store(store, settings)
    pushed = remote.push(entry.id)
    base = datetime(2025, 1, 1, tzinfo=UTC)
    created = [base + timedelta(seconds=i) for i in range(3000)]
    ids = [f"{when:%Y%m%dT%H%M%S}Z-{i:08x}" for i, when in enumerate(created)]
    tags = [
        tag_for("trainer", when.strftime("%Y-%m-%dT%H:%M:%S.%fZ"), cid, "node-z").tag
        for when, cid in zip(created, ids, strict=True)
    ]
    hostile = ["latest", "c.x.99999999T999999999999Z.00000000.00000000", "c.a..b.bad"]
    registry.add_tags(pushed.repository, pushed.tag, tags + hostile)
    _client(remote).manifest_reads = 0
    with caplog.at_level(logging.WARNING):
        found = remote.candidates(SCOPE, "trainer")
    assert _client(remote).manifest_reads == 0
    assert len(found) == 3001
    assert [c.checkpoint_id for c in found] == [entry.id, *reversed(ids)]
    assert "skipped 3 tag(s)" in caplog.text
    assert remote.candidates(SCOPE, "other-label") == []


def test_a_namespace_never_gets_another_namespaces_checkpoint(
    store: Store, settings: RegistryConfig, tmp_path: Path
) -> None:
    entry = commit_checkpoint(store, _files(os.urandom(MiB)))
    remote = remote_store(store, settings)
    pushed = remote.push(entry.id)
    # Someone copies team-a's checkpoint, blobs and all, into team-b's repository.
    client = _client(remote)
    other_repo = client.repository_for("team-b")
    data, _, _ = client.get_manifest(pushed.repository, pushed.tag)
    for layer in [json.loads(data)["config"], *json.loads(data)["layers"]]:
        assert client.mount_blob(other_repo, layer["digest"], pushed.repository)
    client.put_manifest(other_repo, pushed.tag, data, MEDIA_TYPE_MANIFEST)
    other = open_store(tmp_path / "store-b")
    puller = remote_store(other, settings)
    (stolen,) = puller.candidates("team-b", "trainer")
    with pytest.raises(DataLoss, match="another's name"):
        puller.fetch_metadata(stolen)
    with pytest.raises(DataLoss, match="another's name"):
        puller.pull(stolen)
    assert other.catalog.list() == []


@pytest.mark.parametrize("deletes", [True, False], ids=["deletes", "no-deletes"])
def test_prune_deletes_superseded_checkpoints_when_the_registry_allows(
    tmp_path: Path, tls: TlsFiles, deletes: bool, caplog: pytest.LogCaptureFixture
) -> None:
    for registry in _running(tmp_path / "reg", tls, delete_enabled=deletes):
        settings = registry_config(registry, tls, tmp_path)
        store = open_store(tmp_path / "store", retain=0)
        remote = remote_store(store, settings)
        ids = [remote.push(commit_checkpoint(store, _files(os.urandom(64 << 10))).id).checkpoint_id
               for _ in range(3)]  # fmt: skip
        with caplog.at_level(logging.WARNING):
            removed = remote.prune(SCOPE, "trainer", keep=1)
            again = remote.prune(SCOPE, "trainer", keep=1)
        left = [c.checkpoint_id for c in remote.candidates(SCOPE, "trainer")]
        if deletes:
            assert removed == [ids[1], ids[0]] and left == [ids[2]] and again == []
        else:
            assert removed == [] and left == list(reversed(ids))
            assert caplog.text.count("refuses deletes") == 1


def test_retention_keeps_the_good_checkpoints_over_one_that_failed_here(
    settings: RegistryConfig, tmp_path: Path
) -> None:
    """Three good checkpoints of the label and a forged newer one in the registry; a
    start on this node tried the forged one and recorded that it failed. Retention to
    three deletes the forged one, not the oldest good one."""
    store = open_store(tmp_path / "store", retain=0)
    remote = remote_store(store, settings)
    good = [remote.push(commit_checkpoint(store, _files(os.urandom(64 << 10))).id).checkpoint_id
            for _ in range(3)]  # fmt: skip
    newest = store.catalog.get(good[-1])
    newer = datetime.fromisoformat(newest.created) + timedelta(minutes=1)
    forged = forge(store, newest, newer, bomb=zstd_bomb(MiB))
    tag = push_forged(remote.client, store, forged, "node-x", scope=SCOPE)
    assert [c.checkpoint_id for c in remote.candidates(SCOPE, "trainer")] == [
        forged.id, *reversed(good),
    ]  # fmt: skip
    store.failure_records.record_failure(
        forged.id, "cannot pull it: refused at its recorded size", tag=tag.tag
    )
    assert remote.prune(SCOPE, "trainer", keep=3) == [forged.id]
    assert [c.checkpoint_id for c in remote.candidates(SCOPE, "trainer")] == list(reversed(good))


def test_pull_of_a_checkpoint_not_in_the_registry_is_not_found(
    store: Store, settings: RegistryConfig
) -> None:
    entry = commit_checkpoint(store, _files(os.urandom(64 << 10)))
    remote = remote_store(store, settings)
    tag = tag_for(entry.label, entry.created, entry.id, NODE)
    ghost = RemoteCheckpoint(
        f"cedana/{SCOPE}", tag.tag, entry.id, SCOPE, "trainer", entry.created, "", True
    )
    store.maintenance.remove(entry.id)
    with pytest.raises(NotFound):
        remote.pull(ghost)


# -- the CLI -------------------------------------------------------------------------------------


def _cedana(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    status = admin.main(list(argv))
    out, err = capsys.readouterr()
    return status, out, err


def test_the_cli_pushes_lists_pulls_and_syncs(
    store: Store,
    settings: RegistryConfig,
    registry: Registry,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    config = tmp_path / "shim.toml"
    config.write_text(
        f'registry = "{settings.registry}"\n'
        f'registry_auth_file = "{settings.auth_file}"\n'
        f'registry_ca = "{settings.ca_file}"\n'
    )
    first = commit_checkpoint(store, _files(os.urandom(MiB)))
    second = commit_checkpoint(store, _files(os.urandom(MiB)), label="web")
    a = ("--config", str(config), "--store", store.root)
    status, out, err = _cedana(capsys, "checkpoints", "push", first.id[:20], *a)
    assert status == 0, err
    assert out.startswith(f"{registry.host}/cedana/{SCOPE}:c.trainer.") and err == ""
    status, out, err = _cedana(capsys, "checkpoints", "push", second.id, "--json", *a)
    assert status == 0 and json.loads(out)["id"] == second.id
    status, out, err = _cedana(capsys, "checkpoints", "list", "--remote", "--json", *a)
    assert status == 0, err
    listed = json.loads(out)
    assert [(i["id"], i["label"], i["complete"]) for i in listed] == [
        (second.id, "web", True),
        (first.id, "trainer", True),
    ]
    status, out, _ = _cedana(capsys, "checkpoints", "list", "--remote", "-l", "web", *a)
    assert status == 0 and second.id in out and first.id not in out
    other = tmp_path / "store-b"
    b = ("--config", str(config), "--store", str(other))
    open_store(other)
    status, out, err = _cedana(capsys, "checkpoints", "pull", listed[1]["ref"], "--json", *b)
    assert status == 0, err
    assert json.loads(out)["id"] == first.id
    status, out, err = _cedana(capsys, "checkpoints", "pull", second.id, "--namespace", SCOPE, *b)
    assert status == 0, err
    assert out.startswith(second.id)
    assert {e.id for e in open_store(other).catalog.list()} == {first.id, second.id}
    status, _, err = _cedana(capsys, "checkpoints", "pull", "team-a/latest", *b)
    assert status == 1 and "is not a checkpoint tag" in err
    # sync: one pending push, the registry down, then up.
    third = commit_checkpoint(store, _files(os.urandom(MiB)))
    Outbox(store.root).add(third.id)
    registry.stop()
    status, out, err = _cedana(capsys, "checkpoints", "sync", "--json", *a)
    assert status == 1 and f"push of checkpoint {third.id} failed" in err
    assert json.loads(out)["pending"] == [third.id]
    registry.start()
    status, out, err = _cedana(capsys, "checkpoints", "sync", *a)
    assert status == 0, err
    assert out == f"pushed {third.id}\n0 pushes pending for registry {registry.host}\n"


def test_the_cli_says_when_no_registry_is_configured(
    store: Store, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "shim.toml"
    config.write_text("retain = 2\n")
    status, _, err = _cedana(
        capsys, "checkpoints", "sync", "--config", str(config), "--store", store.root
    )
    assert status == 1
    assert err == (
        f'cedana: no registry configured: set `registry = "host[:port]/prefix"` in {config} '
        "(or env CEDANA_REGISTRY)\n"
    )
