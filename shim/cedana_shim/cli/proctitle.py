"""What ``ps`` shows for a shim process: its command line and its name (comm).

A daemon forked from the fork server would otherwise show the server's command
line (``python -m cedana_shim.cli.forkserver ...``) and a cold-forked one its
``start`` command line. Both are named like the runc shim's daemons instead:
``containerd-shim-cedana-v2 -namespace NS -id ID -address A``.

The kernel reads /proc/<pid>/cmdline from the argv area at the top of the
process's stack. CPython copies argv at start-up and never reads that area
again, so it can be overwritten in place; moving or growing it needs
CAP_SYS_RESOURCE (prctl PR_SET_MM), so a title longer than the area is cut.
"""

from __future__ import annotations

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Sequence

    from .args import ShimArgs

SHIM_NAME = "containerd-shim-cedana-v2"
# Fields 48 and 49 of /proc/<pid>/stat (since Linux 3.5), counted from field 3.
_ARG_START, _ARG_END = 45, 46


def daemon_title(args: ShimArgs) -> list[str]:
    """The command line containerd would have given a daemon it started itself: the
    shim's path as containerd ran it (a daemon forked by ``start`` itself still knows
    it; one from the fork server shows the bare name)."""
    import os
    import sys

    program = sys.argv[0] if os.path.basename(sys.argv[0]) == SHIM_NAME else SHIM_NAME
    return [program, "-namespace", args.namespace, "-id", args.id, "-address", args.address]


def set_title(argv: Sequence[str]) -> bool:
    """Make /proc/self/cmdline read ``argv``; False where the area cannot be found."""
    import ctypes

    try:
        with open("/proc/self/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
        start, end = int(fields[_ARG_START]), int(fields[_ARG_END])
    except (OSError, IndexError, ValueError):
        return False
    size = end - start
    if start <= 0 or size <= 1:
        return False
    title = b"\0".join(arg.encode("utf-8", "surrogateescape") for arg in argv)[: size - 1]
    # NUL-padded to the end: the kernel then shows the arguments and nothing after.
    ctypes.memmove(start, title.ljust(size, b"\0"), size)
    return True


def set_name(name: str) -> None:
    """The process name (comm) that ``ps -e`` and ``pgrep`` show; at most 15 bytes."""
    try:
        with open("/proc/self/comm", "w") as f:
            f.write(name[:15])
    except OSError:
        pass
