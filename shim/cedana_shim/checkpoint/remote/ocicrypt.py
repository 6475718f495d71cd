"""ocicrypt's layer encryption, as containers/ocicrypt writes it, so that `skopeo copy
--decryption-key` (and any ocicrypt-aware tool) decrypts the layers we push.

A layer is encrypted with AES-256-CTR under a 32-byte key and a 16-byte nonce; an
HMAC-SHA256 of the ciphertext, keyed with the same key, is its integrity check
(ocicrypt's ``AES_256_CTR_HMAC_SHA256``). CTR keeps the size, so the encrypted blob is
as large as the plain one, and any offset can be produced without the bytes before it
(:func:`cipher_stream`): a resumed upload re-encrypts only from where it resumes. The
layer's descriptor gets ``+encrypted`` appended to its media type and two annotations:

- ``org.opencontainers.image.enc.pubopts``: base64 of ``{"cipher", "hmac",
  "cipheroptions"}``, readable by all;
- ``org.opencontainers.image.enc.keys.jwe``: comma-separated base64 JWEs (JSON
  serialization, A256GCM content encryption), one per recipient key, each wrapping the
  private options ``{"symkey", "digest", "cipheroptions": {"nonce"}}``: the key, the
  nonce and the digest of the plain layer. RSA keys are wrapped with RSA-OAEP, EC keys
  with ECDH-ES+A256KW, as ocicrypt does. Each recipient carries ``kid``: the key's
  fingerprint (:func:`fingerprint`), so a node without the key can say which it lacks.

A pull does not check the HMAC: it checks the ciphertext's digest while it downloads
and the decrypted layer's digest (named in the wrapped options) as the store writes
it. Neither proves who encrypted it (anyone with a recipient's public key can):
that is the signature's job (signing.py, trusted_keys).

The JWE is jwcrypto's (a maintained JOSE implementation on ``cryptography``): no
JOSE code of our own. Everything here is imported lazily, on a push or a pull.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import IO, TYPE_CHECKING, Any, Final

from cedana_shim import errors

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.types import (
        PrivateKeyTypes,
        PublicKeyTypes,
    )

__all__ = [
    "ANN_KEYS_JWE",
    "ANN_PUBOPTS",
    "CIPHER",
    "ENCRYPTED_SUFFIX",
    "DecryptingWriter",
    "LayerKey",
    "NoKey",
    "cipher_stream",
    "decrypted_descriptor",
    "encrypted_descriptor",
    "fingerprint",
    "is_encrypted",
    "unwrap",
]

ANN_KEYS_JWE: Final = "org.opencontainers.image.enc.keys.jwe"
ANN_PUBOPTS: Final = "org.opencontainers.image.enc.pubopts"
ENCRYPTED_SUFFIX: Final = "+encrypted"
CIPHER: Final = "AES_256_CTR_HMAC_SHA256"
_ENC_PREFIX: Final = "org.opencontainers.image.enc."
_MAX_RECIPIENTS: Final = 32
_MAX_JWE_CHARS: Final = 16 << 10
# What ocicrypt writes (and RSA-OAEP-256, which a JWK recipient may ask for): nothing
# else is tried on what a registry hands us.
_JWE_ALGS: Final = ("RSA-OAEP", "RSA-OAEP-256", "ECDH-ES+A256KW", "A256GCM")


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def _unb64(value: object, what: str) -> bytes:
    if not isinstance(value, str):
        raise errors.DataLoss(f"{what} is not base64 text")
    try:
        return base64.b64decode(value, validate=True)
    except (binascii.Error, ValueError):
        raise errors.DataLoss(f"{what} is not base64") from None


@dataclass(frozen=True)
class LayerKey:
    """What decrypts one layer: its key, nonce, HMAC and the plain layer's digest."""

    key: bytes  # 32 bytes
    nonce: bytes  # 16 bytes
    hmac: bytes  # of the ciphertext, keyed with ``key``
    plain_digest: str

    def private_options(self) -> bytes:
        return json.dumps(
            {
                "symkey": _b64(self.key),
                "digest": self.plain_digest,
                "cipheroptions": {"nonce": _b64(self.nonce)},
            },
            separators=(",", ":"),
        ).encode()

    def public_options(self) -> str:
        document = {"cipher": CIPHER, "hmac": _b64(self.hmac), "cipheroptions": {}}
        return _b64(json.dumps(document, separators=(",", ":")).encode())


