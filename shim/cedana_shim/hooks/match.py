"""Which hooks apply to a container, from its OCI spec (config.json).

The rules are containers/common's ``When.Match`` for 1.0.0 files: every
condition a file sets must hold (they are ANDed), and regexes are searched, not
anchored, as Go's ``regexp.MatchString`` does. ``"always": false`` and
``"hasBindMounts": false`` are conditions that never hold (not "when there are
none"), exactly as there.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

from .config import HookConfig, Stage, When

# Bind mounts every CRI/containerd container gets whether or not anyone asked:
# counting them would make ``hasBindMounts`` true for every pod. podman's rule
# is "bind mounts the caller requested"; the spec is all we have, so these are
# left out.
RUNTIME_BIND_MOUNTS = frozenset(
    {"/etc/hosts", "/etc/hostname", "/etc/resolv.conf", "/dev/shm", "/dev/termination-log"}
)


def annotations_of(spec: Mapping[str, Any]) -> dict[str, str]:
    raw = spec.get("annotations")
    if not isinstance(raw, Mapping):
        return {}
    return {k: v for k, v in raw.items() if isinstance(k, str) and isinstance(v, str)}


def command_of(spec: Mapping[str, Any]) -> str | None:
    process = spec.get("process")
    args = process.get("args") if isinstance(process, Mapping) else None
    if isinstance(args, list) and args and isinstance(args[0], str):
        return args[0]
    return None


def has_bind_mounts(spec: Mapping[str, Any]) -> bool:
    for mount in spec.get("mounts") or ():
        if not isinstance(mount, Mapping):
            continue
        options = mount.get("options")
        options = options if isinstance(options, list) else []
        is_bind = mount.get("type") == "bind" or "bind" in options or "rbind" in options
        if is_bind and mount.get("destination") not in RUNTIME_BIND_MOUNTS:
            return True
    return False


def matches(when: When, spec: Mapping[str, Any]) -> bool:
    if when.always is not None and not when.always:
        return False
    if when.has_bind_mounts is not None and not (when.has_bind_mounts and has_bind_mounts(spec)):
        return False
    if when.annotations:
        annotations = annotations_of(spec)
        for key_re, value_re in when.annotations:
            if not any(key_re.search(k) and value_re.search(v) for k, v in annotations.items()):
                return False
    if when.commands:
        command = command_of(spec)
        if command is None or not any(r.search(command) for r in when.commands):
            return False
    return True


def select(hooks: Iterable[HookConfig], stage: Stage, spec: Mapping[str, Any]) -> list[HookConfig]:
    """The hooks to run for ``stage``, in the order given (file-name order)."""
    return [h for h in hooks if stage in h.stages and matches(h.when, spec)]
