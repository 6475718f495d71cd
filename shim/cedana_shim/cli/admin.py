"""``cedana``: the node admin CLI of cedana-shim.

Lists, inspects, removes and prunes the checkpoints in the node's store, and
checkpoints a running container on demand through its own shim. Expected
failures print ``cedana: <what went wrong>`` on stderr and exit 1; usage errors
exit 2; a traceback means a bug. Imports stay light here: each command pulls
in the store, asyncio or the ttrpc client only when it runs.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence

from cedana_shim import __version__, errors

from . import admin_archive, admin_remote
from .admin_common import ROOT_HINT, CliError, is_root

PROG = "cedana"
Handler = Callable[[argparse.Namespace], int]

_STORE_HELP = (
    "checkpoint store directory (default: store_path of the node config, "
    "/var/lib/cedana/checkpoints)"
)
_CONFIG_HELP = "node config file (default /etc/cedana/shim.toml; env CEDANA_CONFIG)"


class _Formatter(argparse.RawDescriptionHelpFormatter):
    def __init__(self, prog: str) -> None:
        super().__init__(prog, max_help_position=32)


def _nonnegative_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"{value} is negative")
    return value


def _positive_seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number of seconds") from None
    if not value > 0 or value == float("inf"):
        raise argparse.ArgumentTypeError(f"{text} must be a positive number of seconds")
    return value


def _globals() -> argparse.ArgumentParser:
    # SUPPRESS: an option given before the subcommand survives the subparser, one
    # given after it wins; both places work.
    common = argparse.ArgumentParser(add_help=False)
    group = common.add_argument_group("global options")
    group.add_argument("--store", metavar="PATH", default=argparse.SUPPRESS, help=_STORE_HELP)
    group.add_argument("--config", metavar="PATH", default=argparse.SUPPRESS, help=_CONFIG_HELP)
    return common


def _handler(name: str) -> Handler:
    """Resolve a command's function only when it runs (lazy imports)."""

    def run(args: argparse.Namespace) -> int:
        if name == "checkpoint":
            from .admin_checkpoint import cmd_checkpoint

            return cmd_checkpoint(args)
        if name == "doctor":
            from .admin_doctor import run_doctor

            return run_doctor(args)
        if name == "inspect":
            from .admin_inspect import cmd_inspect

            return cmd_inspect(args)
        from . import admin_store

        fn: Handler = getattr(admin_store, f"cmd_{name}")
        return fn(args)

    return run


