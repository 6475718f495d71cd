"""A pull whose page chunks come when they are asked for: the lazy restore's source.

:func:`pull.pull_into` downloads every blob before a restore starts. For a restore
through CRIU's lazy-pages daemon on another node (restore.py, node config
``lazy_restore``) :class:`LazyPull` instead stages the manifest's small blobs first
(the config, every layer's own blob: the CRIU layer's tar of small images, the rootfs
diff, /dev/shm) and leaves the chunks of the page images to :meth:`fetch_chunk`,
which the page server (page_server.py) calls on a fault and its prefetcher behind.
Every blob goes through the same staging dir as a full pull's (store/adopt.py):
checked as it arrives (size, sha256; an encrypted layer decrypted on the way), and
committed to the store by :meth:`commit` only once every blob is there. Closed
without a commit (a failure, a fallback), nothing of it is visible.

The same checks as a full pull come first: the manifest (signature, tag, sizes), and
the free space for all of it.
"""

from __future__ import annotations

import contextlib
from typing import IO

from cedana_shim import errors
from cedana_shim.checkpoint.store import Adopter, Adoption, Entry
from cedana_shim.checkpoint.store.adopt import manifest_blobs
from cedana_shim.checkpoint.store.compress import RawBound, ZstdReader
from cedana_shim.checkpoint.store.layout import (
    MAX_CONFIG_BYTES,
    Chunk,
    Config,
    ConfigLayer,
    Manifest,
    parse_config,
)
from cedana_shim.registry import Registry

from .model import RemoteCheckpoint
from .ocicrypt import DecryptingWriter
from .pull import (
    Layers,
    Meter,
    PrivateKeys,
    check_sizes,
    check_space,
    download_blob,
    read_manifest,
)
from .signing import Trust

__all__ = ["LazyPull"]


class _Kept:
    """A staged blob's file, and a copy of its bytes in memory (one chunk's worth)."""

    def __init__(self) -> None:
        self.out: IO[bytes] | None = None
        self.data = bytearray()

    def write(self, data: bytes) -> int:
        assert self.out is not None
        self.out.write(data)
        self.data += data
        return len(data)


class LazyPull:
    """One checkpoint being pulled while it is restored (see the module doc).

    :meth:`begin` before anything else; :meth:`fetch_chunk` from any thread.
    """

    def __init__(
        self,
        adopter: Adopter,
        client: Registry,
        remote: RemoteCheckpoint,
        trust: Trust | None = None,
        keys: PrivateKeys = (),
    ) -> None:
        self._adopter = adopter
        self._client = client
        self._trust = trust
        self._keys = keys
        self.remote = remote
        self.where = f"registry {client.host}: {remote.repository}:{remote.tag}"
        self._stack = contextlib.ExitStack()
        self._adoption: Adoption | None = None
        self._data = b""
        self.manifest: Manifest | None = None
        self.config: Config | None = None
        self._layers: Layers = {}
        self._missing: dict[str, int] = {}  # blobs the store did not have: digest -> size
        self._meter = Meter(0, None)

    def begin(self) -> None:
        """Read and check the manifest, stage the config and every layer's own blob;
        blobs the store already has are pinned from it."""
        data, manifest, ref, layers = read_manifest(
            self._client, self.remote, self._trust, self._keys
        )
        check_sizes(manifest, self.where)
        self._data, self.manifest, self._layers = data, manifest, layers
        adoption = self._stack.enter_context(
            self._adopter.begin_adoption(self.remote.checkpoint_id)
        )
        self._adoption = adoption
        blobs = manifest_blobs(manifest)
        missing = {d: s for d, s in blobs.items() if not adoption.link_existing(d, s)}
        check_space(self._adopter.root, sum(missing.values()), self.remote)
        self._missing = missing
        cdesc = manifest.config
        self._stage(cdesc.digest, cdesc.size)
        self.config = parse_config(
            adoption.read_staged(cdesc.digest, MAX_CONFIG_BYTES), f"{self.where}: config", ref
        )
        for desc in manifest.layers:
            self._stage(desc.digest, desc.size)

    @property
    def store_root(self) -> str:
        """Where the blobs are staged: the store's root."""
        return self._adopter.root

    def pending_bytes(self) -> int:
        """Bytes of the blobs still to download into the staging dir."""
        staged = self._open().staged
        return sum(size for digest, size in self._missing.items() if digest not in staged)

    def chunks(self, layer: str) -> tuple[Chunk, ...]:
        assert self.manifest is not None
        return self.manifest.chunks.get(layer, ())

    def layer(self, name: str) -> ConfigLayer:
        assert self.config is not None
        for layer in self.config.layers:
            if layer.name == name:
                return layer
        raise errors.NotFound(f"checkpoint {self.remote.checkpoint_id} has no layer {name!r}")

    def open_layer(self, name: str) -> IO[bytes]:
        """Layer ``name``'s own blob (its tar), decompressed and held to its raw size."""
        layer = self.layer(name)
        adoption = self._open()
        what = f"checkpoint {self.remote.checkpoint_id}: layer {name!r}"
        blob = open(  # noqa: SIM115 (closed with the reader)
            f"{adoption.path}/{layer.digest.removeprefix('sha256:')}", "rb"
        )
        try:
            return ZstdReader(blob, RawBound(layer.tar_raw_size, what), what)  # type: ignore[return-value]
        except BaseException:
            blob.close()
            raise

    def fetch_chunk(self, chunk: Chunk) -> bytes | bytearray:
        """Chunk ``chunk``'s blob, staged on the way (or read back when it was staged
        already); the caller checks it before it uses a byte (store/chunks.unpack_chunk).

        A call that raises leaves nothing staged (write_blob removes its part file and
        records the blob only once ``fill`` returned), and keeps nothing of its bytes:
        the caller may simply call again (page_server.ChunkFiller retries)."""
        adoption = self._open()
        if chunk.digest in adoption.staged:
            return adoption.read_staged(chunk.digest, chunk.size)
        kept = _Kept()
        encrypted = self._layers.get(chunk.digest)
        repo = self.remote.repository

        def fill(out: IO[bytes]) -> None:
            kept.out = out
            if encrypted is None:
                self._client.pull_blob(repo, chunk.digest, chunk.size, kept, max_size=chunk.size)  # type: ignore[arg-type]
                return
            key = encrypted.key
            plain = DecryptingWriter(kept, key.key, key.nonce)  # type: ignore[arg-type]
            self._client.pull_blob(repo, encrypted.digest, chunk.size, plain, max_size=chunk.size)  # type: ignore[arg-type]

        # Kept in memory as it streams into the staging dir: no read back, no third hash.
        adoption.write_blob(chunk.digest, chunk.size, fill)
        return kept.data  # not copied: the caller only reads it

    def commit(self) -> Entry:
        """Every blob staged (any not fetched yet downloaded now), then the checkpoint
        committed to the store, as a full pull would."""
        adoption = self._open()
        assert self.manifest is not None
        for digest, size in manifest_blobs(self.manifest).items():
            if digest not in adoption.staged:
                self._stage(digest, size)
        return self._adopter.adopt(adoption, self._data)

    def close(self) -> None:
        """Drop the staging dir (after a commit: what is left of it)."""
        self._stack.close()

    def _stage(self, digest: str, size: int) -> None:
        adoption = self._open()
        if digest in adoption.staged:
            return
        download_blob(
            self._client,
            self.remote.repository,
            adoption,
            digest,
            size,
            self._meter,
            self._layers,
        )

    def _open(self) -> Adoption:
        if self._adoption is None:
            raise errors.FailedPrecondition("LazyPull.begin was not called")
        return self._adoption
