"""Checkpoint tags in the registry: one immutable tag per checkpoint, no mutable "latest".

Grammar (every part a valid OCI tag character, 120 characters at most, so that the
in-flight marker ``<tag>.pending`` still fits the 128 a tag may have)::

    c.<label part>.<created YYYYmmddTHHMMSSffffffZ>.<id suffix>.<node hash>[.pending]

* label part: the label itself when it has at most 77 characters; a longer one is
  its first 51 characters, ``..`` and 24 hex digits of its sha256. A label never
  contains ``..``, so the two forms never meet: the encoding is injective (up to a
  96-bit hash for labels over 77 characters, whose full text the manifest carries
  and a pull checks).
* created: the checkpoint's own creation time, UTC, to the microsecond: within one
  label, tags sort by it as strings.
* id suffix: the 8 hex digits that end the checkpoint's id; with the created time's
  seconds they make the whole id, so the id is known from the tag list alone.
* node hash: 8 hex digits of the sha256 of the pushing node's name.

A checkpoint's pin (pins.py) is the tag ``p.`` + its tag without ``c.`` (same length),
naming a small manifest of its own.

Tags are read from the registry, so :func:`parse_tag` is strict and returns None for
anything else (another tool's tag, or a hostile one): callers skip it with a warning.
"""

from __future__ import annotations

import hashlib
import re
from dataclasses import dataclass
from datetime import UTC, datetime
from typing import Final

from cedana_shim import errors
from cedana_shim.checkpoint.policy import validate_label
from cedana_shim.checkpoint.store.layout import check_checkpoint_id, format_created, parse_created

__all__ = [
    "MAX_DIRECT_LABEL",
    "PENDING_SUFFIX",
    "CheckpointTag",
    "encode_label",
    "node_hash",
    "parse_pin_tag",
    "parse_tag",
    "pin_tag",
    "tag_for",
]

PENDING_SUFFIX: Final = ".pending"
_PREFIX: Final = "c."
_PIN_PREFIX: Final = "p."
_CREATED_FORMAT: Final = "%Y%m%dT%H%M%S%fZ"
_CREATED_LEN: Final = 22
_HEX_LEN: Final = 8
_LABEL_HASH_LEN: Final = 24
# 128 (a tag) - len(".pending") - the fixed parts: "c." created, suffix, hash and dots.
MAX_DIRECT_LABEL: Final = 128 - len(PENDING_SUFFIX) - len(_PREFIX) - _CREATED_LEN - 2 * _HEX_LEN - 3
_HASHED_PREFIX: Final = MAX_DIRECT_LABEL - 2 - _LABEL_HASH_LEN
_TAG_RE: Final = re.compile(
    rf"c\.(?P<label>[A-Za-z0-9._-]{{1,{MAX_DIRECT_LABEL}}})\.(?P<created>[0-9]{{8}}T[0-9]{{12}}Z)"
    r"\.(?P<suffix>[0-9a-f]{8})\.(?P<node>[0-9a-f]{8})(?P<pending>\.pending)?"
)
_HASHED_RE: Final = re.compile(
    rf"(?P<prefix>[A-Za-z0-9._-]{{{_HASHED_PREFIX}}})\.\.(?P<hash>[0-9a-f]{{{_LABEL_HASH_LEN}}})"
)


@dataclass(frozen=True)
class CheckpointTag:
    """A parsed checkpoint tag (or in-flight marker)."""

    label_part: str  # the label, or its prefix and hash (see the module doc)
    created: datetime  # UTC
    suffix: str  # the checkpoint id's last 8 hex digits
    node_hash: str
    pending: bool  # the in-flight marker of the checkpoint's tag

    @property
    def checkpoint_id(self) -> str:
        return f"{self.created:%Y%m%dT%H%M%S}Z-{self.suffix}"

    @property
    def created_text(self) -> str:
        """RFC 3339, as the store writes it."""
        return format_created(self.created)

    @property
    def base(self) -> str:
        """The checkpoint's tag (a marker's without ``.pending``)."""
        created = self.created.strftime(_CREATED_FORMAT)
        return f"{_PREFIX}{self.label_part}.{created}.{self.suffix}.{self.node_hash}"

    @property
    def tag(self) -> str:
        return self.base + (PENDING_SUFFIX if self.pending else "")

    @property
    def label(self) -> str | None:
        """The label, when the tag holds it whole (None: hashed, see the manifest)."""
        return None if ".." in self.label_part else self.label_part


def node_hash(node: str) -> str:
    return hashlib.sha256(node.encode()).hexdigest()[:_HEX_LEN]


def encode_label(label: str) -> str:
    """The label part of a tag (see the module doc); InvalidArgument for a bad label."""
    validate_label(label, "the checkpoint")
    if len(label) <= MAX_DIRECT_LABEL:
        return label
    digest = hashlib.sha256(label.encode()).hexdigest()[:_LABEL_HASH_LEN]
    return f"{label[:_HASHED_PREFIX]}..{digest}"


def tag_for(label: str, created: str, checkpoint_id: str, node: str) -> CheckpointTag:
    """The tag of a checkpoint (``created``: RFC 3339, as in the store)."""
    when = parse_created(created)
    if when is None:
        raise errors.InvalidArgument(f"checkpoint {checkpoint_id}: created {created!r}")
    if (why := check_checkpoint_id(checkpoint_id)) is not None:
        raise errors.InvalidArgument(why)
    tag = CheckpointTag(
        encode_label(label), when, checkpoint_id[-_HEX_LEN:], node_hash(node), False
    )
    if tag.checkpoint_id != checkpoint_id:
        raise errors.InvalidArgument(
            f"checkpoint {checkpoint_id}: its id does not start with its created time "
            f"{created}, so a tag cannot name it; only checkpoints this store wrote can be pushed"
        )
    return tag


def parse_tag(tag: str) -> CheckpointTag | None:
    """The checkpoint tag ``tag`` is, or None when it is not one (see the module doc)."""
    m = _TAG_RE.fullmatch(tag)
    if m is None:
        return None
    part = m["label"]
    hashed = _HASHED_RE.fullmatch(part)
    if hashed is not None:
        if ".." in hashed["prefix"]:
            return None
    elif ".." in part:
        return None
    try:
        created = datetime.strptime(m["created"], _CREATED_FORMAT).replace(tzinfo=UTC)
    except ValueError:
        return None
    parsed = CheckpointTag(part, created, m["suffix"], m["node"], m["pending"] is not None)
    return parsed if parsed.tag == tag else None


def pin_tag(tag: CheckpointTag) -> str:
    """The tag of the checkpoint's pin in the registry (see the module doc)."""
    return _PIN_PREFIX + tag.base.removeprefix(_PREFIX)


def parse_pin_tag(tag: str) -> CheckpointTag | None:
    """The checkpoint a pin tag pins; None when ``tag`` is not a pin tag."""
    if not tag.startswith(_PIN_PREFIX):
        return None
    pinned = parse_tag(_PREFIX + tag.removeprefix(_PIN_PREFIX))
    return pinned if pinned is not None and not pinned.pending else None
