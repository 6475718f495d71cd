"""What operators see, end to end: a REAL node agent (`cedana node run`, its own
process) beside real containerd, runc and CRIU. A CRI pod opted in by label is
stopped (checkpoint) and a new pod resumes from it (restore); then:

* the agent posted the pod Events (`Checkpointed`, `Restored`) to the Kubernetes API.
  No kube-apiserver can be installed here (no PyPI wheel carries one with etcd), so
  the agent talks to a small HTTP stand-in that records every request and answers as
  the API server would; the bodies are checked in tests/unit/test_ops_events.py;
* its /metrics, scraped over HTTP, count the checkpoint and the restore with their
  phases and `promtool check metrics` (Debian's prometheus) finds them clean;
* the shim logged one line per operation whose phases add up to its wall time, and
  published containerd's /tasks/checkpointed;
* the chart exposes the metrics port with scrape annotations, serves it on the pod's
  IP, and lets the agent post Events;
* the agent serves /metrics on 127.0.0.1 unless told otherwise, and 800 silent
  connections to it cost no thread each: they are dropped while scrapes go on.

The agent's host root is the test containerd's base dir: its node config there names
the containerd's store, and the install it attempts first fails harmlessly (no
containerd config, no CRIU in that root), which must not hold up the Events.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import re
import resource
import signal
import socket
import subprocess
import sys
import threading
import urllib.request
import uuid
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
import yaml  # type: ignore[import-untyped, unused-ignore]
from support.sockets import closed_by_peer

from .harness.containerd import Containerd
from .harness.cr_events import TOPIC_RESTORE, EventStream
from .harness.cr_support import ShimLog, wait_ticks
from .harness.cri import CriClient
from .harness.cri_apps import start_app, stop_app
from .harness.util import WaitAborted, wait_for
from .test_helm_chart import CHART, helm, run  # noqa: F401 - `helm` is a fixture

PROMTOOL = "/usr/bin/promtool"
NODE = "itest-node"


class ApiStandIn:
    """Records every request; answers POST events 201, everything else 404."""

    def __init__(self) -> None:
        self.events: list[dict[str, Any]] = []
        self.lock = threading.Lock()
        owner = self

        class Handler(BaseHTTPRequestHandler):
            # Headers and body leave in two writes: with Nagle each reply would wait out
            # the client's delayed ACK (40 ms a request).
            disable_nagle_algorithm = True

            def log_message(self, *args: Any) -> None:
                pass

            def _send(self, code: int, body: dict[str, Any]) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                if self.path.endswith("/events"):
                    with owner.lock:
                        owner.events.append(body)
                    self._send(201, body)
                else:
                    self._send(404, {"kind": "Status", "code": 404})

            def do_GET(self) -> None:
                self._send(404, {"kind": "Status", "code": 404})

            do_PATCH = do_GET

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(
            target=self.httpd.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True
        ).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def of(self, namespace: str) -> list[dict[str, Any]]:
        with self.lock:
            return [e for e in self.events if e["involvedObject"]["namespace"] == namespace]

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@dataclasses.dataclass(frozen=True)
class Agent:
    log: Path
    process: subprocess.Popen[bytes]

    def threads(self) -> int:
        return len(os.listdir(f"/proc/{self.process.pid}/task"))

    def serving(self, port: int) -> str:
        """Its first scrape; fails at once, with its log, if it exits instead."""

        def scraped() -> str:
            if self.process.poll() is not None:
                tail = self.log.read_text(errors="replace")[-3000:]
                raise WaitAborted(f"the agent exited {self.process.returncode}:\n{tail}")
            return scrape(port)

        return wait_for(scraped, timeout=60, what=f"metrics, agent log: {self.log}")


@contextlib.contextmanager
def node_agent(containerd: Containerd, api: ApiStandIn, port: int) -> Iterator[Agent]:
    """`cedana node run` on the containerd's base dir as host root."""
    host_root = containerd.base
    (host_root / "shim.toml").write_text(f'store_path = "/{containerd.store.name}"\n')
    log = host_root / f"agent-{uuid.uuid4().hex[:6]}.log"
    argv = [
        sys.executable, "-m", "cedana_shim.node", "run", f"--host-root={host_root}",
        "--shim-config=/shim.toml", f"--kube-api={api.url}", f"--node-name={NODE}",
        f"--metrics-port={port}", "--interval=0.5", "--verify=none",
        "--restart-command=false",
    ]  # fmt: skip
    with open(log, "wb") as out:
        agent = subprocess.Popen(argv, stdout=out, stderr=subprocess.STDOUT)
    try:
        yield Agent(log, agent)
    finally:
        agent.send_signal(signal.SIGTERM)
        try:
            agent.wait(timeout=30)
        except subprocess.TimeoutExpired:
            agent.kill()
            agent.wait()


