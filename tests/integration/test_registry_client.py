"""The registry client against a real registry: Debian's docker-registry
(distribution 2.8) with TLS from a test CA and htpasswd users; skopeo reads back what
the client pushed. Needs no containerd (and no root)."""

from __future__ import annotations

import hashlib
import io
import json
import os
import stat
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import IO

import pytest
from cedana_shim.checkpoint.store.layout import (
    MEDIA_TYPE_CONFIG,
    MEDIA_TYPE_CRIU,
    MEDIA_TYPE_MANIFEST,
    MEDIA_TYPE_SHM,
)
from cedana_shim.errors import (
    DataLoss,
    DeadlineExceeded,
    NotFound,
    PermissionDenied,
    ResourceExhausted,
    Unavailable,
)
from cedana_shim.registry import RegistryClient, RegistryConfig

from .harness.registry import (
    PASSWORD,
    USER,
    HungServer,
    Registry,
    TlsFiles,
    skopeo,
    write_auth_file,
)

MiB = 1 << 20
REPO = "cedana/team-a"


def _running(workdir: Path, **kwargs: object) -> Iterator[Registry]:
    registry = Registry(workdir, **kwargs)  # type: ignore[arg-type]
    registry.start()
    try:
        yield registry
    finally:
        registry.stop()


@pytest.fixture
def registry(tmp_path: Path, tls: TlsFiles) -> Iterator[Registry]:
    yield from _running(tmp_path / "registry", tls=tls)


@pytest.fixture
def auth_file(tmp_path: Path, registry: Registry) -> Path:
    return write_auth_file(tmp_path / "config.json", registry.host, USER, PASSWORD)


def _client(
    registry: Registry | str,
    *,
    tls: TlsFiles | None,
    auth_file: Path | None,
    upload_state_dir: Path | None = None,
    **config: object,
) -> RegistryClient:
    host = registry.host if isinstance(registry, Registry) else registry
    settings = RegistryConfig(
        registry=f"{host}/cedana",
        auth_file=str(auth_file or ""),
        ca_file=str(tls.ca_cert) if tls else "",
        **config,  # type: ignore[arg-type]
    )
    state_dir = str(upload_state_dir) if upload_state_dir else None
    return RegistryClient(settings, upload_state_dir=state_dir)


@pytest.fixture
def client(registry: Registry, tls: TlsFiles, auth_file: Path) -> RegistryClient:
    return _client(registry, tls=tls, auth_file=auth_file, chunk_size=8 * MiB)


def _digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


class Source:
    """``open_source`` over bytes, counting what the client reads; ``on_read`` sees
    the offset of each block about to be handed over."""

    def __init__(self, data: bytes, on_read: Callable[[int], None] | None = None) -> None:
        self.data = data
        self.digest = _digest(data)
        self.size = len(data)
        self.read_bytes = 0
        self._on_read = on_read

    def __call__(self, offset: int) -> IO[bytes]:
        source = self

        class Stream(io.BytesIO):
            def read(self, size: int | None = -1) -> bytes:
                position = self.tell()
                if source._on_read is not None:
                    source._on_read(position)
                block = super().read(size)
                source.read_bytes += len(block)
                return block

        stream = Stream(self.data)
        stream.seek(offset)
        return stream


def _pull(client: RegistryClient, repo: str, source: Source) -> bytes:
    out = io.BytesIO()
    client.pull_blob(repo, source.digest, source.size, out, max_size=1 << 30)
    return out.getvalue()


def _checkpoint_manifest(config: Source, layers: list[tuple[str, Source]]) -> bytes:
    manifest = {
        "schemaVersion": 2,
        "mediaType": MEDIA_TYPE_MANIFEST,
        "artifactType": MEDIA_TYPE_CONFIG,
        "config": {"mediaType": MEDIA_TYPE_CONFIG, "digest": config.digest, "size": config.size},
        "layers": [
            {"mediaType": media_type, "digest": layer.digest, "size": layer.size}
            for media_type, layer in layers
        ],
        "annotations": {"org.opencontainers.image.created": "2026-01-01T00:00:00Z"},
    }
    return json.dumps(manifest).encode()


