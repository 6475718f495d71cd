"""The node agent's Prometheus metrics (``cedana node run --metrics-port``).

Fed by the operations' records (node/ops_spool.py) and, once a round, by a look at
the node's checkpoint store. Label values come from small fixed sets (trigger,
phase, outcome), never from a container, pod or label name: a node runs many.
"""

from __future__ import annotations

import re
from typing import Final

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from .. import __version__
from ..checkpoint import oplog

# Seconds: from a quick dump of a small process to a large GPU checkpoint's push.
BUCKETS: Final = (0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
_WORD: Final = re.compile(r"[a-z][a-z0-9_-]{0,31}")


class AgentMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        self.checkpoints = Counter(
            "cedana_checkpoints",
            "Checkpoints finished on this node, by trigger and outcome (committed, failed).",
            ["trigger", "outcome"],
            registry=r,
        )
        self.checkpoint_seconds = Histogram(
            "cedana_checkpoint_duration_seconds",
            "Wall time of a checkpoint, from its start until it is durable (or failed).",
            ["trigger", "outcome"],
            buckets=BUCKETS,
            registry=r,
        )
        self.checkpoint_phase_seconds = Histogram(
            "cedana_checkpoint_phase_duration_seconds",
            "Time a checkpoint spent in each phase: gpu, freeze, dump, rootfs, commit, "
            "other; compress and push in the background afterwards.",
            ["trigger", "phase"],
            buckets=BUCKETS,
            registry=r,
        )
        self.restores = Counter(
            "cedana_restores",
            "Starts of opted-in containers, by outcome: restored, fell_back (restored after "
            "passing over a candidate), cold (no checkpoint), failed (none restorable).",
            ["outcome"],
            registry=r,
        )
        self.restore_seconds = Histogram(
            "cedana_restore_duration_seconds",
            "Wall time of a restore (or of deciding to start cold).",
            ["outcome"],
            buckets=BUCKETS,
            registry=r,
        )
        self.restore_phase_seconds = Histogram(
            "cedana_restore_phase_duration_seconds",
            "Time a restore spent in each phase (fetch, verify, restore, gpu, ...).",
            ["phase"],
            buckets=BUCKETS,
            registry=r,
        )
        self.raw_bytes = Counter(
            "cedana_checkpoint_raw_bytes",
            "Bytes of checkpoints committed on this node, as CRIU and the rootfs diff wrote them.",
            registry=r,
        )
        self.stored_bytes = Counter(
            "cedana_checkpoint_stored_bytes",
            "Bytes of checkpoints compacted on this node, as stored (compressed).",
            registry=r,
        )
        self.background = Counter(
            "cedana_checkpoint_background_operations",
            "Compactions and pushes of checkpoints, by operation and outcome (done, failed).",
            ["operation", "outcome"],
            registry=r,
        )
        self.store_bytes = Gauge(
            "cedana_store_size_bytes", "Bytes the node's checkpoint store holds.", registry=r
        )
        self.store_checkpoints = Gauge(
            "cedana_store_checkpoints", "Checkpoints in the node's checkpoint store.", registry=r
        )
        self.pending_pushes = Gauge(
            "cedana_pending_pushes", "Checkpoints committed here and not in the registry yet.",
            registry=r,
        )  # fmt: skip
        self.records_lost = Counter(
            "cedana_operation_records_lost",
            "Operation records the agent never saw: dropped from a full spool (spool_full) "
            "or unreadable.",
            ["reason"],
            registry=r,
        )
        self.build_info = Gauge(
            "cedana_build_info",
            "Versions of the shim, CRIU and runc on this node (as the last operation saw them).",
            ["shim", "criu", "runc"],
            registry=r,
        )
        self._versions = {"shim": __version__, "criu": "", "runc": ""}
        self.build_info.labels(**self._versions).set(1)

    def observe(self, record: oplog.OpRecord) -> None:
        """Count one finished operation."""
        if record.versions:
            self.set_versions(record.versions)
        if record.kind == oplog.CHECKPOINT:
            trigger, outcome = word(record.trigger), word(record.outcome)
            self.checkpoints.labels(trigger, outcome).inc()
            self.checkpoint_seconds.labels(trigger, outcome).observe(record.duration_seconds)
            for phase, seconds in record.phases.items():
                self.checkpoint_phase_seconds.labels(trigger, word(phase)).observe(seconds)
            if record.outcome == "committed":
                self.raw_bytes.inc(max(0, record.size_bytes))
        elif record.kind == oplog.RESTORE:
            outcome = word(record.outcome)
            self.restores.labels(outcome).inc()
            self.restore_seconds.labels(outcome).observe(record.duration_seconds)
            for phase, seconds in record.phases.items():
                self.restore_phase_seconds.labels(word(phase)).observe(seconds)
        elif record.kind in (oplog.COMPACTION, oplog.PUSH):
            self.background.labels(record.kind, word(record.outcome)).inc()
            if record.outcome == "done":
                trigger = word(record.trigger)
                for phase, seconds in record.phases.items():
                    self.checkpoint_phase_seconds.labels(trigger, word(phase)).observe(seconds)
                if record.kind == oplog.COMPACTION:
                    self.stored_bytes.inc(max(0, record.size_bytes))

    def set_versions(self, versions: dict[str, str]) -> None:
        current = {
            "shim": versions.get("shim") or self._versions["shim"],
            "criu": versions.get("criu") or self._versions["criu"],
            "runc": versions.get("runc") or self._versions["runc"],
        }
        if current != self._versions:
            self.build_info.clear()
            self._versions = current
            self.build_info.labels(**current).set(1)


def word(value: str) -> str:
    """A label value from a small set: a short lowercase word, else ``other``."""
    return value if _WORD.fullmatch(value) else "other"
