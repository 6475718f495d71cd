"""Pulling a checkpoint from the registry into the local store, verified, all or nothing.

The manifest is read first, its signature checked when the node trusts keys
(signing.py), and checked against the tag and repository it was found under
(manifest.py); every blob's size is checked against limits and the store's
free space BEFORE anything is downloaded. Blobs the store already holds (chunks of
an earlier checkpoint) are pinned from it, not downloaded; the rest stream into the
store's staging dir (store/adopt.py), their sha256 verified on the way, a small
pool at once, the config first (and checked, so a bad one costs no layer
download), then the layers' own blobs (the small CRIU images, the rootfs diff),
then the chunks in the order their files hold them (:func:`download_order`). With
the store's ``cache_raw`` on (and room for it), the CRIU page images are written
out as their chunks arrive, decompressed on the way (store/rawcache.py): the
pulled checkpoint comes with its raw-image cache, and the restore runs CRIU at
once rather than unpacking the blobs first. Only when every blob is there does the
store commit the checkpoint (and place that cache); any failure removes the staging
dir, so nothing partial is ever visible.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import IO, TYPE_CHECKING, Final, TypeAlias

from cedana_shim import errors
from cedana_shim.checkpoint.store import Adopter, Adoption, Entry, fsutil
from cedana_shim.checkpoint.store.adopt import manifest_blobs
from cedana_shim.checkpoint.store.layout import (
    ANN_CREATED,
    ANN_ID,
    ANN_LABEL,
    ANN_SCOPE,
    MAX_CONFIG_BYTES,
    MAX_MANIFEST_BYTES,
    MEDIA_TYPE_MANIFEST,
    CheckpointRef,
    Config,
    Descriptor,
    Manifest,
    parse_checkpoint_ref,
    parse_config,
)
from cedana_shim.registry import Registry

from .encryption import EncryptedLayer, decrypt_manifest, has_encrypted
from .manifest import parse_checkpoint_manifest
from .model import RemoteCheckpoint
from .ocicrypt import DecryptingWriter
from .signing import Trust
from .tags import CheckpointTag, parse_tag

if TYPE_CHECKING:
    from cryptography.hazmat.primitives.asymmetric.types import PrivateKeyTypes

PrivateKeys: TypeAlias = "Sequence[tuple[str, str, PrivateKeyTypes]]"  # path, kid, key
Layers: TypeAlias = dict[str, EncryptedLayer]  # plain digest -> the registry's blob

__all__ = [
    "DOWNLOAD_WORKERS",
    "MAX_BLOB_BYTES",
    "Meter",
    "Progress",
    "check_config",
    "check_sizes",
    "check_space",
    "download_blob",
    "download_order",
    "pull_into",
    "read_manifest",
]

DOWNLOAD_WORKERS: Final = 4
MAX_BLOB_BYTES: Final = 1 << 40  # no layer of a checkpoint comes near a TiB
# Kept free on the store's filesystem after a pull: the next checkpoint needs room too.
FREE_MARGIN_BYTES: Final = 64 << 20
Progress = Callable[[int, int], None]  # (bytes done, bytes in all)


def _tag_of(remote: RemoteCheckpoint) -> CheckpointTag:
    tag = parse_tag(remote.tag)
    if tag is None or tag.pending or tag.checkpoint_id != remote.checkpoint_id:
        raise errors.InvalidArgument(
            f"{remote.ref} is not the tag of checkpoint {remote.checkpoint_id}"
        )
    return tag


def read_manifest(
    client: Registry,
    remote: RemoteCheckpoint,
    trust: Trust | None = None,
    keys: PrivateKeys = (),
) -> tuple[bytes, Manifest, CheckpointRef, Layers]:
    """The checkpoint's manifest from the registry, checked (see manifest.py), and
    with ``trust``, its signature (signing.py): before anything else is read. An
    encrypted one's layers are opened with ``keys`` (encryption.py): the manifest
    returned is the plain one (as the pushing node's store has it), with what
    decrypts each layer; ocicrypt.NoKey (FailedPrecondition) when ``keys`` cannot."""
    tag = _tag_of(remote)
    repo = client.repository_for(remote.scope)
    if repo != remote.repository:
        raise errors.InvalidArgument(
            f"{remote.ref}: repository {remote.repository} is not namespace {remote.scope}'s"
        )
    data, _, digest = client.get_manifest(repo, remote.tag, max_size=MAX_MANIFEST_BYTES)
    where = f"registry {client.host}: {repo}:{remote.tag}"
    if trust is not None:
        trust.check(client, repo, digest, f"checkpoint {remote.checkpoint_id} ({remote.ref})")
    layers: Layers = {}
    if has_encrypted(data, where):
        data, layers = decrypt_manifest(
            data, keys, f"checkpoint {remote.checkpoint_id} ({remote.ref}) in {where}"
        )
    manifest = parse_checkpoint_manifest(
        data, where, scope=remote.scope, tag=tag, label=remote.label or None
    )
    identity = (ANN_ID, ANN_SCOPE, ANN_LABEL, ANN_CREATED)
    desc = Descriptor(
        MEDIA_TYPE_MANIFEST, digest, len(data), {k: manifest.annotations[k] for k in identity}
    )
    return data, manifest, parse_checkpoint_ref(desc, 0, where), layers


def check_config(data: bytes, ref: CheckpointRef, where: str) -> Mapping[str, object]:
    return _parse_config(data, ref, where).metadata


def _parse_config(data: bytes, ref: CheckpointRef, where: str) -> Config:
    return parse_config(data, f"{where}: config", ref)


def check_sizes(manifest: Manifest, where: str) -> None:
    if manifest.config.size > MAX_CONFIG_BYTES:
        raise errors.DataLoss(
            f"{where}: the config announces {manifest.config.size} bytes, more than the "
            f"{MAX_CONFIG_BYTES} a config may have; nothing downloaded"
        )
    for digest, size in manifest_blobs(manifest).items():
        if size > MAX_BLOB_BYTES:
            raise errors.DataLoss(
                f"{where}: blob {digest} announces {size} bytes, more than the "
                f"{MAX_BLOB_BYTES} a checkpoint blob may have; nothing downloaded"
            )


def _free_bytes(root: str) -> int:
    try:
        return fsutil.free_bytes(root)
    except OSError as err:
        raise errors.Internal(f"checking free space in {root}: {err}") from err


def check_space(
    root: str,
    need: int,
    remote: RemoteCheckpoint,
    *,
    doing: str = "pulling",
    then: str = "nothing was downloaded. Free space there (`cedana checkpoints prune`) and retry",
) -> int:
    """The bytes free beyond ``need`` and the margin on the filesystem of ``root``;
    ResourceExhausted if there are none, saying that ``doing`` the checkpoint needs
    them and ``then`` what became of it and what to do."""
    free = _free_bytes(root)
    if need + FREE_MARGIN_BYTES > free:
        raise errors.ResourceExhausted(
            f"{doing} checkpoint {remote.checkpoint_id} ({remote.ref}) needs {need} bytes "
            f"in {root} (and {FREE_MARGIN_BYTES >> 20} MiB to spare), which has {free} "
            f"free; {then}"
        )
    return free - need - FREE_MARGIN_BYTES


class Meter:
    """Bytes done across parallel downloads, for one progress callback."""

    def __init__(self, total: int, progress: Progress | None) -> None:
        self._total = total
        self._progress = progress
        self._held: dict[str, int] = {}
        self._lock = threading.Lock()

    def blob(self, digest: str) -> Callable[[int], None]:
        def update(held: int) -> None:
            with self._lock:
                self._held[digest] = held
                done = sum(self._held.values())
            if self._progress is not None:
                self._progress(done, self._total)

        return update


def pull_into(
    adopter: Adopter,
    client: Registry,
    remote: RemoteCheckpoint,
    progress: Progress | None,
    trust: Trust | None = None,
    keys: PrivateKeys = (),
) -> Entry:
    """See the module doc; the entry as the local store has it afterwards."""
    data, manifest, ref, layers = read_manifest(client, remote, trust, keys)
    repo = remote.repository
    where = f"registry {client.host}: {remote.repository}:{remote.tag}"
    check_sizes(manifest, where)
    blobs = manifest_blobs(manifest)
    with adopter.begin_adoption(remote.checkpoint_id) as adoption:
        missing = {d: s for d, s in blobs.items() if not adoption.link_existing(d, s)}
        spare = check_space(adopter.root, sum(missing.values()), remote)
        meter = Meter(sum(missing.values()), progress)
        cdesc = manifest.config
        if cdesc.digest in missing:
            download_blob(client, repo, adoption, cdesc.digest, cdesc.size, meter, layers)
        config = _parse_config(adoption.read_staged(cdesc.digest, MAX_CONFIG_BYTES), ref, where)
        cache = adoption.cache_layer(manifest, config)
        if cache is not None and cache.raw_size <= spare:
            adoption.begin_cache(manifest, config)
        rest = download_order(manifest, missing)
        with ThreadPoolExecutor(DOWNLOAD_WORKERS, thread_name_prefix="cedana-pull") as pool:
            # Chunks the store had: into the cache while the others download.
            futures = [pool.submit(adoption.fill_cache, d) for d in blobs if d not in missing]
            futures += [
                pool.submit(download_blob, client, repo, adoption, d, missing[d], meter, layers)
                for d in rest
            ]
            try:
                for future in futures:
                    future.result()
            except BaseException:
                for future in futures:
                    future.cancel()
                raise
        return adopter.adopt(adoption, data)


def download_order(manifest: Manifest, missing: Mapping[str, int]) -> list[str]:
    """The blobs of ``missing`` but the config, in the order a pull asks for them: the
    layers' own blobs first, smallest first (the CRIU images other than the pages and
    the rootfs diff, which a restore needs whole before anything else), then the
    chunks of the split files in file and offset order, as CRIU reads the pages."""
    layers = sorted(
        (d.digest for d in manifest.layers if d.digest in missing), key=lambda d: missing[d]
    )
    order = dict.fromkeys(layers)
    for chunks in manifest.chunks.values():
        order |= dict.fromkeys(c.digest for c in chunks if c.digest in missing)
    order.pop(manifest.config.digest, None)
    return list(order)


def download_blob(
    client: Registry,
    repo: str,
    adoption: Adoption,
    digest: str,
    size: int,
    meter: Meter,
    layers: Layers,
) -> None:
    """Blob ``digest`` into the staging dir; an encrypted layer's blob decrypted on the
    way (its ciphertext checked by the registry client, the plain bytes by the store)."""
    encrypted = layers.get(digest)

    def fill(out: IO[bytes]) -> None:
        if encrypted is None:
            client.pull_blob(repo, digest, size, out, max_size=size, progress=meter.blob(digest))
            return
        key = encrypted.key
        plain = DecryptingWriter(out, key.key, key.nonce)
        client.pull_blob(
            repo, encrypted.digest, size, plain, max_size=size,  # type: ignore[arg-type]
            progress=meter.blob(digest),
        )  # fmt: skip

    adoption.write_blob(digest, size, fill)