def _push_checkpoint(client: RegistryClient, repo: str, tag: str) -> tuple[bytes, list[Source]]:
    config = Source(b'{"id": "20260101T000000Z-0123abcd"}')
    criu = Source(os.urandom(40 * MiB + 12345))
    shm = Source(os.urandom(300))
    for blob in (config, criu, shm):
        client.push_blob(repo, blob.digest, blob.size, blob)
    manifest = _checkpoint_manifest(config, [(MEDIA_TYPE_CRIU, criu), (MEDIA_TYPE_SHM, shm)])
    client.put_manifest(repo, tag, manifest, MEDIA_TYPE_MANIFEST)
    return manifest, [config, criu, shm]


def test_round_trip_of_a_multi_chunk_blob_and_manifest_that_skopeo_reads(
    client: RegistryClient, registry: Registry, tls: TlsFiles, tmp_path: Path
) -> None:
    assert client.repository_for("team-a") == REPO
    manifest, blobs = _push_checkpoint(client, REPO, "ckpt-1")
    criu = blobs[1]
    assert criu.read_bytes == criu.size  # 6 PATCHes of up to 8 MiB, each byte read once

    assert _pull(client, REPO, criu) == criu.data
    body, media_type, digest = client.get_manifest(REPO, "ckpt-1")
    assert (body, media_type, digest) == (manifest, MEDIA_TYPE_MANIFEST, _digest(manifest))
    assert client.get_manifest(REPO, digest)[0] == manifest

    creds = ["--creds", f"{USER}:{PASSWORD}"]
    ref = f"docker://{registry.host}/{REPO}:ckpt-1"
    inspect = skopeo("inspect", "--raw", "--cert-dir", str(tls.cert_dir), *creds, ref)
    assert inspect.returncode == 0, inspect.stderr
    assert inspect.stdout.encode() == manifest

    layout = tmp_path / "oci"
    copy = skopeo(
        "copy", "--src-cert-dir", str(tls.cert_dir), "--src-creds", f"{USER}:{PASSWORD}",
        ref, f"oci:{layout}:ckpt-1",
    )  # fmt: skip
    assert copy.returncode == 0, copy.stderr
    for blob in blobs:
        copied = layout / "blobs/sha256" / blob.digest.removeprefix("sha256:")
        assert copied.read_bytes() == blob.data


def test_blob_exists_reports_the_size_only_after_the_push(client: RegistryClient) -> None:
    blob = Source(os.urandom(1000))
    assert client.blob_exists(REPO, blob.digest) is None
    first = client.push_blob(REPO, blob.digest, blob.size, blob)
    assert client.blob_exists(REPO, blob.digest) == 1000
    again = client.push_blob(REPO, blob.digest, blob.size, blob)
    assert (first.existed, first.sent) == (False, 1000)
    assert (again.existed, again.sent) == (True, 0)


def test_local_data_that_no_longer_matches_its_digest_is_never_committed(
    registry: Registry, tls: TlsFiles, auth_file: Path, tmp_path: Path
) -> None:
    """The client does not hash a blob of known digest: the registry's check at the
    commit refuses the changed bytes, and the next push starts a new session."""
    state_dir = tmp_path / "uploads"
    client = _client(
        registry, tls=tls, auth_file=auth_file, upload_state_dir=state_dir, chunk_size=MiB
    )
    blob = Source(os.urandom(3 * MiB))
    changed = Source(blob.data[:-1] + b"!")
    with pytest.raises(DataLoss, match="changed or is damaged") as caught:
        client.push_blob(REPO, blob.digest, blob.size, changed)
    assert "nothing was committed" in str(caught.value)
    assert client.blob_exists(REPO, blob.digest) is None
    assert client.blob_exists(REPO, changed.digest) is None
    assert list(state_dir.iterdir()) == []
    truncated = Source(blob.data[: 2 * MiB])
    with pytest.raises(DataLoss, match="ends at byte 2097152"):
        client.push_blob(REPO, blob.digest, blob.size, truncated)
    assert client.blob_exists(REPO, blob.digest) is None
    result = client.push_blob(REPO, blob.digest, blob.size, blob)
    assert result.resumed_from + result.sent == blob.size
    assert _pull(client, REPO, blob) == blob.data
    assert list(state_dir.iterdir()) == []


