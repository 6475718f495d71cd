"""Signed checkpoints: a node signs what it pushes (signing_key), a node trusting keys
(trusted_keys) refuses, before any blob is read, what none of them signed. Real
stores and the remote store's own code over a shared directory (two stores, two
nodes); the cosign format's codecs under hypothesis."""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path
from typing import Any

import pytest
from cedana_shim.checkpoint.remote import RemoteStore
from cedana_shim.checkpoint.remote.cosign import (
    is_signature_tag,
    parse_signature_manifest,
    payload,
    signature_config,
    signature_manifest,
    signature_tag,
)
from cedana_shim.checkpoint.remote.shared_dir import SharedDirectory
from cedana_shim.checkpoint.remote.signing import Signer, Trust
from cedana_shim.checkpoint.store import Store
from cedana_shim.checkpoint.store.layout import MEDIA_TYPE_MANIFEST
from cedana_shim.config import NodeConfig
from cedana_shim.errors import InvalidArgument, PermissionDenied
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ec, ed25519, rsa
from hypothesis import given
from hypothesis import strategies as st
from support.checkpoints import SCOPE, MiB, commit_checkpoint, open_store

digests = st.binary(min_size=32, max_size=32).map(lambda b: "sha256:" + b.hex())


class CountingDirectory(SharedDirectory):
    def __init__(self, path: str) -> None:
        super().__init__(path)
        self.pulled: list[str] = []

    def pull_blob(self, repo: str, digest: str, *args: Any, **kw: Any) -> None:
        self.pulled.append(digest)
        super().pull_blob(repo, digest, *args, **kw)


def write_key_pair(directory: Path, name: str, kind: str = "ec") -> tuple[Path, Path]:
    """(private, public) PEM files: the private one mode 0600."""
    key: Any
    if kind == "ec":
        key = ec.generate_private_key(ec.SECP256R1())
    elif kind == "rsa":
        key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    else:
        key = ed25519.Ed25519PrivateKey.generate()
    private, public = directory / f"{name}.key", directory / f"{name}.pub"
    private.write_bytes(
        key.private_bytes(
            serialization.Encoding.PEM,
            serialization.PrivateFormat.PKCS8,
            serialization.NoEncryption(),
        )
    )
    private.chmod(0o600)
    public.write_bytes(
        key.public_key().public_bytes(
            serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
        )
    )
    return private, public


@pytest.fixture
def shared(tmp_path: Path) -> Path:
    path = tmp_path / "shared"
    path.mkdir(mode=0o700)
    return path


def _files() -> dict[str, bytes]:
    return {"pages-1.img": os.urandom(MiB), "core-1.img": b"core" * 100, "inventory.img": b"i"}


def _pushed(tmp_path: Path, shared: Path, signer: Signer | None) -> tuple[Store, str]:
    store = open_store(tmp_path / "store-a", chunk_size=256 << 10)
    entry = commit_checkpoint(store, _files())
    RemoteStore(store, SharedDirectory(str(shared)), "node-a", signer=signer).push(entry.id)
    return store, entry.id


def _reader(tmp_path: Path, shared: Path, trust: Trust | None) -> RemoteStore:
    store = open_store(tmp_path / "store-b", chunk_size=256 << 10)
    return RemoteStore(store, CountingDirectory(str(shared)), "node-b", trust=trust)


@pytest.mark.parametrize("kind", ["ec", "rsa", "ed25519"])
def test_a_signed_checkpoint_is_pulled_by_a_node_trusting_its_key(
    tmp_path: Path, shared: Path, kind: str
) -> None:
    private, public = write_key_pair(tmp_path, "real", kind)
    _, checkpoint_id = _pushed(tmp_path, shared, Signer(str(private)))
    reader = _reader(tmp_path, shared, Trust([str(public)]))
    (found,) = reader.candidates(SCOPE, "trainer")  # the .sig tag is no candidate
    assert reader.pull(found).id == checkpoint_id
    tags = os.listdir(shared / SCOPE / "tags")
    assert len([t for t in tags if is_signature_tag(t)]) == 1


@pytest.mark.parametrize("signed_by", [None, "other"])
def test_unsigned_or_untrusted_checkpoints_are_refused_before_any_blob(
    tmp_path: Path, shared: Path, signed_by: str | None
) -> None:
    _, public = write_key_pair(tmp_path, "real")
    other, _ = write_key_pair(tmp_path, "other")
    _pushed(tmp_path, shared, Signer(str(other)) if signed_by else None)
    reader = _reader(tmp_path, shared, Trust([str(public)]))
    (found,) = reader.candidates(SCOPE, "trainer")
    for attempt in (reader.fetch_metadata, reader.pull):
        with pytest.raises(PermissionDenied) as err:
            attempt(found)
        assert str(public) in str(err.value) and found.checkpoint_id in str(err.value)
        assert ("not signed" in str(err.value)) == (signed_by is None)
    assert isinstance(reader.client, CountingDirectory)
    assert reader.client.pulled == []  # not even the config
    # A node that trusts no key takes it as before.
    assert _reader(tmp_path / "c", shared, None).pull(found).id == found.checkpoint_id


