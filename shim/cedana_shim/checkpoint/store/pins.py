"""The pins kept beside index.json, so that a repair of the index keeps them.

A pin is an annotation on the checkpoint's descriptor in index.json
(layout.ANN_PINNED), which a repair rebuilds from the manifests (repair.py): the
manifests do not hold pins (a pin must not change a digest). So every pin change
also rewrites ``pins.json`` (``{"pins": {"<id>": "true" | "policy"}}``), under the
index lock, and a rebuild puts those pins back on the checkpoints it recovers. A
missing or damaged pins.json is read as no pins (the index stays the truth while
it is intact); ids of removed checkpoints are dropped at the next pin change.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Iterable, Mapping
from dataclasses import replace
from typing import Final

from . import fsutil
from .core import INDEX_TMP_PREFIX
from .layout import ANN_ID, ANN_PINNED, PIN_VALUES, Descriptor, dump_json

__all__ = ["PINS", "read_pins", "with_pins", "write_pins"]

PINS: Final = "pins.json"
_MAX_BYTES: Final = 16 << 20
_TMP_PREFIX: Final = f"{INDEX_TMP_PREFIX}pins-"  # so that gc sweeps a crashed write

log = logging.getLogger(__name__)


def write_pins(root_fd: int, descriptors: Iterable[Descriptor]) -> None:
    """Record the pins of ``descriptors`` (the new index's); the caller holds the lock."""
    pins = {
        d.annotations[ANN_ID]: d.annotations[ANN_PINNED]
        for d in descriptors
        if d.annotations.get(ANN_PINNED) in PIN_VALUES and ANN_ID in d.annotations
    }
    fsutil.write_file_atomic(root_fd, PINS, dump_json({"pins": pins}), _TMP_PREFIX)


def read_pins(root_fd: int, path: str) -> dict[str, str]:
    """The pins recorded; {} (logged) when the file is missing or damaged."""
    try:
        data = fsutil.read_file_at(root_fd, PINS, _MAX_BYTES, path=path)
        doc = json.loads(data)
        pins = doc["pins"]
        if not isinstance(pins, dict):
            raise TypeError("pins is not an object")
    except FileNotFoundError:
        return {}
    except (OSError, ValueError, KeyError, TypeError, fsutil.TooLarge) as err:
        log.warning("%s is unreadable (%s): the repaired index has no pins", path, err)
        return {}
    return {str(k): str(v) for k, v in pins.items() if v in PIN_VALUES}


def with_pins(desc: Descriptor, pins: Mapping[str, str]) -> Descriptor:
    """The descriptor with its recorded pin, if it has one."""
    pin = pins.get(desc.annotations.get(ANN_ID, ""))
    if pin is None:
        return desc
    return replace(desc, annotations={**desc.annotations, ANN_PINNED: pin})
