"""The dashboard's API and who may use it: a real controller and two real node agents
(their own processes, each node's store a real checkpoint store on disk), against
the Kubernetes API stand-in (harness/kube_api.py: no kube-apiserver is installable
here), which answers TokenReview and SubjectAccessReview from RBAC-like rules.

* without a token, or with one the API server does not know: 401;
* a user sees only the namespaces where RBAC lets them `get pods`; another
  namespace's checkpoints are neither listed nor shown, and its actions refused (403
  naming the verb); the nodes only with `list nodes`;
* pin and delete act on the real stores of every node holding the checkpoint, and are
  audited: a line in the controller's log and an Event on the pod, naming the user;
* a node agent answers the controller's ServiceAccount only: no token, a user's
  token, or a forged one are refused;
* a policy saved through the API (a ConfigMap) is applied by the node agent that
  runs the pods it selects: it pins the newest checkpoint of their label in the real
  store, and the policies view shows what it covers and what was done; a malformed
  policy is refused with the rule it breaks, and a user without `update configmaps`
  may not save one;
* registry use: what node A's registry holds for the namespaces a user may see, in
  bytes (each blob once), read by node A's agent; a pin through the API reaches the
  registry, where no node's retention deletes the checkpoint until it is unpinned;
* "start a copy" creates a pod with the source's spec, no labels of its own but
  `cedana.ai/copy-of`, and `cedana.ai/restore: <id>`; without `create pods`, 403.
The containerd-backed flows (checkpoint now, migrate) and the browser are in
test_dashboard.py.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from cedana_shim.checkpoint.remote import RemoteStore
from cedana_shim.checkpoint.remote.manifest import EMPTY_DIGEST
from cedana_shim.checkpoint.remote.shared_dir import SharedDirectory
from cedana_shim.checkpoint.store import Store
from support.checkpoints import commit_checkpoint, open_store

from .harness.dashboard import (
    CONTROLLER_TOKEN,
    Controller,
    agent,
    controller,
    free_port,
    http_json,
    namespace_rules,
)
from .harness.kube_api import FakeKubeApi, Rule
from .harness.util import wait_for

ALICE, BOB = "alice-token", "bob-token"
REGISTRY_A = 'registry = "/shared"\n'  # under node A's host root


@dataclass
class Setup:
    kube: FakeKubeApi
    ctl: Controller
    store_a: Store
    store_b: Store
    registry_a: Path  # node A's registry (a shared directory)
    team_a: str  # checkpoint ids
    team_b: str
    agent_port: int


@pytest.fixture
def setup(tmp_path: Path) -> Iterator[Setup]:
    kube = FakeKubeApi()
    kube.add_token(ALICE, "alice@example.com")
    kube.add_token(BOB, "bob@example.com")
    kube.allow(
        "alice@example.com",
        *namespace_rules(
            "team-a",
            ("get", "pods"),
            ("update", "pods"),
            ("update", "configmaps"),
            ("create", "pods"),
            ("create", "pods/eviction"),
            ("delete", "configmaps"),
        ),
        Rule("*", "list", "nodes"),
    )
    kube.allow("bob@example.com", *namespace_rules("team-b", ("get", "pods")))
    roots = {n: tmp_path / n for n in ("a", "b")}
    for root in roots.values():
        root.mkdir()
    # Node A pushes to a registry: a shared directory (the remote store's other
    # backend, the same code for tags, manifests, pins and retention as a registry's).
    (roots["a"] / "shared").mkdir(mode=0o700)
    store_a, store_b = open_store(roots["a"] / "store"), open_store(roots["b"] / "store")
    team_a = commit_checkpoint(store_a, {"pages-1.img": b"a" * 4096}, label="web", scope="team-a")
    team_b = commit_checkpoint(store_b, {"pages-1.img": b"b" * 4096}, label="db", scope="team-b")
    # The pod the team-a checkpoint came from, on node A, opted in.
    env = [{"name": "CEDANA_CHECKPOINT", "value": "web"}]
    kube.add_pod(
        {
            "metadata": {"name": "trainer-0", "namespace": "team-a", "labels": {"app": "web"}},
            "spec": {
                "nodeName": "node-a",
                "containers": [{"name": "trainer", "image": "x", "env": env}],
            },
        }
    )
    kube.add_pod(
        {
            "metadata": {"name": "plain-0", "namespace": "team-a"},
            "spec": {"nodeName": "node-a", "containers": [{"name": "web", "image": "x"}]},
        }
    )
    port = free_port()
    try:
        with (
            agent(kube, roots["a"], "node-a", "127.0.0.1", port, extra_config=REGISTRY_A),
            agent(kube, roots["b"], "node-b", "127.0.0.2", port),
            controller(kube, tmp_path, port) as ctl,
        ):
            yield Setup(
                kube, ctl, store_a, store_b, roots["a"] / "shared", team_a.id, team_b.id, port
            )
    finally:
        kube.close()


def test_sign_in_needs_a_token_the_cluster_knows(setup: Setup) -> None:
    status, doc = setup.ctl.call("GET", "/api/v1/cluster")
    assert status == 401 and "bearer token" in doc["error"]
    status, doc = setup.ctl.call("GET", "/api/v1/cluster", "forged-token")
    assert status == 401 and "does not accept this token" in doc["error"]
    status, doc = setup.ctl.call("GET", "/api/v1/whoami", ALICE)
    assert status == 200, doc
    assert (doc["user"], doc["namespaces"], doc["seesNodes"]) == (
        "alice@example.com",
        ["team-a"],
        True,
    )


def test_each_user_sees_exactly_the_namespaces_rbac_allows(setup: Setup) -> None:
    status, alice = setup.ctl.call("GET", "/api/v1/cluster", ALICE)
    assert status == 200, alice
    assert [c["id"] for c in alice["checkpoints"]] == [setup.team_a]
    assert alice["checkpoints"][0]["nodes"] == ["node-a"]
    assert sorted(n["node"] for n in alice["nodes"]) == ["node-a", "node-b"]
    status, bob = setup.ctl.call("GET", "/api/v1/cluster", BOB)
    assert status == 200, bob
    assert [c["id"] for c in bob["checkpoints"]] == [setup.team_b]
    assert bob["nodes"] is None, "bob may not list nodes"

    status, doc = setup.ctl.call("GET", "/api/v1/namespaces/team-b", ALICE)
    assert status == 403 and "may not get pods in namespace team-b" in doc["error"]
    status, doc = setup.ctl.call("GET", f"/api/v1/checkpoints/{setup.team_b}", ALICE)
    assert status == 403 and "team-b" in doc["error"]
    status, doc = setup.ctl.call("GET", f"/api/v1/checkpoints/{setup.team_a}", ALICE)
    assert status == 200, doc
    assert f'CEDANA_RESTORE, value: "{setup.team_a}"' in doc["restoreByHand"]
    status, doc = setup.ctl.call("GET", "/api/v1/namespaces/team-a", ALICE)
    assert status == 200 and doc["labels"] == ["web"]
    assert [p["id"] for p in doc["timeline"]["checkpoints"]] == [setup.team_a]


def test_pin_and_delete_change_the_real_stores_and_are_audited(setup: Setup) -> None:
    status, doc = setup.ctl.call(
        "POST", f"/api/v1/checkpoints/{setup.team_b}/pin", BOB, {"pinned": True}
    )
    assert status == 403 and "may not update pods in namespace team-b" in doc["error"]
    assert not setup.store_b.catalog.get(setup.team_b).pinned

    status, doc = setup.ctl.call(
        "POST", f"/api/v1/checkpoints/{setup.team_a}/pin", ALICE, {"pinned": True}
    )
    assert (status, doc["nodes"]) == (200, ["node-a"]), doc
    assert setup.store_a.catalog.get(setup.team_a).pinned
    status, doc = setup.ctl.call("POST", f"/api/v1/checkpoints/{setup.team_a}/delete", ALICE)
    assert status == 200, doc
    assert setup.store_a.catalog.list() == []
    status, doc = setup.ctl.call("POST", f"/api/v1/checkpoints/{setup.team_a}/delete", ALICE)
    assert status == 404 and "no node holds" in doc["error"]

    reasons = [(e["reason"], e["involvedObject"]["name"]) for e in setup.kube.events_by("Cedana")]
    assert reasons == [("CedanaPin", "trainer-0"), ("CedanaDelete", "trainer-0")]
    assert all("alice@example.com" in e["message"] for e in setup.kube.events_by("Cedana"))
    log = setup.ctl.proc.log
    wait_for(
        lambda: "audit user=alice@example.com action=delete" in log.read_text(),
        timeout=10,
        what="the audit line in the controller's log",
    )


def test_a_node_agent_answers_the_controller_only(setup: Setup) -> None:
    url = f"http://127.0.0.2:{setup.agent_port}/v1/checkpoints"
    status, doc = http_json(url)
    assert status == 401 and "no bearer token" in doc["error"]
    status, doc = http_json(url, token="forged-token")
    assert status == 401 and "TokenReview" in doc["error"]
    status, doc = http_json(url, token=ALICE)
    assert status == 403 and "alice@example.com is not the cedana controller" in doc["error"]
    agent = f"http://127.0.0.2:{setup.agent_port}"
    status, doc = http_json(f"{agent}/v1/pin", "POST", BOB, {"id": setup.team_b, "pinned": True})
    assert status == 403 and "bob@example.com" in doc["error"]
    status, doc = http_json(f"{agent}/v1/delete", "POST", "", {"id": setup.team_b})
    assert status == 401
    status, doc = http_json(url, token=CONTROLLER_TOKEN)
    assert status == 200 and [c["id"] for c in doc["checkpoints"]] == [setup.team_b]
    entry = setup.store_b.catalog.get(setup.team_b)  # still there: the delete was refused
    assert not entry.pinned, "the refused pin changed nothing"


def test_a_policy_saved_through_the_api_is_applied_by_the_node_agent(setup: Setup) -> None:
    path = "/api/v1/namespaces/team-a/policies/keep-latest"
    status, doc = setup.ctl.call("POST", path, BOB, {"selector": "app=web"})
    assert status == 403 and "may not update configmaps in namespace team-a" in doc["error"]
    status, doc = setup.ctl.call("POST", path, ALICE, {"selector": "app=web", "retain": "0"})
    assert status == 400 and "retain '0' must be a whole number from 1" in doc["error"]
    status, doc = setup.ctl.call(
        "POST", path, ALICE, {"selector": "app=web", "pinLatest": "1", "interval": ""}
    )
    assert status == 200 and doc["pinLatest"] == 1, doc
    saved = setup.kube.state.config_maps[("team-a", "keep-latest")]
    assert saved["data"] == {"selector": "app=web", "pinLatest": "1"}
    assert saved["metadata"]["labels"] == {"cedana.ai/policy": "true"}

    wait_for(
        lambda: setup.store_a.catalog.get(setup.team_a).pinned_by == "policy",
        timeout=30,
        what="node A's agent to pin the newest checkpoint for the policy",
    )
    status, doc = setup.ctl.call("GET", "/api/v1/namespaces/team-a/policies", ALICE)
    assert status == 200, doc
    [policy] = doc["policies"]
    assert policy["covers"] == ["trainer-0/trainer"] and policy["error"] == ""
    [applied] = [a for a in policy["applied"] if a["node"] == "node-a"]
    assert applied["covered"] == ["trainer-0/trainer"]
    assert f"pinned {setup.team_a}" in applied["actions"]
    reasons = [(e["reason"], e["involvedObject"]) for e in setup.kube.events_by("CedanaPolicy")]
    assert [r[1]["kind"] for r in reasons] == ["ConfigMap"]

    status, doc = setup.ctl.call("POST", path + "/delete", BOB)
    assert status == 403 and "may not delete configmaps" in doc["error"]
    status, doc = setup.ctl.call("POST", path + "/delete", ALICE)
    assert status == 200, doc
    assert ("team-a", "keep-latest") not in setup.kube.state.config_maps
    status, doc = setup.ctl.call("GET", "/api/v1/namespaces/team-a/policies", ALICE)
    assert doc["policies"] == []
    status, doc = setup.ctl.call("POST", path + "/delete", ALICE)
    assert status == 404 and "no policy keep-latest" in doc["error"]
    assert setup.store_a.catalog.get(setup.team_a).pinned_by == "policy", "its pins stay"


def test_a_copy_of_a_pod_starts_from_the_chosen_checkpoint(setup: Setup) -> None:
    status, doc = setup.ctl.call("POST", f"/api/v1/checkpoints/{setup.team_b}/copy", BOB)
    assert status == 403 and "may not create pods in namespace team-b" in doc["error"]
    status, doc = setup.ctl.call("POST", f"/api/v1/checkpoints/{setup.team_a}/copy", ALICE)
    assert status == 201, doc
    assert doc["pod"].startswith("trainer-0-copy-") and doc["checkpoint"] == setup.team_a
    copy = setup.kube.state.pods[("team-a", doc["pod"])]
    source = setup.kube.state.pods[("team-a", "trainer-0")]
    assert copy["metadata"]["annotations"] == {"cedana.ai/restore": setup.team_a}
    assert copy["metadata"]["labels"] == {"cedana.ai/copy-of": "trainer-0"}
    assert "nodeName" not in copy["spec"], "the scheduler places the copy"
    assert copy["spec"]["containers"] == source["spec"]["containers"]
    [event] = setup.kube.events_by("CedanaCopy")
    assert event["message"].startswith("alice@example.com: copy done: pod " + doc["pod"])


def test_a_migration_is_refused_before_it_starts_when_it_cannot_work(setup: Setup) -> None:
    path = "/api/v1/namespaces/team-a/pods/{}/migrate"
    status, doc = setup.ctl.call("POST", path.format("trainer-0"), BOB)
    assert status == 403 and "may not create pods/eviction in namespace team-a" in doc["error"]
    status, doc = setup.ctl.call("POST", path.format("plain-0"), ALICE)
    assert status == 404 and "no container that opts in" in doc["error"]
    status, doc = setup.ctl.call("POST", path.format("gone-0"), ALICE)
    assert status == 404 and "no pod gone-0 in namespace team-a" in doc["error"]
    status, doc = setup.ctl.call(
        "POST", "/api/v1/namespaces/team-a/pods/plain-0/checkpoint", ALICE, {}
    )
    assert status == 404 and "no container that opts in" in doc["error"]
    assert setup.kube.state.evictions == [], "nothing was evicted"


def test_registry_use_and_a_pin_in_the_registry(setup: Setup) -> None:
    remote = RemoteStore(setup.store_a, SharedDirectory(str(setup.registry_a)), "node-a")
    remote.push(setup.team_a)
    later = commit_checkpoint(
        setup.store_a, {"pages-1.img": b"c" * 4096}, label="web", scope="team-a"
    )
    remote.push(later.id)
    blobs = setup.registry_a / "team-a" / "blobs" / "sha256"
    # Every blob there is one of the two checkpoints' but the in-flight markers' empty
    # config, which registry use does not count.
    on_disk = sum(p.stat().st_size for p in blobs.iterdir() if f"sha256:{p.name}" != EMPTY_DIGEST)
    status, alice = setup.ctl.call("GET", "/api/v1/cluster", ALICE)
    assert status == 200, alice
    [use] = alice["registryUse"]
    assert (use["via"], use["checkpoints"], use["errors"]) == ("node-a", 2, [])
    assert use["bytes"] == on_disk, "each blob counted once"
    [team_a] = use["namespaces"]
    assert (team_a["namespace"], team_a["bytes"]) == ("team-a", on_disk)
    assert [x["label"] for x in team_a["labels"]] == ["web"]
    status, bob = setup.ctl.call("GET", "/api/v1/cluster", BOB)
    assert [(u["checkpoints"], u["bytes"]) for u in bob["registryUse"]] == [(0, 0)]

    status, doc = setup.ctl.call(
        "POST", f"/api/v1/checkpoints/{setup.team_a}/pin", ALICE, {"pinned": True}
    )
    assert status == 200, doc
    other_node = RemoteStore(
        open_store(setup.registry_a.parent / "other"), SharedDirectory(str(setup.registry_a)), "x"
    )
    assert other_node.prune("team-a", "web", keep=0) == [later.id], "the pinned one stays"
    status, doc = setup.ctl.call(
        "POST", f"/api/v1/checkpoints/{setup.team_a}/pin", ALICE, {"pinned": False}
    )
    assert status == 200, doc
    assert other_node.prune("team-a", "web", keep=0) == [setup.team_a]


def test_an_operation_outlives_a_restart_of_the_controller(setup: Setup, tmp_path: Path) -> None:
    """The migration fails at its first step (no container runs trainer-0 here), and
    a new controller process, reading the operations' ConfigMap, still shows its
    steps, to Alice and not to Bob."""
    status, op = setup.ctl.call("POST", "/api/v1/namespaces/team-a/pods/trainer-0/migrate", ALICE)
    assert status == 202, op

    def ended() -> dict[str, Any] | None:
        doc = setup.ctl.call("GET", f"/api/v1/operations/{op['id']}", ALICE)[1]
        return doc if doc.get("state") != "running" else None

    first = wait_for(ended, timeout=60, what="the migration to fail at its checkpoint")
    assert [(s["name"], s["state"]) for s in first["steps"]][:2] == [
        ("checkpoint", "failed"), ("push", "skipped")
    ]  # fmt: skip
    assert ("cedana-system", "cedana-operations") in setup.kube.state.config_maps
    (tmp_path / "restarted").mkdir()
    with controller(setup.kube, tmp_path / "restarted", setup.agent_port) as restarted:
        status, doc = restarted.call("GET", f"/api/v1/operations/{op['id']}", ALICE)
        assert status == 200 and doc == first, doc
        status, cluster = restarted.call("GET", "/api/v1/cluster", ALICE)
        assert [o["id"] for o in cluster["operations"]] == [op["id"]]
        status, doc = restarted.call("GET", f"/api/v1/operations/{op['id']}", BOB)
        assert status == 404, "bob may not see team-a"
        assert restarted.call("GET", "/api/v1/cluster", BOB)[1]["operations"] == []
