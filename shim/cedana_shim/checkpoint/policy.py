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
MAX_INTERVAL = 30 * 24 * 3600.0  # a month: anything longer is a typo
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

_DURATION = re.compile(r"(\d{1,9}(?:\.\d{1,9})?)(ms|s|m|h)")
# Digits only: float() would also take "nan", "inf" and "1e400".
_PLAIN_SECONDS = re.compile(r"\d{1,9}(?:\.\d{1,9})?")
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
    """Go-style durations (``90s``, ``10m``, ``1h30m``, ``500ms``) or plain seconds,
    between :data:`MIN_INTERVAL` and :data:`MAX_INTERVAL`."""
    value = text.strip()
    if _PLAIN_SECONDS.fullmatch(value):
        seconds = float(value)
    else:
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
    if not MIN_INTERVAL <= seconds <= MAX_INTERVAL:
        raise InvalidArgument(
            f"checkpoint interval {text!r} (from {source}) is out of range: use "
            f"{MIN_INTERVAL:g}s to {MAX_INTERVAL / 86400:g} days"
        )
    return seconds


def environment(spec: Mapping[str, Any]) -> dict[str, str]:
    env: dict[str, str] = {}
    for item in (spec.get("process") or {}).get("env") or []:
        if isinstance(item, str):
            key, _, value = item.partition("=")
            env[key] = value
    return env


def _setting(
    env: Mapping[str, str], env_key: str, annotations: Mapping[str, Any], annotation: str
) -> tuple[str, str] | None:
    """(where it came from, value) of a setting given as env var or annotation.

    Both at once with different values is refused: silently preferring one would
    checkpoint under a label (or at an interval) the user did not mean.
    """
    from_env = env.get(env_key)
    from_annotation = annotations.get(annotation)
    if from_annotation is not None:
        from_annotation = str(from_annotation)
    if from_env is not None and from_annotation is not None and from_env != from_annotation:
        raise InvalidArgument(
            f"conflicting settings: env {env_key}={from_env!r} but annotation "
            f"{annotation}={from_annotation!r}; set one of them, or both to the same value"
        )
    if from_env is not None:
        return f"env {env_key}", from_env
    if from_annotation is not None:
        return f"annotation {annotation}", from_annotation
    return None


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
    setting = _setting(env, ENV_INTERVAL, annotations, ANN_INTERVAL)
    if setting is not None and setting[1]:
        interval = parse_duration(setting[1], setting[0])
    setting = _setting(env, ENV_LABEL, annotations, ANN_LABEL)
    if setting is not None:
        label = validate_label(setting[1], setting[0])
        return Policy(Mode.AUTO, label, interval=interval, **identity)
    if env.get(ENV_ENABLE, "").strip().lower() in TRUE_WORDS or interval is not None:
        # Manual checkpoints land under the container's own name.
        label = validate_label(identity["container"], "the container name")
        return Policy(Mode.MANUAL, label, interval=interval, **identity)
    return Policy(Mode.OFF, scope=scope)