def test_a_signature_moved_onto_another_checkpoint_is_refused(tmp_path: Path, shared: Path) -> None:
    private, public = write_key_pair(tmp_path, "real")
    signer = Signer(str(private))
    store, first = _pushed(tmp_path, shared, signer)
    second = commit_checkpoint(store, _files())
    RemoteStore(store, SharedDirectory(str(shared)), "node-a").push(second.id)  # unsigned
    client = SharedDirectory(str(shared))
    reader = _reader(tmp_path, shared, Trust([str(public)]))
    newest, older = reader.candidates(SCOPE, "trainer")
    assert (newest.checkpoint_id, older.checkpoint_id) == (second.id, first)
    # The forger copies the first checkpoint's signature manifest under the second's.
    first_digest = client.get_manifest(SCOPE, older.tag)[2]
    second_digest = client.get_manifest(SCOPE, newest.tag)[2]
    sig, _, _ = client.get_manifest(SCOPE, signature_tag(first_digest))
    client.put_manifest(SCOPE, signature_tag(second_digest), sig, MEDIA_TYPE_MANIFEST)
    with pytest.raises(PermissionDenied, match="copied from another checkpoint"):
        reader.fetch_metadata(newest)
    assert reader.pull(older).id == first


def test_a_private_key_others_can_read_is_refused(tmp_path: Path) -> None:
    private, public = write_key_pair(tmp_path, "real")
    private.chmod(0o640)
    with pytest.raises(PermissionDenied, match=r"mode 0640.*chmod 600"):
        Signer(str(private))
    with pytest.raises(InvalidArgument, match="not an unencrypted PEM private key"):
        public.chmod(0o600)
        Signer(str(public))
    with pytest.raises(InvalidArgument, match="not a PEM public key"):
        Trust([str(private)])
    with pytest.raises(InvalidArgument, match="absolute"):
        Trust(["relative.pub"])


def test_the_node_config_names_the_keys(tmp_path: Path, shared: Path) -> None:
    private, public = write_key_pair(tmp_path, "real")
    store = open_store(tmp_path / "store", chunk_size=0)
    config = NodeConfig(registry=str(shared), signing_key=str(private), trusted_keys=f" {public} ,")
    remote = RemoteStore.from_config(store, config, "node-a")
    assert remote is not None and remote.signer is not None and remote.trust is not None
    assert remote.trust.paths == (str(public),)
    unsigned = RemoteStore.from_config(store, NodeConfig(registry=str(shared)), "node-a")
    assert unsigned is not None and unsigned.signer is None and unsigned.trust is None


# -- the format ------------------------------------------------------------------------


@given(digests)
def test_signature_tags_round_trip(digest: str) -> None:
    tag = signature_tag(digest)
    assert is_signature_tag(tag) and tag == digest.replace(":", "-") + ".sig"
    assert not is_signature_tag(tag.removesuffix(".sig"))


@given(st.text(min_size=1, max_size=80), digests, st.binary(min_size=1, max_size=600))
def test_signature_manifests_round_trip(reference: str, digest: str, signature: bytes) -> None:
    signed = payload(reference, digest)
    document = json.loads(signed)
    assert document["critical"]["image"]["docker-manifest-digest"] == digest
    manifest = signature_manifest(signed, signature, signature_config("sha256:" + "0" * 64))
    (layer,) = parse_signature_manifest(manifest, "here")
    assert layer.signature == signature and layer.payload_size == len(signed)


@given(st.binary(max_size=2000))
def test_any_bytes_as_a_signature_manifest_fail_only_as_refusals(data: bytes) -> None:
    with contextlib.suppress(PermissionDenied):
        parse_signature_manifest(data, "here")


@given(
    st.recursive(
        st.none() | st.integers() | st.text(),
        lambda c: st.lists(c) | st.dictionaries(st.text(), c),
        max_leaves=20,
    )
)
def test_any_json_as_a_signature_manifest_fails_only_as_refusals(value: Any) -> None:
    for document in (value, {"layers": [value]}, {"layers": [{"mediaType": value}]}):
        with contextlib.suppress(PermissionDenied):
            parse_signature_manifest(json.dumps(document).encode(), "here")
