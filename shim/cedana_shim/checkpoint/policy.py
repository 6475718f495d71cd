"""Who opts in to checkpoint/restore, under which label and scope, and how often.

Read from the container's OCI spec (its ``process.env`` and annotations), so the
application itself changes nothing:

* ``CEDANA_CHECKPOINT=<label>`` (or annotation ``cedana.ai/checkpoint``):
  checkpoint on stop, restore the latest good checkpoint of the label on start;
* ``CEDANA_ENABLE=1``: checkpoints allowed (on demand, periodic), no restore;
* ``CEDANA_CHECKPOINT_INTERVAL=<duration>`` (or ``cedana.ai/checkpoint-interval``):
  periodic leave-running checkpoints;
* ``CEDANA_RESTORE=<checkpoint id or unique prefix>`` (or ``cedana.ai/restore``):
  start from exactly that checkpoint of the scope (restore by hand); the Create
  fails when it cannot be restored, unless ``CEDANA_RESTORE_FALLBACK=cold`` (or
  ``cedana.ai/restore-fallback``) says to start cold instead. On its own it opts the
  container in as ``CEDANA_ENABLE=1`` does; with a label, later checkpoints carry
  the label as usual.

A label is scoped to the pod's Kubernetes namespace (containerd's namespace
outside the CRI): a pod in namespace B never sees namespace A's checkpoints.
Pause containers never take part. A bad label fails the Create with the rule it
broke; silently running an opted-in workload without protection is worse.
"""

from __future__ import annotations

import re
import string
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
ENV_RESTORE = "CEDANA_RESTORE"
ANN_RESTORE = "cedana.ai/restore"
ENV_RESTORE_FALLBACK = "CEDANA_RESTORE_FALLBACK"
ANN_RESTORE_FALLBACK = "cedana.ai/restore-fallback"
FALLBACK_COLD = "cold"
FALLBACK_FAIL = "fail"
# A checkpoint id (20261129T183000Z-3f9a1c2b) or a prefix of one.
RESTORE_REF_MAX = 25
CRI_CONTAINER_TYPE = "io.kubernetes.cri.container-type"
CRI_NAMESPACE = "io.kubernetes.cri.sandbox-namespace"
CRI_POD = "io.kubernetes.cri.sandbox-name"
CRI_CONTAINER = "io.kubernetes.cri.container-name"
CRI_IMAGE = "io.kubernetes.cri.image-name"
TRUE_WORDS = {"1", "true", "yes", "on"}
# How much of a value an error message quotes: a 100 KB label must not make a 100 KB
# error (in containerd's log, kubelet's events, a terminal).
ECHO_MAX = 64

# ASCII digits only: \d, float() and int() also take other scripts' digits (U+0661
# U+0660 "m" was ten minutes), and float() "nan", "inf" and "1e400".
_DURATION = re.compile(r"([0-9]{1,9}(?:\.[0-9]{1,9})?)(ms|s|m|h)")
_PLAIN_SECONDS = re.compile(r"[0-9]{1,9}(?:\.[0-9]{1,9})?")
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
    restore: str = ""  # restore by hand: a checkpoint id or unique prefix of the scope
    restore_fallback: str = FALLBACK_FAIL  # or FALLBACK_COLD
    image_digest: str = ""  # sha256:<hex> when the image is pinned by digest

    @property
    def enabled(self) -> bool:
        return self.mode is not Mode.OFF

    @property
    def restores(self) -> bool:
        """A Create restores: from the label's latest, or from the one asked for."""
        return self.mode is Mode.AUTO or bool(self.restore)


def validate_label(label: str, source: str) -> str:
    """The label itself, or InvalidArgument naming the label, its source and the rule."""
    rule = _text_rule(label, LABEL_MAX)
    if not rule and not re.fullmatch(r"[A-Za-z0-9._-]+", label):
        rule = "it contains characters outside [A-Za-z0-9._-]"
    if rule:
        raise InvalidArgument(
            f"checkpoint label {echoed(label)} (from {source}) is invalid: {rule}; "
            f"use 1-{LABEL_MAX} characters of letters, digits, '.', '_' or '-'"
        )
    return label


def echoed(value: str) -> str:
    """A user's value as an error message quotes it: whole up to :data:`ECHO_MAX`
    characters, else its start and its length."""
    if len(value) <= ECHO_MAX:
        return repr(value)
    return f"{value[:ECHO_MAX]!r}... ({len(value)} characters)"


def _word(text: str) -> str:
    """``text`` trimmed and lowercased to compare with ASCII words. str.strip() and
    lower() know Unicode (U+3000 is a space, the Kelvin sign lowercases to 'k'): a value
    with any other character is kept as it is, so that it equals none of them."""
    return text.strip(string.whitespace).lower() if text.isascii() else text


