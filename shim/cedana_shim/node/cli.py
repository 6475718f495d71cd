"""The ``cedana node`` command line.

``register(subparsers)`` adds ``node`` to the ``cedana`` admin CLI and ``run(args)``
executes it; ``python -m cedana_shim.node`` runs the same commands on their own.
Exit status: 0 done (``status``: all good), 1 a failure the message explains (or
``status`` found a problem), 2 a usage error.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
from collections.abc import Callable, Sequence
from typing import Any

from . import registration as reg

_DESCRIPTION = """\
Install cedana-shim on this node (or on the host mounted at --host-root), remove it
again, or show what is installed. install: the Python environment under /opt/cedana,
the shim on containerd's PATH (/usr/local/bin), CRIU >= 4.1 (checked), the node config
(/etc/cedana/shim.toml), the 'cedana' runtime in containerd's config (a drop-in
through `imports` where that is safe, otherwise a marked, backed-up block in the
config), a containerd restart only when the config changed, and a CRI check that the
handler answers. uninstall puts every file back exactly as it was."""


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--host-root",
        default="/",
        metavar="DIR",
        help="the host's root directory (default /; /host in the DaemonSet)",
    )
    p.add_argument(
        "--containerd-config",
        default="/etc/containerd/config.toml",
        metavar="PATH",
        help="containerd's main config, a host path (default %(default)s)",
    )
    p.add_argument(
        "--containerd-bin",
        metavar="PATH",
        help="containerd binary, a host path (default: found in /usr/local/bin, /usr/bin)",
    )
    p.add_argument(
        "--containerd-socket",
        metavar="PATH",
        help="containerd's socket as this command sees it "
        "(default: [grpc] address of the config, under --host-root)",
    )
    p.add_argument(
        "--prefix",
        default="/opt/cedana",
        metavar="PATH",
        help="where the Python environment goes, a host path (default %(default)s)",
    )
    p.add_argument(
        "--bin-dir",
        default="/usr/local/bin",
        metavar="PATH",
        help="directory on containerd's PATH for the launchers (default %(default)s)",
    )
    p.add_argument(
        "--shim-config",
        default=reg.DEFAULT_SHIM_CONFIG,
        metavar="PATH",
        help=(
            "the node config's host path (default %(default)s; another path only on "
            "containerd 1.6, where it is the handler's ConfigPath)"
        ),
    )
    p.add_argument("--json", action="store_true", help="print the result as JSON")


def _install_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--payload",
        metavar="DIR",
        help="a payload made by `cedana node bundle` (default: build one from "
        "the Python running this command)",
    )
    p.add_argument(
        "--restart-command",
        default="systemctl restart containerd",
        metavar="CMD",
        help="shell command that restarts containerd (default: %(default)s)",
    )
    p.add_argument(
        "--set",
        dest="settings",
        action="append",
        default=[],
        metavar="KEY=VALUE",
        help="a node config setting (store_path, compression_level, ...); repeatable",
    )
    p.add_argument(
        "--shim-config-file",
        metavar="FILE",
        help="install this file as the node config instead of --set values",
    )
    p.add_argument(
        "--criu-source",
        metavar="FILE",
        help="a CRIU >= 4.1 binary to install as /usr/local/sbin/criu if the node has none",
    )
    p.add_argument(
        "--keys-source",
        metavar="DIR",
        help="a directory of PEM key files (the chart's keys Secret), each installed as "
        "/etc/cedana/keys/<name> (0600) for signing_key, trusted_keys, encryption_keys and "
        "decryption_keys",
    )
    p.add_argument(
        "--registry-auth-source",
        metavar="FILE",
        help="a docker config.json with the checkpoint registry's credentials, installed "
        "as /etc/cedana/registry-auth.json (0600); set registry_auth_file to that path",
    )
    p.add_argument(
        "--skip-criu-check",
        action="store_true",
        help="install even without CRIU >= 4.1 (checkpoints will fail)",
    )
    p.add_argument(
        "--default-runtime",
        action=argparse.BooleanOptionalAction,
        default=True,
        help="make 'cedana' containerd's default CRI runtime, so CEDANA_CHECKPOINT alone "
        "opts a container in; pods naming another RuntimeClass keep it (default: on)",
    )
    p.add_argument(
        "--runc-binary",
        metavar="PATH",
        help="the runc binary the 'cedana' handler runs (containerd's BinaryName), e.g. "
        "/usr/bin/nvidia-container-runtime for the NVIDIA toolkit's GPU device injection "
        "(default: runc; containerd >= 1.7)",
    )
    p.add_argument(
        "--no-dropin",
        action="store_true",
        help="always edit containerd's config instead of writing a drop-in",
    )
    p.add_argument(
        "--verify",
        choices=("none", "handler", "pod"),
        default="pod",
        help="after a change: none; handler (CRI lists it); pod (also runs a "
        "pod sandbox and a container with it) (default %(default)s)",
    )
    p.add_argument(
        "--probe-image",
        metavar="IMAGE",
        help="image for the probe container (default: the sandbox image)",
    )
    p.add_argument(
        "--timeout",
        type=float,
        default=120.0,
        metavar="SECONDS",
        help="how long restarts and CRI checks may take (default %(default)s)",
    )
    p.add_argument(
        "--kubelet-runtime-request-timeout",
        metavar="DURATION",
        help="set kubelet's runtimeRequestTimeout (e.g. 10m: restores of large "
        "checkpoints outlast the default 2m) and restart kubelet",
    )
    p.add_argument(
        "--kubelet-config",
        default="/var/lib/kubelet/config.yaml",
        metavar="PATH",
        help="kubelet's config file, a host path (default %(default)s)",
    )
    p.add_argument(
        "--kubelet-restart-command",
        default="systemctl restart kubelet",
        metavar="CMD",
        help="shell command that restarts kubelet",
    )


def register(subparsers: Any) -> None:
    """Add ``node`` and its subcommands to an argparse subparsers object."""
    node = subparsers.add_parser(
        "node",
        help="install, remove or inspect cedana-shim on this node",
        description=_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=(
            "examples:\n"
            "  cedana node install\n"
            "  cedana node install --set store_path=/data/ckpt --set compression_level=5\n"
            "  cedana node status --json\n"
            "  cedana node uninstall\n"
            "  cedana node run --host-root /host      # the DaemonSet helper"
        ),
    )
    # `handler`: what the admin CLI's main() dispatches to, as for its own commands.
    node.set_defaults(handler=run, node_parser=node, node_command=None)
    sub = node.add_subparsers(dest="node_command", metavar="SUBCOMMAND", title="subcommands")

    p = sub.add_parser("install", help="install or update cedana-shim on the node")
    _common(p)
    _install_args(p)

    p = sub.add_parser("uninstall", help="remove what install added; restore every file")
    _common(p)
    p.add_argument("--restart-command", default="systemctl restart containerd", metavar="CMD")
    p.add_argument("--kubelet-config", default="/var/lib/kubelet/config.yaml", metavar="PATH")
    p.add_argument("--kubelet-restart-command", default="systemctl restart kubelet", metavar="CMD")
    p.add_argument("--timeout", type=float, default=120.0, metavar="SECONDS")
    p.add_argument(
        "--verify",
        choices=("none", "handler"),
        default="handler",
        help="none: do not ask CRI (no running-pod check, no wait after restart)",
    )
    p.add_argument(
        "--force", action="store_true", help="uninstall even while pods run with the cedana runtime"
    )

    p = sub.add_parser("status", help="show what is installed and whether the handler answers")
    _common(p)
    p.add_argument("--no-cri", action="store_true", help="do not ask containerd's CRI")
    p.add_argument("-q", "--quiet", action="store_true", help="print nothing; exit 0 when ok")

    p = sub.add_parser("bundle", help="build the self-contained environment from this Python")
    p.add_argument("output", metavar="DIR", help="a new directory for the payload")
    p.add_argument("--json", action="store_true")

    p = sub.add_parser(
        "run",
        help="DaemonSet helper: taint, install, then keep the taint in step with readiness",
    )
    _common(p)
    _install_args(p)
    p.add_argument(
        "--node-name",
        default=os.environ.get("NODE_NAME"),
        metavar="NAME",
        help="this node's name (default: env NODE_NAME)",
    )
    p.add_argument(
        "--namespace",
        default=os.environ.get("POD_NAMESPACE", "cedana-system"),
        help="namespace of the helper/health-check pods (default: env POD_NAMESPACE)",
    )
    p.add_argument(
        "--helper-selector",
        default="app.kubernetes.io/component=helper",
        metavar="SELECTOR",
        help="label selector of the helper pods",
    )
    p.add_argument(
        "--health-selector",
        default="app.kubernetes.io/component=health-check",
        metavar="SELECTOR",
        help="label selector of the health-check pods",
    )
    p.add_argument("--interval", type=float, default=10.0, metavar="SECONDS")
    p.add_argument("--reinstall-interval", type=float, default=600.0, metavar="SECONDS")
    p.add_argument(
        "--metrics-port",
        type=int,
        default=9464,
        metavar="PORT",
        help="serve Prometheus metrics on this port, /metrics (default %(default)s; 0: none)",
    )
    p.add_argument(
        "--metrics-address",
        default="127.0.0.1",
        metavar="ADDR",
        help="the address metrics are served on (default %(default)s: this host only; the "
        "chart passes the pod's IP, where Prometheus scrapes)",
    )
    p.add_argument(
        "--agent-port",
        type=int,
        default=0,
        metavar="PORT",
        help="serve the node agent's API to the cedana controller on this port (default "
        "%(default)s: none; the chart passes 9465)",
    )
    p.add_argument(
        "--agent-address",
        default="127.0.0.1",
        metavar="ADDR",
        help="the address the agent's API is served on (the chart passes the pod's IP)",
    )
    p.add_argument(
        "--controller-user",
        default="system:serviceaccount:cedana-system:cedana-controller",
        metavar="USER",
        help="the only user (by TokenReview) the agent's API answers (default %(default)s)",
    )
    p.add_argument(
        "--containerd-state",
        default="/run/containerd",
        metavar="DIR",
        help="containerd's state directory on the host, where the shims' addresses are "
        "(default %(default)s)",
    )
    p.add_argument("--kubeconfig", metavar="FILE", help="default: in-cluster credentials")
    p.add_argument("--kube-api", metavar="URL", help="API server URL without credentials")
    p.add_argument(
        "--uninstall",
        action="store_true",
        help="instead: taint and unlabel the node, uninstall, then idle",
    )


def _options(args: argparse.Namespace, **extra: Any) -> Any:
    from .installer import Options, settings_from

    common: dict[str, Any] = {
        "host_root": args.host_root,
        "prefix": args.prefix,
        "bin_dir": args.bin_dir,
        "containerd_config": args.containerd_config,
        "containerd_bin": args.containerd_bin,
        "containerd_socket": args.containerd_socket,
        "shim_config": args.shim_config,
    }
    if hasattr(args, "payload"):
        common.update(
            payload=args.payload,
            restart_command=args.restart_command,
            shim_settings=settings_from(args.settings),
            shim_config_file=args.shim_config_file,
            criu_source=args.criu_source,
            registry_auth_source=args.registry_auth_source,
            keys_source=args.keys_source,
            require_criu=not args.skip_criu_check,
            allow_dropin=not args.no_dropin,
            default_runtime=args.default_runtime,
            runc_binary=args.runc_binary,
            verify=args.verify,
            probe_image=args.probe_image,
            timeout=args.timeout,
            kubelet_timeout=args.kubelet_runtime_request_timeout,
            kubelet_config=args.kubelet_config,
            kubelet_restart_command=args.kubelet_restart_command,
            log=lambda msg: print(f"cedana node: {msg}", file=sys.stderr),
        )
    common.update(extra)
    return Options(**common)


def _print_report(report: Any, as_json: bool) -> int:
    if as_json:
        print(json.dumps(report.to_json(), indent=2))
    else:
        print(report.render())
    if not report.ok:
        print(f"cedana node {report.action}: {report.error}", file=sys.stderr)
    return 0 if report.ok else 1


def run(args: argparse.Namespace) -> int:
    """Execute a parsed ``cedana node ...`` command; returns the exit status."""
    from .report import NodeError
    from .settings import SettingsError

    command = getattr(args, "node_command", None)
    if command is None:
        args.node_parser.print_usage(sys.stderr)
        print("cedana node: a subcommand is required (see --help)", file=sys.stderr)
        return 2
    try:
        if command == "install":
            from .installer import install

            return _print_report(install(_options(args)), args.json)
        if command == "uninstall":
            from .uninstaller import uninstall

            opts = _options(
                args,
                restart_command=args.restart_command,
                kubelet_config=args.kubelet_config,
                kubelet_restart_command=args.kubelet_restart_command,
                timeout=args.timeout,
                verify=args.verify,
                force=args.force,
            )
            return _print_report(uninstall(opts), args.json)
        if command == "status":
            return _status(args)
        if command == "bundle":
            return _bundle(args)
        if command == "run":
            return _run_helper(args)
    except (NodeError, SettingsError) as err:
        print(f"cedana node {command}: {err}", file=sys.stderr)
        return 1
    raise AssertionError(f"unknown node command {command}")


def _status(args: argparse.Namespace) -> int:
    from .status import render, status

    info = status(_options(args), check_cri=not args.no_cri)
    if args.json:
        print(json.dumps(info, indent=2))
    elif not args.quiet:
        print(render(info))
    return 0 if info["ok"] else 1


def _bundle(args: argparse.Namespace) -> int:
    from .payload import PayloadError, build

    try:
        manifest = build(args.output)
    except PayloadError as err:
        print(f"cedana node bundle: {err}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(manifest.to_json(), indent=2))
    else:
        print(f"{args.output}: cedana-shim {manifest.version}, Python {manifest.python}")
        for note in manifest.notes:
            print(f"note: {note}")
    return 0


def _run_helper(args: argparse.Namespace) -> int:
    from .cri import CriClient, CriError
    from .hostfs import HostRoot
    from .installer import install, socket_path
    from .kube import KubernetesApi
    from .manager import Selectors, Stop, TaintController, in_background, run_loop
    from .taint import Local
    from .uninstaller import uninstall

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    if not args.node_name:
        print("cedana node run: --node-name (or env NODE_NAME) is required", file=sys.stderr)
        return 2
    api = KubernetesApi(kubeconfig=args.kubeconfig, api_url=args.kube_api)
    selectors = Selectors(args.namespace, args.helper_selector, args.health_selector)
    controller = TaintController(api, args.node_name, selectors)
    stop = Stop()
    stop.install_handlers()
    opts = _options(args)

    if args.uninstall:
        controller.reconcile(Local(False, False), uninstalling=True)
        code = _print_report(uninstall(opts), args.json)
        stop.event.wait()
        return code

    def do_install() -> bool:
        return _print_report(install(opts), args.json) == 0

    def handler_ok() -> bool:
        host = HostRoot(opts.host_root)
        sock = opts.containerd_socket or socket_path(host, None, _main_config(opts))
        try:
            with CriClient(sock) as client:
                return client.status().registered
        except CriError:
            return False

    def pending_pushes() -> None:
        from .pending_pushes import push_pending

        push_pending(HostRoot(opts.host_root), opts.shim_config)

    history = _agent_api(args, api, opts, controller, stop)
    in_background(
        _observer(args, api, opts, history), interval=args.interval, stop=stop, name="observer"
    )
    return run_loop(
        controller,
        do_install,
        handler_ok,
        interval=args.interval,
        reinstall_interval=args.reinstall_interval,
        stop=stop,
        chores=(pending_pushes,),
    )


def _agent_api(args: argparse.Namespace, api: Any, opts: Any, taints: Any, stop: Any) -> Any:
    """Start the agent's API for the controller (``--agent-port``) and the namespace
    policies' applier beside it; returns the history of finished operations that the
    observer fills (and the API shows)."""
    from collections import deque

    from .agent_api import HISTORY, AgentApi, TokenCheck
    from .cri import CriClient, CriError
    from .hostfs import HostRoot
    from .http_server import HttpServer
    from .installer import socket_path
    from .manager import in_background
    from .ops_spool import node_store
    from .policies import PolicyApplier
    from .report import NodeError
    from .shim_checkpoint import ShimCallError, checkpoint, shim_address

    history: deque[dict[str, Any]] = deque(maxlen=HISTORY)
    if not args.agent_port:
        return history
    host = HostRoot(opts.host_root)
    state_dir = host.path(args.containerd_state)

    def find_container(namespace: str, pod: str, container: str) -> str:
        sock = opts.containerd_socket or socket_path(host, None, _main_config(opts))
        try:
            with CriClient(sock) as client:
                return client.find_container(namespace, pod, container)
        except CriError as err:
            raise LookupError(str(err)) from None

    def take(container_id: str, leave_running: bool) -> dict[str, Any]:
        try:
            taken = checkpoint(
                shim_address(state_dir, container_id),
                container_id,
                leave_running=leave_running,
                timeout=600.0,
            )
        except ShimCallError as err:
            raise RuntimeError(str(err)) from None
        return {
            "id": taken.checkpoint_id,
            "namespace": taken.scope,
            "label": taken.label,
            "size": taken.size,
            "containerId": container_id,
        }

    def registry() -> str:
        from ..config import load_node_config
        from ..errors import ShimError

        try:
            return load_node_config(host.path(opts.shim_config), env={}).registry
        except ShimError:
            return ""

    remembered: dict[Any, Any] = {}

    def registry_client() -> Any:
        """The node's registry client, made again only when the node config changes."""
        from ..checkpoint.remote.remote import node_registry
        from ..config import load_node_config
        from ..errors import ShimError
        from .pending_pushes import host_view

        try:
            config = host_view(host, load_node_config(host.path(opts.shim_config), env={}))
        except ShimError:
            return None
        key = (config.registry, config.registry_auth_file, config.registry_ca,
               config.registry_insecure, config.registry_timeout)  # fmt: skip
        if key not in remembered:
            remembered.clear()
            remembered[key] = node_registry(config)
        return remembered[key]

    def taint() -> dict[str, Any] | None:
        last = taints.last
        return None if last is None else {"tainted": last.tainted, "reasons": list(last.reasons)}

    def store() -> Any:
        return node_store(host, opts.shim_config)

    applier = PolicyApplier(api, args.node_name, store, find_container, take)
    handler = AgentApi(
        node=args.node_name,
        tokens=TokenCheck(api),
        controller_user=args.controller_user,
        store=store,
        find_container=find_container,
        take_checkpoint=take,
        registry=registry,
        registry_client=registry_client,
        taint=taint,
        history=history,
        policies=lambda: [dict(v) for v in applier.status.values()],
    )
    try:
        server = HttpServer(handler, args.agent_address, args.agent_port, name="agent-api")
    except OSError as err:
        raise NodeError(
            f"cannot serve the agent API on {args.agent_address} port {args.agent_port}: "
            f"{err.strerror or err}; choose another --agent-address or --agent-port (0: none)"
        ) from None
    server.start()
    logging.getLogger("cedana.node").info("agent API on %s", server.url)

    def policies_round() -> None:
        applier.round()
        handler.registry_pins_round()  # pins made before their push reached the registry

    in_background(policies_round, interval=args.interval, stop=stop, name="policies")
    return history


