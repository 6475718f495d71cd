"""Encrypted checkpoints in the registry: which keys, and how a push keeps its dedupe.

The node config's ``encryption_keys`` names the recipients, as skopeo's
``--encryption-key`` spells them (``jwe:/path/pub.pem``, RSA or EC), comma-separated;
an entry ``<namespace>=jwe:/path`` is for that namespace alone, and a namespace with
entries of its own is encrypted for those only (its key opens nothing of another
namespace). ``decryption_keys`` are the private keys (PEM, mode 0600) this node
opens layers with. Every layer of a push is encrypted (ocicrypt.py); the config
(metadata: names, image, versions, sizes) and the manifest stay readable: a node
judges a candidate on them before it downloads anything.

Dedupe: chunks are shared between checkpoints (a second checkpoint uploads what
changed), so the same plain chunk must encrypt to the same blob. The layer key and
nonce are therefore convergent: HMAC-SHA256 of the plain blob's digest under a secret
derived from the namespace, the label, the fingerprints of the namespace's recipients
and the private key of one of them (in ``decryption_keys``): everything else is
readable in the registry, so without that private key anyone could derive the keys.
Every node with the same keys derives the same secret, so a checkpoint pushed after a
move still shares the chunks of the one before (the node learns their encrypted
digests from the label's newest checkpoint in the registry: PushCipher); a node
holding no recipient's private key encrypts its push under fresh random keys (no
dedupe). What it reveals (README,
"Signed and encrypted checkpoints"): that two checkpoints of one label hold an
identical chunk (the dedupe itself). A new recipient set (key rotation) starts new
keys: the first push after it uploads every chunk once.
"""

from __future__ import annotations

import hashlib
import hmac
import logging
import re
import secrets
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import IO, TYPE_CHECKING, Any, Final

from cedana_shim import errors
from cedana_shim.checkpoint.store.layout import dump_json, load_json
from cedana_shim.registry import ProgressCallback, PushResult, Registry

from .keys import load_private_key, load_public_key, split_paths
from .ocicrypt import (
    LayerKey,
    cipher_stream,
    decrypted_descriptor,
    encrypted_descriptor,
    fingerprint,
    is_encrypted,
    unwrap,
)
from .sender import OpenSource

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.types import (
        PrivateKeyTypes,
        PublicKeyTypes,
    )

__all__ = [
    "Earlier",
    "EncryptedLayer",
    "Encryption",
    "PushCipher",
    "decrypt_manifest",
    "has_encrypted",
]

