"""The spool records (checkpoint/oplog.py) of checkpoints, restores, compactions and
pushes, built from what the task layer has at hand when each one ends."""

from __future__ import annotations

import contextlib
import time
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any, Protocol

from ..errors import ShimError
from . import oplog
from .policy import Policy
from .store import Entry

if TYPE_CHECKING:
    from .restore import RestoreReport

CRI_SANDBOX_UID = "io.kubernetes.cri.sandbox-uid"  # the pod's uid, for its Events


class CheckpointLookup(Protocol):
    """What a background record reads of the store: a checkpoint by id (its catalog)."""

    def get(self, checkpoint_id: str) -> Entry: ...


def pod_uid(spec: Mapping[str, Any]) -> str:
    """The pod's uid from the CRI's annotations; "" outside the CRI."""
    annotations = spec.get("annotations")
    if not isinstance(annotations, Mapping):
        return ""
    return str(annotations.get(CRI_SANDBOX_UID, ""))


def checkpoint_record(
    container_id: str,
    policy: Policy,
    *,
    pod_uid: str,
    outcome: str,
    trigger: str,
    total: float,
    phases: dict[str, float],
    versions: Mapping[str, str],
    checkpoint_id: str = "",
    size: int = 0,
    detail: str = "",
) -> oplog.OpRecord:
    return oplog.OpRecord(
        kind=oplog.CHECKPOINT,
        outcome=outcome,
        container_id=container_id,
        namespace=policy.scope,
        label=policy.label,
        pod=policy.pod,
        pod_uid=pod_uid,
        container=policy.container,
        trigger=trigger,
        checkpoint_id=checkpoint_id,
        size_bytes=size,
        duration_seconds=total,
        phases=phases,
        detail=detail,
        versions=dict(versions),
        time=time.time(),
    )


def restore_outcome(report: RestoreReport) -> str:
    """restored (the newest usable checkpoint), fell_back (restored after passing
    over others), cold (nothing to restore) or failed (candidates, none restored; or
    a restore by hand refused)."""
    if report.failed:
        return "failed"
    if report.checkpoint_id:
        return "fell_back" if report.skipped else "restored"
    return "failed" if report.skipped or report.store_problem else "cold"


def restore_timing(report: RestoreReport) -> tuple[float, dict[str, float]]:
    """The restore's wall time and its phases, ``other`` making up the rest."""
    total = round(report.total, 3)
    return total, oplog.sum_to(total, report.phases)


def restore_record(
    report: RestoreReport, policy: Policy, versions: Mapping[str, str]
) -> oplog.OpRecord:
    total, phases = restore_timing(report)
    return oplog.OpRecord(
        kind=oplog.RESTORE,
        outcome=restore_outcome(report),
        container_id=report.container_id,
        namespace=report.scope,
        label=report.label,
        pod=policy.pod,
        container=policy.container,
        checkpoint_id=report.checkpoint_id,
        duration_seconds=total,
        phases=phases,
        detail=report.detail,
        skipped=list(report.skipped),
        versions=dict(versions),
        time=time.time(),
    )


def background_record(
    checkpoints: CheckpointLookup,
    kind: str,
    outcome: str,
    checkpoint_id: str,
    total: float,
    phases: dict[str, float],
    *,
    entry: Entry | None = None,
    detail: str = "",
) -> oplog.OpRecord:
    """A compaction's or a push's record: metrics only (no pod Event), so what the
    checkpoint says of itself is enough. Blocking (reads the store)."""
    if entry is None:
        with contextlib.suppress(ShimError, OSError):  # deleted meanwhile: counted all the same
            entry = checkpoints.get(checkpoint_id)
    compacted = kind == oplog.COMPACTION and outcome == "done" and entry is not None
    return oplog.OpRecord(
        kind=kind,
        outcome=outcome,
        container_id=str(entry.metadata.get("containerId", "")) if entry else "",
        namespace=entry.scope if entry else "",
        label=entry.label if entry else "",
        trigger=str(entry.metadata.get("reason", "")) if entry else "",
        checkpoint_id=checkpoint_id,
        size_bytes=entry.size if entry and compacted else 0,
        raw_bytes=sum(layer.raw_size for layer in entry.layers) if entry and compacted else 0,
        duration_seconds=total,
        phases=phases,
        detail=detail,
        time=time.time(),
    )
