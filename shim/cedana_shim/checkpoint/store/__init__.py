"""The checkpoint store (see store.py for the layout, the commit sequence and its parts)."""

from .adopt import Adopter, Adoption
from .catalog import Catalog
from .compactor import Compactor
from .failures import FailureRecords
from .ingest import Ingest
from .layout import Chunk, SplitFile
from .maintenance import Maintenance
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
from .raw import RawImages
from .reader import Reader
from .restores import RestoreRecords
from .store import Store
from .writer import Writer

__all__ = [
    "COMMIT_STEPS",
    "COMPACT_STEPS",
    "PUBLISH_STEPS",
    "Adopter",
    "Adoption",
    "Catalog",
    "Chunk",
    "Compactor",
    "Entry",
    "FailureRecords",
    "Ingest",
    "LayerInfo",
    "Maintenance",
    "RawImages",
    "Reader",
    "RepairReport",
    "RestoreRecords",
    "SplitFile",
    "StepHook",
    "Store",
    "StoreConfig",
    "Writer",
]
