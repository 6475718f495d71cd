"""A stand-in for the Kubernetes API server, for the dashboard's tests.

No kube-apiserver can be installed here (no package carries one with etcd), so this
answers the calls the node agents and the controller make, as the API server would,
from state the test sets: who each token belongs to (TokenReview), what each user may
do where (SubjectAccessReview, with RBAC-like rules), pods (list with label and field
selectors, get, create, evict), nodes (get, patch) and Events (recorded). It schedules
nothing and runs nothing: a test that needs a pod to run plays kubelet itself.
"""

from __future__ import annotations

import copy
import json
import re
import threading
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import parse_qs, urlsplit


@dataclass(frozen=True)
class Rule:
    """``verb`` on ``resource`` (``pods``, ``pods/eviction``, ``nodes``) in
    ``namespace`` ("*": every namespace and cluster-wide)."""

    namespace: str
    verb: str
    resource: str


@dataclass
class Request:
    method: str
    path: str
    user: str  # whose bearer token came with it ("" without one)
    body: Any


@dataclass
class KubeState:
    tokens: dict[str, tuple[str, list[str]]] = field(default_factory=dict)
    rules: dict[str, list[Rule]] = field(default_factory=dict)
    pods: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)
    config_maps: dict[tuple[str, str], dict[str, Any]] = field(default_factory=dict)
    nodes: dict[str, dict[str, Any]] = field(default_factory=dict)
    events: list[dict[str, Any]] = field(default_factory=list)
    evictions: list[tuple[str, str]] = field(default_factory=list)
    requests: list[Request] = field(default_factory=list)


