"""The checkpoint store (see store.py for the layout and the commit sequence)."""

from .adopt import Adoption
from .ingest import Ingest
from .layout import Chunk, SplitFile
from .model import (
    COMMIT_STEPS,
    COMPACT_STEPS,
    PUBLISH_STEPS,
    Entry,
    LayerInfo,
    RepairReport,
    StepHook,
    StoreConfig,
)
from .store import Store

__all__ = [
    "COMMIT_STEPS",
    "COMPACT_STEPS",
    "PUBLISH_STEPS",
    "Adoption",
    "Chunk",
    "Entry",
    "Ingest",
    "LayerInfo",
    "RepairReport",
    "SplitFile",
    "StepHook",
    "Store",
    "StoreConfig",
]
