"""The not-ready taint: the pure decision, and the real `kubernetes` client driving it
against a small stand-in for the API server (no API server binary exists here). The
stand-in implements exactly the calls the helper makes: GET and strategic-merge PATCH
of a node (with resourceVersion preconditions), and LIST of pods with field and
label selectors."""

from __future__ import annotations

import copy
import json
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlparse

import pytest
from cedana_shim.node import taint
from cedana_shim.node.kube import KubernetesApi
from cedana_shim.node.manager import Selectors, Stop, TaintController, run_loop
from cedana_shim.node.registration import NODE_LABEL, TAINT_KEY

NODE = "gpu-node-1"
NS = "cedana-system"
HELPER = "app.kubernetes.io/name=cedana,app.kubernetes.io/component=helper"
HEALTH = "app.kubernetes.io/name=cedana,app.kubernetes.io/component=health-check"
OURS = {"key": TAINT_KEY, "effect": "NoSchedule"}
OTHER = {"key": "nvidia.com/gpu", "value": "present", "effect": "NoSchedule"}


def pod(name: str, component: str, ready: bool, node: str = NODE) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Pod",
        "metadata": {
            "name": name,
            "namespace": NS,
            "labels": {
                "app.kubernetes.io/name": "cedana",
                "app.kubernetes.io/component": component,
            },
        },
        "spec": {"nodeName": node, "containers": [{"name": "c", "image": "i"}]},
        "status": {
            "phase": "Running",
            "conditions": [{"type": "Ready", "status": "True" if ready else "False"}],
        },
    }


class FakeApiServer:
    """State plus a ThreadingHTTPServer speaking just enough of the Kubernetes API."""

    def __init__(self) -> None:
        self.node: dict[str, Any] = {
            "apiVersion": "v1",
            "kind": "Node",
            "metadata": {
                "name": NODE,
                "resourceVersion": "1",
                "labels": {"kubernetes.io/os": "linux"},
            },
            "spec": {"taints": [copy.deepcopy(OTHER)]},
        }
        self.pods: dict[str, dict[str, Any]] = {}
        self.patches: list[dict[str, Any]] = []
        self.content_types: list[str] = []
        self.conflict_next_patch = False
        self.lock = threading.Lock()
        server = self

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

            def do_GET(self) -> None:
                url = urlparse(self.path)
                with server.lock:
                    if url.path == f"/api/v1/nodes/{NODE}":
                        return self._send(200, server.node)
                    if url.path == f"/api/v1/namespaces/{NS}/pods":
                        query = {k: v[0] for k, v in parse_qs(url.query).items()}
                        items = [p for p in server.pods.values() if _selected(p, query)]
                        return self._send(
                            200,
                            {"apiVersion": "v1", "kind": "PodList", "metadata": {}, "items": items},
                        )
                return self._send(404, _status(404, "NotFound", url.path))

            def do_PATCH(self) -> None:
                url = urlparse(self.path)
                length = int(self.headers.get("Content-Length", "0"))
                patch = json.loads(self.rfile.read(length))
                with server.lock:
                    server.content_types.append(self.headers.get("Content-Type", ""))
                    if url.path != f"/api/v1/nodes/{NODE}":
                        return self._send(404, _status(404, "NotFound", url.path))
                    if self.headers.get("Content-Type") != "application/strategic-merge-patch+json":
                        return self._send(415, _status(415, "UnsupportedMediaType", "want SMP"))
                    if server.conflict_next_patch:
                        # Another controller wrote the node between our GET and PATCH.
                        server.conflict_next_patch = False
                        server.bump()
                    meta = patch.get("metadata", {})
                    expected = meta.get("resourceVersion")
                    if (
                        expected is not None
                        and expected != server.node["metadata"]["resourceVersion"]
                    ):
                        return self._send(
                            409, _status(409, "Conflict", "the object has been modified")
                        )
                    server.patches.append(patch)
                    for key, value in (meta.get("labels") or {}).items():
                        labels = server.node["metadata"].setdefault("labels", {})
                        if value is None:
                            labels.pop(key, None)
                        else:
                            labels[key] = value
                    if "spec" in patch and "taints" in patch["spec"]:
                        server.node["spec"]["taints"] = patch["spec"]["taints"]
                    server.bump()
                    return self._send(200, server.node)

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(
            target=self.httpd.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True
        )
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def bump(self) -> None:
        meta = self.node["metadata"]
        meta["resourceVersion"] = str(int(meta["resourceVersion"]) + 1)

    def set_pod(self, p: dict[str, Any]) -> None:
        with self.lock:
            self.pods[p["metadata"]["name"]] = p

    @property
    def tainted(self) -> bool:
        return taint.has_taint(self.node)

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def _status(code: int, reason: str, message: str) -> dict[str, Any]:
    return {"kind": "Status", "apiVersion": "v1", "status": "Failure", "code": code,
            "reason": reason, "message": message}  # fmt: skip