def build_parser() -> argparse.ArgumentParser:
    common = _globals()
    parser = argparse.ArgumentParser(
        prog=PROG,
        formatter_class=_Formatter,
        parents=[common],
        description=(
            "Manage cedana-shim checkpoints on this node: list, inspect, remove and prune\n"
            "what is in the checkpoint store, and checkpoint a running container now."
        ),
        epilog=(
            "examples:\n"
            "  cedana checkpoints list\n"
            "  cedana checkpoints list --json --namespace team-a --label trainer\n"
            "  cedana checkpoints inspect 20261129T183000Z-3f9a1c2b --verify\n"
            "  cedana checkpoints prune --keep 2 --gc\n"
            "  cedana checkpoint my-container --leave-running\n"
            "\n"
            "Run `cedana COMMAND --help` for the options of a command."
        ),
    )
    parser.add_argument("--version", action="version", version=f"{PROG} {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", title="commands")

    ck = commands.add_parser(
        "checkpoint",
        parents=[common],
        formatter_class=_Formatter,
        help="checkpoint a running container now, through its shim",
        description=(
            "Checkpoint a running container through the cedana shim that runs it (the\n"
            "same pipeline as checkpoint-on-stop). By default the container stops once\n"
            "its checkpoint is written (exit status 143, as after SIGTERM); with\n"
            "--leave-running it keeps running and is paused only for the dump.\n"
            "The container must have opted in (CEDANA_ENABLE=1 or\n"
            "CEDANA_CHECKPOINT=<label> in its environment). Prints the checkpoint id;\n"
            "on a terminal, also a progress line while it runs."
        ),
        epilog=(
            "examples:\n"
            "  cedana checkpoint web-1 --leave-running\n"
            "  cedana checkpoint web-1 --namespace k8s.io --json\n"
            "  id=$(cedana checkpoint web-1)"
        ),
    )
    ck.add_argument("container_id", metavar="CONTAINER_ID", help="containerd container id")
    ck.add_argument(
        "-n",
        "--namespace",
        metavar="CTRD_NS",
        help="containerd namespace of the container (default: search all of them)",
    )
    ck.add_argument(
        "--leave-running",
        action="store_true",
        help="keep the container running after the checkpoint (default: it stops)",
    )
    ck.add_argument(
        "--containerd-state",
        metavar="DIR",
        default="/run/containerd",
        help="containerd's state directory, where task bundles live (default %(default)s)",
    )
    ck.add_argument(
        "--timeout",
        metavar="SECONDS",
        type=_positive_seconds,
        help="give up after this long; the shim abandons the checkpoint too "
        "(default: wait as long as the shim takes)",
    )
    ck.add_argument("--json", action="store_true", help="print the result as a JSON object")
    ck.set_defaults(handler=_handler("checkpoint"))

    from cedana_shim.controller import cli as controller_cli
    from cedana_shim.node import cli as node_cli
    from cedana_shim.slurm import cli as slurm_cli

    node_cli.register(commands)
    slurm_cli.register(commands)
    controller_cli.register(commands)

    doc = commands.add_parser(
        "doctor",
        parents=[common],
        formatter_class=_Formatter,
        help="check that this node can checkpoint and restore (CRIU, runc, store, GPUs)",
        description=(
            "Check what the shim relies on: CRIU >= 4.1 that passes `criu check`, runc,\n"
            "the checkpoint store's owner and mode, and on GPU nodes the NVIDIA driver,\n"
            "the CUDA checkpoint API or cuda-checkpoint, and the devices. Exits 1 when\n"
            "something required is missing, saying what to do."
        ),
    )
    doc.add_argument("--json", action="store_true", help="print the report as JSON")
    doc.set_defaults(handler=_handler("doctor"))

    cps = commands.add_parser(
        "checkpoints",
        parents=[common],
        formatter_class=_Formatter,
        help="list, inspect, remove, prune, repair, export and import stored checkpoints",
        description=(
            "Work with the checkpoints in this node's store. NAMESPACE is the scope of a\n"
            "label: the pod's Kubernetes namespace, or the containerd namespace outside\n"
            "Kubernetes. Checkpoint ids may be shortened to a unique prefix."
        ),
    )
    cps.set_defaults(handler=None, parser=cps)
    sub = cps.add_subparsers(dest="subcommand", metavar="SUBCOMMAND", title="subcommands")

    ls = sub.add_parser(
        "list",
        aliases=["ls"],
        parents=[common],
        formatter_class=_Formatter,
        help="list checkpoints, newest first",
        description=(
            "List checkpoints, newest first. STATE is raw (durable, not yet compressed)\n"
            "or compacted; RAW is the uncompressed images kept for it (a raw checkpoint,\n"
            "or the cache of the newest one of its label). STATUS names damage found\n"
            "cheaply while listing: a missing or corrupt manifest/config, a missing or\n"
            "truncated blob or raw file (sizes only); `inspect --verify` checks digests.\n"
            "--json prints a JSON array; each item has id, namespace, label, container,\n"
            "created (RFC 3339), size (bytes), state and rawBytes, plus layers and more."
        ),
    )
    ls.add_argument("-n", "--namespace", metavar="NS", help="only this namespace (label scope)")
    ls.add_argument("-l", "--label", metavar="L", help="only this label")
    out = ls.add_mutually_exclusive_group()
    out.add_argument("--json", action="store_true", help="print a JSON array")
    out.add_argument("-q", "--quiet", action="store_true", help="print only the ids")
    ls.set_defaults(handler=_handler("list"))

    ins = sub.add_parser(
        "inspect",
        parents=[common],
        formatter_class=_Formatter,
        help="show everything recorded about a checkpoint",
        description=(
            "Show a checkpoint's metadata: pod, container and image, why it was taken,\n"
            "its layers (stored and raw sizes), tool versions and network facts.\n"
            "--verify also checks every blob (sizes and sha256) and exits 1 if the\n"
            "checkpoint is damaged."
        ),
    )
    ins.add_argument("id", metavar="ID", help="checkpoint id (or a unique prefix)")
    ins.add_argument("--json", action="store_true", help="print a JSON object")
    ins.add_argument(
        "--verify", action="store_true", help="check every blob's size and digest (exit 1 if bad)"
    )
    ins.set_defaults(handler=_handler("inspect"))

    rm = sub.add_parser(
        "rm",
        aliases=["remove"],
        parents=[common],
        formatter_class=_Formatter,
        help="remove checkpoints",
        description=(
            "Remove checkpoints and free the blobs only they used. Prints each id removed;\n"
            "an id that is not found is reported and the others are still removed\n"
            "(exit status 1 if any was not found)."
        ),
    )
    rm.add_argument("ids", metavar="ID", nargs="+", help="checkpoint id (or a unique prefix)")
    rm.set_defaults(handler=_handler("rm"))

    pr = sub.add_parser(
        "prune",
        parents=[common],
        formatter_class=_Formatter,
        help="keep only the newest checkpoints of each namespace/label",
        description=(
            "Keep the newest N checkpoints of each (namespace, label) that matches the\n"
            "filters and remove the rest. --gc also deletes what no checkpoint uses:\n"
            "blobs of crashed commits, abandoned staging dirs, stale temp files."
        ),
        epilog="example:\n  cedana checkpoints prune --namespace team-a --keep 1 --gc",
    )
    pr.add_argument("-n", "--namespace", metavar="NS", help="only this namespace (label scope)")
    pr.add_argument("-l", "--label", metavar="L", help="only this label")
    pr.add_argument(
        "--keep",
        metavar="N",
        type=_nonnegative_int,
        required=True,
        help="checkpoints to keep per namespace/label (0 removes all that match)",
    )
    pr.add_argument("--gc", action="store_true", help="also free unreferenced data; report bytes")
    pr.add_argument("--json", action="store_true", help="print what was removed as JSON")
    pr.set_defaults(handler=_handler("prune"))

    rp = sub.add_parser(
        "repair",
        parents=[common],
        formatter_class=_Formatter,
        help="rebuild a damaged or missing index.json",
        description=(
            "Rebuild the store's index.json from the checkpoints' blobs and raw files when\n"
            "it is missing or damaged (the damaged file is kept as\n"
            "index.json.damaged-<time>). Prints what was recovered and what was dropped,\n"
            "and why. An intact index is left alone. Shims repair a damaged index by\n"
            "themselves the next time they write a checkpoint."
        ),
    )
    rp.add_argument("--json", action="store_true", help="print the report as JSON")
    rp.set_defaults(handler=_handler("repair"))
    admin_remote.register(sub, common, _Formatter)  # list --remote, push, pull, sync
    admin_archive.register(sub, common, _Formatter)  # export, import
    return parser


