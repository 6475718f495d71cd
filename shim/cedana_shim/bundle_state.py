"""What the daemon records in a bundle for the ``delete`` command to find.

``delete`` runs as a fresh process that must not ask the daemon anything, so
the daemon writes the facts it needs (how to call runc for this container) into
``<bundle>/cedana.json`` at Create. A bundle without it (Create never got that
far) falls back to containerd's runc defaults.
"""

from __future__ import annotations

import json
import os

FILE_NAME = "cedana.json"
DEFAULT_RUNC_ROOT = "/run/containerd/runc"


class BundleState:
    """Plain class, not a dataclass: ``delete`` must import little."""

    __slots__ = ("runc_binary", "runc_root", "systemd_cgroup")

    def __init__(self, runc_binary: str, runc_root: str, systemd_cgroup: bool = False) -> None:
        self.runc_binary = runc_binary
        self.runc_root = runc_root  # already joined with the namespace
        self.systemd_cgroup = systemd_cgroup

    def as_dict(self) -> dict[str, object]:
        return {name: getattr(self, name) for name in self.__slots__}

    def __eq__(self, other: object) -> bool:
        return isinstance(other, BundleState) and self.as_dict() == other.as_dict()

    @classmethod
    def default(cls, namespace: str) -> BundleState:
        return cls("runc", os.path.join(DEFAULT_RUNC_ROOT, namespace))

    @classmethod
    def load(cls, bundle: str, namespace: str) -> BundleState:
        try:
            with open(os.path.join(bundle, FILE_NAME)) as f:
                data = json.load(f)
            return cls(
                runc_binary=str(data["runc_binary"]),
                runc_root=str(data["runc_root"]),
                systemd_cgroup=bool(data.get("systemd_cgroup", False)),
            )
        except (OSError, ValueError, KeyError, TypeError):
            return cls.default(namespace)

    def save(self, bundle: str) -> None:
        tmp = os.path.join(bundle, f".{FILE_NAME}.tmp")
        with open(tmp, "w") as f:
            json.dump(self.as_dict(), f)
        os.rename(tmp, os.path.join(bundle, FILE_NAME))
