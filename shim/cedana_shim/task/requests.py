"""The Task API's requests as the container sees them: frozen, validated configs
(containerd's ``process/types.go``), built by the service from the protobufs."""

from __future__ import annotations

from dataclasses import dataclass

from ..runtime.mount import Mount
from .options import RuntimeOptions
from .stdio import StdioConfig


@dataclass(frozen=True, slots=True)
class CreateConfig:
    id: str
    bundle: str
    namespace: str
    rootfs: tuple[Mount, ...]
    stdio: StdioConfig
    checkpoint: str  # a directory of CRIU images to restore at Start, or ""
    options: RuntimeOptions


@dataclass(frozen=True, slots=True)
class ExecConfig:
    exec_id: str
    stdio: StdioConfig
    process_json: bytes  # an OCI specs.Process


@dataclass(frozen=True, slots=True)
class CheckpointConfig:
    image_path: str
    work_path: str
    exit: bool
    open_tcp: bool = False
    external_unix_sockets: bool = False
    file_locks: bool = False
    empty_namespaces: tuple[str, ...] = ()
