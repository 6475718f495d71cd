"""Encrypted checkpoints: every layer a node pushes is ocicrypt-encrypted for the
encryption_keys recipients; a node with one of their private keys pulls it whole, one
without is refused naming the key, before any blob is read. Real stores and the
remote store's own code over a shared directory; the ocicrypt codec under hypothesis.
(tests/integration/test_encrypted_checkpoints.py: skopeo, cosign, real nodes.)"""

from __future__ import annotations

import base64
import contextlib
import filecmp
import hashlib
import hmac
import io
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import zstandard
from cedana_shim.checkpoint.remote import RemoteStore
from cedana_shim.checkpoint.remote.encryption import (
    EncryptedLayer,
    Encryption,
    decrypt_manifest,
)
from cedana_shim.checkpoint.remote.ocicrypt import (
    ANN_KEYS_JWE,
    ANN_PUBOPTS,
    LayerKey,
    NoKey,
    cipher_stream,
    encrypted_descriptor,
    fingerprint,
    unwrap,
)
from cedana_shim.checkpoint.remote.shared_dir import SharedDirectory
from cedana_shim.config import NodeConfig
from cedana_shim.errors import DataLoss, FailedPrecondition, InvalidArgument, PermissionDenied
from cryptography.hazmat.primitives.serialization import load_pem_public_key
from hypothesis import given, settings
from hypothesis import strategies as st
from support.checkpoints import SCOPE, MiB, commit_checkpoint, open_store
from test_remote_signing import CountingDirectory, write_key_pair

PAGES = 4 * MiB


class SendCounter(SharedDirectory):
    def __init__(self, path: str) -> None:
        super().__init__(path)
        self.sent = 0

    def push_blob(self, repo: str, digest: str, size: int, *args: Any, **kw: Any) -> Any:
        result = super().push_blob(repo, digest, size, *args, **kw)
        self.sent += result.sent
        return result

    def push_blob_by_content(self, *args: Any, **kw: Any) -> Any:
        result = super().push_blob_by_content(*args, **kw)
        self.sent += result.sent
        return result


@pytest.fixture
def shared(tmp_path: Path) -> Path:
    path = tmp_path / "shared"
    path.mkdir(mode=0o700)
    return path


