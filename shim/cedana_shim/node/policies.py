"""Checkpoint policies per namespace, stored in the cluster as ConfigMaps and applied
by each node agent to the workloads on its node.

A policy is a ConfigMap labelled ``cedana.ai/policy=true`` in the workloads'
namespace (the dashboard writes them; ``kubectl apply`` works as well)::

    data:
      selector: "app=trainer"   # pods it covers (k=v[,k=v]; "" = every pod)
      interval: "10m"           # a leave-running checkpoint when the newest is older
      retain: "5"               # keep the newest 5 per label on each node (pins aside)
      pinLatest: "1"            # pin the newest 1 per label; unpin what it pinned before
      beforeEviction: checkpoint  # an evicted/drained pod's stop checkpoint is in the
                                # registry before it exits, whatever registry_sync says

It covers the containers of the selected pods that opt in (``CEDANA_CHECKPOINT`` or
``CEDANA_ENABLE``: their label is the env value or, for ``CEDANA_ENABLE``, the
container's name). Every key but the selector is optional. The applier's pins are
marked as the policy's (``Maintenance.pin(by_policy=True)``): it never unpins a
user's pin. ``beforeEviction`` is written for the shims to read at a stop
(checkpoint/push_before_exit.py): every (namespace, label) it covers on the node,
terminating pods included (a drain's SIGTERM must find them there).
"""

from __future__ import annotations

import logging
import re
import time
from collections import deque
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any, Final, Protocol

from ..checkpoint.policy import parse_duration
from ..checkpoint.push_before_exit import FILE as PUSH_FILE
from ..checkpoint.push_before_exit import write_labels
from ..checkpoint.store import Store, StoreConfig
from ..errors import ShimError
from .kube import KubeError

LABEL: Final = "cedana.ai/policy"
KEYS: Final = ("selector", "interval", "retain", "pinLatest", "beforeEviction")
BEFORE_EVICTION: Final = ("checkpoint",)  # the values beforeEviction takes ("" : none)
_SELECTOR_TERM = re.compile(r"[A-Za-z0-9]([-A-Za-z0-9_./]*[A-Za-z0-9])?=[-A-Za-z0-9_.]*")
LINGER_S: Final = 600.0  # a covered pod's pair outlives it: its stop may still run
OPT_IN_ENV: Final = ("CEDANA_CHECKPOINT", "CEDANA_ENABLE")
OPT_IN_ANNOTATION: Final = "cedana.ai/checkpoint"

log = logging.getLogger("cedana.node.policies")


class PolicyError(ValueError):
    """A policy that cannot be applied; the message names the key and the rule."""


@dataclass(frozen=True)
class Policy:
    namespace: str
    name: str
    selector: str = ""
    interval: float | None = None
    retain: int | None = None
    pin_latest: int | None = None
    before_eviction: str = ""

    def to_json(self) -> dict[str, Any]:
        return {
            "namespace": self.namespace,
            "name": self.name,
            "selector": self.selector,
            "interval": self.interval,
            "retain": self.retain,
            "pinLatest": self.pin_latest,
            "beforeEviction": self.before_eviction,
        }


def parse(namespace: str, name: str, data: Mapping[str, Any]) -> Policy:
    unknown = sorted(set(data) - set(KEYS))
    if unknown:
        raise PolicyError(f"policy {namespace}/{name}: unknown keys {unknown} (known: {KEYS})")
    selector = str(data.get("selector") or "").strip()
    for term in filter(None, selector.split(",")):
        if not _SELECTOR_TERM.fullmatch(term.strip()):
            raise PolicyError(f"policy {namespace}/{name}: selector term {term!r} is not key=value")
    interval = None
    if str(data.get("interval") or "").strip():
        try:
            interval = parse_duration(str(data["interval"]), f"policy {namespace}/{name}")
        except ShimError as err:
            raise PolicyError(str(err)) from None
    before_eviction = str(data.get("beforeEviction") or "").strip()
    if before_eviction and before_eviction not in BEFORE_EVICTION:
        raise PolicyError(
            f"policy {namespace}/{name}: beforeEviction {before_eviction!r} must be "
            f"{' or '.join(BEFORE_EVICTION)} (or empty)"
        )
    return Policy(
        namespace,
        name,
        selector,
        interval,
        _count(namespace, name, data, "retain", 1),
        _count(namespace, name, data, "pinLatest", 0),
        before_eviction,
    )


