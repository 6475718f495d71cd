"""What becomes of a checkpoint once it is durable: one owner for all of it.

A checkpoint is durable once the store has published it (raw, fsynced, in
index.json). What follows belongs to :class:`Delivery`, one per node store:

* **compaction** into tar+zstd blobs and chunks, niced, in the background;
* with a registry (node config ``registry``): **who may push** (a namespace that
  cannot name a repository stays on the node), the **outbox record**, written
  before the push starts so that a push this process does not finish is done by
  the next daemon or the node agent, and the **push**, which compacts a raw
  checkpoint on the way and applies the registry's retention;
* the **before-exit wait** (``registry_sync = before-exit``): a stop's exit waits
  until its checkpoint is in the registry, whoever pushes it, or until the grace
  period ends.

The shim daemon and the Slurm runner (lifecycle/) drive it from their event loop
(:meth:`committed`, :meth:`sweep`, :meth:`wait_pushed`, :meth:`drain`); the node
agent and ``cedana checkpoints sync`` call the blocking :meth:`push`. All of them
build the store's settings from the node config in one place
(:meth:`StoreConfig.for_node <cedana_shim.checkpoint.store.StoreConfig.for_node>`).
"""

from __future__ import annotations

import asyncio
import functools
import logging
import platform
import time
from collections.abc import Callable, Collection
from typing import TYPE_CHECKING, Any

from ..config import NodeConfig, Stamp, file_stamp, key_files
from ..errors import FailedPrecondition, NotFound, ShimError
from . import op_records, oplog
from .store import Entry, Store, StoreConfig

if TYPE_CHECKING:
    from .remote import OnCompacted, Outbox, RemoteStore, SyncResult

log = logging.getLogger(__name__)

LEFTOVERS_DELAY = 5.0  # seconds after a daemon first uses a store
PUSH_POLL = 0.2  # seconds between looks at a push another process is making