def _selected(p: dict[str, Any], query: dict[str, str]) -> bool:
    for term in filter(None, query.get("fieldSelector", "").split(",")):
        key, _, value = term.partition("=")
        assert key == "spec.nodeName", f"unexpected field selector {key}"
        if p["spec"].get("nodeName") != value:
            return False
    labels = p["metadata"].get("labels", {})
    for term in filter(None, query.get("labelSelector", "").split(",")):
        key, _, value = term.partition("=")
        if labels.get(key) != value:
            return False
    return True


@pytest.fixture
def server() -> Iterator[FakeApiServer]:
    s = FakeApiServer()
    yield s
    s.close()


@pytest.fixture
def controller(server: FakeApiServer) -> TaintController:
    api = KubernetesApi(api_url=server.url)
    return TaintController(api, NODE, Selectors(NS, HELPER, HEALTH))


INSTALLED = taint.Local(installed=True, handler_ok=True)
STARTING = taint.Local(installed=False, handler_ok=False)


def test_taint_lifecycle_through_the_real_client(
    server: FakeApiServer, controller: TaintController
) -> None:
    # A helper starts: taint at once, before anything else.
    decision = controller.reconcile(STARTING)
    assert decision.tainted and server.tainted
    assert OTHER in server.node["spec"]["taints"], "someone else's taint was dropped"
    assert NODE_LABEL not in server.node["metadata"]["labels"]
    assert set(server.content_types) == {"application/strategic-merge-patch+json"}

    # Installed, but the pods are not Ready yet: keep the taint, label the node so
    # that the health-check pod (RuntimeClass nodeSelector) can be scheduled.
    server.set_pod(pod("cedana-helper-x", "helper", ready=True))
    server.set_pod(pod("cedana-health-x", "health-check", ready=False))
    server.set_pod(pod("cedana-health-other", "health-check", ready=True, node="node-2"))
    decision = controller.reconcile(INSTALLED)
    assert decision.tainted and server.tainted
    assert any("health pod cedana-health-x not Ready" in r for r in decision.reasons)
    assert server.node["metadata"]["labels"][NODE_LABEL] == "true"
    patches = len(server.patches)
    controller.reconcile(INSTALLED)
    assert len(server.patches) == patches, "an unchanged decision must not write the node"

    # Both Ready: the taint goes, the other taint stays.
    server.set_pod(pod("cedana-health-x", "health-check", ready=True))
    decision = controller.reconcile(INSTALLED)
    assert not decision.tainted and not server.tainted
    assert server.node["spec"]["taints"] == [OTHER]

    # The helper restarts (a new process, nothing proven): the taint is back ...
    restarted = TaintController(
        KubernetesApi(api_url=server.url), NODE, Selectors(NS, HELPER, HEALTH)
    )
    assert restarted.reconcile(STARTING).tainted and server.tainted
    # ... and stays while its pod is not Ready again, then goes.
    server.set_pod(pod("cedana-helper-x", "helper", ready=False))
    assert restarted.reconcile(INSTALLED).tainted and server.tainted
    server.set_pod(pod("cedana-helper-x", "helper", ready=True))
    assert not restarted.reconcile(INSTALLED).tainted and not server.tainted

    # The handler stops answering (containerd config overwritten): taint again.
    broken = taint.Local(installed=True, handler_ok=False)
    assert restarted.reconcile(broken).tainted and server.tainted


def test_conflicting_writer_is_retried(server: FakeApiServer, controller: TaintController) -> None:
    server.conflict_next_patch = True
    assert controller.reconcile(STARTING).tainted
    assert server.tainted and len(server.patches) == 1