def _text_rule(text: str, limit: int) -> str:
    """What makes ``text`` unfit as a name in the store; empty when nothing does."""
    if not text:
        return "it is empty"
    if len(text) > limit:
        return f"it is {len(text)} characters long, over {limit}"
    if "/" in text or "\\" in text:
        return "it contains a path separator"
    if ".." in text:
        return "it contains '..'"
    if any(ord(c) < 0x20 or ord(c) == 0x7F for c in text):
        return "it contains control characters"
    return ""


def validate_restore_ref(text: str, source: str) -> str:
    """A checkpoint id or id prefix to restore from, or InvalidArgument with the rule."""
    rule = _text_rule(text, RESTORE_REF_MAX)
    if not rule and not re.fullmatch(r"[0-9A-Za-z-]+", text):
        rule = "it contains characters outside [A-Za-z0-9-]"
    if rule:
        raise InvalidArgument(
            f"checkpoint to restore {echoed(text)} (from {source}) is invalid: {rule}; give a "
            "checkpoint id as `cedana checkpoints list` shows it (e.g. "
            "20261129T183000Z-3f9a1c2b) or a unique prefix of one"
        )
    return text


def validate_fallback(text: str, source: str) -> str:
    value = _word(text)
    if value not in (FALLBACK_COLD, FALLBACK_FAIL):
        raise InvalidArgument(
            f"restore fallback {echoed(text)} (from {source}) is invalid: use "
            f"{FALLBACK_COLD!r} (start cold when the checkpoint cannot be restored) or "
            f"{FALLBACK_FAIL!r} (the default: the container fails to start)"
        )
    return value


def image_digest(image: str) -> str:
    """The digest an image reference pins (``name@sha256:<hex>``, or an image id
    ``sha256:<hex>``); empty when the reference is a tag."""
    m = re.search(r"(?:^|@)(sha256:[0-9a-f]{64})$", image)
    return m.group(1) if m else ""


def parse_duration(text: str, source: str) -> float:
    """Go-style durations (``90s``, ``10m``, ``1h30m``, ``500ms``) or plain seconds,
    between :data:`MIN_INTERVAL` and :data:`MAX_INTERVAL`."""
    value = text.strip(string.whitespace)
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
                f"checkpoint interval {echoed(text)} (from {source}) is not a duration; "
                "write e.g. 90s, 10m or 1h30m (digits 0-9)"
            ) from None
    if not MIN_INTERVAL <= seconds <= MAX_INTERVAL:
        raise InvalidArgument(
            f"checkpoint interval {echoed(text)} (from {source}) is out of range: use "
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
            f"conflicting settings: env {env_key}={echoed(from_env)} but annotation "
            f"{annotation}={echoed(from_annotation)}; set one of them, or both to the same value"
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
    identity["image_digest"] = image_digest(identity["image"])
    restore = _restore_settings(env, annotations)
    interval = None
    setting = _setting(env, ENV_INTERVAL, annotations, ANN_INTERVAL)
    if setting is not None and setting[1]:
        interval = parse_duration(setting[1], setting[0])
    setting = _setting(env, ENV_LABEL, annotations, ANN_LABEL)
    if setting is not None:
        label = validate_label(setting[1], setting[0])
        return Policy(Mode.AUTO, label, interval=interval, **restore, **identity)
    enabled = _word(env.get(ENV_ENABLE, "")) in TRUE_WORDS
    if enabled or interval is not None or restore:
        # Manual checkpoints land under the container's own name.
        label = validate_label(identity["container"], "the container name")
        return Policy(Mode.MANUAL, label, interval=interval, **restore, **identity)
    return Policy(Mode.OFF, scope=scope)


def _restore_settings(env: Mapping[str, str], annotations: Mapping[str, Any]) -> dict[str, str]:
    """``restore`` and ``restore_fallback`` for Policy; empty when none is asked for."""
    setting = _setting(env, ENV_RESTORE, annotations, ANN_RESTORE)
    if setting is None or not setting[1]:
        return {}  # an empty value (a template's default) asks for nothing
    ref = validate_restore_ref(setting[1], setting[0])
    fallback = FALLBACK_FAIL
    chosen = _setting(env, ENV_RESTORE_FALLBACK, annotations, ANN_RESTORE_FALLBACK)
    if chosen is not None and chosen[1].strip(string.whitespace):
        fallback = validate_fallback(chosen[1], chosen[0])
    return {"restore": ref, "restore_fallback": fallback}
