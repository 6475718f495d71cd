"""The on-disk vocabulary of the checkpoint store: an OCI image layout.

Pure functions only (no I/O): names and media types, and strict parsers for the
JSON documents the store reads back from disk (``oci-layout``, ``index.json``,
manifests, checkpoint configs). Everything read from disk is untrusted: a parser
either returns a fully validated value or raises :class:`cedana_shim.errors.DataLoss`
naming where the document came from and what is wrong with it, never a
``KeyError``/``TypeError`` from deep inside.

Longer than the store's other modules on purpose: the whole on-disk vocabulary
(including a split layer's chunks) is checked in one place, so every reader
agrees on what a valid document is.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from typing import Any, Final

from cedana_shim import errors, untrusted_json

__all__ = [
    "ANN_CHUNK_FILE",
    "ANN_CHUNK_OFFSET",
    "ANN_CHUNK_RAW_SIZE",
    "ANN_CREATED",
    "ANN_ID",
    "ANN_LABEL",
    "ANN_SCOPE",
    "ANN_TITLE",
    "LAYOUT_VERSION",
    "MAX_CHUNK_BYTES",
    "MAX_CONFIG_BYTES",
    "MAX_INDEX_BYTES",
    "MAX_MANIFEST_BYTES",
    "MEDIA_TYPE_CONFIG",
    "MEDIA_TYPE_CRIU",
    "MEDIA_TYPE_CRIU_CHUNK",
    "MEDIA_TYPE_FILE_LIST",
    "MEDIA_TYPE_INDEX",
    "MEDIA_TYPE_MANIFEST",
    "MEDIA_TYPE_ROOTFS_DIFF",
    "MEDIA_TYPE_SHM",
    "RESERVED_METADATA_KEYS",
    "CheckpointRef",
    "Chunk",
    "Config",
    "ConfigLayer",
    "Descriptor",
    "Index",
    "Manifest",
    "SplitFile",
    "check_checkpoint_id",
    "check_layer_name",
    "check_media_type",
    "check_scope_or_label",
    "check_split_file_name",
    "chunk_bound",
    "dump_json",
    "dump_manifest",
    "format_created",
    "is_digest",
    "load_json",
    "match_split_files",
    "parse_checkpoint_ref",
    "parse_config",
    "parse_created",
    "parse_descriptor",
    "parse_index",
    "parse_layout_file",
    "parse_manifest",
]

MEDIA_TYPE_INDEX: Final = "application/vnd.oci.image.index.v1+json"
MEDIA_TYPE_MANIFEST: Final = "application/vnd.oci.image.manifest.v1+json"
MEDIA_TYPE_CONFIG: Final = "application/vnd.cedana.checkpoint.config.v1+json"
MEDIA_TYPE_CRIU: Final = "application/vnd.cedana.checkpoint.criu.v1.tar+zstd"
MEDIA_TYPE_ROOTFS_DIFF: Final = "application/vnd.cedana.checkpoint.rootfs-diff.v1.tar+zstd"
MEDIA_TYPE_SHM: Final = "application/vnd.cedana.checkpoint.shm.v1.tar+zstd"
# One piece of a page image split out of a compacted criu layer: a complete zstd
# frame of the file's bytes [offset, offset + rawSize), not a tar. Its descriptor
# follows the layer's own (the tar of everything else) and carries the same title.
MEDIA_TYPE_CRIU_CHUNK: Final = "application/vnd.cedana.checkpoint.criu.chunk.v1+zstd"
# A raw (not yet compacted) layer: its descriptor points at the list of its files
# (names, sizes, CRC-32s), the files themselves live in <store>/raw/<id>/<layer>/.
MEDIA_TYPE_FILE_LIST: Final = "application/vnd.cedana.checkpoint.files.v1+json"

ANN_ID: Final = "cedana.ai/checkpoint.id"
ANN_SCOPE: Final = "cedana.ai/checkpoint.scope"
ANN_LABEL: Final = "cedana.ai/checkpoint.label"
ANN_CREATED: Final = "org.opencontainers.image.created"
# On a checkpoint's descriptor in index.json only (never in its manifest, so a pin
# changes no digest): "true" (a user's pin) or "policy" (a namespace policy's, which
# the policy may take back) exempts it from retention and prune.
ANN_PINNED: Final = "cedana.ai/checkpoint.pinned"
PIN_VALUES: Final = {"true": "user", "policy": "policy"}
ANN_TITLE: Final = "org.opencontainers.image.title"
ANN_CHUNK_FILE: Final = "cedana.ai/chunk.file"
ANN_CHUNK_OFFSET: Final = "cedana.ai/chunk.offset"
ANN_CHUNK_RAW_SIZE: Final = "cedana.ai/chunk.rawSize"

LAYOUT_VERSION: Final = "1.0.0"

# Bounds on what is read into memory: a damaged or hostile file must not make
# the shim allocate gigabytes. 4 MiB is the manifest limit registries enforce.
MAX_INDEX_BYTES: Final = 64 << 20
MAX_MANIFEST_BYTES: Final = 4 << 20
MAX_CONFIG_BYTES: Final = 4 << 20
_MAX_SIZE: Final = (1 << 63) - 1  # an off_t
_MAX_MTIME: Final = 1 << 40
# A chunk is held in memory whole (compressed and raw) while it is read.
MAX_CHUNK_BYTES: Final = 256 << 20

# Keys of the checkpoint config that the store owns; callers may not set them.
RESERVED_METADATA_KEYS: Final = frozenset(
    {"id", "scope", "label", "created", "sizes", "layers", "rawFiles"}
)

_DIGEST_RE: Final = re.compile(r"sha256:[0-9a-f]{64}")
_ID_RE: Final = re.compile(r"[0-9]{8}T[0-9]{6}Z-[0-9a-f]{8}")
_LAYER_NAME_RE: Final = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
# RFC 6838 restricted-name, type "/" subtype.
_MEDIA_TYPE_RE: Final = re.compile(
    r"[A-Za-z0-9][A-Za-z0-9!#$&^_.+-]{0,126}/[A-Za-z0-9][A-Za-z0-9!#$&^_.+-]{0,126}"
)
_CREATED_RE: Final = re.compile(
    r"([0-9]{4})-([0-9]{2})-([0-9]{2})T([0-9]{2}):([0-9]{2}):([0-9]{2})(?:\.([0-9]{1,9}))?"
    r"(Z|[+-][0-9]{2}:[0-9]{2})"
)
_CONTROL_RE: Final = re.compile(r"[\x00-\x1f\x7f]")
# The CRIU images a criu layer splits into chunks: the page contents.
_SPLIT_FILE_RE: Final = re.compile(r"pages-[0-9]+\.img")
_DECIMAL_RE: Final = re.compile(r"0|[1-9][0-9]{0,18}")
_MAX_SCOPE_LEN: Final = 1024


# ---------------------------------------------------------------------------
# Scalar checks (shared by the parsers and by the API's argument checks)


def is_digest(value: object) -> bool:
    return isinstance(value, str) and _DIGEST_RE.fullmatch(value) is not None


def check_checkpoint_id(value: object) -> str | None:
    """Return why ``value`` is not a checkpoint id, or None if it is one."""
    if not isinstance(value, str) or _ID_RE.fullmatch(value) is None:
        return f"{value!r} is not a checkpoint id (expected e.g. 20261129T183000Z-3f9a1c2b)"
    return None


def check_layer_name(value: object) -> str | None:
    if not isinstance(value, str) or _LAYER_NAME_RE.fullmatch(value) is None:
        return (
            f"{value!r} is not a valid layer name (1-128 characters of A-Z a-z 0-9 . _ -, "
            "starting with a letter or digit)"
        )
    return None


def check_media_type(value: object) -> str | None:
    if not isinstance(value, str) or _MEDIA_TYPE_RE.fullmatch(value) is None:
        return f"{value!r} is not a valid media type (expected type/subtype, RFC 6838)"
    return None


def check_scope_or_label(what: str, value: object) -> str | None:
    if not isinstance(value, str) or not value:
        return f"{what} must be a non-empty string, got {value!r}"
    if len(value) > _MAX_SCOPE_LEN:
        return f"{what} is longer than {_MAX_SCOPE_LEN} characters"
    if _CONTROL_RE.search(value):
        return f"{what} {value!r} contains control characters"
    return None


def check_split_file_name(value: object) -> str | None:
    """Why ``value`` is not a file a layer may hold as chunks, or None."""
    if not isinstance(value, str) or _SPLIT_FILE_RE.fullmatch(value) is None:
        return f"{value!r} is not a page image name (pages-<n>.img)"
    return None


def chunk_bound(raw_size: int) -> int:
    """The most bytes zstd may turn ``raw_size`` bytes into (ZSTD_compressBound, rounded up)."""
    return raw_size + (raw_size >> 8) + (64 << 10)


def format_created(when: datetime) -> str:
    """RFC 3339 in UTC with microseconds, e.g. ``2026-11-29T18:30:00.123456Z``."""
    return when.astimezone(UTC).strftime("%Y-%m-%dT%H:%M:%S.%fZ")


def parse_created(value: object) -> datetime | None:
    """The instant an RFC 3339 timestamp names (UTC), or None if it is not one."""
    if not isinstance(value, str):
        return None
    m = _CREATED_RE.fullmatch(value)
    if m is None:
        return None
    year, month, day, hour, minute, second, frac, zone = m.groups()
    micro = int((frac or "0")[:6].ljust(6, "0"))
    try:
        when = datetime(
            int(year), int(month), int(day), int(hour), int(minute), int(second), micro, tzinfo=UTC
        )
        if zone != "Z":
            sign = 1 if zone[0] == "+" else -1
            zh, zm = int(zone[1:3]), int(zone[4:6])
            if zh > 23 or zm > 59:
                return None
            when -= sign * timedelta(hours=zh, minutes=zm)
    except (ValueError, OverflowError):
        return None
    return when


# ---------------------------------------------------------------------------
# JSON


def _reject_duplicates(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    # Two values for one key would let two readers disagree about a document.
    out: dict[str, Any] = {}
    for key, value in pairs:
        if key in out:
            raise ValueError(f"duplicate key {key!r}")
        out[key] = value
    return out


def _reject_constant(name: str) -> Any:
    raise ValueError(f"{name} is not valid JSON")


def load_json(data: bytes, where: str) -> Any:
    """Strict JSON: UTF-8, no duplicate keys, no NaN/Infinity."""
    try:
        text = data.decode("utf-8")
        return untrusted_json.loads(
            text, object_pairs_hook=_reject_duplicates, parse_constant=_reject_constant
        )
    except ValueError as err:  # UnicodeDecodeError is one
        raise errors.DataLoss(f"{where}: not valid JSON ({err})") from None


def dump_json(value: Any) -> bytes:
    return json.dumps(value, separators=(",", ":"), ensure_ascii=False, allow_nan=False).encode()


def dump_manifest(
    annotations: Mapping[str, str], config: Descriptor, layers: Sequence[Descriptor]
) -> bytes:
    """A checkpoint manifest; it carries the index entry's annotations (see repair)."""
    return dump_json(
        {
            "schemaVersion": 2,
            "mediaType": MEDIA_TYPE_MANIFEST,
            "config": config.to_json(),
            "layers": [d.to_json() for d in layers],
            "annotations": dict(annotations),
        }
    )