def _observer(
    args: argparse.Namespace, api: Any, opts: Any, history: Any = None
) -> Callable[[], None]:
    """The chore that turns the shims' operation records into pod Events and
    metrics; starts the metrics server (``--metrics-address``, ``--metrics-port``)."""
    from .hostfs import HostRoot
    from .metrics import AgentMetrics
    from .metrics_server import MetricsServer
    from .ops_spool import OpsObserver, node_store
    from .report import NodeError

    metrics = AgentMetrics()
    if args.metrics_port:
        try:
            server = MetricsServer(metrics.registry, args.metrics_address, args.metrics_port)
        except OSError as err:
            raise NodeError(
                f"cannot serve metrics on {args.metrics_address} port {args.metrics_port}: "
                f"{err.strerror or err}; choose another --metrics-address or --metrics-port "
                "(0: no metrics)"
            ) from None
        server.start()
        logging.getLogger("cedana.node").info("metrics on %s", server.url)
    observer = OpsObserver(api, metrics, args.node_name, history)
    host = HostRoot(opts.host_root)

    def observe() -> None:
        store = node_store(host, opts.shim_config)
        if store is not None:
            observer.round(store)

    return observe


def _main_config(opts: Any) -> dict[str, Any]:
    from . import containerd_config as cc
    from .hostfs import HostRoot

    host = HostRoot(opts.host_root)
    try:
        with open(host.path(opts.containerd_config), "rb") as f:
            return cc.parse(cc.ConfigFile(opts.containerd_config, f.read()))
    except (OSError, cc.ConfigError):
        return {}


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m cedana_shim.node ...``: the same commands without the admin CLI."""
    parser = argparse.ArgumentParser(prog="cedana")
    register(parser.add_subparsers(dest="command"))
    try:
        args = parser.parse_args(["node", *(sys.argv[1:] if argv is None else argv)])
    except SystemExit as exit_:
        code = exit_.code
        return code if isinstance(code, int) else 0 if code is None else 2
    return run(args)
