"""What the daemon records in a bundle for the ``delete`` command to find.

``delete`` runs as a fresh process that must not ask the daemon anything, so
the daemon writes the facts it needs (how to call runc for this container) into
``<bundle>/cedana-runc`` at Create: one ``key=value`` per line, read without
importing ``json`` on that hot path. A bundle without it (Create never got that
far) falls back to containerd's runc defaults.
"""

from __future__ import annotations

import os

FILE_NAME = "cedana-runc"
DEFAULT_RUNC_ROOT = "/run/containerd/runc"


class BundleState:
    """Plain class, not a dataclass: ``delete`` must import little."""

    __slots__ = ("runc_binary", "runc_root", "systemd_cgroup")

    def __init__(self, runc_binary: str, runc_root: str, systemd_cgroup: bool = False) -> None:
        self.runc_binary = runc_binary
        self.runc_root = runc_root  # already joined with the namespace
        self.systemd_cgroup = systemd_cgroup

    def __eq__(self, other: object) -> bool:
        return isinstance(other, BundleState) and (
            self.runc_binary,
            self.runc_root,
            self.systemd_cgroup,
        ) == (other.runc_binary, other.runc_root, other.systemd_cgroup)

    @classmethod
    def default(cls, namespace: str) -> BundleState:
        return cls("runc", os.path.join(DEFAULT_RUNC_ROOT, namespace))

    @classmethod
    def load(cls, bundle: str, namespace: str) -> BundleState:
        try:
            with open(os.path.join(bundle, FILE_NAME)) as f:
                fields = dict(line.rstrip("\n").partition("=")[::2] for line in f if "=" in line)
            return cls(
                runc_binary=fields["runc_binary"],
                runc_root=fields["runc_root"],
                systemd_cgroup=fields.get("systemd_cgroup") == "true",
            )
        except (OSError, KeyError, ValueError):
            return cls.default(namespace)

    def save(self, bundle: str) -> None:
        for value in (self.runc_binary, self.runc_root):
            if "\n" in value:
                raise ValueError(f"runc setting {value!r} contains a newline")
        tmp = os.path.join(bundle, f".{FILE_NAME}.tmp")
        with open(tmp, "w") as f:
            f.write(
                f"runc_binary={self.runc_binary}\nrunc_root={self.runc_root}\n"
                f"systemd_cgroup={'true' if self.systemd_cgroup else 'false'}\n"
            )
        os.rename(tmp, os.path.join(bundle, FILE_NAME))


DELETED_MARK = "cedana-deleted"


def mark_deleted(bundle: str, pid: int, exit_status: int, exited_at: float) -> None:
    """The daemon deleted this container cleanly (runc state gone, rootfs unmounted):
    the ``delete`` command that containerd runs next has nothing left to do."""
    tmp = os.path.join(bundle, f".{DELETED_MARK}.tmp")
    with open(tmp, "w") as f:
        f.write(f"{pid} {exit_status} {exited_at!r}\n")
    os.rename(tmp, os.path.join(bundle, DELETED_MARK))


def read_deleted(bundle: str) -> tuple[int, int, float] | None:
    try:
        with open(os.path.join(bundle, DELETED_MARK)) as f:
            pid, status, when = f.read().split()
        return int(pid), int(status), float(when)
    except (OSError, ValueError):
        return None
