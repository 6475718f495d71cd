"""Key files named by the node config, read and checked.

Private keys (``signing_key``, ``decryption_keys``) must be regular files only their
owner can read or write (mode 0600 or stricter): a key others can read is a key they
may have copied, and it is refused, saying so, rather than used. Public keys
(``trusted_keys``, ``encryption_keys``) are PEM ``PUBLIC KEY`` files.

The keys are parsed with ``cryptography`` (pyca: the maintained binding of
OpenSSL), imported here lazily: only a push or a pull with keys configured loads it,
never the shim's start.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final

from cedana_shim import errors

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.types import (
        PrivateKeyTypes,
        PublicKeyTypes,
    )

__all__ = ["KeyFile", "load_private_key", "load_public_key", "split_paths"]

MAX_KEY_FILE_BYTES: Final = 64 << 10


def split_paths(value: str) -> list[str]:
    """A comma-separated list of paths, blanks dropped."""
    return [part.strip() for part in value.split(",") if part.strip()]


@dataclass(frozen=True)
class KeyFile:
    path: str
    data: bytes


def _read(path: str, what: str, *, private: bool) -> KeyFile:
    if not os.path.isabs(path):
        raise errors.InvalidArgument(f"{what} {path!r} is not an absolute path")
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as err:
        raise errors.InvalidArgument(f"{what} {path}: cannot open it: {err.strerror}") from None
    with os.fdopen(fd, "rb") as f:
        info = os.fstat(f.fileno())
        if not stat.S_ISREG(info.st_mode):
            raise errors.InvalidArgument(f"{what} {path} is not a regular file")
        if private and info.st_mode & 0o077:
            raise errors.PermissionDenied(
                f"{what} {path} has mode {stat.S_IMODE(info.st_mode):04o}: a private key "
                f"must be readable by its owner only; run `chmod 600 {path}` (and replace "
                "the key if others could have read it)"
            )
        data = f.read(MAX_KEY_FILE_BYTES + 1)
    if len(data) > MAX_KEY_FILE_BYTES:
        raise errors.InvalidArgument(f"{what} {path} is larger than a key file")
    return KeyFile(path, data)


def load_private_key(path: str, what: str) -> PrivateKeyTypes:
    """An unencrypted PEM private key (PKCS#8, or PKCS#1/SEC 1), mode 0600."""
    from cryptography.hazmat.primitives.serialization import load_pem_private_key

    key = _read(path, what, private=True)
    try:
        return load_pem_private_key(key.data, password=None)
    except (ValueError, TypeError) as err:
        raise errors.InvalidArgument(
            f"{what} {path} is not an unencrypted PEM private key: {err}"
        ) from None


def load_public_key(path: str, what: str) -> PublicKeyTypes:
    """A PEM ``PUBLIC KEY`` (SubjectPublicKeyInfo), as ``openssl pkey -pubout`` or
    ``cosign generate-key-pair`` writes it."""
    from cryptography.hazmat.primitives.serialization import load_pem_public_key

    key = _read(path, what, private=False)
    try:
        return load_pem_public_key(key.data)
    except (ValueError, TypeError) as err:
        raise errors.InvalidArgument(f"{what} {path} is not a PEM public key: {err}") from None