def _dies_after(chunks: int, chunk: int) -> Callable[[int], None]:
    """A push's progress callback: the pushing process "dies" once the registry has
    acknowledged ``chunks`` chunks of ``chunk`` bytes."""

    def progress(done: int) -> None:
        if done == chunks * chunk:
            raise Unavailable("the pushing process dies here")

    return progress


def test_a_resumed_push_whose_source_changed_is_refused_by_the_registry(
    registry: Registry, tls: TlsFiles, auth_file: Path, tmp_path: Path
) -> None:
    chunk = 1 * MiB
    state_dir = tmp_path / "uploads"
    blob = Source(os.urandom(4 * chunk))

    client = _client(
        registry, tls=tls, auth_file=auth_file, upload_state_dir=state_dir, chunk_size=chunk
    )
    with pytest.raises(Unavailable):
        client.push_blob(REPO, blob.digest, blob.size, blob, _dies_after(2, chunk))
    # The part not sent yet changed: the registry holds two good chunks, then two bad.
    changed = Source(blob.data[:-1] + b"!")
    with pytest.raises(DataLoss, match="changed or is damaged"):
        client.push_blob(REPO, blob.digest, blob.size, changed)
    assert changed.read_bytes == 2 * chunk  # the resumed prefix is not read again
    assert client.blob_exists(REPO, blob.digest) is None
    assert list(state_dir.iterdir()) == []
    result = client.push_blob(REPO, blob.digest, blob.size, blob)
    assert (result.resumed_from, result.sent) == (0, blob.size)
    assert _pull(client, REPO, blob) == blob.data


def test_a_push_by_content_learns_its_digest_at_the_commit(client: RegistryClient) -> None:
    """One read of the source: hashed (and tapped) as it goes, committed as its hash."""
    blob = Source(os.urandom(20 * MiB + 7))
    tap = hashlib.sha512()
    result = client.push_blob_by_content(REPO, "k1", blob.size, blob, tap=tap)
    assert (result.existed, result.digest, result.sent) == (False, blob.digest, blob.size)
    assert blob.read_bytes == blob.size
    assert result.tap == hashlib.sha512(blob.data).digest()
    assert client.blob_exists(REPO, blob.digest) == blob.size
    assert _pull(client, REPO, blob) == blob.data


def test_a_push_by_content_resumes_under_its_key_in_a_new_process(
    registry: Registry, tls: TlsFiles, auth_file: Path, tmp_path: Path
) -> None:
    chunk = 1 * MiB
    state_dir = tmp_path / "uploads"
    blob = Source(os.urandom(6 * chunk + 5))

    first = _client(
        registry, tls=tls, auth_file=auth_file, upload_state_dir=state_dir, chunk_size=chunk
    )
    with pytest.raises(Unavailable):
        first.push_blob_by_content(REPO, "k2", blob.size, blob, _dies_after(3, chunk))
    assert client_has_nothing(first, blob)
    second = _client(
        registry, tls=tls, auth_file=auth_file, upload_state_dir=state_dir, chunk_size=chunk
    )
    tap = hashlib.sha512()
    result = second.push_blob_by_content(REPO, "k2", blob.size, blob, tap=tap)
    assert (result.resumed_from, result.sent) == (3 * chunk, blob.size - 3 * chunk)
    # The resumed prefix is re-read locally: digest and tap cover the whole blob.
    assert result.digest == blob.digest
    assert result.tap == hashlib.sha512(blob.data).digest()
    assert _pull(second, REPO, blob) == blob.data
    assert list(state_dir.iterdir()) == []


