"""The node agent's API answers the controller's ServiceAccount only (TokenReview),
and shows and changes the node's real store."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from cedana_shim.checkpoint.remote import RemoteStore
from cedana_shim.checkpoint.remote.shared_dir import SharedDirectory
from cedana_shim.checkpoint.store import StoreConfig
from cedana_shim.node.agent_api import AgentApi, TokenCheck
from cedana_shim.node.http_server import Request
from cedana_shim.node.kube import Identity, KubeError
from support.checkpoints import SCOPE, commit_checkpoint, open_store

CONTROLLER = "system:serviceaccount:cedana-system:cedana-controller"


class Tokens:
    def __init__(self, users: dict[str, str]) -> None:
        self.users = users
        self.reviews = 0
        self.down = False

    def review_token(self, token: str) -> Identity | None:
        self.reviews += 1
        if self.down:
            raise KubeError("POST tokenreview: connection refused")
        user = self.users.get(token)
        return None if user is None else Identity(user)


def _api(tmp_path: Path, tokens: Tokens) -> AgentApi:
    config = StoreConfig(root=str(tmp_path / "store"))

    def find(namespace: str, pod: str, container: str) -> str:
        raise LookupError(f"pod {namespace}/{pod} is not running on this node")

    def take(container_id: str, leave_running: bool) -> dict[str, Any]:
        raise AssertionError("no container to checkpoint here")

    return AgentApi("node-a", TokenCheck(tokens), CONTROLLER, lambda: config, find, take)


def _call(api: AgentApi, method: str, path: str, token: str, body: Any = None) -> Any:
    headers = {"authorization": f"Bearer {token}"} if token else {}
    data = json.dumps(body).encode() if body is not None else b""
    answer = api(Request(method, path, {}, headers, data, "127.0.0.1"))
    return answer.status, json.loads(answer.body)


def test_only_the_controller_is_answered(tmp_path: Path) -> None:
    tokens = Tokens({"ctl": CONTROLLER, "alice": "alice@example.com"})
    api = _api(tmp_path, tokens)
    status, doc = _call(api, "GET", "/v1/checkpoints", "")
    assert status == 401 and "no bearer token" in doc["error"]
    status, doc = _call(api, "GET", "/v1/checkpoints", "forged")
    assert status == 401 and "TokenReview" in doc["error"]
    status, doc = _call(api, "GET", "/v1/node", "alice")
    assert status == 403 and "alice@example.com is not the cedana controller" in doc["error"]
    assert _call(api, "GET", "/v1/node", "ctl")[0] == 200
    reviews = tokens.reviews
    assert _call(api, "GET", "/v1/node", "ctl")[0] == 200
    assert tokens.reviews == reviews, "a token's review is remembered"
    tokens.down = True
    status, doc = _call(api, "GET", "/v1/node", "new-token")
    assert status == 503 and "connection refused" in doc["error"]


def test_the_controller_lists_pins_and_deletes_real_checkpoints(tmp_path: Path) -> None:
    store = open_store(tmp_path / "store")
    entry = commit_checkpoint(store, {"pages-1.img": b"x" * 64}, label="web")
    api = _api(tmp_path, Tokens({"ctl": CONTROLLER}))
    status, doc = _call(api, "GET", "/v1/checkpoints", "ctl")
    assert status == 200
    [item] = doc["checkpoints"]
    assert (item["id"], item["label"], item["pod"], item["pinned"]) == (
        entry.id,
        "web",
        "trainer-0",
        False,
    )
    node = _call(api, "GET", "/v1/node", "ctl")[1]
    assert node["store"]["checkpoints"] == 1 and node["store"]["bytes"] == entry.size
    assert _call(api, "POST", "/v1/pin", "ctl", {"id": entry.id, "pinned": True})[0] == 200
    assert store.catalog.get(entry.id).pinned
    status, doc = _call(api, "POST", "/v1/checkpoint", "ctl", {"namespace": "a", "pod": "p"})
    assert status == 404 and "not running on this node" in doc["error"]
    assert _call(api, "POST", "/v1/delete", "ctl", {"id": entry.id})[0] == 200
    assert store.catalog.list() == []
    status, doc = _call(api, "POST", "/v1/delete", "ctl", {"id": entry.id})
    assert status == 404 and "not found" in doc["error"]


def test_registry_use_and_pins_reach_the_nodes_registry(tmp_path: Path) -> None:
    """With the node's registry (a shared directory here): what it holds per
    checkpoint, and a pin or a delete through the agent reaches it."""
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o700)
    store = open_store(tmp_path / "store")
    remote = RemoteStore(store, SharedDirectory(str(shared)), "node-a")
    first = commit_checkpoint(store, {"pages-1.img": os.urandom(4096)}, label="web")
    second = commit_checkpoint(store, {"pages-1.img": os.urandom(4096)}, label="web")
    for entry in (first, second):
        remote.push(entry.id)
    api = _api(tmp_path, Tokens({"ctl": CONTROLLER}))
    assert _call(api, "GET", "/v1/registry", "ctl")[0] == 404, "no registry: says so"
    api.registry_client = lambda: SharedDirectory(str(shared))

    headers = {"authorization": "Bearer ctl"}
    query = {"namespaces": f"{SCOPE},absent"}
    answer = api(Request("GET", "/v1/registry", query, headers, b"", "127.0.0.1"))
    doc = json.loads(answer.body)
    assert answer.status == 200 and doc["errors"] == []
    assert sorted(c["id"] for c in doc["checkpoints"]) == sorted([first.id, second.id])
    blobs = {d: s for c in doc["checkpoints"] for d, s in c["blobs"]}
    on_disk = {f"sha256:{p.name}": p.stat().st_size for p in (shared / SCOPE / "blobs").rglob("*")
               if p.is_file()}  # fmt: skip
    assert blobs.items() <= on_disk.items(), "each blob named with its real size"

    status, doc = _call(api, "POST", "/v1/pin", "ctl", {"id": first.id, "pinned": True})
    assert status == 200 and doc["inRegistry"] and doc["registryError"] == ""
    assert remote.prune(SCOPE, "web", keep=0) == [second.id], "the pin reached the registry"
    assert _call(api, "POST", "/v1/delete", "ctl", {"id": first.id})[1]["inRegistry"]
    assert remote.prune(SCOPE, "web", keep=0) == [first.id], "a deleted one is not kept there"


def test_a_pin_made_before_the_push_reaches_the_registry_once_pushed(tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o700)
    store = open_store(tmp_path / "store")
    remote = RemoteStore(store, SharedDirectory(str(shared)), "node-a")
    early = commit_checkpoint(store, {"pages-1.img": os.urandom(4096)}, label="web")
    api = _api(tmp_path, Tokens({"ctl": CONTROLLER}))
    api.registry_client = lambda: SharedDirectory(str(shared))
    status, doc = _call(api, "POST", "/v1/pin", "ctl", {"id": early.id, "pinned": True})
    assert status == 200 and doc["inRegistry"] is False, "nothing to pin there yet"
    remote.push(early.id)
    newer = commit_checkpoint(store, {"pages-1.img": os.urandom(4096)}, label="web")
    remote.push(newer.id)
    assert api.registry_pins_round() == [early.id]
    assert api.registry_pins_round() == [], "settled: no more tag lists for it"
    assert remote.prune(SCOPE, "web", keep=0) == [newer.id]
