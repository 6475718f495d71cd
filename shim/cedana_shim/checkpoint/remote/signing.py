"""Signing the checkpoints a node pushes, and refusing those no trusted key signed.

:class:`Signer` (the node config's ``signing_key``) puts a cosign signature
(cosign.py) of a checkpoint's manifest into the registry BEFORE the checkpoint's tag:
a tag, once visible, is signed. :class:`Trust` (``trusted_keys``) checks a manifest's
signature right after the manifest is read and before anything else of the
checkpoint is downloaded: a checkpoint nobody trusted signed (unsigned, a bad
signature, another key's, a signature of another manifest) is refused with
PermissionDenied, which says why and which keys this node trusts.

Keys: ECDSA (P-256 with SHA-256, as cosign's own keys), RSA (PKCS#1 v1.5, SHA-256) or
Ed25519, as cosign signs and verifies with each. The crypto (``cryptography``) is
imported only here and in keys.py, both loaded on a push or pull alone.
"""

from __future__ import annotations

import hashlib
import io
from collections.abc import Callable, Sequence
from typing import IO, TYPE_CHECKING

from cedana_shim import errors
from cedana_shim.checkpoint.store.layout import MEDIA_TYPE_MANIFEST
from cedana_shim.registry import Registry

from .cosign import (
    MAX_PAYLOAD_BYTES,
    MAX_SIGNATURE_MANIFEST_BYTES,
    check_payload,
    parse_signature_manifest,
    payload,
    signature_config,
    signature_manifest,
    signature_tag,
)
from .keys import load_private_key, load_public_key, split_paths

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.types import (
        PrivateKeyTypes,
        PublicKeyTypes,
    )

__all__ = ["Signer", "Trust"]


def _sha256(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def _reference(client: Registry, repo: str) -> str:
    return f"{client.host}/{repo}"


def _bytes(data: bytes) -> Callable[[int], IO[bytes]]:
    def open_at(offset: int) -> IO[bytes]:
        stream = io.BytesIO(data)
        stream.seek(offset)
        return stream

    return open_at


def _sign(key: PrivateKeyTypes, data: bytes, path: str) -> bytes:
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec, ed25519, padding, rsa

    if isinstance(key, ec.EllipticCurvePrivateKey):
        return key.sign(data, ec.ECDSA(hashes.SHA256()))
    if isinstance(key, rsa.RSAPrivateKey):
        return key.sign(data, padding.PKCS1v15(), hashes.SHA256())
    if isinstance(key, ed25519.Ed25519PrivateKey):
        return key.sign(data)
    raise errors.InvalidArgument(
        f"signing_key {path}: a {type(key).__name__}; use an ECDSA, RSA or Ed25519 key"
    )


def _verifies(key: PublicKeyTypes, data: bytes, signature: bytes) -> bool:
    from cryptography.exceptions import InvalidSignature
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.asymmetric import ec, ed25519, padding, rsa

    try:
        if isinstance(key, ec.EllipticCurvePublicKey):
            key.verify(signature, data, ec.ECDSA(hashes.SHA256()))
        elif isinstance(key, rsa.RSAPublicKey):
            key.verify(signature, data, padding.PKCS1v15(), hashes.SHA256())
        elif isinstance(key, ed25519.Ed25519PublicKey):
            key.verify(signature, data)
        else:
            return False
    except InvalidSignature:
        return False
    return True


class Signer:
    """Signs checkpoint manifests with the private key at ``path`` (mode 0600)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._key = load_private_key(path, "signing_key")
        _sign(self._key, b"", path)  # refuses a key type cosign cannot verify, now

    def sign(self, data: bytes) -> bytes:
        return _sign(self._key, data, self.path)

    def push_signature(self, client: Registry, repo: str, manifest: bytes) -> str:
        """Put the signature of ``manifest`` (the bytes about to be tagged); its tag."""
        signed = payload(_reference(client, repo), _sha256(manifest))
        config = signature_config(_sha256(signed))
        for blob in (signed, config):
            client.push_blob(repo, _sha256(blob), len(blob), _bytes(blob))
        tag = signature_tag(_sha256(manifest))
        document = signature_manifest(signed, self.sign(signed), config)
        client.put_manifest(repo, tag, document, MEDIA_TYPE_MANIFEST)
        return tag


class Trust:
    """The public keys whose signatures this node accepts (``trusted_keys``)."""

    def __init__(self, paths: Sequence[str]) -> None:
        if not paths:
            raise errors.InvalidArgument("trusted_keys names no key")
        self.paths = tuple(paths)
        self._keys = [(p, load_public_key(p, "trusted_keys")) for p in self.paths]

    @classmethod
    def from_setting(cls, value: str) -> Trust | None:
        paths = split_paths(value)
        return cls(paths) if paths else None

    def check(self, client: Registry, repo: str, digest: str, what: str) -> str:
        """The path of the trusted key that signed manifest ``digest`` of ``repo``;
        PermissionDenied (saying why) when none did. Reads the signature manifest and,
        only for a payload not written the way this shim writes it, that payload (a
        few hundred bytes): never a blob of the checkpoint."""
        tag = signature_tag(digest)
        where = f"registry {client.host}: {repo}:{tag}"
        try:
            data, _, _ = client.get_manifest(repo, tag, max_size=MAX_SIGNATURE_MANIFEST_BYTES)
        except errors.NotFound:
            raise self._refusal(what, f"it is not signed (no {tag} in {repo})") from None
        except errors.DataLoss as err:
            raise self._refusal(what, f"its signature cannot be read: {err}") from None
        try:
            return self._verify(client, repo, digest, data, where)
        except errors.PermissionDenied as err:
            raise self._refusal(what, str(err)) from None

    def _verify(self, client: Registry, repo: str, digest: str, data: bytes, where: str) -> str:
        expected = payload(_reference(client, repo), digest)
        for layer in parse_signature_manifest(data, where):
            if layer.payload_digest == _sha256(expected):
                signed = expected
            else:
                signed = self._download(client, repo, layer.payload_digest, layer.payload_size)
            for path, key in self._keys:
                if _verifies(key, signed, layer.signature):
                    check_payload(signed, digest, where)
                    return path
        raise errors.PermissionDenied(
            f"{where}: signed by none of the trusted keys (or the signature is bad)"
        )

    def _download(self, client: Registry, repo: str, digest: str, size: int) -> bytes:
        out = io.BytesIO()
        client.pull_blob(repo, digest, size, out, MAX_PAYLOAD_BYTES)
        return out.getvalue()

    def _refusal(self, what: str, why: str) -> errors.PermissionDenied:
        return errors.PermissionDenied(
            f"{what}: {why}; this node restores only checkpoints signed by a key in "
            f"trusted_keys ({', '.join(self.paths)}): skipped, nothing of it was downloaded"
        )
