"""Forged checkpoints, as someone able to push to the registry could make them: a real
checkpoint's documents copied under a newer id and time, its criu layer's tar blob
swapped for a zstd bomb (a few KiB that expand to far more than the raw size the
config records for it). For the tests of what a node does with such a candidate."""

from __future__ import annotations

import hashlib
import io
import json
import secrets
import tarfile
from collections.abc import Callable
from dataclasses import dataclass
from datetime import datetime
from typing import IO, Any

import zstandard
from cedana_shim.checkpoint.remote.manifest import checkpoint_manifest
from cedana_shim.checkpoint.remote.tags import CheckpointTag, tag_for
from cedana_shim.checkpoint.store import Entry, Store
from cedana_shim.checkpoint.store.adopt import manifest_blobs
from cedana_shim.checkpoint.store.layout import (
    ANN_CREATED,
    ANN_ID,
    ANN_TITLE,
    MEDIA_TYPE_MANIFEST,
    format_created,
    parse_manifest,
)
from cedana_shim.registry import Registry

MiB = 1 << 20
# What the bomb's config says its tar holds: the tracker's 4 KiB.
RECORDED_TAR_BYTES = 4096


def _sha256(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


class _Zeros(io.RawIOBase):
    def __init__(self, size: int) -> None:
        self._left = size

    def readable(self) -> bool:
        return True

    def readinto(self, b: Any) -> int:
        n = min(len(b), self._left)
        b[:n] = bytes(n)
        self._left -= n
        return n


def zstd_bomb(expands_to: int, member: str = "core-1.img") -> bytes:
    """A zstd tar of one member of ``expands_to`` zero bytes: a few KiB per GiB."""
    out = io.BytesIO()
    with (
        zstandard.ZstdCompressor(level=3).stream_writer(out, closefd=False) as z,
        tarfile.open(fileobj=z, mode="w|", bufsize=MiB) as tar,
    ):
        info = tarfile.TarInfo(member)
        info.size, info.mode = expands_to, 0o600
        tar.addfile(info, io.BufferedReader(_Zeros(expands_to), MiB))
    return out.getvalue()


@dataclass(frozen=True)
class Forged:
    id: str
    created: str
    manifest: bytes  # as a store holds it
    metadata: dict[str, Any]  # the config
    blobs: dict[str, bytes]  # everything new it names (the config, the bomb)
    source: Entry  # the real checkpoint it copies

    def tag(self, node: str) -> CheckpointTag:
        return tag_for(str(self.metadata["label"]), self.created, self.id, node)


def with_member(store: Store, entry: Entry, name: str, data: bytes, layer: str = "criu") -> bytes:
    """``entry``'s ``layer`` tar again, with one more member: what a forged blob holds
    whose config records its true size (compress it, and pass ``len`` to :func:`forge`)."""
    with store.adopter.open_blob(entry.layer(layer).digest, "tar blob") as f:
        tar = zstandard.ZstdDecompressor().stream_reader(f).read()
    out = io.BytesIO()
    with (
        tarfile.open(fileobj=io.BytesIO(tar), mode="r") as old,
        tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as new,
    ):
        for member in old:
            new.addfile(member, old.extractfile(member) if member.isreg() else None)
        info = tarfile.TarInfo(name)
        info.size, info.mode = len(data), 0o600
        new.addfile(info, io.BytesIO(data))
    return out.getvalue()


def forge(
    store: Store,
    entry: Entry,
    created: datetime,
    *,
    bomb: bytes,
    layer: str = "criu",
    tar_raw_size: int = RECORDED_TAR_BYTES,
    raw_files: bool = True,
) -> Forged:
    """``entry`` (compacted, of ``store``) as a new checkpoint created at ``created``
    whose ``layer`` tar blob is ``bomb`` (zstd), recorded as ``tar_raw_size`` raw bytes.
    ``raw_files`` False drops the file lists' digests from the config: then a pull
    builds no raw-image cache (and does not unpack the tar), the restore extracts it."""
    cid = f"{created:%Y%m%dT%H%M%S}Z-{secrets.token_hex(4)}"
    when = format_created(created)
    metadata = json.loads(json.dumps(dict(entry.metadata)))
    metadata.update(id=cid, created=when)
    if not raw_files:
        metadata.pop("rawFiles", None)
    bomb_digest = _sha256(bomb)
    for recorded in metadata["layers"]:
        if recorded["name"] == layer:
            split = sum(f["size"] for f in recorded.get("split_files", []))
            recorded.update(digest=bomb_digest, size=len(bomb), raw_size=split + tar_raw_size)
    config = json.dumps(metadata).encode()
    document = json.loads(store.adopter.checkpoint_manifest(entry))
    document["config"].update(digest=_sha256(config), size=len(config))
    for desc in document["layers"]:
        if desc["annotations"].get(ANN_TITLE) == layer and "chunk" not in desc["mediaType"]:
            desc.update(digest=bomb_digest, size=len(bomb))
    document["annotations"].update({ANN_ID: cid, ANN_CREATED: when})
    manifest = json.dumps(document).encode()
    return Forged(
        cid, when, manifest, metadata, {_sha256(config): config, bomb_digest: bomb}, entry
    )


def _blob_source(store: Store, forged: Forged, digest: str) -> Callable[[int], IO[bytes]]:
    def open_at(offset: int) -> IO[bytes]:
        if digest in forged.blobs:
            stream: IO[bytes] = io.BytesIO(forged.blobs[digest])
        else:
            stream = store.adopter.open_blob(digest, f"blob {digest}")
        stream.seek(offset)
        return stream

    return open_at


def push_forged(
    client: Registry, store: Store, forged: Forged, node: str, *, scope: str
) -> CheckpointTag:
    """Push ``forged`` (its blobs, the real one's chunks from ``store``) under its tag."""
    repo = client.repository_for(scope)
    for digest, size in manifest_blobs(parse_manifest(forged.manifest, "forged")).items():
        client.push_blob(repo, digest, size, _blob_source(store, forged, digest))
    tag = forged.tag(node)
    remote = checkpoint_manifest(forged.manifest, forged.metadata, scope, node)
    client.put_manifest(repo, tag.tag, remote, MEDIA_TYPE_MANIFEST)
    return tag


def adopt_forged(target: Store, source: Store, forged: Forged) -> Entry:
    """``forged`` committed into ``target`` as a pull would (``target`` should not
    build a raw-image cache, which would decompress the bomb at once)."""
    with target.adopter.begin_adoption(forged.id) as adoption:
        for digest, size in manifest_blobs(parse_manifest(forged.manifest, "forged")).items():
            data = forged.blobs.get(digest)
            if data is None:
                with source.adopter.open_blob(digest, digest) as f:
                    data = f.read()

            def fill(out: IO[bytes], data: bytes = data) -> None:
                out.write(data)

            adoption.write_blob(digest, size, fill)
        return target.adopter.adopt(adoption, forged.manifest)
