"""The store's public value types, its configuration and its crash points."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Final, Literal, TypeAlias

from cedana_shim import errors

from .layout import Chunk, SplitFile, tar_raw_size

if TYPE_CHECKING:
    from cedana_shim.config import NodeConfig

__all__ = [
    "COMMIT_STEPS",
    "COMPACT_STEPS",
    "PUBLISH_STEPS",
    "Entry",
    "LayerInfo",
    "RepairReport",
    "State",
    "StepHook",
    "StoreConfig",
]

# Where Store(step_hook=...) is called, in order. Tests kill the process at
# each one to prove that a crash anywhere leaves only complete checkpoints
# (raw or compacted) visible. Per-layer steps fire once per layer.
PUBLISH_STEPS: Final = (
    "layer-listed",  # a layer's files fsynced, 0600, CRC'd; its file list written
    "config-written",
    "manifest-written",
    "index-locked",
    "raw-placed",  # raw dirs renamed into raw/<id>, dirs fsynced
    "blobs-placed",  # file lists + config renamed into blobs/sha256, dir fsynced
    "manifest-placed",
    "index-temp-written",  # new index.json fsynced under a temp name
    "index-replaced",  # renamed over index.json: the durable point
    "committed",  # root dir fsynced
)
COMPACT_STEPS: Final = (
    "compact-locked",  # the checkpoint's compaction lock is held
    "layer-writing",  # a layer's first compressed bytes are in its temp blob
    "layer-written",  # that temp blob is complete and fsynced
    "compact-config-written",
    "compact-manifest-written",
    "compact-index-locked",
    "compact-blobs-placed",
    "compact-manifest-placed",
    "compact-index-temp-written",
    "compact-index-replaced",  # the compacted descriptor replaced the raw one
    "compact-committed",
    "raw-released",  # raw files deleted, or kept as the raw-image cache
    "gc-done",  # unreferenced blobs and raw dirs swept (the publish's too), lock held
)
COMMIT_STEPS: Final = PUBLISH_STEPS + COMPACT_STEPS

StepHook: TypeAlias = Callable[[str], None]
State: TypeAlias = Literal["raw", "compacted"]


@dataclass(frozen=True)
class StoreConfig:
    root: str = "/var/lib/cedana/checkpoints"
    compression_level: int = 1  # zstd level, -7 (fastest) .. 22
    threads: int = 0  # zstd worker threads; 0 = all cores
    retain: int = 3  # checkpoints kept per (scope, label) at publish; 0 = keep all
    # Keep the raw CRIU images of the newest checkpoint per label after compaction.
    cache_raw: bool = True
    # Compaction splits a criu layer's page images into chunks of this many raw
    # bytes, each its own zstd blob (shared by checkpoints that hold the same
    # bytes); 0 = one blob for the whole layer, as before chunks existed.
    chunk_size: int = 8 << 20

    @classmethod
    def for_node(cls, config: NodeConfig, *, root: str | None = None) -> StoreConfig:
        """The store of a node config: the one place its keys become the store's
        settings, for every process that opens the node's store (the shim, the Slurm
        runner, the node agent, the CLI). ``root``: the store's path as this process
        sees it (the node agent sees the host's under its mount)."""
        return cls(
            root=config.store_path if root is None else root,
            compression_level=config.compression_level,
            threads=config.compression_threads,
            retain=config.retain,
            cache_raw=config.cache_raw,
            chunk_size=config.chunk_size,
        )


@dataclass(frozen=True)
class LayerInfo:
    name: str
    media_type: str  # a raw layer's is MEDIA_TYPE_FILE_LIST
    digest: str  # the compressed blob (a split layer's tar), or a raw layer's file list
    size: int  # stored bytes: the compressed blob and chunks, or a raw layer's files
    raw_size: int  # uncompressed bytes: the tar and the chunks (a raw dir layer: its files)
    # A compacted layer's page images, held as chunks rather than in its tar.
    chunks: tuple[Chunk, ...] = ()
    split_files: tuple[SplitFile, ...] = ()

    @property
    def blob_size(self) -> int:
        """Stored bytes of the layer's own blob, without its chunks."""
        return self.size - sum(c.size for c in self.chunks)

    @property
    def tar_raw_size(self) -> int:
        """Raw bytes of the layer's own blob (its tar), without its split files."""
        return tar_raw_size(self.raw_size, self.split_files)


@dataclass(frozen=True)
class Entry:
    id: str
    scope: str
    label: str
    created: str  # RFC 3339, UTC
    manifest_digest: str
    size: int  # stored bytes: manifest, config, layers (raw: their files)
    metadata: Mapping[str, Any]  # the config JSON
    layers: tuple[LayerInfo, ...]
    # Why the manifest or config could not be read, or disagree with index.json,
    # for an entry that is listed but broken; verify() raises DataLoss with it.
    damage: str | None = None
    state: State = "compacted"  # meaningless when damaged
    raw_bytes: int = 0  # raw images kept for it: a raw checkpoint's, or the cache
    pinned_by: str = ""  # "user" or "policy": exempt from retention (Maintenance.pin)

    @property
    def pinned(self) -> bool:
        return bool(self.pinned_by)

    def layer(self, name: str) -> LayerInfo:
        for layer in self.layers:
            if layer.name == name:
                return layer
        have = ", ".join(repr(x.name) for x in self.layers) or "none"
        raise errors.NotFound(f"checkpoint {self.id} has no layer {name!r} (layers: {have})")

    def to_json(self) -> dict[str, Any]:
        """The `cedana checkpoints list --json` item."""
        return {
            "id": self.id,
            "namespace": self.scope,
            "label": self.label,
            "container": self.metadata.get("container"),
            "created": self.created,
            "size": self.size,
            "state": None if self.damage else self.state,
            "rawBytes": self.raw_bytes,
            "pinned": self.pinned,
            "pinnedBy": self.pinned_by,
            "layers": [
                {
                    "name": x.name,
                    "mediaType": x.media_type,
                    "size": x.size,
                    "rawSize": x.raw_size,
                    "chunks": len(x.chunks),
                }
                for x in self.layers
            ],
            "damage": self.damage,
        }


@dataclass(frozen=True)
class RepairReport:
    """What Maintenance.repair did: index.json rebuilt from what the blobs and raw dirs hold."""

    index_path: str
    damaged_copy: str | None  # where the unreadable index.json was kept; None: it was missing
    reason: str  # why the index had to be rebuilt
    recovered: tuple[tuple[str, State], ...] = ()  # (checkpoint id, state), oldest first
    dropped: tuple[tuple[str, str], ...] = ()  # (what, why)
    rebuilt: bool = True  # False: index.json was intact, nothing was done

    def to_json(self) -> dict[str, Any]:
        return {
            "index": self.index_path,
            "rebuilt": self.rebuilt,
            "damagedCopy": self.damaged_copy,
            "reason": self.reason,
            "recovered": [{"id": cid, "state": state} for cid, state in self.recovered],
            "dropped": [{"what": what, "why": why} for what, why in self.dropped],
        }
