"""The dashboard's views, built from what the node agents answered (pure functions:
the caller gathers, filters by the user's rights and serializes).

A checkpoint pulled from the registry to another node has the same id there: the
views show one checkpoint with every node that holds it."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from ..node.policies import opted_in


def merged_checkpoints(
    lists: Iterable[dict[str, Any]], records: Iterable[dict[str, Any]]
) -> list[dict[str, Any]]:
    """One item per checkpoint id, newest first, with ``nodes`` (where it lives),
    ``pendingPush`` (not yet in the registry from some node) and, when an agent still
    remembers the operation, its ``durationSeconds``."""
    took = {
        r["checkpoint_id"]: r.get("duration_seconds")
        for r in records
        if r.get("kind") == "checkpoint" and r.get("checkpoint_id")
    }
    by_id: dict[str, dict[str, Any]] = {}
    for answer in lists:
        node = str(answer.get("node") or "")
        for item in answer.get("checkpoints") or ():
            seen = by_id.get(item["id"])
            if seen is None:
                seen = by_id[item["id"]] = {**item, "nodes": [], "pendingPush": False}
                seen["durationSeconds"] = took.get(item["id"])
            seen["nodes"].append(node)
            seen["pendingPush"] = seen["pendingPush"] or bool(item.get("pendingPush"))
            seen["pinned"] = bool(seen.get("pinned")) or bool(item.get("pinned"))
    return sorted(by_id.values(), key=lambda c: (c.get("created") or "", c["id"]), reverse=True)


def all_records(states: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """Every node's recent operations, newest first."""
    found = [r for s in states for r in s.get("recent") or ()]
    return sorted(found, key=lambda r: float(r.get("time") or 0), reverse=True)


def workloads(pods: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    out = []
    for pod in pods:
        containers = opted_in(pod)
        if not containers:
            continue
        meta = pod.get("metadata") or {}
        out.append(
            {
                "namespace": meta.get("namespace") or "",
                "pod": meta.get("name") or "",
                "node": (pod.get("spec") or {}).get("nodeName") or "",
                "phase": (pod.get("status") or {}).get("phase") or "",
                "containers": containers,
            }
        )
    return sorted(out, key=lambda w: (w["namespace"], w["pod"]))


def failures(records: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    """Failed checkpoints and restores, and restores that fell back, with why."""
    return [
        r
        for r in records
        if r.get("outcome") == "failed"
        or (r.get("kind") == "restore" and (r.get("skipped") or r.get("outcome") == "fell_back"))
    ]


def node_rows(states: Iterable[dict[str, Any]]) -> list[dict[str, Any]]:
    return [
        {
            "node": s.get("node"),
            "taint": s.get("taint"),
            "store": s.get("store"),
            "registry": s.get("registry") or "",
            "pendingPushes": len(s.get("pendingPushes") or ()),
        }
        for s in sorted(states, key=lambda s: str(s.get("node")))
    ]


def restore_by_hand(checkpoint: dict[str, Any]) -> str:
    """The lines to paste into a container spec to start from exactly this checkpoint."""
    label = checkpoint.get("label") or ""
    lines = ["env:"]
    if label:
        lines.append(f'- {{name: CEDANA_CHECKPOINT, value: "{label}"}}')
    lines.append(f'- {{name: CEDANA_RESTORE, value: "{checkpoint["id"]}"}}')
    return "\n".join(lines)


def namespace_timeline(
    checkpoints: Iterable[dict[str, Any]], records: Iterable[dict[str, Any]]
) -> dict[str, Any]:
    """Points of the namespace's timeline plot: checkpoints (size, duration) and
    restores (restored, fell back, failed, cold), oldest first."""
    points = [
        {
            "kind": "checkpoint",
            "id": c["id"],
            "label": c.get("label"),
            "created": c.get("created"),
            "size": c.get("size"),
            "durationSeconds": c.get("durationSeconds"),
        }
        for c in checkpoints
    ]
    restores = [
        {
            "kind": "restore",
            "time": r.get("time"),
            "pod": r.get("pod"),
            "node": r.get("node"),
            "label": r.get("label"),
            "outcome": r.get("outcome"),
            "checkpointId": r.get("checkpoint_id"),
            "durationSeconds": r.get("duration_seconds"),
            "skipped": r.get("skipped") or [],
            "detail": r.get("detail") or "",
        }
        for r in records
        if r.get("kind") == "restore"
    ]
    return {
        "checkpoints": sorted(points, key=lambda p: str(p["created"])),
        "restores": sorted(restores, key=lambda p: float(p["time"] or 0)),
    }
