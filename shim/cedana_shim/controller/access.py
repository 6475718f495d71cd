"""Who a user is (TokenReview) and what they may do in a namespace
(SubjectAccessReview), remembered briefly so that a page's dozen calls cost one
review each.

The verbs are Kubernetes' own, so ordinary RBAC decides (README "The dashboard"):

========================  =========================================
see a namespace's data    ``get pods``
checkpoint now, pin,      ``update pods``
delete a checkpoint
start a copy of a pod     ``create pods``
migrate a pod             ``create pods/eviction``
edit a namespace policy   ``update configmaps``
delete a policy           ``delete configmaps``
see the nodes             ``list nodes`` (cluster-wide)
========================  =========================================
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass
from typing import Final

from ..node.agent_api import TokenCheck
from ..node.kube import Identity
from .kube import ClusterApi

REVIEW_TTL: Final = 30.0


@dataclass(frozen=True)
class Need:
    verb: str
    resource: str
    subresource: str = ""

    def __str__(self) -> str:
        what = f"{self.resource}/{self.subresource}" if self.subresource else self.resource
        return f"{self.verb} {what}"


SEE: Final = Need("get", "pods")
CHANGE: Final = Need("update", "pods")
COPY: Final = Need("create", "pods")
MIGRATE: Final = Need("create", "pods", "eviction")
NODES: Final = Need("list", "nodes")
POLICIES: Final = Need("update", "configmaps")
DROP_POLICY: Final = Need("delete", "configmaps")


class Denied(Exception):
    """The user lacks a right; the message names it (and the namespace)."""


class Access:
    def __init__(self, api: ClusterApi, ttl: float = REVIEW_TTL) -> None:
        self._api = api
        self._tokens = TokenCheck(api, ttl)
        self._ttl = ttl
        self._seen: dict[tuple[Identity, str, Need], tuple[float, bool]] = {}
        self._lock = threading.Lock()

    def identity(self, token: str) -> Identity | None:
        return self._tokens.identity(token)

    def can(self, who: Identity, namespace: str, need: Need) -> bool:
        key = (who, namespace, need)
        now = time.monotonic()
        with self._lock:
            hit = self._seen.get(key)
            if hit is not None and hit[0] > now:
                return hit[1]
        allowed = self._api.allowed(who, namespace, need.verb, need.resource, need.subresource)
        with self._lock:
            if len(self._seen) > 4096:
                self._seen = {k: v for k, v in self._seen.items() if v[0] > now}
            self._seen[key] = (now + self._ttl, allowed)
        return allowed

    def require(self, who: Identity, namespace: str, need: Need) -> None:
        if not self.can(who, namespace, need):
            where = f"in namespace {namespace}" if namespace else "cluster-wide"
            raise Denied(
                f"{who.user} may not {need} {where}; ask a cluster admin for a Role that grants it"
            )