# ---------------------------------------------------------------------------
# Documents


@dataclass(frozen=True)
class Descriptor:
    media_type: str
    digest: str
    size: int
    annotations: Mapping[str, str] = field(default_factory=dict)
    # The descriptor as read, so fields this code does not know survive a rewrite.
    raw: Mapping[str, Any] = field(default_factory=dict, compare=False, repr=False)

    @property
    def hex(self) -> str:
        return self.digest.removeprefix("sha256:")

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = dict(self.raw)
        out.update(mediaType=self.media_type, digest=self.digest, size=self.size)
        if self.annotations:
            out["annotations"] = dict(self.annotations)
        else:
            out.pop("annotations", None)
        return out


@dataclass(frozen=True)
class CheckpointRef:
    """What index.json says about one checkpoint (no blob read needed)."""

    id: str
    scope: str
    label: str
    created: str
    created_at: datetime
    descriptor: Descriptor
    position: int  # in index.json: commit order, the tie-breaker for equal times

    @property
    def pinned_by(self) -> str:
        """ "user", "policy", or "" when not pinned."""
        return PIN_VALUES.get(self.descriptor.annotations.get(ANN_PINNED, ""), "")

    @property
    def pinned(self) -> bool:
        return bool(self.pinned_by)


@dataclass(frozen=True)
class Index:
    descriptors: tuple[Descriptor, ...]
    checkpoints: tuple[CheckpointRef, ...]
    # Top-level fields other than "manifests", kept verbatim on rewrite.
    extra: Mapping[str, Any] = field(default_factory=dict)

    def to_json(self, descriptors: Sequence[Descriptor]) -> dict[str, Any]:
        out: dict[str, Any] = {"schemaVersion": 2, "mediaType": MEDIA_TYPE_INDEX}
        out.update((k, v) for k, v in self.extra.items() if k not in out)
        out["manifests"] = [d.to_json() for d in descriptors]
        return out


