"""The registry as the checkpoint store shared by every node: push, list, pull, prune.

One repository per namespace (``<prefix>/<namespace>``), one immutable tag per
checkpoint (tags.py). A push writes, in this order: the in-flight marker
``<tag>.pending`` (manifest.py), every blob the registry lacks (chunked, resumable:
a push killed half way and run again sends only what is missing; a raw checkpoint's
chunks as its compaction writes them, sender.py), the manifest under its tag LAST
(the commit point: a tag always names a whole checkpoint). All the while the marker
is put again every few seconds (heartbeat.py), and when the push ends, done or
failed, it is deleted (a registry that refuses deletes keeps it: superseded by the
tag, or stale once no longer refreshed). Listing reads the tag list only; manifests
are read for what a tag does not say (a hashed label, a marker's heartbeat). See
pull.py for pulls.
"""

from __future__ import annotations

import io
import logging
import os
import threading
import time
from collections.abc import Callable, Iterable, Mapping
from datetime import UTC, datetime
from typing import IO, TYPE_CHECKING, Any, TypeAlias

from cedana_shim import errors
from cedana_shim.checkpoint.store.adopt import manifest_blobs
from cedana_shim.checkpoint.store.failures import failed_last, has_failed
from cedana_shim.checkpoint.store.layout import (
    ANN_LABEL,
    MEDIA_TYPE_MANIFEST,
    load_json,
    parse_manifest,
)
from cedana_shim.registry import Registry, RegistryClient, RegistryConfig

from .cosign import is_signature_tag, signature_tag
from .encryption import EncryptedLayer, Encryption
from .heartbeat import MarkerHeartbeat
from .manifest import (
    EMPTY_CONFIG,
    EMPTY_DIGEST,
    HEARTBEAT_S,
    check_node,
    checkpoint_manifest,
    is_node_name,
    marker_manifest,
    parse_marker,
)
from .model import RemoteCheckpoint
from .pins import pinned_bases
from .pull import check_config, check_sizes, pull_into, read_manifest
from .sender import UPLOAD_WORKERS, BlobSender, Progress
from .shared_dir import SharedDirectory, names_shared_dir
from .signing import Signer, Trust
from .tags import PENDING_SUFFIX, CheckpointTag, encode_label, parse_pin_tag, parse_tag, tag_for

if TYPE_CHECKING:
    from cedana_shim.checkpoint.store import Entry, Store
    from cedana_shim.config import NodeConfig

    from .lazy_pull import LazyPull

__all__ = ["UPLOAD_WORKERS", "OnCompacted", "RemoteStore", "node_registry"]

log = logging.getLogger(__name__)

OnCompacted: TypeAlias = "Callable[[Entry, float], None]"  # (the entry, seconds it took)
# `list` is a method name below, so the class body cannot say list[...].
_Remotes: TypeAlias = list[RemoteCheckpoint]
_Ids: TypeAlias = list[str]
_Tags: TypeAlias = list[CheckpointTag]


def _newest_first(tags: Iterable[CheckpointTag]) -> _Tags:
    return sorted(tags, key=lambda t: (t.created, t.suffix, t.node_hash), reverse=True)


def node_registry(config: NodeConfig, upload_state_dir: str | None = None) -> Registry | None:
    """The registry the node config names (a shared directory when ``registry`` is a
    path), with resumable uploads' state in ``upload_state_dir``; None without one."""
    if not config.registry:
        return None
    if names_shared_dir(config.registry):
        return SharedDirectory(config.registry)
    settings = RegistryConfig(
        registry=config.registry,
        auth_file=config.registry_auth_file,
        ca_file=config.registry_ca,
        insecure=config.registry_insecure,
        timeout=config.registry_timeout,
    )
    return RegistryClient(settings, upload_state_dir=upload_state_dir)


