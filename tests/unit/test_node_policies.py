"""Namespace policies (ConfigMaps): parsed strictly, and applied by a node agent to
its node's real store: a checkpoint when the newest is older than the interval, the
newest N pinned as the policy's (a user's pin never taken back), retention."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from cedana_shim.checkpoint.store import StoreConfig
from cedana_shim.node.policies import (
    LINGER_S,
    PolicyApplier,
    PolicyError,
    parse,
    to_config_map,
)
from support.checkpoints import commit_checkpoint, open_store


def test_a_policy_is_parsed_strictly() -> None:
    policy = parse("team-a", "p", {"selector": "app=web", "interval": "10m", "retain": "2"})
    assert (policy.interval, policy.retain, policy.pin_latest) == (600.0, 2, None)
    assert to_config_map(policy, {"selector": "app=web", "retain": "2", "pinLatest": ""})[
        "data"
    ] == {"selector": "app=web", "retain": "2"}
    for data, why in (
        ({"interval": "often"}, "not a duration"),
        ({"interval": "1s"}, "out of range"),
        ({"retain": "0"}, "retain '0' must be a whole number from 1"),
        ({"pinLatest": "-1"}, "pinLatest"),
        ({"selector": "app"}, "not key=value"),
        ({"colour": "red"}, "unknown keys"),
    ):
        with pytest.raises(PolicyError, match=why):
            parse("team-a", "p", data)


class Api:
    def __init__(self, policy: dict[str, str]) -> None:
        self.policy = policy

    def list_policies(self) -> list[dict[str, Any]]:
        meta = {"name": "keep", "namespace": "team-a", "labels": {"cedana.ai/policy": "true"}}
        return [{"metadata": meta, "data": self.policy}]

    def list_pods(self, namespace: str, node: str, label_selector: str) -> list[dict[str, Any]]:
        assert (namespace, node, label_selector) == ("team-a", "node-a", "app=web")
        env = [{"name": "CEDANA_CHECKPOINT", "value": "web"}]
        return [
            {
                "metadata": {"name": "web-0", "namespace": "team-a"},
                "spec": {"containers": [{"name": "app", "env": env}, {"name": "sidecar"}]},
                "status": {"phase": "Running"},
            }
        ]


def test_the_applier_checkpoints_pins_and_retains_on_the_real_store(tmp_path: Path) -> None:
    store = open_store(tmp_path / "store")
    taken: list[str] = []

    def take(container_id: str, leave_running: bool) -> dict[str, Any]:
        assert (container_id, leave_running) == ("cid-of-app", True)
        entry = commit_checkpoint(store, {"p.img": b"x"}, label="web", scope="team-a")
        taken.append(entry.id)
        return {"id": entry.id}

    def find(namespace: str, pod: str, container: str) -> str:
        assert (namespace, pod, container) == ("team-a", "web-0", "app")
        return "cid-of-app"

    config = StoreConfig(root=str(tmp_path / "store"))
    old = [commit_checkpoint(store, {"p.img": b"y"}, label="web", scope="team-a") for _ in range(3)]
    store.maintenance.pin(old[0].id)  # a user's pin
    api = Api({"selector": "app=web", "interval": "10m", "retain": "1", "pinLatest": "1"})
    applier = PolicyApplier(api, "node-a", lambda: config, find, take, clock=lambda: 2e9)
    applier.round()
    status = applier.status["team-a/keep"]
    assert status["error"] == "" and status["covered"] == ["web-0/app"]
    assert len(taken) == 1, "the newest checkpoint was older than the interval"
    kept = {e.id: e.pinned_by for e in store.catalog.list()}
    # The new one pinned by the policy, the user's pin kept; retain 1 kept the newest
    # unpinned one (pins do not count) and pruned the rest.
    assert kept == {taken[0]: "policy", old[0].id: "user", old[2].id: ""}
    assert f"pinned {taken[0]}" in status["actions"]

    applier.clock = lambda: 0.0  # the newest is now "younger" than the interval
    applier.round()
    assert len(taken) == 1
    newer = commit_checkpoint(store, {"p.img": b"z"}, label="web", scope="team-a")
    applier.round()
    kept = {e.id: e.pinned_by for e in store.catalog.list()}
    assert kept == {newer.id: "policy", old[0].id: "user", taken[0]: ""}, (
        "the policy moves its own pin, never the user's"
    )


def test_before_eviction_is_written_for_the_shims_of_the_node(tmp_path: Path) -> None:
    """beforeEviction names the covered (namespace, label) pairs in the store's
    push-before-exit.json, terminating pods included; the shim reads it at a stop."""
    from cedana_shim.checkpoint.push_before_exit import read_labels, wants_push_before_exit

    with pytest.raises(PolicyError, match="beforeEviction 'yes' must be checkpoint"):
        parse("team-a", "p", {"beforeEviction": "yes"})
    assert parse("team-a", "p", {"beforeEviction": "checkpoint"}).before_eviction == "checkpoint"

    class Draining(Api):
        def list_pods(self, namespace: str, node: str, selector: str) -> list[dict[str, Any]]:
            pods = super().list_pods(namespace, node, selector)
            pods[0]["metadata"]["deletionTimestamp"] = "2026-12-04T21:00:00Z"  # being evicted
            return pods

    open_store(tmp_path / "store")
    root = str(tmp_path / "store")
    api = Draining({"selector": "app=web", "beforeEviction": "checkpoint"})

    def nothing(*_: Any) -> Any:
        raise AssertionError("beforeEviction alone takes no checkpoint")

    now = [1000.0]
    applier = PolicyApplier(
        api, "node-a", lambda: StoreConfig(root=root), nothing, nothing, clock=lambda: now[0]
    )
    applier.round()
    assert read_labels(root) == {("team-a", "web")}
    assert wants_push_before_exit(root, "team-a", "web")
    assert not wants_push_before_exit(root, "team-a", "other")
    # The evicted pod leaves the API while its container is still stopping: its pair
    # stays for LINGER_S, then goes.
    api.list_pods = lambda *_: []  # type: ignore[method-assign]
    now[0] += LINGER_S - 1
    applier.round()
    assert read_labels(root) == {("team-a", "web")}
    now[0] += 2
    applier.round()
    assert read_labels(root) == set()
    del api.list_pods
    applier.round()
    assert read_labels(root) == {("team-a", "web")}
    api.policy = {"selector": "app=web"}  # the key removed: the shims are told at once
    applier.round()
    assert read_labels(root) == set()
