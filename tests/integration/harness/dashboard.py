"""The dashboard's parts as the chart runs them, each a real process of its own: node
agents (`cedana node run --agent-port`) and the controller (`cedana controller run`),
all talking to the Kubernetes API stand-in (kube_api.py).

Each agent serves on its own loopback address (127.0.0.1, 127.0.0.2, ...: the pod IP
its helper pod has in the stand-in), all on one port, as agents on separate nodes do.
"""

from __future__ import annotations

import contextlib
import json
import signal
import socket
import subprocess
import sys
import urllib.error
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .kube_api import FakeKubeApi, Rule
from .util import WaitAborted, wait_for

CONTROLLER_USER = "system:serviceaccount:cedana-system:cedana-controller"
CONTROLLER_TOKEN = "controller-sa-token"
AGENTS_NS = "cedana-system"
HELPER_LABELS = {"app.kubernetes.io/component": "helper"}


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclass
class Proc:
    name: str
    log: Path
    process: subprocess.Popen[bytes]

    def tail(self) -> str:
        return self.log.read_text(errors="replace")[-4000:]

    def check_alive(self) -> None:
        if self.process.poll() is not None:
            raise WaitAborted(f"{self.name} exited {self.process.returncode}:\n{self.tail()}")


@contextlib.contextmanager
def process(name: str, argv: list[str], log: Path) -> Iterator[Proc]:
    with open(log, "wb") as out:
        child = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
    proc = Proc(name, log, child)
    try:
        yield proc
    finally:
        child.send_signal(signal.SIGTERM)
        try:
            child.wait(timeout=30)
        except subprocess.TimeoutExpired:
            child.kill()
            child.wait()


def helper_pod(node: str, ip: str) -> dict[str, Any]:
    """The chart's helper pod of ``node`` as the API server shows it."""
    return {
        "metadata": {"name": f"cedana-helper-{node}", "namespace": AGENTS_NS,
                     "labels": dict(HELPER_LABELS)},
        "spec": {"nodeName": node, "containers": [{"name": "helper", "image": "cedana"}]},
        "status": {"phase": "Running", "podIP": ip,
                   "conditions": [{"type": "Ready", "status": "True"}]},
    }  # fmt: skip


@contextlib.contextmanager
def agent(
    kube: FakeKubeApi,
    host_root: Path,
    node: str,
    ip: str,
    port: int,
    *,
    containerd_socket: Path | None = None,
    store: str = "/store",
    extra_config: str = "",
) -> Iterator[Proc]:
    """`cedana node run` for ``node`` with ``host_root`` as its host's root, whose
    node config names the store ``<host_root><store>``; its helper pod registered."""
    (host_root / "shim.toml").write_text(f'store_path = "{store}"\n{extra_config}')
    kube.add_node(node)
    kube.add_pod(helper_pod(node, ip))
    argv = [
        sys.executable, "-m", "cedana_shim.node", "run", f"--host-root={host_root}",
        "--shim-config=/shim.toml", f"--kube-api={kube.url}", f"--node-name={node}",
        "--metrics-port=0", f"--agent-port={port}", f"--agent-address={ip}",
        "--interval=0.5", "--verify=none", "--restart-command=false",
        "--containerd-state=/state", f"--controller-user={CONTROLLER_USER}",
    ]  # fmt: skip
    if containerd_socket is not None:
        argv.append(f"--containerd-socket={containerd_socket}")
    with process(f"agent {node}", argv, host_root / f"agent-{node}.log") as proc:
        wait_for(lambda: _listening(proc, ip, port), timeout=60, what=f"agent {node}'s API")
        yield proc


@contextlib.contextmanager
def controller(kube: FakeKubeApi, workdir: Path, agent_port: int) -> Iterator[Controller]:
    kube.add_token(CONTROLLER_TOKEN, CONTROLLER_USER)
    token_file = workdir / "controller-token"
    token_file.write_text(CONTROLLER_TOKEN + "\n")
    port = free_port()
    argv = [
        sys.executable, "-m", "cedana_shim.controller", "run", "--address=127.0.0.1",
        f"--port={port}", f"--kube-api={kube.url}", f"--token-file={token_file}",
        f"--agents-namespace={AGENTS_NS}", f"--agent-port={agent_port}",
    ]  # fmt: skip
    with process("controller", argv, workdir / "controller.log") as proc:
        wait_for(lambda: _listening(proc, "127.0.0.1", port), timeout=60, what="the controller")
        yield Controller(proc, f"http://127.0.0.1:{port}")


@dataclass
class Controller:
    proc: Proc
    url: str

    def call(self, method: str, path: str, token: str = "", body: Any = None) -> tuple[int, Any]:
        """(status, JSON answer) of the controller's API."""
        return http_json(self.url + path, method, token, body)


def http_json(url: str, method: str = "GET", token: str = "", body: Any = None) -> tuple[int, Any]:
    headers = {"Content-Type": "application/json"}
    if token:
        headers["Authorization"] = f"Bearer {token}"
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url, data=data, method=method, headers=headers)
    try:
        with urllib.request.urlopen(request, timeout=120) as answer:
            return answer.status, json.loads(answer.read())
    except urllib.error.HTTPError as err:
        return err.code, json.loads(err.read())


def _listening(proc: Proc, ip: str, port: int) -> bool:
    proc.check_alive()
    with socket.socket() as s:
        s.settimeout(1)
        return s.connect_ex((ip, port)) == 0


def namespace_rules(namespace: str, *verbs: tuple[str, str]) -> list[Rule]:
    return [Rule(namespace, verb, resource) for verb, resource in verbs]
