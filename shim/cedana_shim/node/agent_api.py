"""The node agent's API: what it knows and can do on its node, for the controller only.

Every request carries a bearer token; the agent asks the API server who it belongs
to (TokenReview) and answers only the controller's ServiceAccount
(``--controller-user``, ``system:serviceaccount:<ns>:<name>``): 401 without a token
or with one the API server does not know, 403 for anyone else. Users never reach
this API; the controller checks their rights (SubjectAccessReview) before it calls.
A token's review is remembered for :data:`REVIEW_TTL` seconds (by its SHA-256), so
the controller's polling costs one TokenReview a minute, not one a request.

GET  /v1/node         the node: taint decision, store use, registry, pending pushes,
                      the operations finished lately (checkpoints, restores, failures),
                      how each namespace policy was applied here (node/policies.py)
GET  /v1/checkpoints  the checkpoints in this node's store
GET  /v1/registry?namespaces=a,b
                      what the node's registry holds for those namespaces: each
                      checkpoint's blobs and sizes, read with the node's credentials
                      (registry_use.py); 404 when the node has no registry
POST /v1/checkpoint   {"namespace", "pod", "container", "leaveRunning"}: checkpoint now
POST /v1/pin          {"id", "pinned"}: exempt from retention, or end that, in this
                      node's store and in the registry (checkpoint/remote/pins.py;
                      one whose push is still to come: registry_pins_round, later)
POST /v1/delete       {"id"}: remove from this node's store (and its pin in the registry)
"""

from __future__ import annotations

import hashlib
import json
import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Final

from .. import errors
from ..checkpoint.remote import Outbox
from ..checkpoint.remote.pins import set_pin
from ..checkpoint.store import Store, StoreConfig
from ..untrusted_json import loads
from .http_server import Request, Response
from .kube import Identity, KubeError, TokenApi
from .registry_use import RegistryUse

if TYPE_CHECKING:
    from ..registry import Registry

REVIEW_TTL: Final = 60.0
HISTORY: Final = 200  # operations kept for /v1/node (the agent's memory only)

log = logging.getLogger("cedana.node.api")


def json_response(status: int, doc: Any) -> Response:
    return Response(status, json.dumps(doc).encode())


def error(status: int, message: str) -> Response:
    return json_response(status, {"error": message})


class TokenCheck:
    """Who a bearer token belongs to, by TokenReview, remembered for ``ttl`` seconds."""

    def __init__(self, api: TokenApi, ttl: float = REVIEW_TTL) -> None:
        self._api = api
        self._ttl = ttl
        self._seen: dict[str, tuple[float, Identity | None]] = {}
        self._lock = threading.Lock()

    def identity(self, token: str) -> Identity | None:
        key = hashlib.sha256(token.encode()).hexdigest()
        now = time.monotonic()
        with self._lock:
            hit = self._seen.get(key)
            if hit is not None and hit[0] > now:
                return hit[1]
        found = self._api.review_token(token)  # KubeError: the caller answers 503
        with self._lock:
            if len(self._seen) > 1024:  # forget expired reviews before the map grows
                self._seen = {k: v for k, v in self._seen.items() if v[0] > now}
            self._seen[key] = (now + self._ttl, found)
        return found