@dataclass(frozen=True)
class Chunk:
    """One blob of a split file: the file's bytes [offset, offset + raw_size), zstd."""

    file: str  # a top-level page image of the layer, e.g. pages-1.img
    offset: int
    raw_size: int
    digest: str
    size: int  # stored (compressed) bytes

    def descriptor(self, layer: str) -> Descriptor:
        return Descriptor(
            MEDIA_TYPE_CRIU_CHUNK,
            self.digest,
            self.size,
            {
                ANN_TITLE: layer,
                ANN_CHUNK_FILE: self.file,
                ANN_CHUNK_OFFSET: str(self.offset),
                ANN_CHUNK_RAW_SIZE: str(self.raw_size),
            },
        )


@dataclass(frozen=True)
class SplitFile:
    """A file a compacted layer holds as chunks rather than in its tar."""

    path: str
    size: int
    mode: int
    mtime: int

    def to_json(self) -> dict[str, Any]:
        return {"path": self.path, "size": self.size, "mode": self.mode, "mtime": self.mtime}


@dataclass(frozen=True)
class Manifest:
    config: Descriptor
    # One per layer, each carrying its name in ANN_TITLE; chunk descriptors are
    # not here but in ``chunks``.
    layers: tuple[Descriptor, ...]
    annotations: Mapping[str, str] = field(default_factory=dict)
    # Layer name -> its chunks, file by file, each file's from offset 0 on.
    chunks: Mapping[str, tuple[Chunk, ...]] = field(default_factory=dict)

    def layer_names(self) -> tuple[str, ...]:
        return tuple(d.annotations[ANN_TITLE] for d in self.layers)


