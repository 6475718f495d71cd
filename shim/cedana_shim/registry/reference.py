"""Names in a registry: the ``registry`` setting, repositories, tags and digests.

Pure functions, no I/O. Everything here is validated against the OCI
distribution-spec grammar before it is put into a URL, so a name never carries a
``/``, ``?``, ``#`` or ``..`` that would address another repository, and a
Kubernetes namespace maps to exactly one repository (one path component) under the
configured prefix: namespace B can never name A's repository.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass
from typing import Final

from cedana_shim.errors import InvalidArgument

__all__ = [
    "RegistryLocation",
    "check_digest",
    "check_ref",
    "check_repository",
    "check_tag",
    "parse_registry",
    "repository_for",
]

_COMPONENT: Final = r"[a-z0-9]+(?:(?:\.|_|__|-+)[a-z0-9]+)*"
_REPOSITORY_RE: Final = re.compile(rf"{_COMPONENT}(?:/{_COMPONENT})*")
_TAG_RE: Final = re.compile(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,127}")
_DIGEST_RE: Final = re.compile(r"sha256:[0-9a-f]{64}")
_DNS1123_LABEL_RE: Final = re.compile(r"[a-z0-9](?:[-a-z0-9]{0,61}[a-z0-9])?")
_HOSTNAME_RE: Final = re.compile(
    r"[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?)*"
)
# Docker and most registries refuse longer names; the spec leaves it to them.
MAX_REPOSITORY_LEN: Final = 255


@dataclass(frozen=True)
class RegistryLocation:
    """The parsed ``registry`` setting: ``host[:port]`` and a repository prefix."""

    host: str  # "registry.example.com", "127.0.0.1:5000", "[::1]:5000"
    prefix: str  # "" or a repository path such as "cedana/checkpoints"


def parse_registry(value: str) -> RegistryLocation:
    """Parse ``host[:port][/prefix]`` (the node config's ``registry`` key)."""
    where = f"registry setting {value!r}"
    if "://" in value:
        raise InvalidArgument(
            f"{where}: give host[:port]/prefix without a scheme "
            "(HTTPS is the default; registry_insecure selects plain HTTP)"
        )
    host, _, prefix = value.partition("/")
    _check_host(host, where)
    if prefix:
        check_repository(prefix, what=f"{where}: the repository prefix")
    return RegistryLocation(host=host, prefix=prefix)


def _check_host(host: str, where: str) -> None:
    name, port = _split_port(host, where)
    if port is not None and not (port.isdigit() and port.isascii() and 0 < int(port) < 65536):
        raise InvalidArgument(f"{where}: {port!r} is not a TCP port")
    if name.startswith("["):
        try:
            ipaddress.IPv6Address(name[1:-1])
        except ValueError:
            raise InvalidArgument(f"{where}: {name!r} is not an IPv6 address") from None
        return
    if len(name) > 253 or not _HOSTNAME_RE.fullmatch(name):
        raise InvalidArgument(f"{where}: {name!r} is not a host name or IP address")


def _split_port(host: str, where: str) -> tuple[str, str | None]:
    if host.startswith("["):
        end = host.find("]")
        rest = host[end + 1 :] if end >= 0 else None
        if rest is None or (rest and not rest.startswith(":")):
            raise InvalidArgument(f"{where}: {host!r} is not [IPv6 address][:port]")
        return host[: end + 1], (rest[1:] if rest else None)
    name, colon, port = host.partition(":")
    return name, (port if colon else None)


def check_repository(name: str, *, what: str = "repository") -> str:
    """Return ``name`` if it is a repository name of the distribution spec."""
    if len(name) > MAX_REPOSITORY_LEN or not _REPOSITORY_RE.fullmatch(name):
        raise InvalidArgument(
            f"{what} {name!r} is not a valid repository name: lowercase components "
            f"[a-z0-9] joined by '.', '_', '__' or '-', separated by '/', at most "
            f"{MAX_REPOSITORY_LEN} characters"
        )
    return name


def repository_for(prefix: str, namespace: str) -> str:
    """The repository holding the checkpoints of a Kubernetes namespace.

    The namespace must be a DNS-1123 label (what Kubernetes allows), which is always one
    repository path component, so distinct namespaces get distinct repositories.
    """
    if not _DNS1123_LABEL_RE.fullmatch(namespace):
        raise InvalidArgument(
            f"namespace {namespace!r} is not a DNS-1123 label (lowercase letters, digits "
            "and '-', at most 63 characters, starting and ending with a letter or digit)"
        )
    return check_repository(f"{prefix}/{namespace}" if prefix else namespace)


def check_tag(tag: str) -> str:
    """Return ``tag`` if it matches ``[A-Za-z0-9_][A-Za-z0-9._-]{0,127}``."""
    if not _TAG_RE.fullmatch(tag):
        raise InvalidArgument(
            f"tag {tag!r} is not valid: 1 to 128 characters of [A-Za-z0-9._-], "
            "not starting with '.' or '-'"
        )
    return tag


def check_digest(digest: str) -> str:
    """Return ``digest`` if it is ``sha256:`` and 64 lowercase hex digits."""
    if not _DIGEST_RE.fullmatch(digest):
        raise InvalidArgument(f"digest {digest!r} is not sha256:<64 lowercase hex digits>")
    return digest


def check_ref(ref: str) -> str:
    """Return ``ref`` if it is a manifest reference: a digest or a tag."""
    return check_digest(ref) if ref.startswith("sha256:") else check_tag(ref)
