"""Values shared by the rootfs diff modules: counts, limits and the OCI names.

Paths inside these modules are ``bytes`` relative to the layer root, because
file names are bytes on Linux and the tar format stores bytes: nothing is ever
decoded on the way from an upperdir to an archive and back, so a name that is
not UTF-8 survives unchanged.
"""

from __future__ import annotations

import errno
import os
from dataclasses import dataclass
from typing import Final

from cedana_shim import errors

WHITEOUT_PREFIX: Final = b".wh."
OPAQUE_MARKER: Final = b".wh..wh..opq"
PATH_MAX: Final = 4095
NAME_MAX: Final = 255

# Extended attributes a diff carries. security.capability is what lets
# `ping` or a file-capability binary work without setuid; ACLs and user.*
# are ordinary data. Left out on purpose: trusted.* (host-private, and
# trusted.overlay.* would corrupt the overlay it is written to) and
# security.selinux/smack/ima (labels belong to the node and the new container's
# context, not to the old container's files).
_XATTR_EXACT: Final = frozenset(
    {b"security.capability", b"system.posix_acl_access", b"system.posix_acl_default"}
)


def xattr_allowed(name: bytes) -> bool:
    """Whether an extended attribute is captured and accepted on apply.

    A name with ``=`` cannot be carried: a pax record is ``key=value`` and
    readers split at the first ``=``.
    """
    if name in _XATTR_EXACT:
        return True
    return (
        name.startswith(b"user.")
        and len(name) > len(b"user.")
        and not name.startswith(b"user.overlay.")
        and b"=" not in name
    )


@dataclass(frozen=True, slots=True)
class DiffStats:
    """What a capture wrote or an apply did.

    ``files`` counts regular files and hard links, ``deletions`` whiteouts and
    opaque markers, ``bytes`` file content. ``skipped`` counts what a capture
    could not carry (sockets, FIFOs, device nodes, names overlayfs would read
    as whiteouts); each one is logged with its path.
    """

    files: int = 0
    dirs: int = 0
    symlinks: int = 0
    deletions: int = 0
    bytes: int = 0
    skipped: int = 0


@dataclass(slots=True)
class Counter:
    """Mutable tally behind a :class:`DiffStats`."""

    files: int = 0
    dirs: int = 0
    symlinks: int = 0
    deletions: int = 0
    size: int = 0
    skipped: int = 0

    def freeze(self) -> DiffStats:
        return DiffStats(
            self.files, self.dirs, self.symlinks, self.deletions, self.size, self.skipped
        )


@dataclass(frozen=True, slots=True)
class Limits:
    """Bounds on an archive an apply accepts; beyond them it refuses the archive.

    The defaults are far above any real container layer and well below what
    would exhaust a node. Memory while applying is about 450 bytes per
    member (the validated plan is kept so headers are read exactly once).
    """

    max_members: int = 500_000
    max_member_bytes: int = 64 << 30
    max_total_bytes: int = 512 << 30
    max_archive_bytes: int = 600 << 30
    # Directory nesting. Each level holds an open descriptor while walking, and
    # an apply walks up to three paths at once: keep 3 * this under RLIMIT_NOFILE.
    max_depth: int = 256
    # One pax or GNU long-name header, read whole into memory.
    max_header_bytes: int = 1 << 20
    max_xattr_bytes: int = 64 << 10


DEFAULT_LIMITS: Final = Limits()


def show(path: bytes) -> str:
    """A layer-relative path as the container sees it, for messages."""
    return "/" + path.decode("utf-8", "backslashreplace")


def os_error(err: OSError, doing: str) -> errors.ShimError:
    """An OSError met while ``doing`` something, as the class a caller can act on."""
    code = err.errno or 0
    cls: type[errors.ShimError] = errors.Internal
    hint = ""
    if code in (errno.ENOSPC, errno.EDQUOT):
        cls, hint = errors.ResourceExhausted, "; free space on that filesystem and retry"
    elif code in (errno.EPERM, errno.EACCES, errno.EROFS):
        cls, hint = errors.PermissionDenied, "; the shim must run as root on a writable path"
    elif code == errno.ENOENT:
        cls = errors.NotFound
    where = f" ({os.fsdecode(err.filename)})" if isinstance(err.filename, str | bytes) else ""
    return cls(f"rootfs diff: {doing}{where}: {os.strerror(code)}{hint}")


class ArchiveRefused(errors.InvalidArgument):
    """A member breaks a rule; ``detail`` names the member and the rule alone, for a
    caller that reads a tar of another kind (a checkpoint archive) to word its own."""

    def __init__(self, message: str, detail: str) -> None:
        super().__init__(message)
        self.detail = detail


class ArchiveCorrupt(errors.DataLoss):
    """The archive itself is damaged (``detail``: where and how)."""

    def __init__(self, message: str, detail: str) -> None:
        super().__init__(message)
        self.detail = detail


def refuse(name: bytes, rule: str) -> ArchiveRefused:
    """An archive member breaking ``rule``: the whole archive is refused unapplied."""
    detail = f"member {show(name)!r} {rule}"
    return ArchiveRefused(
        f"rootfs diff refused, nothing was applied: {detail}. The "
        "archive is damaged or crafted; restore from another checkpoint or start afresh",
        detail,
    )


def open_dir(path: str, what: str) -> int:
    """A descriptor of the directory a capture reads or an apply writes into."""
    try:
        return os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except FileNotFoundError as err:
        raise errors.NotFound(f"{what} {path} does not exist") from err
    except NotADirectoryError as err:
        raise errors.InvalidArgument(f"{what} {path} is not a directory") from err
    except OSError as err:
        raise os_error(err, f"opening {what}") from err