class FakeKubeApi:
    def __init__(self) -> None:
        self.state = KubeState()
        self.lock = threading.Lock()
        self.on_evict: Callable[[str, str], None] | None = None
        owner = self

        class Handler(BaseHTTPRequestHandler):
            disable_nagle_algorithm = True

            def log_message(self, *args: Any) -> None:
                pass

            def _body(self) -> Any:
                length = int(self.headers.get("Content-Length") or 0)
                return json.loads(self.rfile.read(length)) if length else None

            def _answer(self, method: str) -> None:
                url = urlsplit(self.path)
                query = {k: v[0] for k, v in parse_qs(url.query).items()}
                body = self._body() if method in ("POST", "PATCH", "PUT") else None
                code, doc = owner.handle(method, url.path, query, body, self.headers)
                data = json.dumps(doc).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_GET(self) -> None:
                self._answer("GET")

            def do_POST(self) -> None:
                self._answer("POST")

            def do_PATCH(self) -> None:
                self._answer("PATCH")

            def do_PUT(self) -> None:
                self._answer("PUT")

            def do_DELETE(self) -> None:
                self._answer("DELETE")

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        threading.Thread(
            target=self.httpd.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True
        ).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()

    # -- what the test sets ------------------------------------------------------------

    def add_token(self, token: str, user: str, groups: list[str] | None = None) -> None:
        with self.lock:
            self.state.tokens[token] = (user, groups or ["system:authenticated"])

    def allow(self, user: str, *rules: Rule) -> None:
        with self.lock:
            self.state.rules.setdefault(user, []).extend(rules)

    def add_pod(self, pod: dict[str, Any]) -> dict[str, Any]:
        pod = copy.deepcopy(pod)
        meta = pod.setdefault("metadata", {})
        meta.setdefault("uid", str(uuid.uuid4()))
        pod.setdefault("apiVersion", "v1")
        pod.setdefault("kind", "Pod")
        pod.setdefault("status", {"phase": "Running"})
        with self.lock:
            self.state.pods[(meta["namespace"], meta["name"])] = pod
        return pod

    def add_node(self, name: str) -> None:
        with self.lock:
            self.state.nodes[name] = {
                "apiVersion": "v1",
                "kind": "Node",
                "metadata": {"name": name, "labels": {}, "resourceVersion": "1"},
                "spec": {},
            }

    def events_by(self, reason_prefix: str) -> list[dict[str, Any]]:
        with self.lock:
            return [e for e in self.state.events if e["reason"].startswith(reason_prefix)]

    def pods(self) -> list[dict[str, Any]]:
        with self.lock:
            return [copy.deepcopy(p) for p in self.state.pods.values()]

    # -- the API -----------------------------------------------------------------------

    def _user(self, headers: Any) -> str:
        scheme, _, token = str(headers.get("Authorization") or "").partition(" ")
        found = self.state.tokens.get(token.strip()) if scheme == "Bearer" else None
        return found[0] if found else ""

    def handle(
        self, method: str, path: str, query: dict[str, str], body: Any, headers: Any
    ) -> tuple[int, Any]:
        with self.lock:
            self.state.requests.append(Request(method, path, self._user(headers), body))
            return self._route(method, path, query, body)

    def _route(self, method: str, path: str, query: dict[str, str], body: Any) -> tuple[int, Any]:
        s = self.state
        if (method, path) == ("POST", "/apis/authentication.k8s.io/v1/tokenreviews"):
            found = s.tokens.get(body["spec"]["token"])
            status: dict[str, Any] = {"authenticated": found is not None}
            if found:
                status["user"] = {"username": found[0], "groups": found[1], "uid": found[0]}
            return 201, {**body, "status": status}
        if (method, path) == ("POST", "/apis/authorization.k8s.io/v1/subjectaccessreviews"):
            spec = body["spec"]
            attrs = spec.get("resourceAttributes") or {}
            resource = attrs.get("resource", "")
            if attrs.get("subresource"):
                resource += "/" + attrs["subresource"]
            allowed = any(
                r.verb == attrs.get("verb")
                and r.resource == resource
                and r.namespace in ("*", attrs.get("namespace", ""))
                for r in s.rules.get(spec.get("user", ""), [])
            )
            return 201, {**body, "status": {"allowed": allowed}}
        if m := re.fullmatch(r"/api/v1/nodes/([^/]+)", path):
            node = s.nodes.get(m[1])
            if node is None:
                return 404, _status(404, f"nodes {m[1]} not found")
            if method == "PATCH":
                for key in ("metadata", "spec"):
                    for k, v in (body.get(key) or {}).items():
                        if isinstance(v, dict):
                            node[key].setdefault(k, {}).update(v)
                        else:
                            node[key][k] = v
            return 200, node
        if method == "GET" and path == "/api/v1/pods":
            return 200, _pod_list(s.pods.values(), query)
        if m := re.fullmatch(r"/api/v1/namespaces/([^/]+)/pods", path):
            if method == "GET":
                return 200, _pod_list((p for (ns, _), p in s.pods.items() if ns == m[1]), query)
            if method == "POST":
                pod = copy.deepcopy(body)
                pod["metadata"]["namespace"] = m[1]
                pod["metadata"].setdefault("uid", str(uuid.uuid4()))
                pod.setdefault("status", {"phase": "Pending"})
                if (m[1], pod["metadata"]["name"]) in s.pods:
                    return 409, _status(409, "already exists")
                s.pods[(m[1], pod["metadata"]["name"])] = pod
                return 201, pod
        if m := re.fullmatch(r"/api/v1/namespaces/([^/]+)/pods/([^/]+)", path):
            pod = s.pods.get((m[1], m[2]))
            if pod is None:
                return 404, _status(404, f'pods "{m[2]}" not found')
            return 200, pod
        if m := re.fullmatch(r"/api/v1/namespaces/([^/]+)/pods/([^/]+)/eviction", path):
            if s.pods.pop((m[1], m[2]), None) is None:
                return 404, _status(404, f'pods "{m[2]}" not found')
            s.evictions.append((m[1], m[2]))
            hook = self.on_evict
            if hook is not None:
                threading.Thread(target=hook, args=(m[1], m[2]), daemon=True).start()
            return 201, _status(201, "evicted", "Success")
        if method == "GET" and path == "/api/v1/configmaps":
            items = [copy.deepcopy(c) for c in s.config_maps.values() if _selected(c, query)]
            return 200, {"apiVersion": "v1", "kind": "ConfigMapList", "metadata": {},
                         "items": items}  # fmt: skip
        if (m := re.fullmatch(r"/api/v1/namespaces/([^/]+)/configmaps", path)) and method == "POST":
            if (m[1], body["metadata"]["name"]) in s.config_maps:
                return 409, _status(409, "already exists")
            body["metadata"]["namespace"] = m[1]
            s.config_maps[(m[1], body["metadata"]["name"])] = body
            return 201, body
        if m := re.fullmatch(r"/api/v1/namespaces/([^/]+)/configmaps/([^/]+)", path):
            if (m[1], m[2]) not in s.config_maps:
                return 404, _status(404, f'configmaps "{m[2]}" not found')
            if method == "PUT":
                body["metadata"]["namespace"] = m[1]
                s.config_maps[(m[1], m[2])] = body
            if method == "DELETE":
                del s.config_maps[(m[1], m[2])]
                return 200, _status(200, "deleted", "Success")
            return 200, s.config_maps[(m[1], m[2])]
        if method == "POST" and re.fullmatch(r"/api/v1/namespaces/([^/]+)/events", path):
            s.events.append(body)
            return 201, body
        return 404, _status(404, f"{method} {path} is not served by the stand-in")


def _status(code: int, message: str, status: str = "Failure") -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "Status",
        "status": status,
        "code": code,
        "message": message,
        "metadata": {},
    }


def _selected(pod: dict[str, Any], query: dict[str, str]) -> bool:
    labels = (pod.get("metadata") or {}).get("labels") or {}
    for term in filter(None, query.get("labelSelector", "").split(",")):
        key, _, value = term.partition("=")
        if labels.get(key) != value:
            return False
    for term in filter(None, query.get("fieldSelector", "").split(",")):
        key, _, value = term.partition("=")
        if key == "spec.nodeName" and (pod.get("spec") or {}).get("nodeName") != value:
            return False
    return True


def _pod_list(pods: Any, query: dict[str, str]) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "PodList",
        "metadata": {},
        "items": [copy.deepcopy(p) for p in pods if _selected(p, query)],
    }
