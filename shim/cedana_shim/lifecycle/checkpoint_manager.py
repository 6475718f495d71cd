"""The daemon-wide part of checkpointing: one per shim daemon, built by the composition root.

:class:`CheckpointManager` holds the checkpoint pipeline for each node config
(``PipelineSource``), the event sender, the labels this daemon is writing (a restore
of the label waits for them), and the work that goes on after a checkpoint is durable:
compaction and the push to the registry, in the background, and the leftovers sweep
of what dead daemons left behind. It builds each opted-in container's
:class:`~.checkpointing.Checkpointing` and :class:`~cedana_shim.checkpoint.restore.RestoreSession`.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Any, Protocol

from google.protobuf.message import Message

from ..api.cedana.v1 import cedana_pb2 as cedana_ev
from ..checkpoint import op_records, oplog
from ..checkpoint.pipeline import Pipeline
from ..checkpoint.policy import Policy, parse_duration
from ..checkpoint.restore import RestoreReport, RestoreSession
from ..checkpoint.store import Entry
from ..errors import NotFound, ShimError
from .checkpointing import LEFTOVERS_DELAY, Checkpointing
from .events import EventSender
from .image_digest import ImageDigest, ImageDigestLookup

if TYPE_CHECKING:
    from ..checkpoint.remote import OnCompacted

log = logging.getLogger(__name__)


class PipelineSource(Protocol):
    """The checkpoint pipeline for a node config file ("" = the default one)."""

    def get(self, config_path: str) -> Pipeline: ...


class CheckpointManager:
    def __init__(
        self,
        events: EventSender,
        pipelines: PipelineSource,
        image_digest: ImageDigest | None = None,
    ) -> None:
        self.events = events
        self.pipelines = pipelines
        # A container's image digest from containerd: asked only with a
        # registry, where checkpoints move between nodes (runtime/containerd_images.py).
        self.image_digest = image_digest
        self._writing: Counter[tuple[str, str]] = Counter()  # (scope, label) -> dumps
        self._compactions: set[asyncio.Task[Any]] = set()
        self._swept: set[str] = set()  # stores whose leftovers this daemon compacts
        self._sweeps: set[asyncio.Task[None]] = set()

    def for_container(
        self, container_id: str, policy: Policy, config_path: str
    ) -> tuple[Checkpointing, RestoreSession | None]:
        pipeline = self.pipelines.get(config_path)
        if pipeline.store.root not in self._swept:
            self._swept.add(pipeline.store.root)
            self.compact_leftovers(pipeline)
        config = pipeline.config
        if policy.interval is None and config.checkpoint_interval:
            interval = parse_duration(config.checkpoint_interval, "node config checkpoint_interval")
            policy = replace(policy, interval=interval)
        cr = Checkpointing(container_id, policy, pipeline, self)
        if config.registry and self.image_digest is not None and not policy.image_digest:
            cr.image = ImageDigestLookup(container_id, self.image_digest)
            cr.image.later(LEFTOVERS_DELAY)
        restore = None
        if policy.restores:  # by label (auto), or by hand (CEDANA_RESTORE)
            restore = RestoreSession(
                store=pipeline.store,
                hooks=pipeline.hooks,
                gpu=pipeline.gpu,
                config=config,
                policy=policy,
                container_id=container_id,
                report=lambda report: self.report_restore(report, pipeline, policy),
                writing_here=self.writing,
                remote=pipeline.remote if config.registry else None,
                image_digest=self._digest_of(container_id) if config.registry else None,
            )
        return cr, restore

    def publish(self, event: Message) -> None:
        self.events.send(event)

    def _digest_of(self, container_id: str) -> Callable[[], Awaitable[str]] | None:
        lookup = self.image_digest
        return None if lookup is None else functools.partial(lookup, container_id)

    # -- labels being written (a restore of the label waits for them) -----------------

    def writing(self, scope: str, label: str) -> bool:
        return self._writing[(scope, label)] > 0

    @contextlib.contextmanager
    def writing_label(self, policy: Policy) -> Any:
        key = (policy.scope, policy.label)
        self._writing[key] += 1
        try:
            yield
        finally:
            self._writing[key] -= 1
            if not self._writing[key]:
                del self._writing[key]

    # -- restores ----------------------------------------------------------------

    def report_restore(self, report: RestoreReport, pipeline: Pipeline, policy: Policy) -> None:
        record = op_records.restore_record(report, policy, pipeline.versions.values)
        log_fn = log.warning if report.alarming else log.info
        if report.checkpoint_id:
            message = "restored from checkpoint"
        elif report.outcome == "failed":
            message = "restore refused: the container does not start"
        else:
            message = "starting cold"
        log_fn(
            message,
            extra={
                "container": report.container_id,
                "label": report.label,
                "scope": report.scope,
                "checkpoint": report.checkpoint_id,
                "memory": report.memory,
                "criu": report.criu,
                "outcome": record.outcome,
                "why": report.detail,
                "seconds": record.duration_seconds,
                "phases": record.phases,
            },
        )
        oplog.write(pipeline.store.root, record)
        self.publish(
            cedana_ev.RestoreOutcome(
                container_id=report.container_id,
                scope=report.scope,
                label=report.label,
                checkpoint_id=report.checkpoint_id,
                outcome=report.outcome,
                detail=report.detail,
            )
        )

    # -- compaction, in the background ---------------------------------------------

    def compact_later(
        self, pipeline: Pipeline, checkpoint_id: str, *, urgent: bool = False
    ) -> asyncio.Task[None]:
        """Compaction (niced); with a registry, the push compacts it on the way (each
        chunk sent as soon as it is compressed; not niced when ``urgent``: a stop's exit
        waits for that push). A checkpoint the push did not compact (the registry
        refused it, the record is another's) is compacted after."""

        async def run() -> None:
            if pipeline.config.registry:
                await self._push(pipeline, [checkpoint_id], compacting=True, urgent=urgent)
                if not await asyncio.to_thread(_still_raw, pipeline, checkpoint_id):
                    return
            await self._compact(pipeline, checkpoint_id)

        task = asyncio.get_running_loop().create_task(run())
        self._compactions.add(task)
        task.add_done_callback(self._compactions.discard)
        return task

    def compact_leftovers(self, pipeline: Pipeline) -> None:
        """Compact what a daemon that died (or was killed) left raw; after a pause, so
        that it stays off the Create that brought this daemon up."""

        async def run() -> None:
            await asyncio.sleep(LEFTOVERS_DELAY)
            try:
                pending = await asyncio.to_thread(pipeline.store.pending_compaction)
            except (ShimError, OSError) as err:
                log.warning("cannot list checkpoints to compact", extra={"error": str(err)})
                return
            for checkpoint_id in pending:
                await self._compact(pipeline, checkpoint_id)
            if pipeline.config.registry:
                await self._push(pipeline, None)  # what dead daemons left in the outbox

        task = asyncio.get_running_loop().create_task(run())
        self._sweeps.add(task)
        task.add_done_callback(self._sweeps.discard)

    def _compacted_by_push(self, pipeline: Pipeline) -> OnCompacted:
        """What a push that compacted a checkpoint on the way logs and records, as
        ``_compact`` does (called in the push's thread)."""

        def done(entry: Entry, seconds: float) -> None:
            _log_compacted(entry, seconds)
            record = op_records.background_record(
                pipeline.store, oplog.COMPACTION, "done", entry.id, seconds,
                {"compress": seconds}, entry=entry,
            )  # fmt: skip
            oplog.write(pipeline.store.root, record)

        return done

    async def _compact(self, pipeline: Pipeline, checkpoint_id: str) -> None:
        clock = oplog.PhaseClock()
        entry: Entry | None = None
        outcome, error = "done", ""
        try:
            with clock.phase("compress"):
                entry = await pipeline.compact(checkpoint_id)
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
        await self._record_background(
            pipeline, oplog.COMPACTION, outcome, [(checkpoint_id, error)], total, phases, entry
        )

    async def _push(
        self,
        pipeline: Pipeline,
        ids: list[str] | None,
        *,
        compacting: bool = False,
        urgent: bool = False,
    ) -> None:
        """Push pending checkpoints (``ids``, or all the outbox holds) to the registry; a
        failure leaves them pending for the next daemon or the node agent."""
        clock = oplog.PhaseClock()
        compacted = self._compacted_by_push(pipeline) if compacting else None
        try:
            with clock.phase("push"):
                result = await asyncio.to_thread(
                    functools.partial(pipeline.push_pending, ids, compacted, urgent=urgent)
                )
        except (ShimError, OSError) as err:
            log.warning(
                "cannot push checkpoints to the registry; they stay pending",
                extra={"checkpoints": ids, "registry": pipeline.config.registry, "error": str(err)},
            )
            return
        total, phases = clock.finish()
        # Each push logs itself ("checkpoint pushed", with its tag).
        for checkpoint_id, error in result.failed:
            log.warning(
                "checkpoint push failed; it stays pending",
                extra={
                    "checkpoint": checkpoint_id,
                    "registry": pipeline.config.registry,
                    "error": error,
                },
            )
        # One sync may push several (a sweep): each gets the sync's time, which is
        # exact for the usual push of the checkpoint just committed.
        pushed = [(checkpoint_id, "") for checkpoint_id in result.pushed]
        await self._record_background(pipeline, oplog.PUSH, "done", pushed, total, phases)
        await self._record_background(pipeline, oplog.PUSH, "failed", result.failed, total, phases)

    async def _record_background(
        self,
        pipeline: Pipeline,
        kind: str,
        outcome: str,
        done: list[tuple[str, str]],  # (checkpoint id, error)
        total: float,
        phases: dict[str, float],
        entry: Entry | None = None,
    ) -> None:
        def write() -> None:
            for checkpoint_id, error in done:
                record = op_records.background_record(
                    pipeline.store, kind, outcome, checkpoint_id, total, phases,
                    entry=entry, detail=error,
                )  # fmt: skip
                oplog.write(pipeline.store.root, record)

        if done:
            await asyncio.to_thread(write)

    async def drain(self, timeout: float) -> None:
        """Let compactions of this daemon's checkpoints finish before it exits; the
        leftovers of others can wait for the next daemon."""
        for sweep in list(self._sweeps):
            sweep.cancel()
        if not self._compactions:
            return
        log.info("waiting for checkpoint compactions", extra={"pending": len(self._compactions)})
        await asyncio.wait(set(self._compactions), timeout=timeout)


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


def _still_raw(pipeline: Pipeline, checkpoint_id: str) -> bool:
    """Whether a checkpoint is still to compact (an unreadable store: let it say why)."""
    try:
        return pipeline.store.get(checkpoint_id).state == "raw"
    except NotFound:
        return False  # removed meanwhile
    except (ShimError, OSError):
        return True


__all__ = ["CheckpointManager", "PipelineSource"]
