"""Who opts in to checkpoint/restore, under which label and scope, and how often.

Read from the container's OCI spec (its ``process.env`` and annotations), so the
application itself changes nothing:

* ``CEDANA_CHECKPOINT=<label>`` (or annotation ``cedana.ai/checkpoint``):
  checkpoint on stop, restore the latest good checkpoint of the label on start;
* ``CEDANA_ENABLE=1``: checkpoints allowed (on demand, periodic), no restore;
* ``CEDANA_CHECKPOINT_INTERVAL=<duration>`` (or ``cedana.ai/checkpoint-interval``):
  periodic leave-running checkpoints.

A label is scoped to the pod's Kubernetes namespace (containerd's namespace
outside the CRI): a pod in namespace B never sees namespace A's checkpoints.
Pause containers never take part. A bad label fails the Create with the rule it
broke; silently running an opted-in workload without protection is worse.
"""

from __future__ import annotations

import re
from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any

from ..errors import InvalidArgument

LABEL_MAX = 128
MIN_INTERVAL = 10.0  # seconds; a dump every few seconds would do nothing but dump
ENV_LABEL = "CEDANA_CHECKPOINT"
ENV_ENABLE = "CEDANA_ENABLE"
ENV_INTERVAL = "CEDANA_CHECKPOINT_INTERVAL"
ANN_LABEL = "cedana.ai/checkpoint"
ANN_INTERVAL = "cedana.ai/checkpoint-interval"
CRI_CONTAINER_TYPE = "io.kubernetes.cri.container-type"
CRI_NAMESPACE = "io.kubernetes.cri.sandbox-namespace"
CRI_POD = "io.kubernetes.cri.sandbox-name"
CRI_CONTAINER = "io.kubernetes.cri.container-name"
CRI_IMAGE = "io.kubernetes.cri.image-name"
TRUE_WORDS = {"1", "true", "yes", "on"}

_DURATION = re.compile(r"(\d+(?:\.\d+)?)(ms|s|m|h)")
_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}


class Mode(Enum):
    OFF = "off"
    MANUAL = "manual"  # checkpoints on demand or periodic; never restores by itself
    AUTO = "auto"  # checkpoint on stop, restore on start


@dataclass(frozen=True, slots=True)
class Policy:
    mode: Mode
    label: str = ""
    scope: str = ""
    interval: float | None = None
    pod: str = ""
    container: str = ""
    image: str = ""

    @property
    def enabled(self) -> bool:
        return self.mode is not Mode.OFF


def validate_label(label: str, source: str) -> str:
    """The label itself, or InvalidArgument naming the label, its source and the rule."""
    rule = ""
    if not label:
        rule = "it is empty"
    elif len(label) > LABEL_MAX:
        rule = f"it is {len(label)} characters long, over {LABEL_MAX}"
    elif "/" in label or "\\" in label:
        rule = "it contains a path separator"
    elif ".." in label:
        rule = "it contains '..'"
    elif any(ord(c) < 0x20 or ord(c) == 0x7F for c in label):
        rule = "it contains control characters"
    elif not re.fullmatch(r"[A-Za-z0-9._-]+", label):
        rule = "it contains characters outside [A-Za-z0-9._-]"
    if rule:
        raise InvalidArgument(
            f"checkpoint label {label!r} (from {source}) is invalid: {rule}; "
            f"use 1-{LABEL_MAX} characters of letters, digits, '.', '_' or '-'"
        )
    return label


def parse_duration(text: str, source: str) -> float:
    """Go-style durations (``90s``, ``10m``, ``1h30m``, ``500ms``) or plain seconds."""
    value = text.strip()
    try:
        seconds = float(value)
    except ValueError:
        pos, seconds = 0, 0.0
        for match in _DURATION.finditer(value):
            if match.start() != pos:
                break
            seconds += float(match.group(1)) * _UNITS[match.group(2)]
            pos = match.end()
        if pos != len(value) or not value:
            raise InvalidArgument(
                f"checkpoint interval {text!r} (from {source}) is not a duration; "
                "write e.g. 90s, 10m or 1h30m"
            ) from None
    if seconds < MIN_INTERVAL:
        raise InvalidArgument(
            f"checkpoint interval {text!r} (from {source}) is under the minimum of "
            f"{MIN_INTERVAL:g}s"
        )
    return seconds


def environment(spec: Mapping[str, Any]) -> dict[str, str]:
    env: dict[str, str] = {}
    for item in (spec.get("process") or {}).get("env") or []:
        if isinstance(item, str):
            key, _, value = item.partition("=")
            env[key] = value
    return env


def policy_for(spec: Mapping[str, Any], container_id: str, containerd_namespace: str) -> Policy:
    annotations = spec.get("annotations") or {}
    if not isinstance(annotations, Mapping):
        annotations = {}
    if annotations.get(CRI_CONTAINER_TYPE) == "sandbox":
        return Policy(Mode.OFF)
    env = environment(spec)
    scope = str(annotations.get(CRI_NAMESPACE) or containerd_namespace)
    identity = {
        "scope": scope,
        "pod": str(annotations.get(CRI_POD, "")),
        "container": str(annotations.get(CRI_CONTAINER) or container_id),
        "image": str(annotations.get(CRI_IMAGE, "")),
    }
    interval = None
    for source, raw in (
        (f"env {ENV_INTERVAL}", env.get(ENV_INTERVAL)),
        (f"annotation {ANN_INTERVAL}", annotations.get(ANN_INTERVAL)),
    ):
        if raw:
            interval = parse_duration(str(raw), source)
            break
    if ENV_LABEL in env:
        label = validate_label(env[ENV_LABEL], f"env {ENV_LABEL}")
        return Policy(Mode.AUTO, label, interval=interval, **identity)
    if ANN_LABEL in annotations:
        label = validate_label(str(annotations[ANN_LABEL]), f"annotation {ANN_LABEL}")
        return Policy(Mode.AUTO, label, interval=interval, **identity)
    if env.get(ENV_ENABLE, "").strip().lower() in TRUE_WORDS or interval is not None:
        # Manual checkpoints land under the container's own name.
        label = validate_label(identity["container"], "the container name")
        return Policy(Mode.MANUAL, label, interval=interval, **identity)
    return Policy(Mode.OFF, scope=scope)
