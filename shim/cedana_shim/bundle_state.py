"""What the daemon records in a bundle for the ``delete`` command to find.

``delete`` runs as a fresh process that must not ask the daemon anything, so
the daemon writes the facts it needs into the bundle, in files read without
importing ``json`` on that hot path:

- ``cedana-runc`` (at Create): how to call runc for this container, one
  ``key=value`` per line. A bundle without it (Create never got that far) falls
  back to containerd's runc defaults.
- ``cedana-deleted``: the daemon deleted the container itself; nothing is left but
  to print the DeleteResponse it holds (the shell launcher does, without Python).
- ``cedana-criu-group`` (while ``runc restore`` or ``runc checkpoint`` runs): its
  process group (runc, CRIU, CRIU's action scripts), which ``delete`` kills if the
  daemon died mid-operation; for a lazy restore, until its lazy-pages daemon exits:
  that daemon's group, marked ``lazy`` (its tasks are killed before it).
"""

from __future__ import annotations

import os

from .wire import delete_response

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
_OCTAL_BYTES = frozenset(f"{byte:03o}" for byte in range(256))


def mark_deleted(bundle: str, pid: int, exit_status: int, exited_at: float) -> None:
    """The daemon deleted this container cleanly (runc state gone, rootfs unmounted):
    the ``delete`` command that containerd runs next has nothing left to do but print
    this DeleteResponse. It is stored as printf octal escapes on one line, which the
    shim's shell launcher prints without starting Python (:mod:`cedana_shim.launcher`).
    """
    response = delete_response(pid, exit_status, exited_at)
    tmp = os.path.join(bundle, f".{DELETED_MARK}.tmp")
    with open(tmp, "w") as f:
        f.write("".join(f"\\{byte:03o}" for byte in response) + "\n")
    os.rename(tmp, os.path.join(bundle, DELETED_MARK))


def read_deleted(bundle: str) -> bytes | None:
    """The DeleteResponse :func:`mark_deleted` left, if any."""
    try:
        with open(os.path.join(bundle, DELETED_MARK)) as f:
            text = f.read().strip()
    except OSError:
        return None
    if text[:1] != "\\":
        return _read_pid_status_mark(text)
    escapes = text[1:].split("\\")
    if not all(e in _OCTAL_BYTES for e in escapes):
        return None  # not what mark_deleted writes (the shell launcher refuses it too)
    return bytes(int(e, 8) for e in escapes)


def _read_pid_status_mark(text: str) -> bytes | None:
    """``pid status exited_at``, as daemons before the shell's fast path wrote it (one
    may still run through an upgrade)."""
    try:
        pid, status, when = text.split()
        return delete_response(int(pid), int(status), float(when))
    except ValueError:
        return None


CRIU_GROUP_MARK = "cedana-criu-group"
CRIU_ROOT = "criu-root"


def criu_root(runc_root: str, container_id: str) -> str:
    """Where ``runc restore`` binds the container's rootfs for CRIU, in runc's state
    dir; a runc killed mid-restore leaves it mounted."""
    return os.path.join(runc_root, container_id, CRIU_ROOT)


def mark_criu_group(bundle: str, pgid: int, leader_start: int, *, lazy: bool = False) -> None:
    """A ``runc restore`` or ``runc checkpoint`` runs in process group ``pgid``, led by
    the process that started at ``leader_start`` (clock ticks after boot,
    /proc/<pid>/stat field 22).

    If the daemon dies, runc and CRIU go on outside containerd (a CRIU holding the
    container's tasks keeps them from dying); ``delete`` reads this to stop them.
    The start time keeps a reused pid from being killed. ``lazy``: the group is a lazy
    restore's lazy-pages daemon, which holds the restored tasks' memory.
    """
    tmp = os.path.join(bundle, f".{CRIU_GROUP_MARK}.tmp")
    with open(tmp, "w") as f:
        f.write(f"{pgid} {leader_start}{' lazy' if lazy else ''}\n")
    os.rename(tmp, os.path.join(bundle, CRIU_GROUP_MARK))


def read_criu_group(bundle: str) -> tuple[int, int, bool] | None:
    """(pgid, leader start time, lazy) of a restore or checkpoint in flight, as
    :func:`mark_criu_group` wrote: ``lazy``, the group is a lazy restore's lazy-pages
    daemon."""
    try:
        with open(os.path.join(bundle, CRIU_GROUP_MARK)) as f:
            pgid, start, *rest = f.read().split()
        return int(pgid), int(start), rest == ["lazy"]
    except (OSError, ValueError):
        return None


def clear_criu_group(bundle: str) -> None:
    try:
        os.unlink(os.path.join(bundle, CRIU_GROUP_MARK))
    except FileNotFoundError:
        return  # contextlib.suppress would cost delete an import


STOPPING_MARK = "cedana-stopping"


def mark_stopping(bundle: str, signal: int) -> None:
    """A stop signal is being turned into a checkpoint: the container is frozen until
    the checkpoint is durable. If the daemon dies meanwhile, ``delete`` reads this,
    thaws the container and delivers ``signal``, as would have happened without us."""
    tmp = os.path.join(bundle, f".{STOPPING_MARK}.tmp")
    with open(tmp, "w") as f:
        f.write(f"{signal}\n")
    os.rename(tmp, os.path.join(bundle, STOPPING_MARK))


def read_stopping(bundle: str) -> int | None:
    try:
        with open(os.path.join(bundle, STOPPING_MARK)) as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


def clear_stopping(bundle: str) -> None:
    try:
        os.unlink(os.path.join(bundle, STOPPING_MARK))
    except FileNotFoundError:
        return
