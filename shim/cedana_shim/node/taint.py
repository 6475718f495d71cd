"""Should the node carry ``cedana.ai/not-ready:NoSchedule``? The pure decision.

The taint keeps pods that want the cedana runtime off a node until the runtime is
proven there: the installer finished, CRI answers for the handler, and the node's
cedana helper and health-check pods are Ready (the health-check pod runs with
``runtimeClassName: cedana`` and an exec readiness probe, so its readiness is the
runtime working end to end). Anything else, including a helper that has just
restarted, puts the taint back. The ``cedana.ai/shim=true`` label (the
RuntimeClass's nodeSelector) follows the installation alone: the health-check pod
needs it to be scheduled before the taint can go.

Inputs are plain JSON objects as the API server returns them; the output is the
strategic-merge patch to send, or None when the node already matches.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from .registration import NODE_LABEL, TAINT_EFFECT, TAINT_KEY

Role = Literal["helper", "health"]
ROLES: tuple[Role, ...] = ("helper", "health")


@dataclass(frozen=True)
class PodState:
    name: str
    role: Role
    ready: bool
    terminating: bool


@dataclass(frozen=True)
class Local:
    """What the helper knows first-hand about its node."""

    installed: bool  # the last install run succeeded
    handler_ok: bool  # CRI lists the cedana handler right now


@dataclass(frozen=True)
class Decision:
    tainted: bool
    label: bool | None  # True: set cedana.ai/shim=true; False: remove it; None: leave
    reasons: tuple[str, ...]


def pod_state(pod: Mapping[str, Any], role: Role) -> PodState:
    meta = pod.get("metadata") or {}
    conditions = (pod.get("status") or {}).get("conditions") or []
    ready = any(c.get("type") == "Ready" and c.get("status") == "True" for c in conditions)
    return PodState(
        name=str(meta.get("name", "?")),
        role=role,
        ready=ready,
        terminating=meta.get("deletionTimestamp") is not None,
    )


def decide(pods: Iterable[PodState], local: Local, *, uninstalling: bool = False) -> Decision:
    if uninstalling:
        return Decision(True, False, ("cedana is being removed from the node",))
    reasons: list[str] = []
    if not local.installed:
        reasons.append("cedana is not installed (yet)")
    elif not local.handler_ok:
        reasons.append("the CRI does not list the cedana handler")
    pods = list(pods)
    for role in ROLES:
        live = [p for p in pods if p.role == role and not p.terminating]
        if not live:
            reasons.append(f"no {role} pod on the node")
        elif not any(p.ready for p in live):
            reasons.append(f"{role} pod {', '.join(p.name for p in live)} not Ready")
    return Decision(bool(reasons), True if local.installed else None, tuple(reasons))


def _is_ours(taint: Mapping[str, Any]) -> bool:
    return taint.get("key") == TAINT_KEY and taint.get("effect") == TAINT_EFFECT


def node_patch(node: Mapping[str, Any], decision: Decision) -> dict[str, Any] | None:
    """The patch that makes ``node`` match ``decision``; None when it already does.

    ``spec.taints`` has no merge key, so the whole list is sent, built from the one
    just read; ``metadata.resourceVersion`` makes the API server refuse the patch
    (409) if another controller changed the node in between.
    """
    meta = node.get("metadata") or {}
    taints: Sequence[Mapping[str, Any]] = (node.get("spec") or {}).get("taints") or []
    has_taint = any(_is_ours(t) for t in taints)
    has_label = (meta.get("labels") or {}).get(NODE_LABEL) == "true"
    patch: dict[str, Any] = {"metadata": {"resourceVersion": meta.get("resourceVersion")}}
    changed = False
    if decision.tainted != has_taint:
        if decision.tainted:
            new = [dict(t) for t in taints] + [{"key": TAINT_KEY, "effect": TAINT_EFFECT}]
        else:
            new = [dict(t) for t in taints if not _is_ours(t)]
        patch["spec"] = {"taints": new}
        changed = True
    if decision.label is not None and decision.label != has_label:
        patch["metadata"]["labels"] = {NODE_LABEL: "true" if decision.label else None}
        changed = True
    return patch if changed else None


def has_taint(node: Mapping[str, Any]) -> bool:
    return any(_is_ours(t) for t in (node.get("spec") or {}).get("taints") or [])