@dataclass
class AgentApi:
    """The request handler (see the module doc). ``store`` gives the node's store
    config (None when the node config cannot be read); ``find_container`` and
    ``take_checkpoint`` reach the CRI and the shim; ``taint`` the last decision."""

    node: str
    tokens: TokenCheck
    controller_user: str
    store: Callable[[], StoreConfig | None]
    find_container: Callable[[str, str, str], str]  # (namespace, pod, container) -> id
    take_checkpoint: Callable[[str, bool], dict[str, Any]]  # (container id, leave running)
    registry: Callable[[], str] = lambda: ""
    taint: Callable[[], dict[str, Any] | None] = lambda: None
    policies: Callable[[], list[dict[str, Any]]] = lambda: []  # how each was applied here
    registry_client: Callable[[], Registry | None] = lambda: None  # the node's, or None
    usage: RegistryUse = field(default_factory=RegistryUse)
    # Pinned checkpoints whose registry pin was settled (done, or not in the registry
    # once pushed): registry_pins_round leaves them alone.
    _settled: set[str] = field(default_factory=set)
    history: deque[dict[str, Any]] = field(default_factory=lambda: deque(maxlen=HISTORY))

    def __call__(self, request: Request) -> Response:
        token = request.bearer()
        if not token:
            return error(401, "no bearer token: this API answers the cedana controller only")
        try:
            who = self.tokens.identity(token)
        except KubeError as err:
            return error(503, f"cannot check the token with the API server (TokenReview): {err}")
        if who is None:
            return error(401, "the API server does not know this token (TokenReview)")
        if who.user != self.controller_user:
            log.warning("refused %s %s from %s", request.method, request.path, who.user)
            return error(403, f"{who.user} is not the cedana controller ({self.controller_user})")
        route = (request.method, request.path)
        try:
            if route == ("GET", "/v1/node"):
                return json_response(200, self.node_state())
            if route == ("GET", "/v1/checkpoints"):
                return json_response(200, self.checkpoints())
            if route == ("GET", "/v1/registry"):
                return self.registry_use(request.query.get("namespaces", ""))
            if request.method == "POST" and request.path in _ACTIONS:
                body = loads(request.body or b"{}")
                if not isinstance(body, dict):
                    return error(400, "the body must be a JSON object")
                return _ACTIONS[request.path](self, body)
        except (ValueError, KeyError, TypeError) as err:
            return error(400, f"a malformed request: {err}")
        except errors.NotFound as err:
            return error(404, str(err))
        except errors.InvalidArgument as err:
            return error(400, str(err))
        except errors.ShimError as err:
            return error(500, str(err))
        return error(404, f"no {request.method} {request.path} here")

    # -- views -------------------------------------------------------------------------

    def _open(self) -> tuple[StoreConfig, Store] | None:
        config = self.store()
        if config is None:
            return None
        return config, Store(config)

    def node_state(self) -> dict[str, Any]:
        opened = self._open()
        store: dict[str, Any] = {"root": "", "checkpoints": 0, "bytes": 0, "readable": False}
        pending: list[str] = []
        if opened is not None:
            config, opened_store = opened
            entries = opened_store.catalog.list()
            cached = sum(e.raw_bytes for e in entries if e.state == "compacted")
            store = {
                "root": config.root,
                "checkpoints": len(entries),
                "bytes": sum(e.size for e in entries) + cached,
                "readable": True,
            }
            pending = Outbox(config.root).pending()
        return {
            "node": self.node,
            "taint": self.taint(),
            "store": store,
            "registry": self.registry(),
            "pendingPushes": pending,
            "recent": list(self.history),
            "policies": self.policies(),
        }

    def checkpoints(self) -> dict[str, Any]:
        opened = self._open()
        if opened is None:
            return {"node": self.node, "checkpoints": []}
        config, store = opened
        pending = set(Outbox(config.root).pending())
        items = []
        for entry in store.catalog.list():
            doc = entry.to_json()
            doc.pop("layers", None)
            meta = entry.metadata
            # How long it took is in the operation record (the history), not here.
            doc.update(
                pod=meta.get("pod") or "",
                pendingPush=entry.id in pending,
                trigger=meta.get("reason") or "",
                image=meta.get("image") or "",
            )
            items.append(doc)
        return {"node": self.node, "checkpoints": items}

    def registry_use(self, namespaces: str) -> Response:
        client = self.registry_client()
        if client is None:
            return error(404, f"node {self.node} pushes to no registry")
        wanted = [n for n in namespaces.split(",") if n]
        return json_response(200, {"node": self.node, **self.usage.read(client, wanted)})

    # -- actions -----------------------------------------------------------------------

    def checkpoint_now(self, body: dict[str, Any]) -> Response:
        namespace, pod = str(body["namespace"]), str(body["pod"])
        container = str(body.get("container") or "")
        try:
            container_id = self.find_container(namespace, pod, container)
            taken = self.take_checkpoint(container_id, bool(body.get("leaveRunning", True)))
        except LookupError as err:
            return error(404, str(err))
        except RuntimeError as err:
            return error(409, str(err))
        return json_response(200, {"node": self.node, **taken})

    def pin(self, body: dict[str, Any]) -> Response:
        opened = self._need_store()
        checkpoint_id, pinned = str(body["id"]), bool(body.get("pinned", True))
        scope = opened.catalog.get(checkpoint_id).scope
        opened.maintenance.pin(checkpoint_id, pinned)
        answer = {"node": self.node, "id": checkpoint_id, "pinned": pinned}
        return json_response(200, {**answer, **self._registry_pin(scope, checkpoint_id, pinned)})

    def delete(self, body: dict[str, Any]) -> Response:
        opened = self._need_store()
        checkpoint_id = str(body["id"])
        scope = opened.catalog.get(checkpoint_id).scope
        opened.maintenance.remove(checkpoint_id)
        # The registry's copy stays, for its retention to remove in time: not if pinned.
        registry = self._registry_pin(scope, checkpoint_id, False)
        return json_response(
            200, {"node": self.node, "id": checkpoint_id, "deleted": True, **registry}
        )

    def registry_pins_round(self) -> list[str]:
        """Pin in the registry what a user pinned here before its push reached it
        (the pin then found nothing to pin there); the ids pinned now. Run every
        round beside the policies: one tag list per such checkpoint, once pushed."""
        client = self.registry_client()
        opened = self._open()
        if client is None or opened is None:
            return []
        config, store = opened
        pending = set(Outbox(config.root).pending())
        done = []
        for entry in store.catalog.list():
            if entry.pinned_by != "user" or entry.id in self._settled or entry.id in pending:
                continue
            try:
                if set_pin(client, entry.scope, entry.id, True, self.node):
                    done.append(entry.id)
            except errors.ShimError as err:
                log.warning("registry pin of %s: %s (next round again)", entry.id, err)
                continue
            self._settled.add(entry.id)
        return done

    def _registry_pin(self, scope: str, checkpoint_id: str, pinned: bool) -> dict[str, Any]:
        """Pin (or unpin) in the registry too; ``inRegistry``: whether it holds the
        checkpoint, ``registryError``: why that failed ("" when it did not)."""
        client = self.registry_client()
        if client is None:
            return {"inRegistry": False, "registryError": ""}
        try:
            held = set_pin(client, scope, checkpoint_id, pinned, self.node)
        except errors.ShimError as err:
            log.warning("registry pin of %s: %s", checkpoint_id, err)
            return {"inRegistry": True, "registryError": str(err)}
        # Not held yet (its push still to come): registry_pins_round pins it later.
        if held or not pinned:
            self._settled.add(checkpoint_id)
        else:
            self._settled.discard(checkpoint_id)
        return {"inRegistry": held, "registryError": ""}

    def _need_store(self) -> Store:
        opened = self._open()
        if opened is None:
            raise errors.NotFound(f"node {self.node} cannot read its node config or store")
        return opened[1]


_ACTIONS: Final[dict[str, Callable[[AgentApi, dict[str, Any]], Response]]] = {
    "/v1/checkpoint": AgentApi.checkpoint_now,
    "/v1/pin": AgentApi.pin,
    "/v1/delete": AgentApi.delete,
}