def fingerprint(key: PublicKeyTypes) -> str:
    """``sha256:<hex>`` of the key's SubjectPublicKeyInfo (DER): what
    ``openssl pkey -pubin -in pub.pem -outform DER | sha256sum`` prints."""
    from cryptography.hazmat.primitives import serialization

    der = key.public_bytes(
        serialization.Encoding.DER, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    return "sha256:" + hashlib.sha256(der).hexdigest()


class _CipherStream:
    """A file-like view of ``source`` (positioned at ``offset``) through AES-256-CTR:
    encryption and decryption are the same operation."""

    def __init__(self, source: IO[bytes], key: bytes, nonce: bytes, offset: int) -> None:
        from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

        counter = (int.from_bytes(nonce, "big") + offset // 16) % (1 << 128)
        self._cipher = Cipher(algorithms.AES(key), modes.CTR(counter.to_bytes(16, "big")))
        self._context = self._cipher.encryptor()
        self._context.update(bytes(offset % 16))  # into the block where offset falls
        self._source = source

    def read(self, size: int = -1) -> bytes:
        return self._context.update(self._source.read(size))

    def readable(self) -> bool:
        return True

    def close(self) -> None:
        self._source.close()

    def __enter__(self) -> _CipherStream:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class DecryptingWriter:
    """Writes the decryption of what it is given (from offset 0 of the layer) to ``out``."""

    def __init__(self, out: IO[bytes], key: bytes, nonce: bytes) -> None:
        from cryptography.hazmat.primitives.ciphers import Cipher, algorithms, modes

        self._context = Cipher(algorithms.AES(key), modes.CTR(nonce)).decryptor()
        self._out = out

    def write(self, data: bytes) -> int:
        return self._out.write(self._context.update(data))


def cipher_stream(source: IO[bytes], key: bytes, nonce: bytes, offset: int = 0) -> IO[bytes]:
    """``source`` (at ``offset`` of the layer) encrypted or decrypted from ``offset`` on."""
    return _CipherStream(source, key, nonce, offset)  # type: ignore[return-value]


def is_encrypted(media_type: str) -> bool:
    return media_type.endswith(ENCRYPTED_SUFFIX)


def _jwe(plaintext: bytes, recipients: Sequence[tuple[str, PublicKeyTypes]]) -> str:
    from cryptography.hazmat.primitives.asymmetric import ec, rsa
    from jwcrypto import jwe, jwk

    token = jwe.JWE(plaintext, protected=json.dumps({"enc": "A256GCM"}))
    for kid, key in recipients:
        if isinstance(key, rsa.RSAPublicKey):
            alg = "RSA-OAEP"
        elif isinstance(key, ec.EllipticCurvePublicKey):
            alg = "ECDH-ES+A256KW"
        else:
            raise errors.InvalidArgument(
                f"encryption key {kid}: a {type(key).__name__}; ocicrypt's JWE takes RSA or EC keys"
            )
        token.add_recipient(jwk.JWK.from_pyca(key), header=json.dumps({"alg": alg, "kid": kid}))
    return str(token.serialize(compact=False))


def encrypted_descriptor(
    descriptor: Mapping[str, Any],
    layer: LayerKey,
    digest: str,
    recipients: Sequence[tuple[str, PublicKeyTypes]],
) -> dict[str, Any]:
    """The registry's descriptor of a layer encrypted under ``layer`` (now ``digest``);
    the key wrapped for each of ``recipients`` (fingerprint, public key)."""
    wrapped = _jwe(layer.private_options(), recipients)
    out = dict(descriptor)
    annotations = dict(out.get("annotations", {}))
    annotations[ANN_KEYS_JWE] = _b64(wrapped.encode())
    annotations[ANN_PUBOPTS] = layer.public_options()
    out.update(
        mediaType=str(descriptor["mediaType"]) + ENCRYPTED_SUFFIX,
        digest=digest,
        annotations=annotations,
    )
    return out


class NoKey(errors.FailedPrecondition):
    """None of this node's private keys opens a layer's key."""

    def __init__(self, message: str, kids: Sequence[str]) -> None:
        super().__init__(message)
        self.kids = tuple(kids)


def _recipient_kids(token: Mapping[str, Any]) -> list[str]:
    headers: list[Any] = [token.get("header")]
    recipients = token.get("recipients")
    if isinstance(recipients, list):
        headers += [r.get("header") for r in recipients if isinstance(r, dict)]
    kids = [h.get("kid") for h in headers if isinstance(h, dict)]
    return [k for k in kids if isinstance(k, str) and len(k) <= 80]


def unwrap(
    descriptor: Mapping[str, Any], keys: Iterable[tuple[str, str, PrivateKeyTypes]], where: str
) -> LayerKey:
    """The key of an encrypted layer, opened with the first of ``keys`` (path,
    fingerprint, private key) that can; NoKey (naming the recipients' fingerprints)
    when none can. A key is tried only on a JWE naming its fingerprint, or on one
    that names none (another tool's)."""
    from jwcrypto import jwe, jwk
    from jwcrypto.common import JWException

    annotations = descriptor.get("annotations")
    if not isinstance(annotations, dict):
        raise errors.DataLoss(f"{where}: an encrypted layer without annotations")
    pub = load_public_options(annotations.get(ANN_PUBOPTS), where)
    wrapped = annotations.get(ANN_KEYS_JWE)
    if not isinstance(wrapped, str) or not wrapped:
        raise errors.DataLoss(f"{where}: an encrypted layer without {ANN_KEYS_JWE}")
    parts = wrapped.split(",")
    if len(parts) > _MAX_RECIPIENTS or any(len(p) > _MAX_JWE_CHARS for p in parts):
        raise errors.DataLoss(f"{where}: {ANN_KEYS_JWE} is larger than any we write")
    kids: list[str] = []
    keys = list(keys)
    for part in parts:
        text = _unb64(part, f"{where}: {ANN_KEYS_JWE}")
        try:
            document = json.loads(text)
        except ValueError:
            raise errors.DataLoss(f"{where}: {ANN_KEYS_JWE} holds no JWE") from None
        named = _recipient_kids(document) if isinstance(document, dict) else []
        kids += named
        for _, kid, key in keys:
            if named and kid not in named:
                continue
            token = jwe.JWE()
            token.allowed_algs = list(_JWE_ALGS)
            try:
                token.deserialize(text.decode(), key=jwk.JWK.from_pyca(key))
            except (JWException, ValueError, TypeError, KeyError, UnicodeDecodeError):
                continue
            return _private_options(token.payload, pub, where)
    theirs = ", ".join(sorted(set(kids))) or "keys that do not say which"
    mine = ", ".join(path for path, _, _ in keys) or "no key: decryption_keys is empty"
    raise NoKey(
        f"{where}: encrypted for {theirs}; this node's decryption_keys ({mine}) open none of "
        "them: add the private key of one of those recipients to decryption_keys",
        sorted(set(kids)),
    )


def load_public_options(value: object, where: str) -> bytes:
    """The HMAC from the pubopts annotation (the only public option we use)."""
    what = f"{where}: {ANN_PUBOPTS}"
    try:
        document = json.loads(_unb64(value, what))
    except ValueError:
        raise errors.DataLoss(f"{what} is not JSON") from None
    if not isinstance(document, dict) or document.get("cipher") != CIPHER:
        cipher = document.get("cipher") if isinstance(document, dict) else None
        raise errors.DataLoss(f"{what}: cipher {cipher!r}, not {CIPHER}")
    mac = _unb64(document.get("hmac"), f"{what}: hmac")
    if len(mac) != 32:
        raise errors.DataLoss(f"{what}: an HMAC of {len(mac)} bytes")
    return mac


def _private_options(data: bytes, mac: bytes, where: str) -> LayerKey:
    from cedana_shim.checkpoint.store.layout import is_digest

    try:
        document = json.loads(data)
    except ValueError:
        raise errors.DataLoss(f"{where}: the wrapped layer key is not JSON") from None
    if not isinstance(document, dict):
        raise errors.DataLoss(f"{where}: the wrapped layer key is not a JSON object")
    key = _unb64(document.get("symkey"), f"{where}: symkey")
    options = document.get("cipheroptions")
    nonce = _unb64(options.get("nonce") if isinstance(options, dict) else None, f"{where}: nonce")
    digest = document.get("digest")
    if len(key) != 32 or len(nonce) != 16 or not is_digest(digest):
        raise errors.DataLoss(f"{where}: the wrapped layer key is not an AES-256-CTR key")
    assert isinstance(digest, str)
    return LayerKey(key, nonce, mac, digest)


def decrypted_descriptor(descriptor: Mapping[str, Any], layer: LayerKey) -> dict[str, Any]:
    """The plain layer's descriptor (as the pushing node's store had it)."""
    out = dict(descriptor)
    out["mediaType"] = str(descriptor["mediaType"]).removesuffix(ENCRYPTED_SUFFIX)
    out["digest"] = layer.plain_digest
    annotations = {
        k: v for k, v in dict(descriptor.get("annotations", {})).items()
        if not k.startswith(_ENC_PREFIX)
    }  # fmt: skip
    if annotations:
        out["annotations"] = annotations
    else:
        out.pop("annotations", None)
    return out
