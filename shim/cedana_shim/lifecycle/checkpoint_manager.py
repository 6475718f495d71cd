"""The daemon-wide part of checkpointing: one per shim daemon (or Slurm job runner),
built by the composition root.

:class:`CheckpointManager` holds the checkpoint pipeline for each node config
(``PipelineSource``), the event sender, and the labels this daemon is writing (a
restore of the label waits for them). It builds each opted-in container's
:class:`~.checkpointing.Checkpointing` and :class:`~cedana_shim.checkpoint.restore.RestoreSession`,
starts each store's leftovers sweep once, and lets what follows durability
(:class:`~cedana_shim.checkpoint.delivery.Delivery`: compaction, pushes) finish before
the daemon exits.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import replace
from typing import Any, Protocol

from google.protobuf.message import Message

from ..api.cedana.v1 import cedana_pb2 as cedana_ev
from ..checkpoint import op_records, oplog
from ..checkpoint.delivery import LEFTOVERS_DELAY, Delivery
from ..checkpoint.pipeline import Pipeline
from ..checkpoint.policy import Policy, parse_duration
from ..checkpoint.restore import RestoreReport, RestoreSession
from .checkpointing import Checkpointing
from .events import EventSender
from .image_digest import ImageDigest, ImageDigestLookup

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
        self._swept: set[str] = set()  # stores whose leftovers this daemon compacts
        # Every pipeline's, a config that changed builds a new one: all are drained.
        self._deliveries: list[Delivery] = []

    def for_container(
        self, container_id: str, policy: Policy, config_path: str
    ) -> tuple[Checkpointing, RestoreSession | None]:
        pipeline = self.pipelines.get(config_path)
        if pipeline.delivery not in self._deliveries:
            self._deliveries.append(pipeline.delivery)
        if pipeline.store.root not in self._swept:
            self._swept.add(pipeline.store.root)
            pipeline.delivery.sweep()
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
                remote=pipeline.delivery.remote if config.registry else None,
                image_digest=self._digest_of(container_id) if config.registry else None,
                versions=pipeline.versions,
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

    async def drain(self, timeout: float) -> None:
        """Let compactions and pushes of this daemon's checkpoints finish before it
        exits (bounded, all stores together)."""
        deadline = asyncio.get_running_loop().time() + timeout
        for delivery in self._deliveries:
            await delivery.drain(max(0.0, deadline - asyncio.get_running_loop().time()))


__all__ = ["CheckpointManager", "PipelineSource"]