class RemoteStore:
    """A node's view of the registry (see the module doc); safe to share between threads."""

    def __init__(
        self,
        store: Store,
        client: Registry,
        node: str,
        *,
        retain: int = 0,
        signer: Signer | None = None,
        trust: Trust | None = None,
        encryption: Encryption | None = None,
    ) -> None:
        self.store = store
        self.client = client
        self.node = check_node(node)
        self.signer = signer  # signs every checkpoint pushed (signing_key)
        self.trust = trust  # the keys a pulled checkpoint must be signed by (trusted_keys)
        # encryption_keys (every layer pushed encrypted) and decryption_keys
        self.encryption = encryption or Encryption({}, ())
        # Checkpoints kept per label in the registry after a sync pushed to it (the
        # node config's `retain`); 0 prunes nothing.
        self.retain = retain
        self.heartbeat_s = HEARTBEAT_S  # how often a push puts its marker again
        self._deletes_refused = False
        self._lock = threading.Lock()

    @classmethod
    def from_config(cls, store: Store, config: NodeConfig, node: str) -> RemoteStore | None:
        """The remote store the node config names; None when ``registry`` is ""."""
        if not config.registry:
            return None
        keys: dict[str, Any] = {
            "retain": config.retain,
            "signer": Signer(config.signing_key) if config.signing_key else None,
            "trust": Trust.from_setting(config.trusted_keys),
            "encryption": Encryption.from_config(config.encryption_keys, config.decryption_keys),
        }
        client = node_registry(config, os.path.join(store.root, "outbox", "uploads"))
        assert client is not None  # config.registry is set
        return cls(store, client, node, **keys)

    # -- push -------------------------------------------------------------------------

    def push(
        self,
        checkpoint_id: str,
        progress: Progress | None = None,
        on_compacted: OnCompacted | None = None,
        *,
        niced: bool = True,
    ) -> RemoteCheckpoint:
        """Push a checkpoint of the local store, compacting it first if it is raw: each
        chunk is sent as soon as it is compressed (sender.py); ``on_compacted(entry,
        seconds)`` is told when the compaction is done; ``niced`` False compacts at
        this thread's priority (a stop's exit waits for the push).

        Idempotent: a checkpoint whose tag exists is not sent again; one whose push
        was interrupted sends only what the registry lacks.
        """
        entry = self._pushable(checkpoint_id)
        # The node that took it, whoever pushes (its shim, the node agent, the CLI):
        # one checkpoint, one tag.
        recorded = entry.metadata.get("node")
        origin = recorded if isinstance(recorded, str) and is_node_name(recorded) else self.node
        try:
            repo = self.client.repository_for(entry.scope)
            tag = tag_for(entry.label, entry.created, entry.id, origin)
        except errors.InvalidArgument as err:
            raise errors.InvalidArgument(
                f"checkpoint {entry.id} ({entry.scope}/{entry.label}) cannot be pushed to "
                f"registry {self.client.host}: {err}"
            ) from None
        remote = self._remote(repo, tag, entry.label, complete=True, node=origin)
        if self._manifest_digest(repo, tag.tag) is not None:
            return remote  # the tag is written last: everything is there
        started = datetime.now(UTC)
        what = f"checkpoint {entry.id}"

        def put_marker(beat: datetime) -> str:
            """The in-flight marker, beating at ``beat``; its digest."""
            marker = marker_manifest(entry.id, entry.scope, entry.label, origin, started, beat)
            return self.client.put_manifest(
                repo, tag.tag + PENDING_SUFFIX, marker, MEDIA_TYPE_MANIFEST
            )

        def first_marker() -> str:
            # The empty config it names first: a registry checks that it has it.
            self.client.push_blob(repo, EMPTY_DIGEST, len(EMPTY_CONFIG), _bytes(EMPTY_CONFIG))
            return put_marker(started)

        cipher = self.encryption.for_push(
            entry.scope, entry.label, lambda: self._earlier_layers(entry.scope, entry.label)
        )
        push_layer = cipher.push if cipher is not None else None
        with BlobSender(self.client, repo, what, progress, push_layer) as sender:
            first = sender.first(first_marker)
            # Closed (the marker deleted) when the push ends, whichever way it does.
            with MarkerHeartbeat(
                first,
                put_marker,
                lambda digest: self._delete(repo, digest, quiet=True),
                what,
                interval=self.heartbeat_s,
            ):
                if entry.state == "raw":
                    entry = self._compact(entry.id, sender, on_compacted, niced)
                local = self.store.adopter.checkpoint_manifest(entry)
                manifest = checkpoint_manifest(local, entry.metadata, entry.scope, origin)
                parsed = parse_manifest(local, f"{what}: manifest")
                blobs = manifest_blobs(parsed)
                config = frozenset({parsed.config.digest})  # read before any pull: clear
                sender.finish(blobs, lambda d: self._source(d, f"{what}: blob {d}"), config)
                if cipher is not None:
                    manifest = cipher.manifest(manifest, f"{what}: manifest")
                if self.signer is not None:  # signed before its tag makes it visible
                    self.signer.push_signature(self.client, repo, manifest)
                self.client.put_manifest(repo, tag.tag, manifest, MEDIA_TYPE_MANIFEST)
        log.info(
            "checkpoint pushed",
            extra={"checkpoint": entry.id, "registry": self.client.host, "tag": tag.tag},
        )
        return remote

    def _earlier_layers(self, scope: str, label: str) -> Mapping[str, EncryptedLayer]:
        """The encrypted layers of the label's newest checkpoint that this node's keys
        open, by plain digest ({} when none): a node that did not push them learns
        their digests here, to skip what the registry has (encryption.PushCipher). Read
        as a pull reads it (checked, and signed by ``trusted_keys`` when set)."""
        try:
            for remote in self.candidates(scope, label)[:1]:
                return read_manifest(self.client, remote, self.trust, self.encryption.private)[3]
        except (errors.ShimError, ValueError) as err:
            # Only an optimization: without it the chunks go up again.
            log.info("not reading the label's previous encrypted layers: %s", err)
        return {}

    def _pushable(self, checkpoint_id: str) -> Entry:
        entry = self.store.catalog.get(checkpoint_id)
        if entry.damage is not None:
            raise errors.DataLoss(f"checkpoint {entry.id} is damaged: {entry.damage}")
        return entry

    def _compact(
        self,
        checkpoint_id: str,
        sender: BlobSender,
        on_compacted: OnCompacted | None,
        niced: bool,
    ) -> Entry:
        began = time.monotonic()
        compacted = self.store.compactor.compact(checkpoint_id, on_blob=sender.offer, niced=niced)
        if compacted is None:
            raise errors.NotFound(
                f"checkpoint {checkpoint_id} was removed from {self.store.root} "
                "(retention or prune) before it could be pushed"
            )
        if on_compacted is not None:
            on_compacted(compacted, time.monotonic() - began)
        return compacted

    def _source(self, digest: str, what: str) -> Callable[[int], IO[bytes]]:
        def open_at(offset: int) -> IO[bytes]:
            stream = self.store.adopter.open_blob(digest, what)
            stream.seek(offset)
            return stream

        return open_at

    # -- listing ------------------------------------------------------------------------

    def candidates(self, scope: str, label: str) -> _Remotes:
        """Complete checkpoints of (scope, label), newest first, from the tag list alone."""
        repo = self.client.repository_for(scope)
        part = encode_label(label)
        tags = [t for t in self._tags(repo) if not t.pending and t.label_part == part]
        return [self._remote(repo, t, label, complete=True) for t in _newest_first(tags)]

    def in_flight(self, scope: str, label: str, *, now: datetime | None = None) -> _Remotes:
        """Pushes of (scope, label) really in flight at ``now`` (default: now): begun,
        not complete, newer than the newest complete checkpoint, their marker refreshed
        lately by its pusher and not dated in the future (manifest.Marker), newest first."""
        repo = self.client.repository_for(scope)
        part = encode_label(label)
        tags = [t for t in self._tags(repo) if t.label_part == part]
        return self._in_flight(repo, tags, label, now or datetime.now(UTC))

    def _in_flight(self, repo: str, tags: _Tags, label: str | None, now: datetime) -> _Remotes:
        complete = {t.base for t in tags if not t.pending}
        newest = max((t.created for t in tags if not t.pending), default=None)
        found: _Remotes = []
        for tag in _newest_first(t for t in tags if t.pending and t.base not in complete):
            if newest is not None and tag.created <= newest:
                continue
            where = f"registry {self.client.host}: {repo}:{tag.tag}"
            try:
                data, _, _ = self.client.get_manifest(repo, tag.tag)
                marker = parse_marker(data, where, tag)
            except errors.NotFound:
                continue  # finished (or given up) meanwhile
            except errors.DataLoss as err:
                log.warning("skipping an in-flight marker: %s", err)
                continue
            why = marker.why_not_live(now)
            if why:
                log.info("ignoring the in-flight marker %s: %s", where, why)
                continue
            name = label if label is not None else (tag.label or "")
            found.append(self._remote(repo, tag, name, complete=False, node=marker.node))
        return found

    def list(self, scope: str | None = None) -> _Remotes:
        """Checkpoints in the registry (and pushes in flight), newest first.

        ``scope`` None: the namespaces this node's store has checkpoints of (a
        registry need not say which repositories it has).
        """
        scopes = (
            [scope] if scope is not None else sorted({e.scope for e in self.store.catalog.list()})
        )
        found: _Remotes = []
        for name in scopes:
            try:
                repo = self.client.repository_for(name)
            except errors.InvalidArgument:
                if scope is not None:
                    raise
                continue  # not a Kubernetes namespace: never pushed
            tags = self._tags(repo)
            for tag in tags:
                if not tag.pending:
                    found.append(self._remote(repo, tag, self._label_of(repo, tag), complete=True))
            found += self._in_flight(repo, tags, None, datetime.now(UTC))
        return sorted(found, key=lambda r: (r.created, r.checkpoint_id), reverse=True)

    def _label_of(self, repo: str, tag: CheckpointTag) -> str:
        """The label a tag names: in the tag, or (hashed) in its manifest."""
        if tag.label is not None:
            return tag.label
        try:
            data, _, _ = self.client.get_manifest(repo, tag.tag)
            # The annotations alone: an encrypted manifest's layers are not the store's.
            document = load_json(data, f"{repo}:{tag.tag}")
            annotations = document.get("annotations") if isinstance(document, dict) else None
            found = annotations.get(ANN_LABEL, "") if isinstance(annotations, dict) else ""
        except (errors.NotFound, errors.DataLoss):
            return ""
        if not isinstance(found, str):
            return ""
        return found if encode_label(found) == tag.label_part else ""

    def fetch_metadata(self, remote: RemoteCheckpoint) -> Mapping[str, Any]:
        """The checkpoint's config (its metadata), read and checked before any pull."""
        _, manifest, ref, _ = read_manifest(
            self.client, remote, self.trust, self.encryption.private
        )
        where = f"registry {self.client.host}: {remote.repository}:{remote.tag}"
        config = manifest.config
        check_sizes(manifest, where)
        out = io.BytesIO()
        self.client.pull_blob(remote.repository, config.digest, config.size, out, config.size)
        return check_config(out.getvalue(), ref, where)

    def pull(self, remote: RemoteCheckpoint, progress: Progress | None = None) -> Entry:
        """The checkpoint in the local store, pulled unless it is there (see pull.py)."""
        try:
            return self.store.catalog.get(remote.checkpoint_id)
        except errors.NotFound:
            pass
        return pull_into(
            self.store.adopter, self.client, remote, progress, self.trust, self.encryption.private
        )

    def lazy_pull(self, remote: RemoteCheckpoint) -> LazyPull:
        """A pull of ``remote`` whose page chunks come on demand (lazy_pull.py); not
        begun yet."""
        from .lazy_pull import LazyPull  # the lazy restore's only

        return LazyPull(
            self.store.adopter, self.client, remote, self.trust, self.encryption.private
        )

    # -- prune --------------------------------------------------------------------------

    def prune(self, scope: str, label: str, keep: int) -> _Ids:
        """Delete all but the newest ``keep`` checkpoints of (scope, label) from the
        registry, and the markers their tags superseded; returns the ids deleted.
        [] when the registry refuses deletes (logged once). Tags this node's store has
        a failure record of count last, as in the store's own retention: a good
        checkpoint is never deleted for one that failed here. A checkpoint pinned in
        the registry (pins.py) is kept and not counted."""
        if keep < 0:
            raise errors.InvalidArgument(f"keep must be >= 0, got {keep}")
        repo = self.client.repository_for(scope)
        part = encode_label(label)
        pins: set[str] = set()
        tags = [t for t in self._tags(repo, pins) if t.label_part == part]
        failures = self.store.failure_records.failures()
        complete = failed_last(
            _newest_first(t for t in tags if not t.pending and t.base not in pins),
            lambda t: has_failed(failures, t.checkpoint_id, t.base),
        )
        bases = {t.base for t in tags if not t.pending}  # a pinned one's supersedes too
        markers = [t for t in tags if t.pending and t.base in bases]
        removed: _Ids = []
        for tag in [*complete[keep:], *markers]:
            digest = self._manifest_digest(repo, tag.tag)
            if digest is None:
                continue
            if not self._delete(repo, digest):
                return []
            if not tag.pending:
                removed.append(tag.checkpoint_id)
                signature = self._manifest_digest(repo, signature_tag(digest))
                if signature is not None:
                    self._delete(repo, signature, quiet=True)
        return removed

    # -- helpers ------------------------------------------------------------------------

    def _tags(self, repo: str, pins: set[str] | None = None) -> _Tags:
        """The repository's checkpoint tags and markers; others are skipped, with a
        warning. ``pins`` receives the pinned checkpoints' tags (pins.py)."""
        try:
            names = list(self.client.list_tags(repo))
        except errors.NotFound:
            return []
        if pins is not None:
            pins |= pinned_bases(names)
        parsed: _Tags = []
        skipped: list[str] = []
        for name in names:
            if is_signature_tag(name) or parse_pin_tag(name) is not None:
                continue  # a signature (cosign.py) or a pin (pins.py): read elsewhere
            tag = parse_tag(name)
            if tag is None:
                skipped.append(name)
            else:
                parsed.append(tag)
        if skipped:
            log.warning(
                "registry %s: %s: skipped %d tag(s) that are not checkpoint tags (e.g. %s)",
                self.client.host,
                repo,
                len(skipped),
                ", ".join(repr(s) for s in skipped[:3]),
            )
        return parsed

    def _manifest_digest(self, repo: str, ref: str) -> str | None:
        try:
            _, _, digest = self.client.get_manifest(repo, ref)
        except errors.NotFound:
            return None
        return digest

    def _delete(self, repo: str, digest: str, *, quiet: bool = False) -> bool:
        """Delete a manifest; False (warned once) when the registry refuses deletes."""
        try:
            if self.client.delete_manifest(repo, digest):
                return True
        except errors.NotFound:
            return True
        except errors.ShimError as err:
            if not quiet:
                raise
            log.warning("could not delete %s@%s: %s", repo, digest, err)
            return False
        with self._lock:
            first, self._deletes_refused = not self._deletes_refused, True
        if first:
            log.warning(
                "registry %s refuses deletes: superseded checkpoints and in-flight markers "
                "stay there (enable deletes, or expire them with the registry's own tools)",
                self.client.host,
            )
        return False

    def _remote(
        self, repo: str, tag: CheckpointTag, label: str, *, complete: bool, node: str = ""
    ) -> RemoteCheckpoint:
        return RemoteCheckpoint(
            repository=repo,
            tag=tag.base,
            checkpoint_id=tag.checkpoint_id,
            scope=repo.rsplit("/", 1)[-1],
            label=label,
            created=tag.created_text,
            node=node,
            complete=complete,
            node_hash=tag.node_hash,
        )


def _bytes(data: bytes) -> Callable[[int], IO[bytes]]:
    def open_at(offset: int) -> IO[bytes]:
        stream = io.BytesIO(data)
        stream.seek(offset)
        return stream

    return open_at
