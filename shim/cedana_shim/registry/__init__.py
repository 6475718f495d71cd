"""An OCI distribution-spec registry client: the shared checkpoint store across nodes.

:class:`RegistryClient` pushes and pulls blobs (chunked, resumable, verified while
streaming) and manifests, lists tags and deletes manifests, over TLS with docker
``config.json`` credentials (Basic or Bearer tokens). Repository names come from
:func:`repository_for`: ``<prefix>/<namespace>``. :class:`Registry` is what the shared
checkpoint store needs of one (a shared directory is the other backend).
"""

from .client import (
    DEFAULT_CHUNK_SIZE,
    MANIFEST_MEDIA_TYPES,
    MAX_MANIFEST_BYTES,
    RegistryClient,
    RegistryConfig,
)
from .credentials import Credentials, load_credentials
from .protocol import Registry
from .push import BLOCK_SIZE, OpenSource, ProgressCallback, PushResult, Tap
from .reference import (
    RegistryLocation,
    check_digest,
    check_ref,
    check_repository,
    check_tag,
    parse_registry,
    repository_for,
)

__all__ = [
    "BLOCK_SIZE",
    "DEFAULT_CHUNK_SIZE",
    "MANIFEST_MEDIA_TYPES",
    "MAX_MANIFEST_BYTES",
    "Credentials",
    "OpenSource",
    "ProgressCallback",
    "PushResult",
    "Registry",
    "RegistryClient",
    "RegistryConfig",
    "RegistryLocation",
    "Tap",
    "check_digest",
    "check_ref",
    "check_repository",
    "check_tag",
    "load_credentials",
    "parse_registry",
    "repository_for",
]