class Delivery:
    def __init__(self, store: Store, config: NodeConfig, node_name: str | None = None) -> None:
        self.store = store
        self.config = config
        self._node = node_name or platform.node()
        self._remote: RemoteStore | None = None
        self._auth_stamp = self._files_stamp()
        self._tasks: set[asyncio.Task[Any]] = set()  # compactions and pushes
        self._sweep: asyncio.Task[None] | None = None

    @classmethod
    def for_node(
        cls, config: NodeConfig, *, root: str | None = None, node_name: str | None = None
    ) -> Delivery:
        """The node's store as the node config sets it up (``root``: see
        :meth:`StoreConfig.for_node`)."""
        return cls(Store(StoreConfig.for_node(config, root=root)), config, node_name)

    # -- the registry ---------------------------------------------------------------------

    def outbox(self) -> Outbox:
        """Checkpoints committed here and not pushed yet (durable, in the store)."""
        from .remote import Outbox

        return Outbox(self.store.root)

    def remote(self) -> RemoteStore:
        """The registry of the node config; built again when its credentials file or a
        key file it names has changed since (a rotated Secret, such as ECR's 12-hour
        tokens or a replaced key, reaches a daemon that lives for weeks: the node agent
        installs the new file)."""
        stamp = self._files_stamp()
        if self._remote is None or stamp != self._auth_stamp:
            from .remote import RemoteStore

            remote = RemoteStore.from_config(self.store, self.config, self._node)
            if remote is None:
                raise FailedPrecondition("no registry in the node config")
            self._remote, self._auth_stamp = remote, stamp
        return self._remote

    def _files_stamp(self) -> tuple[Stamp, ...]:
        files = [self.config.registry_auth_file, *key_files(self.config)]
        return tuple(file_stamp(path) for path in files)  # "": None

    def refusal(self, scope: str) -> str:
        """Why checkpoints of namespace ``scope`` cannot go to the registry (its name
        cannot name a repository: e.g. containerd's k8s.io outside Kubernetes); ""."""
        from ..registry import parse_registry, repository_for
        from .remote.shared_dir import names_shared_dir

        registry = self.config.registry
        try:
            repository_for(
                "" if names_shared_dir(registry) else parse_registry(registry).prefix, scope
            )
        except ShimError as err:
            return f"namespace {scope!r} cannot be pushed to {registry}: {err}"
        return ""

    def push(
        self,
        ids: Collection[str] | None = None,
        *,
        on_compacted: OnCompacted | None = None,
        progress: Callable[[str, int, int], None] | None = None,
        urgent: bool = False,
    ) -> SyncResult:
        """Push ``ids`` (or every pending push) to the registry, each under its outbox
        record's lock (a record another process holds is reported busy), compacting a
        raw one on the way (``on_compacted`` is told; niced unless ``urgent``: a stop's
        exit waits); then keep the newest ``retain`` checkpoints of each label pushed
        there too. Blocking."""
        from .remote import sync

        return sync(
            self.remote(),
            self.outbox(),
            only=ids,
            progress=progress,
            on_compacted=on_compacted,
            niced=not urgent,
        )

    # -- after a commit, in the background (the daemon's event loop) ---------------------

    async def committed(self, entry: Entry, *, urgent: bool = False) -> asyncio.Task[None]:
        """The checkpoint just became durable: record its push (with a registry), then
        compact it in the background, or push it, compacting on the way (each chunk sent
        as soon as it is compressed; not niced when ``urgent``: a stop's exit waits for
        that push). A checkpoint the push did not compact (the registry refused it, the
        record is another's) is compacted after. The task returned ends with both."""
        pushing = bool(self.config.registry) and await self._record_push(entry)

        async def run() -> None:
            if pushing:
                await self._push([entry.id], compacting=True, urgent=urgent)
                if not await asyncio.to_thread(self._still_raw, entry.id):
                    return
            await self._compact(entry.id)

        return self._spawn(run())

    def sweep(self) -> None:
        """Compact what a daemon that died (or was killed) left raw, and push what it
        left in the outbox; after a pause, so that it stays off the Create that brought
        this daemon up. Once per daemon and store."""
        if self._sweep is not None:
            return

        async def run() -> None:
            await asyncio.sleep(LEFTOVERS_DELAY)
            try:
                pending = await asyncio.to_thread(self.store.compactor.pending_compaction)
            except (ShimError, OSError) as err:
                log.warning("cannot list checkpoints to compact", extra={"error": str(err)})
                return
            for checkpoint_id in pending:
                await self._compact(checkpoint_id)
            if self.config.registry:
                await self._push(None)  # what dead daemons left in the outbox

        self._sweep = asyncio.get_running_loop().create_task(run())

    async def wait_pushed(
        self,
        entry: Entry,
        after_commit: asyncio.Task[None] | None,
        hurry: asyncio.Event,
        container_id: str,
    ) -> None:
        """registry_sync = before-exit: until the checkpoint is in the registry (a spot
        node's disk goes with the node), or ``hurry`` (a SIGKILL: the end of the grace
        period), or checkpoint_timeout; the push goes on in the background then.
        Whoever pushes it counts: another process (the leftovers sweep, the node agent,
        `cedana checkpoints sync`) may hold its outbox record; the wait follows it and
        pushes itself once the record is let go unpushed."""
        deadline = time.monotonic() + self.config.checkpoint_timeout
        hurried = asyncio.get_running_loop().create_task(hurry.wait())
        try:
            if after_commit is not None and not after_commit.done():
                await asyncio.wait(
                    {after_commit, hurried},
                    timeout=deadline - time.monotonic(),
                    return_when=asyncio.FIRST_COMPLETED,
                )
            while not hurried.done() and time.monotonic() < deadline:
                try:
                    if entry.id not in await asyncio.to_thread(self.outbox().pending):
                        return  # pushed
                    result = await asyncio.to_thread(self.push, [entry.id])
                except (ShimError, OSError):
                    break  # logged by the push; the record stays for a later one
                if entry.id not in result.busy:
                    return  # pushed, or failed (and logged): the exit goes on
                await asyncio.wait({hurried}, timeout=PUSH_POLL)
        finally:
            hurried.cancel()
        log.warning(
            "exit reported before the checkpoint reached the registry; the push goes on",
            extra={"container": container_id, "checkpoint": entry.id},
        )

    async def drain(self, timeout: float) -> None:
        """Let compactions and pushes of this daemon's checkpoints finish before it
        exits (bounded); the leftovers of others can wait for the next daemon."""
        if self._sweep is not None:
            self._sweep.cancel()
        if not self._tasks:
            return
        log.info("waiting for checkpoint compactions", extra={"pending": len(self._tasks)})
        await asyncio.wait(set(self._tasks), timeout=timeout)

    # -- the steps ---------------------------------------------------------------------

    def _spawn(self, work: Any) -> asyncio.Task[None]:
        task: asyncio.Task[None] = asyncio.get_running_loop().create_task(work)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)
        return task

    async def _record_push(self, entry: Entry) -> bool:
        """The outbox record comes first: a push this daemon does not finish is taken up
        by the next daemon or the node agent. False: this checkpoint is not pushed."""
        refusal = self.refusal(entry.scope)
        if refusal:
            log.warning(
                "checkpoint stays on this node", extra={"checkpoint": entry.id, "why": refusal}
            )
            return False
        try:
            await asyncio.to_thread(self.outbox().add, entry.id)
        except (ShimError, OSError) as err:
            log.error(
                "cannot record the pending push of a checkpoint; this daemon pushes it, "
                "no other will if it dies first",
                extra={"checkpoint": entry.id, "error": str(err)},
            )
        return True

    async def _compact(self, checkpoint_id: str) -> None:
        """Compress a published checkpoint (the store runs it niced: it competes with
        the node's workloads)."""
        clock = oplog.PhaseClock()
        entry: Entry | None = None
        outcome, error = "done", ""
        try:
            with clock.phase("compress"):
                entry = await asyncio.to_thread(self.store.compactor.compact, checkpoint_id)
        except (ShimError, OSError) as err:
            # The raw checkpoint stays valid and restorable; compaction is retried by
            # the next daemon that finds it.
            log.warning(
                "checkpoint compaction failed; it stays uncompressed",
                extra={"checkpoint": checkpoint_id, "error": str(err)},
            )
            outcome, error = "failed", str(err)
        else:
            if entry is None:
                return  # nothing to do (compacted already, or gone)
        total, phases = clock.finish()
        if entry is not None:
            _log_compacted(entry, total)
        done = [(checkpoint_id, error)]
        await self._record(oplog.COMPACTION, outcome, done, total, phases, entry)

    def _compacted_by_push(self, entry: Entry, seconds: float) -> None:
        """What a push that compacted a checkpoint on the way logs and records, as
        ``_compact`` does (called in the push's thread)."""
        _log_compacted(entry, seconds)
        record = op_records.background_record(
            self.store.catalog, oplog.COMPACTION, "done", entry.id, seconds, {"compress": seconds},
            entry=entry,
        )  # fmt: skip
        oplog.write(self.store.root, record)

    async def _push(
        self, ids: list[str] | None, *, compacting: bool = False, urgent: bool = False
    ) -> None:
        """Push pending checkpoints (``ids``, or all the outbox holds); a failure leaves
        them pending for the next daemon or the node agent."""
        clock = oplog.PhaseClock()
        compacted = self._compacted_by_push if compacting else None
        try:
            with clock.phase("push"):
                result = await asyncio.to_thread(
                    functools.partial(self.push, ids, on_compacted=compacted, urgent=urgent)
                )
        except (ShimError, OSError) as err:
            log.warning(
                "cannot push checkpoints to the registry; they stay pending",
                extra={"checkpoints": ids, "registry": self.config.registry, "error": str(err)},
            )
            return
        total, phases = clock.finish()
        # Each push logs itself ("checkpoint pushed", with its tag).
        for checkpoint_id, error in result.failed:
            log.warning(
                "checkpoint push failed; it stays pending",
                extra={
                    "checkpoint": checkpoint_id,
                    "registry": self.config.registry,
                    "error": error,
                },
            )
        # One sync may push several (a sweep): each gets the sync's time, which is
        # exact for the usual push of the checkpoint just committed.
        pushed = [(checkpoint_id, "") for checkpoint_id in result.pushed]
        await self._record(oplog.PUSH, "done", pushed, total, phases)
        await self._record(oplog.PUSH, "failed", result.failed, total, phases)

    async def _record(
        self,
        kind: str,
        outcome: str,
        done: list[tuple[str, str]],  # (checkpoint id, error)
        total: float,
        phases: dict[str, float],
        entry: Entry | None = None,
    ) -> None:
        """The operations' records for the node agent (Events, metrics)."""

        def write() -> None:
            for checkpoint_id, error in done:
                record = op_records.background_record(
                    self.store.catalog, kind, outcome, checkpoint_id, total, phases,
                    entry=entry, detail=error,
                )  # fmt: skip
                oplog.write(self.store.root, record)

        if done:
            await asyncio.to_thread(write)

    def _still_raw(self, checkpoint_id: str) -> bool:
        """Whether a checkpoint is still to compact (an unreadable store: let it say why)."""
        try:
            return self.store.catalog.get(checkpoint_id).state == "raw"
        except NotFound:
            return False  # removed meanwhile
        except (ShimError, OSError):
            return True


def _log_compacted(entry: Entry, seconds: float) -> None:
    log.info(
        "checkpoint compacted",
        extra={
            "checkpoint": entry.id,
            "size": entry.size,
            "label": entry.label,
            "seconds": seconds,
        },
    )


__all__ = ["LEFTOVERS_DELAY", "Delivery"]
