"""The ``cedana slurm`` command line.

``register(subparsers)`` adds ``slurm`` to the ``cedana`` admin CLI: ``install``,
``uninstall`` and ``status`` (this node's Slurm side, see :mod:`.install`) and the
job commands of :mod:`.jobs_cli`. Each subcommand sets ``handler`` as the admin
CLI's own commands do; errors are ``cedana_shim.errors`` classes, which the admin
CLI prints as ``cedana: <message>`` (exit 1).
"""

from __future__ import annotations

import argparse
import json
from typing import Any

from .jobs_cli import register_job_commands

_DESCRIPTION = """\
Checkpoint Slurm batch jobs that opt in with CEDANA_ENABLE=1 or CEDANA_CHECKPOINT=<label>
in their environment (e.g. #SBATCH --export=ALL,CEDANA_ENABLE=1,CEDANA_CHECKPOINT=run1).
install puts a SPANK plugin on a worker (built here against Slurm's headers) and one
line in plugstack.conf; uninstall gives every file back byte for byte. No Slurm
restart is needed: each new job step reads plugstack.conf."""


def _slurm_conf_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--slurm-conf",
        metavar="PATH",
        help="slurm.conf (default: SLURM_CONF, else the one Slurm's commands read)",
    )
    p.add_argument(
        "--prefix",
        default="/usr/local/lib/cedana",
        metavar="DIR",
        help="where the plugin and the install record go (default %(default)s)",
    )
    p.add_argument("--json", action="store_true", help="print the result as JSON")


def register(subparsers: Any) -> None:
    """Add ``slurm`` and its subcommands to an argparse subparsers object."""
    slurm = subparsers.add_parser(
        "slurm",
        help="checkpoint Slurm jobs: install on a node, checkpoint and restore jobs",
        description=_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=(
            "examples:\n"
            "  cedana slurm install --node-role worker\n"
            "  cedana slurm install --node-role controller --slurm-conf /etc/slurm/slurm.conf\n"
            "  cedana slurm install --node-role controller --node-role worker   # one node\n"
            "  cedana slurm status --json\n"
            "  cedana slurm uninstall"
        ),
    )
    slurm.set_defaults(handler=None, parser=slurm)
    sub = slurm.add_subparsers(dest="slurm_command", metavar="SUBCOMMAND", title="subcommands")

    p = sub.add_parser(
        "install",
        help="install the Slurm side of this node (idempotent)",
        description="controller: nothing unless configless (then the plugstack line and "
        "`scontrol reconfigure`); worker: the SPANK plugin and its plugstack line; "
        "login: nothing. A node with several roles gets what each needs: repeat "
        "--node-role, or install again with another; the roles add up.",
    )
    p.add_argument(
        "--node-role",
        required=True,
        action="append",
        choices=("controller", "worker", "login"),
        help="this node's role; repeat it for each role a node has",
    )
    _slurm_conf_args(p)
    p.add_argument(
        "--runner",
        metavar="PATH",
        help="the job runner the plugin hands over to (default: cedana-slurm-task "
        "beside this cedana, else on PATH)",
    )
    p.add_argument(
        "--shim-config",
        metavar="PATH",
        help="the node config the runner reads (default: its own, /etc/cedana/shim.toml); "
        "written on the plugstack line, never taken from the job's environment",
    )
    p.add_argument(
        "--slurm-include",
        default="/usr/include",
        metavar="DIR",
        help="directory holding slurm/spank.h (default %(default)s)",
    )
    p.set_defaults(handler=_install)

    p = sub.add_parser("uninstall", help="remove what install added; restore every file")
    _slurm_conf_args(p)
    p.set_defaults(handler=_uninstall)

    p = sub.add_parser("status", help="show what is installed (exit 1 on a problem)")
    _slurm_conf_args(p)
    p.set_defaults(handler=_status)

    register_job_commands(sub)


def _options(args: argparse.Namespace, **extra: Any) -> Any:
    from .install import Options

    return Options(slurm_conf=args.slurm_conf, prefix=args.prefix, **extra)


def _print(report: Any, as_json: bool) -> int:
    print(json.dumps(report.to_json(), indent=2) if as_json else report.render())
    return 0


def _install(args: argparse.Namespace) -> int:
    from .install import install

    opts = _options(
        args,
        roles=tuple(args.node_role),
        runner=args.runner,
        shim_config=args.shim_config,
        include_dir=args.slurm_include,
    )
    return _print(install(opts), args.json)


def _uninstall(args: argparse.Namespace) -> int:
    from .install import uninstall

    return _print(uninstall(_options(args)), args.json)


def _status(args: argparse.Namespace) -> int:
    from .install import render_status, status

    info = status(_options(args))
    print(json.dumps(info, indent=2) if args.json else render_status(info))
    return 0 if info["ok"] else 1