def test_terminating_pods_do_not_count(server: FakeApiServer, controller: TaintController) -> None:
    server.set_pod(pod("cedana-helper-x", "helper", ready=True))
    leaving = pod("cedana-health-x", "health-check", ready=True)
    leaving["metadata"]["deletionTimestamp"] = "2026-01-01T00:00:00Z"
    server.set_pod(leaving)
    decision = controller.reconcile(INSTALLED)
    assert decision.tainted and "no health pod on the node" in decision.reasons


def test_uninstall_taints_and_unlabels(server: FakeApiServer, controller: TaintController) -> None:
    server.node["metadata"]["labels"][NODE_LABEL] = "true"
    decision = controller.reconcile(STARTING, uninstalling=True)
    assert decision.tainted and server.tainted
    assert NODE_LABEL not in server.node["metadata"]["labels"]


def test_helper_loop_taints_first_then_follows_readiness(
    server: FakeApiServer, controller: TaintController
) -> None:
    server.set_pod(pod("cedana-helper-x", "helper", ready=True))
    server.set_pod(pod("cedana-health-x", "health-check", ready=True))
    seen: list[bool] = []

    def install() -> bool:
        seen.append(server.tainted)  # the taint is on before install starts
        return True

    run_loop(
        controller, install, lambda: True, interval=0, reinstall_interval=3600,
        stop=Stop(), max_rounds=2,
    )  # fmt: skip
    assert seen == [True] and not server.tainted


def test_failed_install_keeps_the_taint_and_retries(
    server: FakeApiServer, controller: TaintController
) -> None:
    server.set_pod(pod("cedana-helper-x", "helper", ready=True))
    server.set_pod(pod("cedana-health-x", "health-check", ready=True))
    attempts: list[int] = []

    def install() -> bool:
        attempts.append(1)
        return len(attempts) >= 3

    run_loop(
        controller, install, lambda: True, interval=0, reinstall_interval=3600,
        stop=Stop(), max_rounds=2,
    )  # fmt: skip
    assert len(attempts) == 2 and server.tainted
    run_loop(
        controller, install, lambda: True, interval=0, reinstall_interval=3600,
        stop=Stop(), max_rounds=1,
    )  # fmt: skip
    assert len(attempts) == 3 and not server.tainted


def test_chores_run_each_round_once_installed(
    server: FakeApiServer, controller: TaintController
) -> None:
    """The pending pushes of the node's outbox are taken up by the helper's loop, only
    on a node where the install succeeded."""
    ran: list[int] = []
    attempts: list[int] = []

    def install() -> bool:
        attempts.append(1)
        return len(attempts) >= 2

    run_loop(
        controller, install, lambda: True, interval=0, reinstall_interval=0,
        stop=Stop(), max_rounds=3, chores=(lambda: ran.append(1),),
    )  # fmt: skip
    assert len(ran) == 2  # not in the round whose install failed


@pytest.mark.parametrize(
    ("pods", "local", "tainted"),
    [
        ([], STARTING, True),
        ([("helper", True), ("health", True)], STARTING, True),
        ([("helper", True), ("health", True)], INSTALLED, False),
        ([("helper", True)], INSTALLED, True),
        ([("helper", False), ("health", True)], INSTALLED, True),
        ([("helper", True), ("health", True)], taint.Local(True, False), True),
        ([("helper", True), ("health", False), ("health", True)], INSTALLED, False),
    ],
)
def test_decision_table(pods: list[tuple[str, bool]], local: taint.Local, tainted: bool) -> None:
    states = [taint.PodState(f"p{i}", role, ready, False) for i, (role, ready) in enumerate(pods)]  # type: ignore[arg-type]
    assert taint.decide(states, local).tainted is tainted


def test_patch_is_none_when_the_node_already_matches() -> None:
    node = {"metadata": {"resourceVersion": "7", "labels": {NODE_LABEL: "true"}},
            "spec": {"taints": [OURS]}}  # fmt: skip
    assert taint.node_patch(node, taint.Decision(True, True, ("x",))) is None
    patch = taint.node_patch(node, taint.Decision(False, True, ()))
    assert patch == {"metadata": {"resourceVersion": "7"}, "spec": {"taints": []}}