def _error(message: str) -> None:
    sys.stderr.write(f"{PROG}: {message}\n")


def _run(handler: Handler, args: argparse.Namespace) -> int:
    try:
        status = handler(args)
        sys.stdout.flush()  # a closed pipe shows here, not as noise at interpreter exit
        return status
    except CliError as err:
        _error(str(err))
        return err.status
    except errors.ShimError as err:
        _error(str(err) or type(err).__name__)
        return 1
    except BrokenPipeError:
        # `cedana checkpoints list | head`: stop quietly, as a tool killed by SIGPIPE.
        try:
            devnull = os.open(os.devnull, os.O_WRONLY)
            os.dup2(devnull, sys.stdout.fileno())
        except (OSError, ValueError, AttributeError):
            pass
        return 141
    except PermissionError as err:
        where = f"{err.filename}: " if err.filename else ""
        hint = f"; {ROOT_HINT}" if not is_root() else ""
        _error(f"{where}{err.strerror or 'permission denied'}{hint}")
        return 1
    except OSError as err:
        _error(str(err))
        return 1
    except KeyboardInterrupt:
        sys.stderr.write(f"\n{PROG}: interrupted\n")
        return 130


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    try:
        args = parser.parse_args(sys.argv[1:] if argv is None else list(argv))
    except SystemExit as exit_:  # --help, --version (0) and usage errors (2)
        code = exit_.code
        return code if isinstance(code, int) else 0 if code is None else 2
    handler: Handler | None = getattr(args, "handler", None)
    if handler is None:
        sub: argparse.ArgumentParser = getattr(args, "parser", parser)
        sub.print_usage(sys.stderr)
        _error(f"{'a subcommand' if sub is not parser else 'a command'} is required (see --help)")
        return 2
    return _run(handler, args)


if __name__ == "__main__":
    sys.exit(main())