# Encrypted chunks remembered by a node (their digest and HMAC): a second checkpoint's
# unchanged chunks are looked up by that digest instead of sent again. About 200 bytes
# each: 64 Ki of them are 8 TiB of chunks at 8 MiB.
_KNOWN_MAX: Final = 1 << 16
_NAMESPACE_RE: Final = re.compile(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?")
_KDF_CONTEXT: Final = b"cedana-shim checkpoint layer keys v2"
log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Recipient:
    path: str
    kid: str  # fingerprint(): what the JWE names
    key: PublicKeyTypes


@dataclass(frozen=True)
class EncryptedLayer:
    """A layer as the registry holds it: its blob's digest and what decrypts it."""

    digest: str
    key: LayerKey


def _parse_recipients(value: str) -> dict[str | None, list[Recipient]]:
    found: dict[str | None, list[Recipient]] = {}
    for entry in split_paths(value):
        scope: str | None = None
        spec = entry
        head, sep, tail = entry.partition("=")
        if sep and not head.startswith("jwe:"):
            if not _NAMESPACE_RE.fullmatch(head):
                raise errors.InvalidArgument(
                    f"encryption_keys entry {entry!r}: {head!r} is not a namespace name"
                )
            scope, spec = head, tail
        if not spec.startswith("jwe:"):
            raise errors.InvalidArgument(
                f"encryption_keys entry {entry!r}: a recipient is jwe:<path to a PEM public "
                "key> (skopeo's --encryption-key spelling), optionally after <namespace>="
            )
        path = spec.removeprefix("jwe:")
        key = load_public_key(path, "encryption_keys")
        from cryptography.hazmat.primitives.asymmetric import ec, rsa

        if not isinstance(key, (rsa.RSAPublicKey, ec.EllipticCurvePublicKey)):
            raise errors.InvalidArgument(
                f"encryption_keys {path}: a {type(key).__name__}; ocicrypt's JWE recipients "
                "are RSA or EC keys"
            )
        found.setdefault(scope, []).append(Recipient(path, fingerprint(key), key))
    return found


class Encryption:
    """The node's keys (see the module doc)."""

    def __init__(
        self,
        recipients: Mapping[str | None, Sequence[Recipient]],
        private: Sequence[tuple[str, str, PrivateKeyTypes]],
    ) -> None:
        self._recipients = {k: tuple(v) for k, v in recipients.items()}
        self.private = tuple(private)  # (path, fingerprint, key)
        self._known = _Known()

    @classmethod
    def from_config(cls, encryption_keys: str, decryption_keys: str) -> Encryption:
        private = []
        for path in split_paths(decryption_keys):
            key = load_private_key(path, "decryption_keys")
            private.append((path, fingerprint(key.public_key()), key))
        return cls(_parse_recipients(encryption_keys), private)

    def recipients(self, scope: str) -> tuple[Recipient, ...]:
        return self._recipients.get(scope) or self._recipients.get(None) or ()

    def for_push(self, scope: str, label: str, earlier: Earlier | None = None) -> PushCipher | None:
        """What encrypts a push of (scope, label); None when it has no recipient.
        ``earlier``: the label's previous checkpoint's layers, read on the first chunk
        this node does not know."""
        recipients = self.recipients(scope)
        if not recipients:
            return None
        kids = sorted(r.kid for r in recipients)
        # The convergence secret needs a secret: namespace, label and the recipients'
        # fingerprints are all readable in the registry (the JWE headers name the kids,
        # the config the plain digests), so a private key of one recipient is mixed in.
        # Every node holding it derives the same keys; one holding none gets fresh
        # random keys for this push (secure, no dedupe with earlier pushes).
        own = sorted((kid, key) for _path, kid, key in self.private if kid in kids)
        if own:
            hidden = hashlib.sha256(_private_der(own[0][1])).digest()
        else:
            earlier = None  # fresh keys: nothing earlier was encrypted under them
            log.warning(
                "encrypted push without a recipient's private key in decryption_keys: its "
                "chunks get fresh keys and share nothing with earlier checkpoints",
                extra={"namespace": scope, "label": label},
            )
            hidden = secrets.token_bytes(32)
        material = b"\0".join(
            [_KDF_CONTEXT, scope.encode(), label.encode(), *(k.encode() for k in kids)]
        )
        secret = hmac.new(hidden, material, "sha256").digest()
        return PushCipher(recipients, secret, self._known, earlier)


def _private_der(key: PrivateKeyTypes) -> bytes:
    from cryptography.hazmat.primitives import serialization

    return key.private_bytes(
        serialization.Encoding.DER,
        serialization.PrivateFormat.PKCS8,
        serialization.NoEncryption(),
    )


class _Known:
    """(secret, plain digest) -> the encrypted layer, across the pushes of a node."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._layers: dict[tuple[bytes, str], EncryptedLayer] = {}

    def get(self, secret: bytes, digest: str) -> EncryptedLayer | None:
        with self._lock:
            return self._layers.get((secret, digest))

    def put(self, secret: bytes, digest: str, layer: EncryptedLayer) -> None:
        with self._lock:
            if len(self._layers) >= _KNOWN_MAX:
                self._layers.clear()  # rare, and only costs an upload of each again
            self._layers[(secret, digest)] = layer


# Plain digest -> the encrypted layer, read from the newest checkpoint of the label
# in the registry (decrypt_manifest): what a node that did not push it learns.
Earlier = Callable[[], Mapping[str, EncryptedLayer]]


class PushCipher:
    """Encrypts and sends the layers of one push; safe to share between the sender's
    threads.

    One pass per new chunk: a chunk whose encrypted blob this node knows (it pushed it,
    or read it in the label's previous checkpoint: ``earlier``) is looked up in the
    registry by that digest and skipped when there; any other is encrypted as it
    streams and committed under the digest of what was sent, its HMAC taken from the
    same bytes (registry.push's "push by content"). Its upload resumes under a key
    derived from the secret and the plain digest, which fixes the ciphertext.
    """

    def __init__(
        self,
        recipients: Sequence[Recipient],
        secret: bytes,
        known: _Known,
        earlier: Earlier | None = None,
    ) -> None:
        self._recipients = [(r.kid, r.key) for r in recipients]
        self._secret = secret
        self._known = known
        self._earlier = earlier
        self._earlier_lock = threading.Lock()  # read once, by the first thread to miss
        self._lock = threading.Lock()
        self._layers: dict[str, EncryptedLayer] = {}

    def _derive(self, what: bytes, plain_digest: str) -> bytes:
        return hmac.new(self._secret, what + b"\0" + plain_digest.encode(), "sha256").digest()

    def push(
        self,
        client: Registry,
        repo: str,
        digest: str,
        size: int,
        open_at: OpenSource,
        progress: ProgressCallback | None,
    ) -> PushResult:
        """Send plain blob ``digest`` encrypted (see the class doc)."""
        key = self._derive(b"key", digest)
        nonce = self._derive(b"nonce", digest)[:16]

        def open_encrypted(offset: int) -> IO[bytes]:
            return cipher_stream(open_at(offset), key, nonce, offset)

        known = self._known.get(self._secret, digest) or self._from_earlier(digest, key)
        if known is not None:
            # A blob changed since it was remembered is caught by the upload, which
            # hashes what it sends and refuses to commit it under the wrong digest.
            self._remember(digest, known)
            return client.push_blob(repo, known.digest, size, open_encrypted, progress)
        upload_key = self._derive(b"upload", digest).hex()
        mac = hmac.new(key, digestmod="sha256")
        result = client.push_blob_by_content(repo, upload_key, size, open_encrypted, progress, mac)
        layer = EncryptedLayer(result.digest, LayerKey(key, nonce, result.tap, digest))
        self._known.put(self._secret, digest, layer)
        self._remember(digest, layer)
        return result

    def _remember(self, digest: str, layer: EncryptedLayer) -> None:
        with self._lock:
            self._layers[digest] = layer

    def _from_earlier(self, digest: str, key: bytes) -> EncryptedLayer | None:
        """The layer as the label's previous checkpoint holds it, under our keys."""
        with self._earlier_lock:
            earlier, self._earlier = self._earlier, None
            if earlier is not None:
                for plain, layer in earlier().items():
                    # Only what our secret encrypted (a rotation starts new keys).
                    if layer.key.key == self._derive(b"key", plain):
                        self._known.put(self._secret, plain, layer)
        found = self._known.get(self._secret, digest)
        return found if found is not None and found.key.key == key else None

    def manifest(self, data: bytes, where: str) -> bytes:
        """The registry manifest ``data`` with every layer's descriptor encrypted."""
        document = load_json(data, where)
        layers = []
        for item in document["layers"]:
            with self._lock:
                layer = self._layers.get(item["digest"])
            if layer is None:
                raise errors.Internal(f"{where}: layer {item['digest']} was not encrypted")
            layers.append(encrypted_descriptor(item, layer.key, layer.digest, self._recipients))
        document["layers"] = layers
        return dump_json(document)


def has_encrypted(data: bytes, where: str) -> bool:
    document = load_json(data, where)
    layers = document.get("layers") if isinstance(document, dict) else None
    return isinstance(layers, list) and any(
        isinstance(d, dict) and is_encrypted(str(d.get("mediaType", ""))) for d in layers
    )


def decrypt_manifest(
    data: bytes, keys: Sequence[tuple[str, str, PrivateKeyTypes]], where: str
) -> tuple[bytes, dict[str, EncryptedLayer]]:
    """The manifest with its layers' plain descriptors, and plain digest -> the
    encrypted layer; ocicrypt.NoKey when ``keys`` open none of a layer's keys."""
    document: Any = load_json(data, where)
    layers: list[Any] = []
    found: dict[str, EncryptedLayer] = {}
    opened: dict[str, LayerKey] = {}  # one unwrap per JWE, not per chunk that repeats
    for i, item in enumerate(document.get("layers", [])):
        if not isinstance(item, dict) or not is_encrypted(str(item.get("mediaType", ""))):
            layers.append(item)
            continue
        annotations = item.get("annotations")
        wrapped = (
            annotations.get("org.opencontainers.image.enc.keys.jwe")
            if isinstance(annotations, dict)
            else None
        )
        cache_key = str(wrapped)
        layer = opened.get(cache_key)
        if layer is None:
            layer = unwrap(item, keys, f"{where}: layers[{i}]")
            opened[cache_key] = layer
        digest = item.get("digest")
        if not isinstance(digest, str):
            raise errors.DataLoss(f"{where}: layers[{i}]: no digest")
        found[layer.plain_digest] = EncryptedLayer(digest, layer)
        layers.append(decrypted_descriptor(item, layer))
    document["layers"] = layers
    return dump_json(document), found
