"""Entry point of ``containerd-shim-cedana-v2``.

``start`` and ``delete`` are short commands that write one answer to stdout and
exit; without an action the process is the long-lived daemon (normally forked
by ``start``, so this path runs only when started by hand with ``-socket``).
Imports stay inside the branches: each path pays only for what it uses.
"""

from __future__ import annotations

import os
import sys

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import NoReturn

STDIN_LIMIT = 10 << 20
_daemon_ran = False


def _read_stdin() -> bytes:
    try:
        if os.isatty(0):
            return b""
        data = sys.stdin.buffer.read(STDIN_LIMIT + 1)
    except (OSError, ValueError):
        return b""
    if len(data) > STDIN_LIMIT:
        raise SystemExit(f"start: options on stdin exceed {STDIN_LIMIT} bytes")
    return data


def main(argv: list[str] | None = None) -> int:
    from .args import UsageError, parse_args

    try:
        args = parse_args(sys.argv[1:] if argv is None else argv)
    except UsageError as err:
        sys.stderr.write(f"containerd-shim-cedana-v2: {err}\n")
        return 2
    if args.version:
        from .. import __version__

        sys.stdout.write(f"containerd-shim-cedana-v2:\n  Version: {__version__}\n")
        return 0
    if args.info:
        from .info import run_info

        return run_info(_read_stdin())
    if args.action == "start":
        from .start import StartError, run_start

        try:
            return run_start(args, _read_stdin())
        except (StartError, OSError) as err:
            sys.stderr.write(f"cedana shim start for container {args.id}: {err}\n")
            return 1
    if args.action == "delete":
        from .delete import run_delete

        return run_delete(args)
    if args.action == "":
        if not args.namespace:
            sys.stderr.write("containerd-shim-cedana-v2: shim namespace cannot be empty\n")
            return 2
        from .daemon import run_daemon

        global _daemon_ran
        _daemon_ran = True
        return run_daemon(args, b"")
    sys.stderr.write(f"containerd-shim-cedana-v2: unknown action {args.action!r}\n")
    return 2


def launch() -> NoReturn:
    """The launcher's entry point: :func:`main`, then exit.

    The one-shot commands (``start``, ``delete``, ``-info``, ``-v``) end with
    ``os._exit`` once their output is flushed: the interpreter's teardown would cost
    ``start`` more instructions than all of its imports (callgrind: ~7.6 M against
    ~6.7 M), and they leave nothing that needs it (no threads, no open files to flush).
    The daemon started by hand exits normally.
    """
    code = main()
    if _daemon_ran:
        sys.exit(code)
    try:
        sys.stdout.flush()
        sys.stderr.flush()
    except (OSError, ValueError):
        code = 120  # what the interpreter exits with when its own final flush fails
    os._exit(code)


if __name__ == "__main__":
    sys.exit(main())
