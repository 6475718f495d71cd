"""Checkpoint signatures in cosign's key-based format, written and read back strictly.

A signed checkpoint has, beside its tag, the manifest ``sha256-<hex>.sig`` (cosign's
"simple signing" layout, which ``cosign verify --key pub.pem --insecure-ignore-tlog``
accepts): an image config naming the payload, and one layer per signature, each the
payload blob (a JSON document naming the checkpoint manifest's digest) with its
signature, base64, in the annotation ``dev.cosignproject.cosign/signature``.

The signature covers the manifest digest, and the manifest names every blob by its
digest: a verified manifest pins the config and every layer of the checkpoint.

This module is the format alone (no key, no I/O): signing.py signs and verifies.
Everything read back is untrusted and parsed with limits.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import json
from dataclasses import dataclass
from typing import Any, Final

from cedana_shim import errors
from cedana_shim.checkpoint.store.layout import MEDIA_TYPE_MANIFEST, is_digest, load_json

__all__ = [
    "ANN_SIGNATURE",
    "MAX_PAYLOAD_BYTES",
    "MAX_SIGNATURES",
    "MAX_SIGNATURE_MANIFEST_BYTES",
    "MEDIA_TYPE_IMAGE_CONFIG",
    "MEDIA_TYPE_SIMPLE_SIGNING",
    "SignatureLayer",
    "check_payload",
    "is_signature_tag",
    "parse_signature_manifest",
    "payload",
    "signature_config",
    "signature_manifest",
    "signature_tag",
]

MEDIA_TYPE_SIMPLE_SIGNING: Final = "application/vnd.dev.cosign.simplesigning.v1+json"
MEDIA_TYPE_IMAGE_CONFIG: Final = "application/vnd.oci.image.config.v1+json"
ANN_SIGNATURE: Final = "dev.cosignproject.cosign/signature"
PAYLOAD_TYPE: Final = "cosign container image signature"
# Bounds on what is read back: a payload is ~250 bytes, a signature manifest holds one
# layer per signing (cosign appends), a few hundred bytes each.
MAX_PAYLOAD_BYTES: Final = 64 << 10
MAX_SIGNATURE_MANIFEST_BYTES: Final = 256 << 10
MAX_SIGNATURES: Final = 64
_SIG_SUFFIX: Final = ".sig"


def signature_tag(digest: str) -> str:
    """The tag of the signatures of the manifest ``digest`` (cosign's convention)."""
    if not is_digest(digest):
        raise errors.InvalidArgument(f"{digest!r} is not a sha256 digest")
    return digest.replace(":", "-", 1) + _SIG_SUFFIX


def is_signature_tag(tag: str) -> bool:
    if not (tag.startswith("sha256-") and tag.endswith(_SIG_SUFFIX)):
        return False
    return is_digest(tag.removesuffix(_SIG_SUFFIX).replace("-", ":", 1))


def _dump(value: Any) -> bytes:
    # Compact, keys in cosign's order: the bytes cosign itself writes for a payload.
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode()


def payload(reference: str, digest: str) -> bytes:
    """The simple-signing payload that says ``reference@digest`` is signed."""
    return _dump(
        {
            "critical": {
                "identity": {"docker-reference": reference},
                "image": {"docker-manifest-digest": digest},
                "type": PAYLOAD_TYPE,
            },
            "optional": None,
        }
    )


def check_payload(data: bytes, digest: str, where: str) -> None:
    """That a payload (already verified as signed) says ``digest`` is what it signs."""
    document = load_json(data, f"{where}: payload")
    critical = document.get("critical") if isinstance(document, dict) else None
    image = critical.get("image") if isinstance(critical, dict) else None
    if not isinstance(critical, dict) or critical.get("type") != PAYLOAD_TYPE:
        raise errors.PermissionDenied(f"{where}: the payload is not a cosign image signature")
    signed = image.get("docker-manifest-digest") if isinstance(image, dict) else None
    if signed != digest:
        raise errors.PermissionDenied(
            f"{where}: the signature is for manifest {signed!r}, not {digest}: a signature "
            "copied from another checkpoint"
        )


def signature_config(payload_digest: str) -> bytes:
    """The image config cosign writes beside a signature: the payload as its one layer."""
    return _dump(
        {
            "architecture": "",
            "created": "0001-01-01T00:00:00Z",
            "history": [{"created": "0001-01-01T00:00:00Z"}],
            "os": "",
            "rootfs": {"type": "layers", "diff_ids": [payload_digest]},
            "config": {},
        }
    )


def _sha256(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def signature_manifest(payload_data: bytes, signature: bytes, config: bytes) -> bytes:
    return _dump(
        {
            "schemaVersion": 2,
            "mediaType": MEDIA_TYPE_MANIFEST,
            "config": {
                "mediaType": MEDIA_TYPE_IMAGE_CONFIG,
                "size": len(config),
                "digest": _sha256(config),
            },
            "layers": [
                {
                    "mediaType": MEDIA_TYPE_SIMPLE_SIGNING,
                    "size": len(payload_data),
                    "digest": _sha256(payload_data),
                    "annotations": {ANN_SIGNATURE: base64.b64encode(signature).decode()},
                }
            ],
        }
    )


@dataclass(frozen=True)
class SignatureLayer:
    """One signature of a signature manifest: its payload's descriptor and the bytes."""

    payload_digest: str
    payload_size: int
    signature: bytes


def parse_signature_manifest(data: bytes, where: str) -> list[SignatureLayer]:
    """The signatures a ``.sig`` manifest holds; PermissionDenied when it is not one."""
    try:
        document = load_json(data, where)
    except errors.DataLoss as err:
        raise errors.PermissionDenied(str(err)) from None
    layers = document.get("layers") if isinstance(document, dict) else None
    if not isinstance(layers, list) or not layers:
        raise errors.PermissionDenied(f"{where}: a signature manifest without signatures")
    found: list[SignatureLayer] = []
    for i, layer in enumerate(layers[:MAX_SIGNATURES]):
        lw = f"{where}: layers[{i}]"
        if not isinstance(layer, dict) or layer.get("mediaType") != MEDIA_TYPE_SIMPLE_SIGNING:
            continue  # not a simple signing layer (another tool's): not ours to judge
        digest, size = layer.get("digest"), layer.get("size")
        annotations = layer.get("annotations")
        encoded = annotations.get(ANN_SIGNATURE) if isinstance(annotations, dict) else None
        if not is_digest(digest) or isinstance(size, bool) or not isinstance(size, int):
            raise errors.PermissionDenied(f"{lw}: not a payload descriptor")
        if not 0 < size <= MAX_PAYLOAD_BYTES:
            raise errors.PermissionDenied(f"{lw}: a payload of {size} bytes")
        if not isinstance(encoded, str):
            raise errors.PermissionDenied(f"{lw}: no {ANN_SIGNATURE} annotation")
        try:
            signature = base64.b64decode(encoded, validate=True)
        except (binascii.Error, ValueError):
            raise errors.PermissionDenied(f"{lw}: the signature is not base64") from None
        assert isinstance(digest, str)
        found.append(SignatureLayer(digest, size, signature))
    if not found:
        raise errors.PermissionDenied(f"{where}: no cosign signature in it")
    return found