def _count(namespace: str, name: str, data: Mapping[str, Any], key: str, least: int) -> int | None:
    text = str(data.get(key) or "").strip()
    if not text:
        return None
    if not text.isdigit() or int(text) < least or int(text) > 1000:
        raise PolicyError(
            f"policy {namespace}/{name}: {key} {text!r} must be a whole number from {least} to 1000"
        )
    return int(text)


def from_config_map(config_map: Mapping[str, Any]) -> Policy:
    meta = config_map.get("metadata") or {}
    return parse(str(meta.get("namespace")), str(meta.get("name")), config_map.get("data") or {})


def to_config_map(policy: Policy, data: Mapping[str, str]) -> dict[str, Any]:
    return {
        "apiVersion": "v1",
        "kind": "ConfigMap",
        "metadata": {
            "name": policy.name,
            "namespace": policy.namespace,
            "labels": {LABEL: "true"},
        },
        "data": {k: str(v) for k, v in data.items() if k in KEYS and str(v).strip()},
    }


def selects(selector: str, labels: Mapping[str, str]) -> bool:
    for term in filter(None, selector.split(",")):
        key, _, value = term.strip().partition("=")
        if labels.get(key) != value:
            return False
    return True


def opted_in(pod: Mapping[str, Any]) -> list[dict[str, str]]:
    """The pod's containers that opt in, with their label (for ``CEDANA_ENABLE``,
    the container's name, as the shim takes it)."""
    spec = pod.get("spec") or {}
    annotations = (pod.get("metadata") or {}).get("annotations") or {}
    found = []
    for container in spec.get("containers") or ():
        env = {e.get("name"): e.get("value") or "" for e in container.get("env") or ()}
        name = str(container.get("name"))
        label = env.get("CEDANA_CHECKPOINT") or annotations.get(OPT_IN_ANNOTATION) or ""
        if label or "CEDANA_ENABLE" in env:
            found.append({"name": name, "label": str(label or name)})
    return found


class PolicyApi(Protocol):
    def list_policies(self) -> list[dict[str, Any]]: ...

    def list_pods(self, namespace: str, node: str, label_selector: str) -> list[dict[str, Any]]: ...


