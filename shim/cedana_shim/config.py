"""Node configuration: ``/etc/cedana/shim.toml``, each key overridable by env.

The file is optional (defaults are sensible for a node); its path can also come
from the CRI runtime's ``ConfigPath`` option. Every key can be overridden with
``CEDANA_<KEY>`` in the shim's environment (containerd's, or the
``[plugins."io.containerd.shim.v1.manager"] env`` of containerd 2.3+), which is
also how tests point a shim at a private store. Unknown keys and bad values are
errors: a typo must not silently change where process memory is written.
"""

from __future__ import annotations

import math
import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from .errors import InvalidArgument

DEFAULT_PATH = "/etc/cedana/shim.toml"
MAX_TIMEOUT = 7 * 24 * 3600.0  # a week: anything longer is a typo, not a timeout

Stamp = tuple[int, int, int] | None


def file_stamp(path: str) -> Stamp:
    """What changes when a file named by the config is replaced or rewritten (its
    inode, size, mtime): a daemon reads the file again only when this does. None when
    there is no file."""
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_ino, st.st_size, st.st_mtime_ns)


def key_files(config: NodeConfig) -> list[str]:
    """Every key file the config names (signing_key, trusted_keys, encryption_keys'
    recipients after their ``[<namespace>=]jwe:``, decryption_keys)."""
    paths = [config.signing_key]
    for value in (config.trusted_keys, config.encryption_keys, config.decryption_keys):
        for entry in value.split(","):
            entry = entry.strip()
            paths.append(entry.partition("jwe:")[2] if "jwe:" in entry else entry)
    return [p for p in paths if p]


@dataclass(frozen=True, slots=True)
class NodeConfig:
    store_path: str = "/var/lib/cedana/checkpoints"
    compression_level: int = 1  # zstd; 1 is fastest, 19 smallest (bench/README.md)
    compression_threads: int = 0  # 0: one per core
    retain: int = 3  # checkpoints kept per (namespace, label)
    # Also keep the newest checkpoint's raw CRIU images per label: restores skip the
    # decompression (digests are still checked, in parallel with the restore).
    cache_raw: bool = True
    # Periodic checkpoints for opted-in containers that set no interval ("15m"); "" = none.
    checkpoint_interval: str = ""
    checkpoint_timeout: float = 600.0  # seconds a checkpoint (GPU + CRIU + commit) may take
    restore_timeout: float = 600.0
    # Restore through CRIU's lazy-pages daemon: the tasks run as soon as everything but
    # their memory is restored, the memory follows (README, "Node configuration").
    lazy_restore: bool = False
    # How long a restore waits for a checkpoint of its label that is still being
    # written (a stop in flight on this node) before it picks from what is committed.
    label_wait_timeout: float = 120.0
    # auto: where the kernel tracks dirty pages (CRIU's mem_dirty_track), a container's
    # next dump writes only the pages it wrote since its last checkpoint; off: never.
    dirty_tracking: str = "auto"
    tcp_established: bool = True  # dump established TCP connections (restored when the IP is kept)
    file_locks: bool = True
    criu_config_extra: str = ""  # lines appended to the CRIU config file runc reads
    # hooks.d directories, colon-separated; a later one overrides files of the same name
    hooks_dirs: str = "/usr/share/cedana/hooks.d:/etc/cedana/hooks.d"
    gpu_backend: str = "auto"  # auto | driver-api | cuda-checkpoint
    cuda_checkpoint_path: str = ""  # default: cuda-checkpoint on PATH
    gpu_lock_timeout_ms: int = 10000  # how long a CUDA lock waits for submitted work
    # The shim's own log, beside containerd's: containerd stops reading a shim's log
    # once its last task is deleted, and later lines (compaction) would be lost.
    log_file: str = "/var/log/cedana/shim.log"
    # Raw bytes per compressed piece of a CRIU page image in the store (each its own
    # blob, shared between checkpoints that hold the same bytes); 0: one blob per layer.
    chunk_size: int = 8 << 20
    # The checkpoint store shared across nodes: an OCI registry, "host[:port]/prefix"
    # (one repository per namespace under it), or an absolute path: a directory every
    # node mounts, laid out like a registry; "" keeps checkpoints on this node only.
    registry: str = ""
    registry_auth_file: str = ""  # docker config.json with the registry's credentials, 0600
    registry_ca: str = ""  # extra CA bundle (PEM) for the registry's TLS
    registry_insecure: bool = False  # plain HTTP: a loopback or lab registry only
    # before-exit: a stop reports the exit once the push is done (or the kill's grace
    # is nearly spent); background: at once, the push follows.
    registry_sync: str = "before-exit"
    registry_timeout: float = 30.0  # seconds per registry request (connect, each read)
    # Signatures of pushed checkpoints, in cosign's key-based format: the private key
    # (PEM, mode 0600) this node signs every checkpoint it pushes with; "": unsigned.
    signing_key: str = ""
    # Public keys (PEM), comma-separated: when set, a checkpoint from the registry is
    # restored only if one of them signed it (checked before any blob is downloaded).
    trusted_keys: str = ""
    # Layer encryption (ocicrypt): recipients as skopeo's --encryption-key spells them,
    # comma-separated "jwe:/path/pub.pem"; "<namespace>=jwe:/path" for that namespace
    # alone. Every layer pushed is encrypted for them; "": pushed in the clear.
    encryption_keys: str = ""
    # Private keys (PEM, mode 0600), comma-separated, that open encrypted checkpoints.
    decryption_keys: str = ""