def tar_raw_size(raw_size: int, split_files: Sequence[SplitFile]) -> int:
    """What a compacted layer's own blob (its tar) decompresses to: the whole layer's
    raw size less the files split into chunks."""
    return raw_size - sum(f.size for f in split_files)


@dataclass(frozen=True)
class ConfigLayer:
    name: str
    media_type: str
    digest: str
    size: int  # the layer's own blob (a split layer's: the tar of the files not split)
    raw_size: int  # the whole layer uncompressed (a split layer's: tar and split files)
    split_files: tuple[SplitFile, ...] = ()

    @property
    def tar_raw_size(self) -> int:
        return tar_raw_size(self.raw_size, self.split_files)


@dataclass(frozen=True)
class Config:
    """A checkpoint config: the caller's metadata plus what the store records."""

    metadata: dict[str, Any]  # the whole JSON object
    layers: tuple[ConfigLayer, ...]
    # Layer name -> digest of the layer's file list, for every layer that was
    # published raw (kept after compaction: it identifies the raw-image cache).
    raw_files: Mapping[str, str]


def _expect_object(value: Any, where: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise errors.DataLoss(f"{where}: expected a JSON object, got {type(value).__name__}")
    return value


def _expect_size(value: Any, where: str) -> int:
    # bool is an int in Python but never a size in JSON.
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value <= _MAX_SIZE:
        raise errors.DataLoss(f"{where}: expected a size (integer >= 0), got {value!r}")
    return value


def _expect_str(value: Any, where: str) -> str:
    if not isinstance(value, str):
        raise errors.DataLoss(f"{where}: expected a string, got {value!r}")
    return value


def parse_descriptor(value: Any, where: str) -> Descriptor:
    obj = _expect_object(value, where)
    media_type = obj.get("mediaType")
    if (why := check_media_type(media_type)) is not None:
        raise errors.DataLoss(f"{where}: mediaType: {why}")
    digest = obj.get("digest")
    if not is_digest(digest):
        raise errors.DataLoss(f"{where}: digest {digest!r} is not sha256:<64 lowercase hex>")
    size = _expect_size(obj.get("size"), f"{where}: size")
    annotations_raw = obj.get("annotations", {})
    annotations = _expect_object(annotations_raw, f"{where}: annotations")
    for key, val in annotations.items():
        if not isinstance(val, str):
            raise errors.DataLoss(f"{where}: annotation {key!r} is not a string: {val!r}")
    assert isinstance(media_type, str) and isinstance(digest, str)
    return Descriptor(media_type, digest, size, dict(annotations), raw=dict(obj))


def _expect_int(value: Any, low: int, high: int, where: str) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise errors.DataLoss(f"{where}: expected an integer in [{low}, {high}], got {value!r}")
    return value


def _decimal_annotation(annotations: Mapping[str, str], key: str, where: str) -> int:
    value = annotations.get(key)
    if value is None or _DECIMAL_RE.fullmatch(value) is None:
        raise errors.DataLoss(f"{where}: annotation {key} {value!r} is not a decimal size")
    number = int(value)
    if number > _MAX_SIZE:
        raise errors.DataLoss(f"{where}: annotation {key} {value} is out of range")
    return number


def _parse_chunk(desc: Descriptor, where: str) -> Chunk:
    file = desc.annotations.get(ANN_CHUNK_FILE)
    if (why := check_split_file_name(file)) is not None:
        raise errors.DataLoss(f"{where}: annotation {ANN_CHUNK_FILE}: {why}")
    assert isinstance(file, str)
    offset = _decimal_annotation(desc.annotations, ANN_CHUNK_OFFSET, where)
    raw_size = _decimal_annotation(desc.annotations, ANN_CHUNK_RAW_SIZE, where)
    if not 0 < raw_size <= MAX_CHUNK_BYTES or offset > _MAX_SIZE - raw_size:
        raise errors.DataLoss(
            f"{where}: chunk of {file} at offset {offset} claims {raw_size} bytes "
            f"(1..{MAX_CHUNK_BYTES} allowed)"
        )
    if not 0 < desc.size <= chunk_bound(raw_size):
        raise errors.DataLoss(
            f"{where}: chunk of {file} at offset {offset} is {desc.size} bytes stored, "
            f"impossible for {raw_size} bytes compressed"
        )
    return Chunk(file, offset, raw_size, desc.digest, desc.size)


def _check_chunk_order(chunks: Sequence[Chunk], where: str) -> None:
    """Each file's chunks together, from offset 0 on, each where the previous one ends."""
    done: set[str] = set()
    current, end = "", 0
    for chunk in chunks:
        if chunk.file != current:
            if chunk.file in done:
                raise errors.DataLoss(f"{where}: the chunks of {chunk.file} are not together")
            done.add(current)
            current, end = chunk.file, 0
        if chunk.offset != end:
            raise errors.DataLoss(
                f"{where}: chunk of {chunk.file} at offset {chunk.offset}, expected one at {end} "
                "(a chunk is missing or out of order)"
            )
        end += chunk.raw_size


def match_split_files(
    chunks: Sequence[Chunk], split_files: Sequence[SplitFile], where: str
) -> None:
    """DataLoss unless ``chunks`` (checked by the manifest's parser) make up ``split_files``."""
    have: dict[str, int] = {}
    for chunk in chunks:
        have[chunk.file] = have.get(chunk.file, 0) + chunk.raw_size
    want = {f.path: f.size for f in split_files}
    for path in have.keys() - want.keys():
        raise errors.DataLoss(
            f"{where}: the manifest has chunks of {path}, the config no such file"
        )
    for path, size in want.items():
        if have.get(path, 0) != size:
            raise errors.DataLoss(
                f"{where}: the chunks of {path} hold {have.get(path, 0)} bytes, the config says "
                f"{size} (a chunk is missing)"
            )


def parse_layout_file(data: bytes, where: str) -> None:
    obj = _expect_object(load_json(data, where), where)
    version = obj.get("imageLayoutVersion")
    if version != LAYOUT_VERSION:
        raise errors.DataLoss(
            f"{where}: imageLayoutVersion is {version!r}, this store writes {LAYOUT_VERSION!r}"
        )


def parse_checkpoint_ref(desc: Descriptor, position: int, where: str) -> CheckpointRef:
    ann = desc.annotations
    cid = ann[ANN_ID]
    if (why := check_checkpoint_id(cid)) is not None:
        raise errors.DataLoss(f"{where}: {why}")
    if desc.media_type != MEDIA_TYPE_MANIFEST:
        raise errors.DataLoss(
            f"{where}: checkpoint {cid} has mediaType {desc.media_type!r}, "
            f"expected {MEDIA_TYPE_MANIFEST}"
        )
    for key, what in ((ANN_SCOPE, "scope"), (ANN_LABEL, "label")):
        if (why := check_scope_or_label(what, ann.get(key))) is not None:
            raise errors.DataLoss(f"{where}: checkpoint {cid}: annotation {key}: {why}")
    created = ann.get(ANN_CREATED)
    created_at = parse_created(created)
    if created_at is None:
        raise errors.DataLoss(
            f"{where}: checkpoint {cid}: annotation {ANN_CREATED} {created!r} is not RFC 3339"
        )
    assert isinstance(created, str)
    return CheckpointRef(cid, ann[ANN_SCOPE], ann[ANN_LABEL], created, created_at, desc, position)


def parse_index(data: bytes, where: str) -> Index:
    obj = _expect_object(load_json(data, where), where)
    if obj.get("schemaVersion") != 2:
        raise errors.DataLoss(f"{where}: schemaVersion is {obj.get('schemaVersion')!r}, not 2")
    if "mediaType" in obj and obj["mediaType"] != MEDIA_TYPE_INDEX:
        raise errors.DataLoss(f"{where}: mediaType is {obj['mediaType']!r}, not {MEDIA_TYPE_INDEX}")
    manifests = obj.get("manifests")
    if not isinstance(manifests, list):
        raise errors.DataLoss(f"{where}: 'manifests' is missing or not a list")
    descriptors: list[Descriptor] = []
    checkpoints: list[CheckpointRef] = []
    seen: set[str] = set()
    for i, item in enumerate(manifests):
        desc = parse_descriptor(item, f"{where}: manifests[{i}]")
        descriptors.append(desc)
        # Entries without our id annotation belong to other tools sharing the
        # layout; they are kept (and their blobs protected) but not listed.
        if ANN_ID in desc.annotations:
            ref = parse_checkpoint_ref(desc, i, f"{where}: manifests[{i}]")
            if ref.id in seen:
                raise errors.DataLoss(f"{where}: checkpoint {ref.id} is listed twice")
            seen.add(ref.id)
            checkpoints.append(ref)
    extra = {k: v for k, v in obj.items() if k != "manifests"}
    return Index(tuple(descriptors), tuple(checkpoints), extra)


def parse_manifest(data: bytes, where: str) -> Manifest:
    obj = _expect_object(load_json(data, where), where)
    if obj.get("schemaVersion") != 2:
        raise errors.DataLoss(f"{where}: schemaVersion is {obj.get('schemaVersion')!r}, not 2")
    if obj.get("mediaType") != MEDIA_TYPE_MANIFEST:
        raise errors.DataLoss(
            f"{where}: mediaType is {obj.get('mediaType')!r}, not {MEDIA_TYPE_MANIFEST}"
        )
    config = parse_descriptor(obj.get("config"), f"{where}: config")
    if config.media_type != MEDIA_TYPE_CONFIG:
        raise errors.DataLoss(
            f"{where}: config mediaType is {config.media_type!r}, not {MEDIA_TYPE_CONFIG}"
        )
    raw_layers = obj.get("layers")
    if not isinstance(raw_layers, list):
        raise errors.DataLoss(f"{where}: 'layers' is missing or not a list")
    layers: list[Descriptor] = []
    chunks: dict[str, list[Chunk]] = {}
    names: set[str] = set()
    for i, item in enumerate(raw_layers):
        lw = f"{where}: layers[{i}]"
        desc = parse_descriptor(item, lw)
        name = desc.annotations.get(ANN_TITLE)
        if (why := check_layer_name(name)) is not None:
            raise errors.DataLoss(f"{lw}: annotation {ANN_TITLE}: {why}")
        assert isinstance(name, str)
        if desc.media_type == MEDIA_TYPE_CRIU_CHUNK:
            if not layers or layers[-1].annotations[ANN_TITLE] != name:
                raise errors.DataLoss(
                    f"{lw}: a chunk of layer {name!r} that does not follow that layer's descriptor"
                )
            chunks.setdefault(name, []).append(_parse_chunk(desc, lw))
            continue
        if name in names:
            raise errors.DataLoss(f"{where}: layer {name!r} appears twice")
        names.add(name)
        layers.append(desc)
    for name, pieces in chunks.items():
        _check_chunk_order(pieces, f"{where}: layer {name!r}")
    annotations = _expect_object(obj.get("annotations", {}), f"{where}: annotations")
    for key, val in annotations.items():
        if not isinstance(val, str):
            raise errors.DataLoss(f"{where}: annotation {key!r} is not a string: {val!r}")
    return Manifest(config, tuple(layers), annotations, {k: tuple(v) for k, v in chunks.items()})


def _check_identity(obj: dict[str, Any], where: str, ref: CheckpointRef) -> None:
    # First, before any field is judged: a config that names another checkpoint
    # means blobs were swapped or mixed up, and that is what must be reported.
    for key, expected in (("id", ref.id), ("scope", ref.scope), ("label", ref.label)):
        if obj.get(key) != expected:
            raise errors.DataLoss(
                f"{where}: config {key} is {obj.get(key)!r} but index.json says {expected!r}"
            )
    created = obj.get("created")
    if parse_created(created) != ref.created_at:
        raise errors.DataLoss(
            f"{where}: config created is {created!r} but index.json says {ref.created!r}"
        )


def _parse_raw_files(value: Any, where: str) -> dict[str, str]:
    if value is None:
        return {}
    raw_files = _expect_object(value, where)
    for name, digest in raw_files.items():
        if (why := check_layer_name(name)) is not None:
            raise errors.DataLoss(f"{where}: {why}")
        if not is_digest(digest):
            raise errors.DataLoss(f"{where}: {name}: {digest!r} is not sha256:<64 lowercase hex>")
    return raw_files


def _parse_split_files(value: Any, where: str) -> tuple[SplitFile, ...]:
    if value is None:
        return ()
    if not isinstance(value, list):
        raise errors.DataLoss(f"{where}: expected a list, got {type(value).__name__}")
    files: list[SplitFile] = []
    for i, item in enumerate(value):
        fw = f"{where}[{i}]"
        obj = _expect_object(item, fw)
        path = obj.get("path")
        if (why := check_split_file_name(path)) is not None:
            raise errors.DataLoss(f"{fw}: path: {why}")
        assert isinstance(path, str)
        if any(f.path == path for f in files):
            raise errors.DataLoss(f"{fw}: {path} is listed twice")
        files.append(
            SplitFile(
                path,
                _expect_size(obj.get("size"), f"{fw}: size"),
                _expect_int(obj.get("mode"), 0, 0o7777, f"{fw}: mode"),
                _expect_int(obj.get("mtime"), -_MAX_MTIME, _MAX_MTIME, f"{fw}: mtime"),
            )
        )
    return tuple(files)


def parse_config(data: bytes, where: str, ref: CheckpointRef) -> Config:
    """The checkpoint config (metadata JSON), the layers and raw file lists it records.

    Its identity fields must agree with the index entry that led here.
    """
    obj = _expect_object(load_json(data, where), where)
    _check_identity(obj, where, ref)
    sizes = _expect_object(obj.get("sizes"), f"{where}: sizes")
    _expect_size(sizes.get("raw"), f"{where}: sizes.raw")
    _expect_size(sizes.get("stored"), f"{where}: sizes.stored")
    raw_layers = obj.get("layers")
    if not isinstance(raw_layers, list):
        raise errors.DataLoss(f"{where}: 'layers' is missing or not a list")
    layers: list[ConfigLayer] = []
    for i, item in enumerate(raw_layers):
        lw = f"{where}: layers[{i}]"
        layer = _expect_object(item, lw)
        name = layer.get("name")
        if (why := check_layer_name(name)) is not None:
            raise errors.DataLoss(f"{lw}: name: {why}")
        media_type = layer.get("media_type")
        if (why := check_media_type(media_type)) is not None:
            raise errors.DataLoss(f"{lw}: media_type: {why}")
        digest = layer.get("digest")
        if not is_digest(digest):
            raise errors.DataLoss(f"{lw}: digest {digest!r} is not sha256:<64 lowercase hex>")
        parsed = ConfigLayer(
            _expect_str(name, f"{lw}: name"),
            _expect_str(media_type, f"{lw}: media_type"),
            _expect_str(digest, f"{lw}: digest"),
            _expect_size(layer.get("size"), f"{lw}: size"),
            _expect_size(layer.get("raw_size"), f"{lw}: raw_size"),
            _parse_split_files(layer.get("split_files"), f"{lw}: split_files"),
        )
        if parsed.tar_raw_size < 0:
            raise errors.DataLoss(
                f"{lw}: raw_size {parsed.raw_size} is less than its split files hold"
            )
        layers.append(parsed)
    raw_files = _parse_raw_files(obj.get("rawFiles"), f"{where}: rawFiles")
    return Config(obj, tuple(layers), raw_files)