@dataclass
class PolicyApplier:
    """One round: every policy, applied to the covered containers on this node."""

    api: PolicyApi
    node: str
    store: Callable[[], StoreConfig | None]
    find_container: Callable[[str, str, str], str]
    take_checkpoint: Callable[[str, bool], dict[str, Any]]
    clock: Callable[[], float] = time.time
    status: dict[str, dict[str, Any]] = field(default_factory=dict)
    # Per policy, the (namespace, label) pairs its beforeEviction covers here, with
    # when each was last seen (a pod gone from the API lingers: see _before_exit).
    push_before_exit: dict[str, dict[tuple[str, str], float]] = field(default_factory=dict)

    def round(self) -> None:
        try:
            maps = self.api.list_policies()
        except KubeError as err:
            log.warning("cannot list the policies: %s", err)
            return
        config = self.store()
        seen = set()
        for config_map in maps:
            meta = config_map.get("metadata") or {}
            key = f"{meta.get('namespace')}/{meta.get('name')}"
            seen.add(key)
            state = self.status.setdefault(
                key, {"policy": key, "node": self.node, "covered": [], "actions": [],
                      "error": ""}
            )  # fmt: skip
            try:
                policy = from_config_map(config_map)
                if config is not None:
                    self._apply(policy, Store(config), state)
                self.push_before_exit[key] = self._before_exit(policy, key)
                state["error"] = ""
            except (PolicyError, ShimError, KubeError, LookupError, RuntimeError) as err:
                state["error"] = str(err)
                log.warning("policy %s: %s", key, err)
            state["appliedAt"] = self.clock()
        for gone in set(self.status) - seen:
            del self.status[gone]
        for gone in set(self.push_before_exit) - seen:
            del self.push_before_exit[gone]
        if config is not None:
            pairs = {p for seen in self.push_before_exit.values() for p in seen}
            try:
                if write_labels(config.root, pairs):
                    log.info("stops that wait for the registry: %s", sorted(pairs) or "none")
            except OSError as err:
                log.warning("cannot write %s in %s: %s", PUSH_FILE, config.root, err)

    def _before_exit(self, policy: Policy, key: str) -> dict[tuple[str, str], float]:
        """What the policy's beforeEviction covers on this node: every pod it selects
        here, terminating ones too (a drained pod's stop reads the file), and for
        :data:`LINGER_S` those that left the API (a pod deleted at once, whose
        container is still stopping); nothing once the key is gone from the policy."""
        if not policy.before_eviction:
            return {}
        now = self.clock()
        seen = {
            pair: when
            for pair, when in self.push_before_exit.get(key, {}).items()
            if now - when < LINGER_S
        }
        for pod in self.api.list_pods(policy.namespace, self.node, policy.selector):
            for container in opted_in(pod):
                seen[(policy.namespace, container["label"])] = now
        return seen

    def _apply(self, policy: Policy, store: Store, state: dict[str, Any]) -> None:
        actions: deque[str] = deque(state["actions"], maxlen=10)
        covered = []
        labels = set()
        for pod in self.api.list_pods(policy.namespace, self.node, policy.selector):
            meta = pod.get("metadata") or {}
            if meta.get("deletionTimestamp") or (pod.get("status") or {}).get("phase") not in (
                None,
                "Running",
            ):
                continue
            for container in opted_in(pod):
                covered.append(f"{meta.get('name')}/{container['name']}")
                labels.add(container["label"])
                if policy.interval is not None:
                    taken = self._periodic(policy, store, str(meta.get("name")), container)
                    if taken:
                        actions.append(f"checkpoint {taken} of {meta.get('name')}")
        for label in sorted(labels):
            if policy.pin_latest is not None:
                actions.extend(self._pins(policy, store, label))
            if policy.retain is not None:
                for removed in store.maintenance.prune(
                    scope=policy.namespace, label=label, keep=policy.retain
                ):
                    actions.append(f"removed {removed} (retain {policy.retain})")
        state["covered"] = covered
        state["actions"] = list(actions)

    def _periodic(self, policy: Policy, store: Store, pod: str, container: dict[str, str]) -> str:
        """A checkpoint when the label's newest is older than the interval; its id."""
        entries = store.catalog.list(scope=policy.namespace, label=container["label"])
        newest = max((_created(e.created) for e in entries), default=0.0)
        assert policy.interval is not None
        if self.clock() - newest < policy.interval:
            return ""
        container_id = self.find_container(policy.namespace, pod, container["name"])
        return str(self.take_checkpoint(container_id, True).get("id") or "")

    def _pins(self, policy: Policy, store: Store, label: str) -> list[str]:
        assert policy.pin_latest is not None
        done = []
        entries = sorted(
            (e for e in store.catalog.list(scope=policy.namespace, label=label) if not e.damage),
            key=lambda e: e.created,
            reverse=True,
        )
        for index, entry in enumerate(entries):
            if index < policy.pin_latest and not entry.pinned:
                store.maintenance.pin(entry.id, True, by_policy=True)
                done.append(f"pinned {entry.id}")
            elif index >= policy.pin_latest and entry.pinned_by == "policy":
                store.maintenance.pin(entry.id, False)
                done.append(f"unpinned {entry.id}")
        return done


def _created(text: str) -> float:
    try:
        return datetime.fromisoformat(text.replace("Z", "+00:00")).astimezone(UTC).timestamp()
    except ValueError:
        return 0.0