def _coerce(name: str, kind: type, value: Any, source: str) -> Any:
    if kind is bool:
        if isinstance(value, bool):
            return value
        if isinstance(value, str) and value.lower() in (
            "1",
            "true",
            "yes",
            "on",
            "0",
            "false",
            "no",
            "off",
        ):
            return value.lower() in ("1", "true", "yes", "on")
    elif kind is int:
        if isinstance(value, int) and not isinstance(value, bool):
            return value
        if isinstance(value, str) and value.strip().lstrip("-").isdigit():
            return int(value)
    elif kind is float:
        if isinstance(value, (int, float)) and not isinstance(value, bool):
            return float(value)
        try:
            return float(value)
        except (TypeError, ValueError):
            pass
    elif isinstance(value, str):
        return value
    raise InvalidArgument(
        f"cedana node config {source}: {name} = {value!r} is not a {kind.__name__}"
    )


def load_node_config(path: str | None = None, env: Mapping[str, str] | None = None) -> NodeConfig:
    """The node config from ``path`` (default /etc/cedana/shim.toml) and ``CEDANA_*`` env."""
    env = os.environ if env is None else env
    file = path or env.get("CEDANA_CONFIG") or DEFAULT_PATH
    values: dict[str, Any] = {}
    try:
        with open(file, "rb") as f:
            values = tomllib.load(f)
    except FileNotFoundError:
        if path:  # named explicitly (ConfigPath): its absence is a mistake worth reporting
            raise InvalidArgument(f"cedana node config {file} does not exist") from None
    except tomllib.TOMLDecodeError as err:
        raise InvalidArgument(f"cedana node config {file} is not valid TOML: {err}") from err
    kinds = {f.name: type(getattr(NodeConfig(), f.name)) for f in fields(NodeConfig)}
    unknown = sorted(set(values) - set(kinds))
    if unknown:
        raise InvalidArgument(f"cedana node config {file}: unknown keys {', '.join(unknown)}")
    parsed = {k: _coerce(k, kinds[k], v, file) for k, v in values.items()}
    for name, kind in kinds.items():
        raw = env.get(f"CEDANA_{name.upper()}")
        if raw is not None:
            parsed[name] = _coerce(name, kind, raw, f"env CEDANA_{name.upper()}")
    config = NodeConfig(**parsed)
    if not 1 <= config.compression_level <= 22:
        raise InvalidArgument(f"compression_level {config.compression_level} is not in 1..22")
    if config.gpu_backend not in ("auto", "driver-api", "cuda-checkpoint"):
        raise InvalidArgument(
            f"gpu_backend {config.gpu_backend!r} is not auto, driver-api or cuda-checkpoint"
        )
    if config.dirty_tracking not in ("auto", "off"):
        raise InvalidArgument(
            f"cedana node config {file}: dirty_tracking {config.dirty_tracking!r} is not "
            "auto or off"
        )
    if config.retain < 1:
        raise InvalidArgument(f"retain {config.retain} must keep at least one checkpoint")
    if config.chunk_size and not 4096 <= config.chunk_size <= 256 << 20:
        raise InvalidArgument(
            f"cedana node config {file}: chunk_size {config.chunk_size} must be 0 (one blob "
            "per layer) or 4096..268435456 bytes"
        )
    if config.registry_sync not in ("before-exit", "background"):
        raise InvalidArgument(
            f"cedana node config {file}: registry_sync {config.registry_sync!r} is not "
            "before-exit or background"
        )
    if not math.isfinite(config.registry_timeout) or not 0 < config.registry_timeout <= 3600:
        raise InvalidArgument(
            f"cedana node config {file}: registry_timeout {config.registry_timeout!r} must "
            "be a number of seconds in (0, 3600]"
        )
    for name in ("checkpoint_timeout", "restore_timeout", "label_wait_timeout"):
        seconds = getattr(config, name)
        if not math.isfinite(seconds) or not 0 <= seconds <= MAX_TIMEOUT:
            raise InvalidArgument(
                f"cedana node config {file}: {name} = {seconds!r} must be a number of "
                f"seconds between 0 and {MAX_TIMEOUT:g}"
            )
    return config