def test_a_push_by_content_whose_resumed_bytes_differ_is_refused_by_the_registry(
    registry: Registry, tls: TlsFiles, auth_file: Path, tmp_path: Path
) -> None:
    """The digest named at the commit is the hash of what this process read; bytes the
    registry holds from an earlier push that are not those are never committed."""
    chunk = 1 * MiB
    state_dir = tmp_path / "uploads"
    blob = Source(os.urandom(4 * chunk))

    client = _client(
        registry, tls=tls, auth_file=auth_file, upload_state_dir=state_dir, chunk_size=chunk
    )
    with pytest.raises(Unavailable):
        client.push_blob_by_content(REPO, "k3", blob.size, blob, _dies_after(2, chunk))
    # The same key now gives other bytes in the part already sent.
    other = Source(b"!" + blob.data[1:])
    with pytest.raises(DataLoss, match="DIGEST_INVALID"):
        client.push_blob_by_content(REPO, "k3", other.size, other)
    assert client.blob_exists(REPO, other.digest) is None
    assert client.blob_exists(REPO, blob.digest) is None
    assert list(state_dir.iterdir()) == []  # the refused session is forgotten
    result = client.push_blob_by_content(REPO, "k3", other.size, other)
    assert (result.resumed_from, result.digest) == (0, other.digest)


def client_has_nothing(client: RegistryClient, blob: Source) -> bool:
    return client.blob_exists(REPO, blob.digest) is None


def test_wrong_password_is_permission_denied_naming_registry_and_auth_file(
    registry: Registry, tls: TlsFiles, tmp_path: Path
) -> None:
    wrong = write_auth_file(tmp_path / "wrong.json", registry.host, USER, "not-the-password")
    client = _client(registry, tls=tls, auth_file=wrong)
    with pytest.raises(PermissionDenied) as caught:
        client.blob_exists(REPO, _digest(b"x"))
    message = str(caught.value)
    assert registry.host in message and REPO in message and str(wrong) in message
    assert "authentication failed" in message


def test_no_auth_file_is_permission_denied_saying_so(registry: Registry, tls: TlsFiles) -> None:
    client = _client(registry, tls=tls, auth_file=None)
    with pytest.raises(PermissionDenied) as caught:
        client.get_manifest(REPO, "latest")
    message = str(caught.value)
    assert registry.host in message and REPO in message
    assert "no registry_auth_file configured" in message


def test_a_group_readable_auth_file_is_refused(
    registry: Registry, tls: TlsFiles, tmp_path: Path
) -> None:
    loose = write_auth_file(tmp_path / "loose.json", registry.host, USER, PASSWORD, mode=0o644)
    with pytest.raises(PermissionDenied, match=f"chmod 600 {loose}"):
        _client(registry, tls=tls, auth_file=loose)


def test_push_resumes_after_the_registry_hung_and_was_restarted(
    registry: Registry, tls: TlsFiles, auth_file: Path, tmp_path: Path
) -> None:
    chunk = 1 * MiB
    state_dir = tmp_path / "uploads"
    blob = Source(os.urandom(6 * chunk + 5))

    def hang_after_three_chunks(done: int) -> None:
        if done == 3 * chunk:
            registry.pause()  # the next PATCH goes out and is never read

    first = _client(
        registry, tls=tls, auth_file=auth_file, upload_state_dir=state_dir,
        chunk_size=chunk, timeout=2.0,
    )  # fmt: skip
    started = time.monotonic()
    with pytest.raises((DeadlineExceeded, Unavailable)) as caught:
        first.push_blob(REPO, blob.digest, blob.size, blob, progress=hang_after_three_chunks)
    assert time.monotonic() - started < 30
    assert registry.host in str(caught.value)
    sent_before = blob.read_bytes
    (state_file,) = state_dir.iterdir()
    assert stat.S_IMODE(state_file.stat().st_mode) == 0o600

    registry.kill()
    registry.start()
    # A new client with the same state dir: what a new process does.
    second = _client(
        registry, tls=tls, auth_file=auth_file, upload_state_dir=state_dir, chunk_size=chunk
    )
    blob.read_bytes = 0
    result = second.push_blob(REPO, blob.digest, blob.size, blob)
    assert result.resumed_from == 3 * chunk
    assert result.sent == blob.size - 3 * chunk
    assert blob.read_bytes == result.sent  # what the registry holds is not read again
    resent = sent_before + result.sent - blob.size
    assert 0 <= resent <= chunk
    assert _pull(second, REPO, blob) == blob.data
    assert list(state_dir.iterdir()) == []


