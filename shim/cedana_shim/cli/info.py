"""``containerd-shim-cedana-v2 -info``: what the runtime supports, for containerd 2.x.

containerd writes the runtime options to stdin (a ``google.protobuf.Any``, as in
``CreateTaskRequest.options``; nothing when the runtime has none) and reads a
``containerd.types.RuntimeInfo`` from stdout. As the runc shim does, the features
are those of the runc binary the options name (``BinaryName``, looked up on PATH):
``<runc> features`` prints the OCI runtime-spec features document, which goes out as
JSON in an ``Any`` of the type containerd registers for it. The CRI reads from it
whether recursive read-only mounts (``rro``) and idmap mounts can be used.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

from google.protobuf.any_pb2 import Any
from google.protobuf.message import DecodeError

from .. import __version__
from ..api.containerd.types import introspection_pb2
from ..errors import InvalidArgument
from ..node.registration import RUNTIME_TYPE
from ..task.options import parse_runtime_options

FEATURES_TYPE_URL = "types.containerd.io/opencontainers/runtime-spec/1/features/Features"
FEATURES_TIMEOUT = 30.0


class InfoError(Exception):
    """The runtime cannot be described; the message says why."""


def runtime_info(stdin: bytes) -> introspection_pb2.RuntimeInfo:
    info = introspection_pb2.RuntimeInfo(
        name=RUNTIME_TYPE, version=introspection_pb2.RuntimeVersion(version=__version__)
    )
    options = None
    if stdin:
        try:
            options = Any.FromString(stdin)
        except DecodeError as err:
            raise InfoError(f"runtime options on stdin do not decode: {err}") from None
        info.options.CopyFrom(options)
    try:
        binary = parse_runtime_options(options).binary_name
    except InvalidArgument as err:
        raise InfoError(str(err)) from None
    path = shutil.which(binary)
    if path is None:
        raise InfoError(f"failed to look up the path of {binary!r} (BinaryName) on PATH")
    features = runc_features(path)
    if features is not None:
        info.features.CopyFrom(Any(type_url=FEATURES_TYPE_URL, value=features))
    return info


def runc_features(path: str) -> bytes | None:
    """``<path> features`` as JSON bytes; None (and a note on stderr) for a runc that
    has no ``features`` command, which containerd's runc shim tolerates too."""
    try:
        proc = subprocess.run(
            [path, "features"], capture_output=True, timeout=FEATURES_TIMEOUT, check=False
        )
    except (OSError, subprocess.TimeoutExpired) as err:
        sys.stderr.write(f"containerd-shim-cedana-v2 -info: {path} features: {err}\n")
        return None
    if proc.returncode != 0:
        sys.stderr.write(
            f"containerd-shim-cedana-v2 -info: {path} features exited {proc.returncode}: "
            f"{proc.stderr.decode(errors='replace').strip()[-500:]}\n"
        )
        return None
    try:
        json.loads(proc.stdout)
    except ValueError as err:
        sys.stderr.write(f"containerd-shim-cedana-v2 -info: {path} features: not JSON ({err})\n")
        return None
    return proc.stdout.strip()


def run_info(stdin: bytes) -> int:
    try:
        info = runtime_info(stdin)
    except InfoError as err:
        sys.stderr.write(f"containerd-shim-cedana-v2 -info: {err}\n")
        return 1
    sys.stdout.buffer.write(info.SerializeToString())
    sys.stdout.buffer.flush()
    return 0
