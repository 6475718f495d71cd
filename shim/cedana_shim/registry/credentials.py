"""Registry credentials from a docker ``config.json`` (the ``registry_auth_file``).

Only the ``auths`` section is read: ``auths.<host>.auth`` (base64 of
``user:password``), or ``username`` and ``password``, and ``identitytoken`` (an
OAuth2 refresh token, as ``docker login`` stores for token-based registries).
Credential helpers (``credsStore``, ``credHelpers``) are not run: the shim never
executes programs named by a data file.

The file holds secrets, so it must be a regular file that neither group nor others
can read or write; anything else is refused with an error that says how to fix it.
"""

from __future__ import annotations

import base64
import binascii
import os
import stat
from dataclasses import dataclass
from typing import Any, Final

from cedana_shim import untrusted_json
from cedana_shim.errors import FailedPrecondition, InvalidArgument, PermissionDenied

__all__ = ["Credentials", "load_credentials", "parse_auth_config", "read_auth_file"]

MAX_AUTH_FILE_BYTES: Final = 1 << 20


@dataclass(frozen=True, repr=False)
class Credentials:
    """What to present to one registry host."""

    username: str = ""
    password: str = ""
    identity_token: str = ""  # OAuth2 refresh token; preferred over the password for tokens

    def __repr__(self) -> str:  # never print the secrets
        return f"Credentials(username={self.username!r}, password=***, identity_token=***)"


def read_auth_file(path: str) -> bytes:
    """Read the auth file after checking it is a private regular file."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NONBLOCK | os.O_NOCTTY)
    except FileNotFoundError:
        raise FailedPrecondition(
            f"registry auth file {path} does not exist: create it (docker config.json "
            "format) or unset registry_auth_file"
        ) from None
    except OSError as err:
        raise PermissionDenied(f"registry auth file {path}: {err.strerror}") from err
    try:
        info = os.fstat(fd)
        if not stat.S_ISREG(info.st_mode):
            raise PermissionDenied(f"registry auth file {path} is not a regular file")
        if info.st_mode & 0o077:
            raise PermissionDenied(
                f"registry auth file {path} is accessible by group or others (mode "
                f"{stat.S_IMODE(info.st_mode):04o}) and holds registry credentials: run "
                f"`chmod 600 {path}`"
            )
        chunks: list[bytes] = []
        remaining = MAX_AUTH_FILE_BYTES + 1
        while remaining > 0 and (chunk := os.read(fd, remaining)):
            chunks.append(chunk)
            remaining -= len(chunk)
        data = b"".join(chunks)
    finally:
        os.close(fd)
    if len(data) > MAX_AUTH_FILE_BYTES:
        raise InvalidArgument(
            f"registry auth file {path} is larger than {MAX_AUTH_FILE_BYTES} bytes"
        )
    return data


def load_credentials(path: str, host: str) -> Credentials | None:
    """The credentials for ``host`` in the auth file at ``path`` (None: no entry)."""
    return parse_auth_config(read_auth_file(path), host, source=path)


def _host_key(key: str) -> str:
    """``https://host:port/v1/`` -> ``host:port`` (docker accepts all these spellings)."""
    for scheme in ("https://", "http://"):
        if key.lower().startswith(scheme):
            key = key[len(scheme) :]
            break
    return key.split("/", 1)[0].lower()


def parse_auth_config(data: bytes, host: str, *, source: str) -> Credentials | None:
    """Parse a docker ``config.json``; ``source`` names the file in errors."""
    try:
        document = untrusted_json.loads(data)
    except ValueError as err:
        raise InvalidArgument(f"registry auth file {source} is not valid JSON: {err}") from None
    if not isinstance(document, dict):
        raise InvalidArgument(f"registry auth file {source}: expected a JSON object")
    auths = document.get("auths", {})
    if not isinstance(auths, dict):
        raise InvalidArgument(f"registry auth file {source}: 'auths' is not an object")
    wanted = host.lower()
    for key, entry in auths.items():
        if _host_key(key) == wanted:
            return _parse_entry(entry, f"registry auth file {source}, auths.{key}")
    return None


def _parse_entry(entry: Any, where: str) -> Credentials | None:
    if not isinstance(entry, dict):
        raise InvalidArgument(f"{where}: expected an object")
    fields = {}
    for name in ("auth", "username", "password", "identitytoken"):
        value = entry.get(name, "")
        if not isinstance(value, str):
            raise InvalidArgument(f"{where}.{name}: expected a string")
        fields[name] = value
    username, password = fields["username"], fields["password"]
    if fields["auth"]:
        username, password = _decode_basic(fields["auth"], where)
    if not (username or password or fields["identitytoken"]):
        return None
    return Credentials(username=username, password=password, identity_token=fields["identitytoken"])


def _decode_basic(value: str, where: str) -> tuple[str, str]:
    try:
        decoded = base64.b64decode(value, validate=True).decode("utf-8")
    except (binascii.Error, UnicodeDecodeError, ValueError):
        raise InvalidArgument(f"{where}.auth is not base64 of user:password") from None
    username, colon, password = decoded.partition(":")
    if not colon:
        raise InvalidArgument(f"{where}.auth is not base64 of user:password (no ':')")
    return username, password