def test_push_after_the_registry_was_killed_mid_chunk_completes(
    registry: Registry, tls: TlsFiles, auth_file: Path
) -> None:
    chunk = 4 * MiB
    killed = threading.Event()

    def kill_in_second_chunk(offset: int) -> None:
        if offset >= 6 * MiB and not killed.is_set():
            killed.set()
            registry.kill()

    blob = Source(os.urandom(12 * MiB), on_read=kill_in_second_chunk)
    client = _client(registry, tls=tls, auth_file=auth_file, chunk_size=chunk, timeout=5.0)
    with pytest.raises((Unavailable, DeadlineExceeded)):
        client.push_blob(REPO, blob.digest, blob.size, blob)
    registry.start()
    result = client.push_blob(REPO, blob.digest, blob.size, blob)
    # distribution 2.8 drops a session whose stored bytes run past its last
    # acknowledged chunk; a registry that keeps it lets the push resume at 4 MiB.
    assert result.resumed_from in (0, chunk)
    assert result.resumed_from + result.sent == blob.size
    assert _pull(client, REPO, blob) == blob.data


def test_a_blob_corrupted_on_the_registry_disk_is_data_loss(
    client: RegistryClient, registry: Registry, tmp_path: Path
) -> None:
    blob = Source(os.urandom(3 * MiB))
    client.push_blob(REPO, blob.digest, blob.size, blob)
    registry.corrupt_blob(blob.digest, offset=2 * MiB + 7)
    with (tmp_path / "pulled.tmp").open("w+b") as dest, pytest.raises(DataLoss) as caught:
        client.pull_blob(REPO, blob.digest, blob.size, dest, max_size=blob.size)
    message = str(caught.value)
    assert registry.host in message and blob.digest in message and "damaged" in message
    # The caller's temporary file holds the damaged bytes: it is dropped, never renamed.
    assert (tmp_path / "pulled.tmp").stat().st_size == blob.size


def test_a_blob_over_max_size_is_refused_before_downloading(client: RegistryClient) -> None:
    blob = Source(os.urandom(2000))
    client.push_blob(REPO, blob.digest, blob.size, blob)
    with pytest.raises(ResourceExhausted, match="more than the 1000 allowed"):
        client.pull_blob(REPO, blob.digest, blob.size, io.BytesIO(), max_size=1000)
    with pytest.raises(DataLoss, match="announces 2000 bytes, expected 1999"):
        client.pull_blob(REPO, blob.digest, 1999, io.BytesIO(), max_size=1 << 20)


def test_a_few_thousand_tags_are_listed(client: RegistryClient, registry: Registry) -> None:
    config = Source(b"{}")
    client.push_blob(REPO, config.digest, config.size, config)
    client.put_manifest(REPO, "t0", _checkpoint_manifest(config, []), MEDIA_TYPE_MANIFEST)
    registry.add_tags(REPO, "t0", [f"t{i}" for i in range(1, 3000)])
    # distribution 2.8 ignores `n` and sends one page; the pages of registries that
    # honour it are covered by tests/unit/test_registry_client_fake.py.
    assert set(client.list_tags(REPO, page_size=100)) == {f"t{i}" for i in range(3000)}
    with pytest.raises(ResourceExhausted, match="more than 100 tags"):
        list(client.list_tags(REPO, max_tags=100))
    with pytest.raises(NotFound):
        list(client.list_tags("cedana/nobody"))


def _push_small_manifest(client: RegistryClient, tag: str) -> str:
    config = Source(b'{"small": true}')
    client.push_blob(REPO, config.digest, config.size, config)
    manifest = _checkpoint_manifest(config, [])
    return client.put_manifest(REPO, tag, manifest, MEDIA_TYPE_MANIFEST)