def scrape(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        return str(resp.read().decode())


def value(exposition: str, name: str, **labels: str) -> float:
    for line in exposition.splitlines():
        m = re.fullmatch(r"(\w+)(?:\{(.*)\})? (\S+)", line)
        if not m or m.group(1) != name:
            continue
        found = dict(re.findall(r'(\w+)="([^"]*)"', m.group(2) or ""))
        if all(found.get(k) == v for k, v in labels.items()):
            return float(m.group(3))
    return 0.0


def test_events_metrics_and_log_lines_of_a_checkpoint_and_restore(
    containerd: Containerd, cri: CriClient
) -> None:
    label = f"obs-{uuid.uuid4().hex[:8]}"
    kns = f"ns-{uuid.uuid4().hex[:6]}"
    port = _free_port()
    api = ApiStandIn()
    shim_log = ShimLog(containerd)
    try:
        with (
            node_agent(containerd, api, port) as agent,
            EventStream(containerd.socket) as events,
            contextlib.ExitStack() as stack,
        ):
            first = start_app(stack, containerd, cri, label=label, namespace=kns)
            events.wait_topic(TOPIC_RESTORE, first.cid, timeout=30, outcome="cold")
            wait_ticks(first.stdout, count=3)
            stop_app(cri, first)
            committed = events.wait_commit(first.cid, timeout=60)
            events.wait(
                lambda e: (
                    e.topic == "/tasks/checkpointed"
                    and e.type_url.endswith("containerd.events.TaskCheckpointed")
                ),
                timeout=10,
                what="containerd's /tasks/checkpointed",
            )
            second = start_app(stack, containerd, cri, label=label, namespace=kns)
            events.wait_topic(TOPIC_RESTORE, second.cid, timeout=30, outcome="restored")

            def posted() -> list[str] | None:
                reasons = [e["reason"] for e in api.of(kns)]
                return reasons if {"Checkpointed", "Restored"} <= set(reasons) else None

            reasons = wait_for(posted, timeout=30, what=f"events in {kns}, agent log: {agent.log}")
            assert reasons == ["Checkpointed", "Restored"], reasons
            checkpointed, restored = api.of(kns)
            assert checkpointed["involvedObject"]["name"] == "counter"
            assert checkpointed["involvedObject"]["fieldPath"] == "spec.containers{app}"
            assert checkpointed["involvedObject"]["uid"]  # the CRI annotation
            assert committed.checkpoint_id in checkpointed["message"]
            assert "trigger stop" in checkpointed["message"]
            assert committed.checkpoint_id in restored["message"]
            assert checkpointed["source"]["host"] == NODE

            def counted() -> str | None:
                text = scrape(port)
                done = value(text, "cedana_restores_total", outcome="restored") >= 1
                return text if done else None

            exposition = wait_for(counted, timeout=30, what="the restore in the metrics")
            stop_app(cri, second)
    finally:
        api.close()

    assert value(exposition, "cedana_checkpoints_total", trigger="stop", outcome="committed") >= 1
    for phase in ("freeze", "dump", "rootfs", "commit"):
        assert value(
            exposition, "cedana_checkpoint_phase_duration_seconds_count",
            trigger="stop", phase=phase,
        ) >= 1, phase  # fmt: skip
    assert value(exposition, "cedana_checkpoint_raw_bytes_total") > 0
    assert value(exposition, "cedana_store_checkpoints") >= 1
    assert 'cedana_build_info{criu="Version: 4' in exposition
    for value_of_a_workload in (label, kns, '"counter"', first.cid):
        assert value_of_a_workload not in exposition
    check = subprocess.run(
        [PROMTOOL, "check", "metrics"], input=exposition.encode(), capture_output=True, timeout=60
    )
    assert check.returncode == 0 and not check.stdout.strip(), check.stdout + check.stderr

    # One line per operation; its phases add up to its wall time.
    (line,) = shim_log.find("checkpoint committed", container=first.cid)
    assert set(line["phases"]) >= {"freeze", "dump", "rootfs", "commit"}
    assert sum(line["phases"].values()) == pytest.approx(line["seconds"], abs=0.002)
    (line,) = shim_log.find("restored from checkpoint", container=second.cid)
    assert "restore" in line["phases"]
    assert sum(line["phases"].values()) == pytest.approx(line["seconds"], abs=0.002)


def _refused(host: str, port: int) -> bool:
    try:
        socket.create_connection((host, port), timeout=10).close()
    except ConnectionRefusedError:
        return True
    return False


@pytest.mark.ctrd_versions("2.1")
def test_the_agent_serves_metrics_on_loopback_unless_told(containerd: Containerd) -> None:
    port = _free_port()
    api = ApiStandIn()
    try:
        with node_agent(containerd, api, port) as agent:
            agent.serving(port)
            # All of 127/8 is loopback: an agent on every address answers on 127.0.0.2.
            assert _refused("127.0.0.2", port)
    finally:
        api.close()


@pytest.mark.ctrd_versions("2.1")
def test_idle_metrics_connections_hold_no_thread_and_are_dropped(containerd: Containerd) -> None:
    port = _free_port()
    api = ApiStandIn()
    count = 800
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft < count + 200:
        resource.setrlimit(resource.RLIMIT_NOFILE, (min(hard, 4 * count), hard))
    idle: list[socket.socket] = []
    try:
        with node_agent(containerd, api, port) as agent:
            agent.serving(port)
            threads = agent.threads()
            idle = [socket.create_connection(("127.0.0.1", port), timeout=60) for _ in range(count)]
            # The agent has taken them in: it closes the oldest silent ones to make room
            # (a thread-per-connection server starts a thread for each instead).
            wait_for(
                lambda: any(map(closed_by_peer, idle)) or agent.threads() > threads + count // 2,
                timeout=60,
                what="the agent to take the idle connections in",
            )
            # A few threads of its own may come and go (gRPC's, the observer's).
            assert agent.threads() < threads + 10, (threads, agent.threads())
            assert "cedana_build_info" in scrape(port)
            wait_for(
                lambda: all(map(closed_by_peer, idle)),
                timeout=90,
                what="every idle connection to be dropped",
            )
            assert agent.threads() < threads + 10, (threads, agent.threads())
    finally:
        for sock in idle:
            sock.close()
        api.close()


def test_the_chart_exposes_metrics_and_may_post_events(helm: list[str]) -> None:  # noqa: F811
    docs = [d for d in _yaml_docs(run([*helm, "template", "x", str(CHART)])) if d]
    (daemonset,) = [
        d for d in docs if d["kind"] == "DaemonSet" and "helper" in d["metadata"]["name"]
    ]
    pod = daemonset["spec"]["template"]
    assert pod["metadata"]["annotations"] == {
        "prometheus.io/scrape": "true",
        "prometheus.io/port": "9464",
        "prometheus.io/path": "/metrics",
    }
    (container,) = pod["spec"]["containers"]
    # Beside the agent's API for the dashboard (test_helm_chart.py).
    assert {"name": "metrics", "containerPort": 9464, "protocol": "TCP"} in container["ports"]
    assert "--metrics-port=9464" in container["args"]
    # On the pod's IP, where Prometheus' pod discovery scrapes; kubelet expands $(POD_IP).
    assert "--metrics-address=$(POD_IP)" in container["args"]
    pod_ip = {"name": "POD_IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}}
    assert pod_ip in container["env"]
    (role,) = [d for d in docs if d["kind"] == "ClusterRole" and "helper" in d["metadata"]["name"]]
    rules = {(r["resources"][0], v) for r in role["rules"] for v in r["verbs"]}
    assert {("events", "create"), ("pods", "get")} <= rules

    off = [
        d
        for d in _yaml_docs(
            run(
                [
                    *helm,
                    "template",
                    "x",
                    str(CHART),
                    "--set",
                    "metrics.port=0",
                    "--set",
                    "controller.enabled=false",
                ]
            )
        )
        if d
    ]
    (daemonset,) = [
        d for d in off if d["kind"] == "DaemonSet" and "helper" in d["metadata"]["name"]
    ]
    assert "annotations" not in daemonset["spec"]["template"]["metadata"]
    (container,) = daemonset["spec"]["template"]["spec"]["containers"]
    assert "ports" not in container
    assert "--metrics-port=0" in container["args"]
    assert not any(a.startswith("--metrics-address") for a in container["args"])
    assert pod_ip not in container["env"]

    chosen = run(
        [
            *helm,
            "template",
            "x",
            str(CHART),
            "--set",
            "metrics.address=0.0.0.0",
            "--set",
            "controller.enabled=false",
        ]  # the agent API needs the pod IP
    )
    (daemonset,) = [
        d
        for d in _yaml_docs(chosen)
        if d and d["kind"] == "DaemonSet" and "helper" in d["metadata"]["name"]
    ]
    (container,) = daemonset["spec"]["template"]["spec"]["containers"]
    assert "--metrics-address=0.0.0.0" in container["args"]
    assert pod_ip not in container["env"]


def _yaml_docs(text: str) -> list[Any]:
    return list(yaml.safe_load_all(text))
