"""The pod Events that tell an operation's story in ``kubectl describe pod``.

One finished operation (a record of the spool, see checkpoint/oplog.py) becomes
zero, one or two core/v1 Events on its pod:

* checkpoint committed: ``Checkpointed`` (Normal): id, trigger, size, duration;
* checkpoint failed: ``CheckpointFailed`` (Warning): trigger, error;
* restore: ``RestoreFellBack`` (Warning) for every candidate passed over, with why,
  then ``Restored`` (Normal): from which checkpoint, how long; a restore that
  restored nothing says "started without its checkpoint" in its ``RestoreFellBack``;
* a cold start without any checkpoint, compactions and pushes: metrics only.

An Event's name is derived from the record, so posting it again after a lost
answer finds it there (HTTP 409) instead of making a second one.
"""

from __future__ import annotations

import hashlib
from datetime import UTC, datetime
from typing import Any, Final

from ..checkpoint import oplog

COMPONENT: Final = "cedana-node-agent"
MESSAGE_LIMIT: Final = 1024  # the API server's limit on an Event's message


def events_for(record: oplog.OpRecord, record_name: str, node: str) -> list[dict[str, Any]]:
    """The Events for ``record`` (spool file ``record_name``); [] when it has no pod."""
    if not record.pod or not record.namespace:
        return []
    found: list[tuple[str, str, str]] = []  # (type, reason, message)
    who = f"container {record.container or record.container_id} (label {record.label})"
    took = f"{record.duration_seconds:.2f}s"
    if record.kind == oplog.CHECKPOINT and record.outcome == "committed":
        found.append(
            (
                "Normal",
                "Checkpointed",
                f"Checkpoint {record.checkpoint_id} of {who}, trigger {record.trigger}: "
                f"{human_bytes(record.size_bytes)} in {took} ({_phases(record.phases)})",
            )
        )
    elif record.kind == oplog.CHECKPOINT:
        found.append(
            (
                "Warning",
                "CheckpointFailed",
                f"Checkpoint of {who}, trigger {record.trigger}, failed after {took}: "
                f"{record.detail}",
            )
        )
    elif record.kind == oplog.RESTORE and record.outcome != "cold":
        if record.skipped or record.outcome == "failed":
            passed = "; ".join(record.skipped) or record.detail
            ending = (
                f"restored from {record.checkpoint_id}"
                if record.checkpoint_id
                else "started without its checkpoint"
            )
            found.append(("Warning", "RestoreFellBack", f"{who}: passed over {passed}; {ending}"))
        if record.checkpoint_id:
            found.append(
                (
                    "Normal",
                    "Restored",
                    f"{who[0].upper()}{who[1:]} restored from checkpoint "
                    f"{record.checkpoint_id} in {took} ({_phases(record.phases)})",
                )
            )
    digest = hashlib.sha256(record_name.encode()).hexdigest()[:12]
    return [
        event_body(record, node, kind, reason, message, f"{record.pod}.{digest}{index}")
        for index, (kind, reason, message) in enumerate(found)
    ]


def event_body(
    record: oplog.OpRecord, node: str, kind: str, reason: str, message: str, name: str
) -> dict[str, Any]:
    """A core/v1 Event about the record's pod (and container, when the CRI named it)."""
    when = datetime.fromtimestamp(record.time or 0, UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    involved: dict[str, Any] = {
        "apiVersion": "v1",
        "kind": "Pod",
        "namespace": record.namespace,
        "name": record.pod,
    }
    if record.pod_uid:
        involved["uid"] = record.pod_uid
    if record.container:
        involved["fieldPath"] = f"spec.containers{{{record.container}}}"
    if len(message) > MESSAGE_LIMIT:
        message = message[: MESSAGE_LIMIT - 3] + "..."
    return {
        "apiVersion": "v1",
        "kind": "Event",
        "metadata": {"name": name, "namespace": record.namespace},
        "involvedObject": involved,
        "type": kind,
        "reason": reason,
        "message": message,
        "source": {"component": COMPONENT, "host": node},
        "reportingComponent": COMPONENT,
        "reportingInstance": node,
        "firstTimestamp": when,
        "lastTimestamp": when,
        "count": 1,
    }


def human_bytes(size: int) -> str:
    units = ("B", "KiB", "MiB", "GiB")
    value, step = float(size), 0
    while value >= 1024 and step < len(units) - 1:
        value /= 1024
        step += 1
    return f"{size} B" if step == 0 else f"{value:.1f} {units[step]}"


def _phases(phases: dict[str, float]) -> str:
    return ", ".join(f"{name} {seconds:.2f}s" for name, seconds in phases.items()) or "no phases"