def test_delete_manifest_when_the_registry_allows_deletes(client: RegistryClient) -> None:
    digest = _push_small_manifest(client, "doomed")
    assert client.delete_manifest(REPO, digest) is True
    with pytest.raises(NotFound):
        client.get_manifest(REPO, digest)


def test_delete_manifest_when_the_registry_refuses_deletes(tmp_path: Path, tls: TlsFiles) -> None:
    for registry in _running(tmp_path / "nodelete", tls=tls, delete_enabled=False):
        auth = write_auth_file(tmp_path / "config.json", registry.host, USER, PASSWORD)
        client = _client(registry, tls=tls, auth_file=auth)
        digest = _push_small_manifest(client, "kept")
        assert client.delete_manifest(REPO, digest) is False
        assert client.get_manifest(REPO, "kept")[2] == digest


def test_cross_repository_mount(client: RegistryClient) -> None:
    blob = Source(os.urandom(5000))
    client.push_blob(REPO, blob.digest, blob.size, blob)
    assert client.mount_blob("cedana/team-b", blob.digest, REPO) is True
    assert client.blob_exists("cedana/team-b", blob.digest) == 5000
    missing = _digest(b"never pushed")
    assert client.mount_blob("cedana/team-b", missing, REPO) is False
    assert client.blob_exists("cedana/team-b", missing) is None


def test_insecure_mode_talks_plain_http(tmp_path: Path) -> None:
    for registry in _running(tmp_path / "plain", tls=None, auth=False):
        client = _client(registry, tls=None, auth_file=None, insecure=True)
        blob = Source(os.urandom(100_000))
        client.push_blob(REPO, blob.digest, blob.size, blob)
        assert _pull(client, REPO, blob) == blob.data


def test_a_registry_signed_by_an_unknown_ca_says_to_set_registry_ca(
    registry: Registry, auth_file: Path
) -> None:
    client = _client(registry, tls=None, auth_file=auth_file)
    with pytest.raises(Unavailable, match="registry_ca") as caught:
        client.blob_exists(REPO, _digest(b"x"))
    assert registry.host in str(caught.value)


@pytest.mark.parametrize("insecure", [True, False], ids=["http", "https"])
def test_a_registry_that_never_answers_times_out(insecure: bool) -> None:
    server = HungServer()
    try:
        client = _client(server.host, tls=None, auth_file=None, insecure=insecure, timeout=1.0)
        started = time.monotonic()
        with pytest.raises(DeadlineExceeded, match=server.host):
            client.blob_exists(REPO, _digest(b"x"))
        assert time.monotonic() - started < 10
        assert server.connections >= 1
    finally:
        server.close()


class _Pattern:
    """``size`` bytes repeating a random MiB, read without holding them all."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._block = os.urandom(MiB)
        hasher = hashlib.sha256()
        for _ in range(size // MiB):
            hasher.update(self._block)
        self.digest = "sha256:" + hasher.hexdigest()

    def __call__(self, offset: int) -> IO[bytes]:
        pattern = self

        class Stream(io.RawIOBase):
            position = offset

            def readable(self) -> bool:
                return True

            def readinto(self, buffer: memoryview) -> int:  # type: ignore[override]
                count = min(len(buffer), pattern.size - self.position, MiB)
                start = self.position % MiB
                piece = (pattern._block + pattern._block)[start : start + count]
                buffer[:count] = piece
                self.position += count
                return count

        return io.BufferedReader(Stream())


def _rss() -> int:
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def test_pushing_a_gib_keeps_memory_bounded(client: RegistryClient) -> None:
    source = _Pattern(1 << 30)
    peak = baseline = _rss()
    done = threading.Event()

    def sample() -> None:
        nonlocal peak
        while not done.wait(0.01):
            peak = max(peak, _rss())

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        client.push_blob(REPO, source.digest, source.size, source)
    finally:
        done.set()
        sampler.join()
    growth = peak - baseline
    print(f"RSS growth pushing 1 GiB in 8 MiB chunks: {growth / MiB:.1f} MiB")
    assert growth < 3 * 8 * MiB
    assert client.blob_exists(REPO, source.digest) == source.size