def _pages(marker: bytes) -> bytes:
    return (marker + os.urandom(4000)) * (PAGES // 4032)


def _files(pages: bytes) -> dict[str, bytes]:
    return {"pages-1.img": pages, "core-1.img": b"core" * 1000, "inventory.img": b"inv"}


def _node(
    tmp_path: Path, shared: Path, name: str, client: SharedDirectory | None = None, **keys: str
) -> RemoteStore:
    store = open_store(tmp_path / f"store-{name}", chunk_size=256 << 10)
    remote = RemoteStore.from_config(store, NodeConfig(registry=str(shared), **keys), name)
    assert remote is not None
    if client is not None:
        remote.client = client
    return remote


def _blobs(shared: Path) -> list[bytes]:
    out = []
    for path in shared.rglob("*"):
        if path.is_file() and "tags" not in path.parts:
            out.append(path.read_bytes())
    return out


def _decompressed(data: bytes) -> bytes:
    try:
        return zstandard.ZstdDecompressor().decompressobj().decompress(data)
    except zstandard.ZstdError:
        return b""


def test_no_plain_byte_reaches_the_store_and_a_node_with_the_key_pulls_it_whole(
    tmp_path: Path, shared: Path
) -> None:
    rsa_key, rsa_pub = write_key_pair(tmp_path, "rsa", "rsa")
    ec_key, ec_pub = write_key_pair(tmp_path, "ec", "ec")
    marker = b"MARKER-" + os.urandom(8).hex().encode()
    a = _node(tmp_path, shared, "node-a", encryption_keys=f"jwe:{rsa_pub},jwe:{ec_pub}")
    entry = commit_checkpoint(a.store, _files(_pages(marker)))
    pushed = a.push(entry.id)
    blobs = _blobs(shared)
    assert len(blobs) > 10
    assert not any(marker in b or marker in _decompressed(b) for b in blobs)
    for private in (rsa_key, ec_key):  # either recipient's key opens it
        name = f"node-{private.stem}"
        b = _node(tmp_path, shared, name, decryption_keys=str(private))
        (found,) = b.candidates(SCOPE, "trainer")
        assert found.tag == pushed.tag and b.fetch_metadata(found)["pod"] == "trainer-0"
        pulled = b.pull(found)
        b.store.reader.verify(pulled, deep=True)
        out_a, out_b = tmp_path / f"{name}-a", tmp_path / f"{name}-b"
        a.store.reader.extract_layer(a.store.catalog.get(entry.id), "criu", str(out_a))
        b.store.reader.extract_layer(pulled, "criu", str(out_b))
        match, _, _ = filecmp.cmpfiles(out_a, out_b, sorted(_files(b"")), shallow=False)
        assert len(match) == 3 and marker in (out_b / "pages-1.img").read_bytes()


@pytest.mark.parametrize("keys", ["", "wrong"])
def test_a_node_without_the_key_is_refused_naming_it_before_any_blob(
    tmp_path: Path, shared: Path, keys: str
) -> None:
    _, public = write_key_pair(tmp_path, "real", "ec")
    wrong, _ = write_key_pair(tmp_path, "wrong", "rsa")
    a = _node(tmp_path, shared, "node-a", encryption_keys=f"jwe:{public}")
    a.push(commit_checkpoint(a.store, _files(_pages(b"x"))).id)
    kid = fingerprint(load_pem_public_key(public.read_bytes()))
    client = CountingDirectory(str(shared))
    b = _node(tmp_path, shared, "node-b", client, decryption_keys=str(wrong) if keys else "")
    (found,) = b.candidates(SCOPE, "trainer")
    for attempt in (b.fetch_metadata, b.pull):
        with pytest.raises(FailedPrecondition) as err:
            attempt(found)
        assert isinstance(err.value, NoKey) and err.value.kids == (kid,)
        assert kid in str(err.value) and "decryption_keys" in str(err.value)
        assert found.checkpoint_id in str(err.value)
        assert (str(wrong) in str(err.value)) == bool(keys)
    assert client.pulled == []


def test_a_tenth_rewritten_still_uploads_little_and_dedupes_across_nodes(
    tmp_path: Path, shared: Path
) -> None:
    private, public = write_key_pair(tmp_path, "real", "ec")
    keys = {"encryption_keys": f"jwe:{public}", "decryption_keys": str(private)}
    counter = SendCounter(str(shared))
    a = _node(tmp_path, shared, "node-a", counter, **keys)
    pages = bytearray(os.urandom(PAGES))
    first = commit_checkpoint(a.store, _files(bytes(pages)))
    a.push(first.id)
    first_sent, counter.sent = counter.sent, 0
    assert first_sent > PAGES
    pages[PAGES // 3 : PAGES // 3 + PAGES // 10] = os.urandom(PAGES // 10)
    second = commit_checkpoint(a.store, _files(bytes(pages)))
    a.push(second.id)
    assert counter.sent <= 0.15 * first_sent
    # Another node with the same keys pulls the second and pushes a third: the
    # chunks it shares with the second are already there.
    b = _node(tmp_path, shared, "node-b", SendCounter(str(shared)), **keys)
    b.pull(b.candidates(SCOPE, "trainer")[0])
    pages[: PAGES // 10] = os.urandom(PAGES // 10)
    third = commit_checkpoint(b.store, _files(bytes(pages)))
    b.push(third.id)
    assert isinstance(b.client, SendCounter) and b.client.sent <= 0.15 * first_sent


class CountingSource:
    """``open_at`` over bytes, counting the bytes read."""

    def __init__(self, data: bytes) -> None:
        self.data = data
        self.read = 0

    def __call__(self, offset: int) -> io.BytesIO:
        source = self

        class Stream(io.BytesIO):
            def read(self, size: int | None = -1) -> bytes:
                block = super().read(size)
                source.read += len(block)
                return block

        return Stream(self.data[offset:])


def test_a_new_chunk_is_read_and_encrypted_once_its_digest_and_hmac_from_that_pass(
    tmp_path: Path, shared: Path
) -> None:
    """No pass ahead of the upload to learn the encrypted digest: it is the hash of
    what was sent; the HMAC is of the same bytes. A chunk the node knows goes by its
    digest: the registry has it, nothing is read."""
    private, public = write_key_pair(tmp_path, "real", "ec")
    cipher = Encryption.from_config(f"jwe:{public}", str(private)).for_push(SCOPE, "l")
    assert cipher is not None
    client = SharedDirectory(str(shared))
    plain = os.urandom(3 * MiB + 5)
    digest = "sha256:" + hashlib.sha256(plain).hexdigest()
    source = CountingSource(plain)
    result = cipher.push(client, "ns", digest, len(plain), source, None)
    assert source.read == len(plain)
    key, nonce = cipher._derive(b"key", digest), cipher._derive(b"nonce", digest)[:16]
    encrypted = cipher_stream(io.BytesIO(plain), key, nonce).read()
    assert result.digest == "sha256:" + hashlib.sha256(encrypted).hexdigest()
    assert result.tap == hmac.new(key, encrypted, "sha256").digest()
    again = CountingSource(plain)
    assert cipher.push(client, "ns", digest, len(plain), again, None).existed
    assert again.read == 0
    layer = json.loads(cipher.manifest(_one_layer(digest, len(plain)), "m"))["layers"][0]
    assert layer["digest"] == result.digest


def test_layers_of_another_secret_in_the_registry_are_not_taken_as_ours(
    tmp_path: Path, shared: Path
) -> None:
    """What the label's newest checkpoint says is used only for the chunks whose key is
    the one this push derives (a rotation starts new keys, and a blob is never named by
    what someone else encrypted)."""
    private, public = write_key_pair(tmp_path, "real", "ec")
    plain = os.urandom(MiB)
    digest = "sha256:" + hashlib.sha256(plain).hexdigest()
    foreign = EncryptedLayer("sha256:" + "0" * 64, LayerKey(b"k" * 32, b"n" * 16, b"", digest))
    encryption = Encryption.from_config(f"jwe:{public}", str(private))
    cipher = encryption.for_push(SCOPE, "l", lambda: {digest: foreign})
    assert cipher is not None
    result = cipher.push(
        SharedDirectory(str(shared)), "ns", digest, MiB, CountingSource(plain), None
    )
    assert not result.existed and result.digest != foreign.digest


def _one_layer(digest: str, size: int) -> bytes:
    layer = {"mediaType": "application/vnd.cedana.criu.v1.tar+zstd", "digest": digest, "size": size}
    return json.dumps({"schemaVersion": 2, "layers": [layer]}).encode()


def test_chunk_keys_need_a_recipients_private_key_not_only_what_the_registry_shows(
    tmp_path: Path,
) -> None:
    """The namespace, label and recipients' fingerprints are readable in the registry
    (JWE kids, tags, config) and so are the plain digests: keys derived from those alone
    could be derived by any reader. A recipient's private key is part of the secret; a
    pusher without one gets fresh random keys."""
    private, public = write_key_pair(tmp_path, "real", "ec")
    other_private, _ = write_key_pair(tmp_path, "other", "ec")
    digest = "sha256:" + "ab" * 32

    def layer_key(decryption_keys: str) -> bytes:
        cipher = Encryption.from_config(f"jwe:{public}", decryption_keys).for_push(SCOPE, "l")
        assert cipher is not None
        return cipher._derive(b"key", digest)

    holder = layer_key(str(private))
    assert layer_key(str(private)) == holder  # convergent across nodes holding the key
    assert layer_key(str(other_private)) != holder  # not a recipient's: random
    assert layer_key("") != holder
    assert layer_key("") != layer_key("")  # fresh keys for each push without one


def test_a_namespace_key_opens_that_namespace_alone(tmp_path: Path, shared: Path) -> None:
    team_key, team_pub = write_key_pair(tmp_path, "team", "ec")
    all_key, all_pub = write_key_pair(tmp_path, "all", "rsa")
    a = _node(tmp_path, shared, "node-a", encryption_keys=f"jwe:{all_pub}, {SCOPE}=jwe:{team_pub}")
    a.push(commit_checkpoint(a.store, _files(_pages(b"a"))).id)
    a.push(commit_checkpoint(a.store, _files(_pages(b"b")), scope="team-b").id)
    team = _node(tmp_path, shared, "team", decryption_keys=str(team_key))
    other = _node(tmp_path, shared, "all", decryption_keys=str(all_key))
    team.pull(team.candidates(SCOPE, "trainer")[0])
    other.pull(other.candidates("team-b", "trainer")[0])
    with pytest.raises(NoKey):
        other.pull(other.candidates(SCOPE, "trainer")[0])
    with pytest.raises(NoKey):
        team.pull(team.candidates("team-b", "trainer")[0])


def test_a_new_key_beside_the_old_keeps_old_checkpoints_restorable(
    tmp_path: Path, shared: Path
) -> None:
    old_key, old_pub = write_key_pair(tmp_path, "old", "rsa")
    new_key, new_pub = write_key_pair(tmp_path, "new", "ec")
    before = _node(tmp_path, shared, "before", encryption_keys=f"jwe:{old_pub}")
    first = commit_checkpoint(before.store, _files(_pages(b"1")))
    before.push(first.id)
    after = _node(
        tmp_path, shared, "after", encryption_keys=f"jwe:{new_pub}",
        decryption_keys=f"{new_key},{old_key}",
    )  # fmt: skip
    after.push(commit_checkpoint(after.store, _files(_pages(b"2"))).id)
    newest, oldest = after.candidates(SCOPE, "trainer")
    assert oldest.checkpoint_id == first.id
    fresh = _node(tmp_path, shared, "fresh", decryption_keys=f"{new_key},{old_key}")
    assert fresh.pull(oldest).id == first.id and fresh.pull(newest)
    retired = _node(tmp_path, shared, "retired", decryption_keys=str(new_key))
    retired.pull(newest)
    with pytest.raises(NoKey) as err:
        retired.pull(oldest)
    assert err.value.kids == (fingerprint(load_pem_public_key(old_pub.read_bytes())),)


def test_signed_and_encrypted_the_signature_covers_the_encrypted_manifest(
    tmp_path: Path, shared: Path
) -> None:
    private, public = write_key_pair(tmp_path, "enc", "ec")
    signing, trusted = write_key_pair(tmp_path, "sign", "ec")
    a = _node(tmp_path, shared, "node-a", encryption_keys=f"jwe:{public}", signing_key=str(signing))
    a.push(commit_checkpoint(a.store, _files(_pages(b"s"))).id)
    b = _node(tmp_path, shared, "node-b", decryption_keys=str(private), trusted_keys=str(trusted))
    b.pull(b.candidates(SCOPE, "trainer")[0])
    stranger = _node(tmp_path, shared, "node-c", trusted_keys=str(public))
    with pytest.raises(PermissionDenied):  # the signature is checked before the keys
        stranger.pull(stranger.candidates(SCOPE, "trainer")[0])


def test_keys_are_refused_clearly(tmp_path: Path, shared: Path) -> None:
    private, public = write_key_pair(tmp_path, "k", "ec")
    _, ed_pub = write_key_pair(tmp_path, "ed", "ed25519")
    public.chmod(0o600)  # refused for what it is, not for its mode
    cases = [
        ({"encryption_keys": str(public)}, InvalidArgument, "jwe:<path"),
        ({"encryption_keys": f"Team_A=jwe:{public}"}, InvalidArgument, "not a namespace"),
        ({"encryption_keys": f"jwe:{ed_pub}"}, InvalidArgument, "RSA or EC"),
        ({"encryption_keys": "jwe:/nonexistent.pem"}, InvalidArgument, "cannot open"),
        ({"decryption_keys": str(public)}, InvalidArgument, "private key"),
    ]
    for keys, error, message in cases:
        with pytest.raises(error, match=message):
            _node(tmp_path, shared, "node-a", **keys)
    private.chmod(0o644)
    with pytest.raises(PermissionDenied, match="chmod 600"):
        _node(tmp_path, shared, "node-a", decryption_keys=str(private))


# -- the codec --------------------------------------------------------------------------


@settings(max_examples=50, deadline=None)
@given(st.binary(max_size=3000), st.integers(0, 3000), st.binary(min_size=16, max_size=16))
def test_the_cipher_from_any_offset_is_the_whole_ciphers_tail(
    data: bytes, offset: int, nonce: bytes
) -> None:
    key = bytes(range(32))
    offset = min(offset, len(data))
    whole = cipher_stream(io.BytesIO(data), key, nonce).read()
    assert len(whole) == len(data)
    assert cipher_stream(io.BytesIO(data[offset:]), key, nonce, offset).read() == whole[offset:]
    assert cipher_stream(io.BytesIO(whole), key, nonce).read() == data


def _ec_pair() -> tuple[Any, str, Any]:
    from cryptography.hazmat.primitives.asymmetric import ec

    key = ec.generate_private_key(ec.SECP256R1())
    return key, fingerprint(key.public_key()), key.public_key()


@settings(max_examples=20, deadline=None)
@given(st.binary(min_size=32, max_size=32), st.binary(min_size=16, max_size=16), st.binary())
def test_wrapped_layer_keys_round_trip(key: bytes, nonce: bytes, plain: bytes) -> None:
    private, kid, public = _ec_pair()
    layer = LayerKey(key, nonce, os.urandom(32), "sha256:" + "a" * 64)
    descriptor = {"mediaType": "application/x+zstd", "digest": "sha256:" + "b" * 64, "size": 1}
    encrypted = encrypted_descriptor(descriptor, layer, "sha256:" + "c" * 64, [(kid, public)])
    assert encrypted["mediaType"] == "application/x+zstd+encrypted"
    assert set(encrypted["annotations"]) == {ANN_KEYS_JWE, ANN_PUBOPTS}
    assert unwrap(encrypted, [("p", kid, private)], "here") == layer
    with pytest.raises(NoKey):
        other, other_kid, _ = _ec_pair()
        unwrap(encrypted, [("q", other_kid, other)], "here")


@settings(max_examples=100, deadline=None)
@given(
    st.dictionaries(
        st.sampled_from([ANN_KEYS_JWE, ANN_PUBOPTS, "x"]),
        st.text(max_size=40) | st.binary(max_size=60).map(lambda b: base64.b64encode(b).decode()),
    )
)
def test_any_encrypted_descriptor_fails_only_as_data_loss_or_no_key(annotations: Any) -> None:
    document = {
        "layers": [
            {"mediaType": "a+encrypted", "digest": "sha256:" + "0" * 64, "annotations": annotations}
        ]
    }
    with contextlib.suppress(DataLoss, NoKey):
        decrypt_manifest(json.dumps(document).encode(), [], "here")


def test_encryption_without_keys_is_nothing() -> None:
    nothing = Encryption.from_config("", "")
    assert nothing.for_push(SCOPE, "trainer") is None and nothing.private == ()


@settings(max_examples=200, deadline=None)
@given(st.text(alphabet=st.sampled_from("jwe:/=,. aA-_tmp9"), max_size=40))
def test_any_encryption_keys_setting_fails_only_as_a_config_error(value: str) -> None:
    with contextlib.suppress(InvalidArgument, PermissionDenied):
        Encryption.from_config(value, "")


def test_the_shim_loads_no_crypto_until_a_push_or_pull_needs_it() -> None:
    code = (
        "import sys, cedana_shim.checkpoint.remote, cedana_shim.checkpoint.restore\n"
        "print(sorted(m for m in sys.modules if m.startswith(('cryptography', 'jwcrypto'))))"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.strip() == "[]", (done.stdout, done.stderr)
