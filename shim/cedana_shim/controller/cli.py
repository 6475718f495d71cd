"""``cedana controller run``: the dashboard's server (the chart's cedana-controller)."""

from __future__ import annotations

import argparse
import logging
import os
import sys
from collections.abc import Sequence
from typing import Any

SA_TOKEN = "/var/run/secrets/kubernetes.io/serviceaccount/token"


def register(subparsers: Any) -> None:
    controller = subparsers.add_parser(
        "controller",
        help="the cluster's dashboard and its JSON API (the chart's cedana-controller)",
        description="Serve the dashboard: every node's checkpoints in one place, and "
        "checkpoints, pins, deletions, copies and migrations driven from it.",
    )
    controller.set_defaults(handler=run, controller_parser=controller, controller_command=None)
    sub = controller.add_subparsers(dest="controller_command", metavar="SUBCOMMAND")
    p = sub.add_parser("run", help="serve the dashboard until SIGTERM")
    p.add_argument(
        "--address", default="0.0.0.0", metavar="ADDR", help="listen here (default %(default)s)"
    )
    p.add_argument(
        "--port", type=int, default=8080, metavar="PORT", help="the UI and API (default 8080)"
    )
    p.add_argument(
        "--agents-namespace",
        default=os.environ.get("POD_NAMESPACE", "cedana-system"),
        metavar="NS",
        help="namespace of the node agents' pods (default: env POD_NAMESPACE)",
    )
    p.add_argument(
        "--agents-selector",
        default="app.kubernetes.io/component=helper",
        metavar="SELECTOR",
        help="label selector of the node agents' pods (default %(default)s)",
    )
    p.add_argument(
        "--agent-port",
        type=int,
        default=9465,
        metavar="PORT",
        help="the port the node agents serve their API on (their --agent-port; default 9465)",
    )
    p.add_argument(
        "--token-file",
        default=SA_TOKEN,
        metavar="FILE",
        help="this controller's ServiceAccount token, shown to the agents (default %(default)s)",
    )
    p.add_argument("--kubeconfig", metavar="FILE", help="default: in-cluster credentials")
    p.add_argument("--kube-api", metavar="URL", help="API server URL without credentials")


def run(args: argparse.Namespace) -> int:
    if args.controller_command != "run":
        args.controller_parser.print_usage(sys.stderr)
        print("cedana controller: a subcommand is required (run)", file=sys.stderr)
        return 2
    from ..node.http_server import HttpServer
    from ..node.manager import Stop
    from .access import Access
    from .agents import Agents
    from .api import ControllerApi
    from .kube import ControllerKube
    from .op_store import ConfigMapOperations
    from .operations import Operations
    from .service import Dashboard

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")

    def token() -> str:
        with open(args.token_file) as f:
            return f.read().strip()

    try:
        token()
    except OSError as err:
        print(
            f"cedana controller: cannot read the ServiceAccount token {args.token_file}: "
            f"{err.strerror or err}; run in a pod with a ServiceAccount, or pass --token-file",
            file=sys.stderr,
        )
        return 1
    api = ControllerKube(kubeconfig=args.kubeconfig, api_url=args.kube_api)
    agents = Agents(
        api, token, namespace=args.agents_namespace, selector=args.agents_selector,
        port=args.agent_port,
    )  # fmt: skip
    # Operations are kept in a ConfigMap of the controller's own namespace (op_store.py).
    operations = Operations(ConfigMapOperations(api, args.agents_namespace))
    dashboard = Dashboard(api, Access(api), agents, operations=operations)
    try:
        server = HttpServer(ControllerApi(dashboard), args.address, args.port, name="controller")
    except OSError as err:
        print(
            f"cedana controller: cannot listen on {args.address} port {args.port}: "
            f"{err.strerror or err}; choose another --address or --port",
            file=sys.stderr,
        )
        return 1
    stop = Stop()
    stop.install_handlers()
    server.start()
    logging.getLogger("cedana.controller").info("dashboard on %s", server.url)
    stop.event.wait()
    server.close()
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m cedana_shim.controller run ...``."""
    parser = argparse.ArgumentParser(prog="cedana")
    register(parser.add_subparsers(dest="command"))
    args = parser.parse_args(["controller", *(sys.argv[1:] if argv is None else argv)])
    return run(args)
