"""The dashboard end to end, as a person uses it in a browser.

Real on this machine: two containerds ("node A", "node B": own roots, stores and
shims) sharing a real registry (TLS, auth), a node agent on each (`cedana node run
--agent-port`, its own process), the controller (`cedana controller run`), and
headless Chromium (Debian's `chromium`) driven over the DevTools protocol: keys typed
and pressed, the mouse clicked where buttons are drawn, confirm dialogs accepted.

Only the Kubernetes API server is a stand-in (harness/kube_api.py: none is
installable here). It answers TokenReview, SubjectAccessReview, pods, evictions and
Events, but schedules and runs nothing, so this test plays kubelet and the workload's
ReplicaSet where they would act: it starts the CRI pods the API objects describe,
and when the controller evicts the pod it stops the CRI pod on node A (as kubelet
does) and, as the ReplicaSet would, creates the replacement pod object bound to node
B and starts its CRI pod there. Everything the dashboard shows and does in between is
the controller's and the agents' own work.

A user whose RBAC allows namespace team-a only signs in with a token, sees team-a and
not team-b, checkpoints a running counter, pins that checkpoint (pinned in node A's
real store), opens the namespace and checkpoint views, migrates the pod off node A
(cordoned meanwhile) to node B (the page shows the steps; the new pod resumes the
count from the registry) and
deletes the pinned checkpoint (gone from node A's store), then types a policy into
the namespace view (every 10 s, pin the latest) and sees node B's agent apply it to
the migrated pod (a new checkpoint, pinned as the policy's in B's real store; its
stop now waits for the registry: beforeEviction). The cluster view shows the
registry's use in bytes, and a reload of the page still shows the migration's steps. Each
action left an Event naming the user. Screenshots of every view are kept
(CEDANA_TEST_ARTIFACTS, default /tmp/cedana-test-artifacts, under dashboard/).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import uuid
from pathlib import Path
from typing import Any

import pytest
from cedana_shim.checkpoint.push_before_exit import read_labels
from cedana_shim.checkpoint.remote import Outbox
from cedana_shim.checkpoint.remote.tags import parse_pin_tag
from cedana_shim.checkpoint.store import Store, StoreConfig

from .conftest import MakeNode
from .harness.browser import Browser, browser
from .harness.containerd import Containerd
from .harness.cr_events import TOPIC_RESTORE, EventStream
from .harness.cr_support import assert_continues, parse_ticks, unique_label, wait_ticks
from .harness.cri_apps import start_app, stop_app
from .harness.dashboard import agent, controller, free_port, http_json, namespace_rules
from .harness.kube_api import FakeKubeApi, Rule
from .harness.registry import PREFIX, Registry, TlsFiles
from .harness.util import wait_for

pytestmark = pytest.mark.ctrd_versions("2.1")
TOKEN = "alice-token"
USER = "alice@example.com"
OWNER = {"apiVersion": "apps/v1", "kind": "ReplicaSet", "name": "counter-5d8f",
         "uid": "rs-" + uuid.uuid4().hex[:8], "controller": True}  # fmt: skip


def artifacts() -> Path:
    root = Path(os.environ.get("CEDANA_TEST_ARTIFACTS", "/tmp/cedana-test-artifacts"))
    out = root / "dashboard"
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    return out


def pod_object(namespace: str, name: str, node: str, label: str) -> dict[str, Any]:
    """The API object of a workload pod, as its ReplicaSet makes it."""
    return {
        "metadata": {"name": name, "namespace": namespace, "labels": {"app": "counter"},
                     "ownerReferences": [OWNER]},
        "spec": {"nodeName": node, "containers": [{
            "name": "app", "image": "busybox",
            "env": [{"name": "CEDANA_CHECKPOINT", "value": label}]}]},
        "status": {"phase": "Running"},
    }  # fmt: skip


def agent_config(node: Containerd, reg: Registry, tls_files: TlsFiles, env: dict[str, str]) -> str:
    """The node config the agent reads from its host root: the same registry as the
    shims; the credential and CA files copied under the root (the agent resolves the
    config's paths there, as on a real node under /host)."""
    shutil.copy(env["CEDANA_REGISTRY_AUTH_FILE"], node.base / "registry-auth.json")
    shutil.copy(tls_files.ca_cert, node.base / "registry-ca.pem")
    return (
        f'registry = "{reg.host}/{PREFIX}"\n'
        'registry_auth_file = "/registry-auth.json"\nregistry_ca = "/registry-ca.pem"\n'
    )


def pin_tags(reg: Registry) -> set[str]:
    """The checkpoints pinned in team-a's repository (pin tags, checkpoint/remote/pins.py),
    read on the registry's disk."""
    tags = reg.storage / "docker/registry/v2/repositories" / PREFIX / "team-a" / "_manifests/tags"
    found = (parse_pin_tag(p.name) for p in (tags.iterdir() if tags.exists() else ()))
    return {t.checkpoint_id for t in found if t is not None}


def node_store(node: Containerd) -> Store:
    return Store(StoreConfig(root=str(node.store)))


def sign_in(page: Browser, url: str, shots: Path) -> None:
    """With the keyboard only: Tab from the top reaches the labelled token field."""
    page.open(url)
    page.wait("!document.querySelector('#sign-in').hidden", what="the sign-in form")
    unlabelled = page.eval(
        "[...document.querySelectorAll('input, select')].filter(e => !e.labels.length)"
        ".map(e => e.id)"
    )
    assert unlabelled == [], f"form fields without a label: {unlabelled}"
    page.eval("document.activeElement.blur()")
    for _ in range(5):
        page.press("Tab")
        if page.focused() == "input#token":
            break
    assert page.focused() == "input#token", page.focused()
    page.screenshot(shots / "1-sign-in.png")
    page.type(TOKEN)
    page.press("Enter")
    page.wait("document.querySelector('#view-title')?.textContent === 'Cluster'", what="sign-in")


def wait_status(page: Browser, text: str, timeout: float = 120) -> str:
    found: str = page.wait(
        f"(() => {{ const s = document.querySelector('#status'); "
        f"if (s.className === 'error') throw new Error(s.textContent); "
        f"return s.textContent.includes({text!r}) && s.textContent; }})()",
        what=f"the status line to say {text!r}",
        timeout=timeout,
    )
    return found


def test_a_user_drives_checkpoints_and_a_migration_from_the_browser(
    make_node: MakeNode,
    node_env: dict[str, str],
    registry: Registry,
    tls: TlsFiles,
    tmp_path: Path,
) -> None:
    shots = artifacts()
    a, b = make_node(node_env), make_node(node_env)
    kube = FakeKubeApi()
    kube.add_token(TOKEN, USER)
    kube.allow(
        USER,
        *namespace_rules(
            "team-a",
            ("get", "pods"),
            ("update", "pods"),
            ("create", "pods/eviction"),
            ("update", "configmaps"),
        ),
        Rule("*", "list", "nodes"),
    )
    label = unique_label("dash")
    port = free_port()
    cri_a, cri_b = a.cri(), b.cri()
    try:
        with (
            agent(kube, a.base, "node-a", "127.0.0.1", port, containerd_socket=a.socket,
                  store=f"/{a.store.name}", extra_config=agent_config(a, registry, tls, node_env)),
            agent(kube, b.base, "node-b", "127.0.0.2", port, containerd_socket=b.socket,
                  store=f"/{b.store.name}", extra_config=agent_config(b, registry, tls, node_env)),
            controller(kube, tmp_path, port) as ctl,
            EventStream(b.socket) as events_b,
            browser(tmp_path) as page,
            contextlib.ExitStack() as stack,
        ):  # fmt: skip
            # kubelet's part: the pods the API objects describe, running for real.
            first = start_app(stack, a, cri_a, label=label, namespace="team-a",
                              host_network=False, pod_name="counter-0")  # fmt: skip
            kube.add_pod(pod_object("team-a", "counter-0", "node-a", label))
            other = start_app(stack, b, cri_b, label=unique_label("other"), namespace="team-b",
                              pod_name="db-0")  # fmt: skip
            kube.add_pod(pod_object("team-b", "db-0", "node-b", "other"))
            wait_ticks(first.stdout, count=3)
            wait_ticks(other.stdout, count=1)

            sign_in(page, ctl.url + "/", shots)
            options = page.eval(
                "[...document.querySelectorAll('#ns-pick option')].map(o => o.value)"
            )
            assert options == ["", "team-a"], "alice must see team-a only"
            body = page.text()
            assert "counter-0" in body and "db-0" not in body and "team-b" not in body
            assert "node-a" in body and "node-b" in body  # she may list nodes

            # Checkpoint now, with the keyboard: focus the button, press Enter.
            page.eval(
                "document.querySelector('[aria-label=\"Checkpoint team-a/counter-0 now\"]').focus()"
            )
            page.press("Enter")
            status = wait_status(page, "Checkpointing team-a/counter-0: done")
            taken = status.split("(")[-1].rstrip(")")
            assert node_store(a).catalog.get(taken).label == label
            page.wait(f"document.body.innerText.includes({taken!r})", what="the new checkpoint")
            page.screenshot(shots / "2-cluster.png")

            page.click(f'[aria-label="Pin checkpoint {taken}"]')
            wait_status(page, f"Pinning {taken}: done")
            assert node_store(a).catalog.get(taken).pinned, "the pin must reach node A's store"
            # ... and the registry (at once, or by node A's agent once the push is done).
            wait_for(
                lambda: taken in pin_tags(registry),
                timeout=90,
                what="the pin tag in the registry",
            )

            page.eval("location.hash = '#/ns/team-a'")
            page.wait("document.querySelector('#view-title')?.textContent === 'Namespace team-a'",
                      what="the namespace view")  # fmt: skip
            assert page.eval("document.querySelectorAll('svg.timeline circle').length") >= 1
            page.screenshot(shots / "3-namespace.png")

            page.click(f'a[href="#/checkpoint/{taken}"]')
            title = f"Checkpoint {taken}"
            page.wait(f"document.querySelector('#view-title')?.textContent === {title!r}",
                      what="the checkpoint view")  # fmt: skip
            assert f'CEDANA_RESTORE, value: "{taken}"' in page.eval(
                "document.querySelector('#restore-by-hand').textContent"
            )
            assert "node-a" in page.text()
            page.screenshot(shots / "4-checkpoint.png")

            # Migrate: the controller checkpoints, waits for the push, evicts.
            page.eval("location.hash = '#/cluster'")
            page.click("#avoid-node")  # off node A: cordoned until the pod is rescheduled
            page.click('[aria-label="Migrate team-a/counter-0"]')
            wait_for(lambda: kube.state.evictions, timeout=180, what="the eviction")
            assert kube.state.evictions == [("team-a", "counter-0")]
            assert kube.state.nodes["node-a"]["spec"].get("unschedulable") is True
            page.screenshot(shots / "5-migrating.png")
            # kubelet on A stops the evicted pod (its stop checkpoints and pushes it);
            # the ReplicaSet makes a replacement, bound to node B; kubelet on B runs it.
            stop_app(cri_a, first)
            before = parse_ticks(first.stdout())
            assert before is not None
            kube.add_pod(pod_object("team-a", "counter-1", "node-b", label))
            second = start_app(stack, b, cri_b, label=label, namespace="team-a",
                               host_network=False, pod_name="counter-1")  # fmt: skip
            outcome = events_b.wait_topic(TOPIC_RESTORE, second.cid, timeout=120)
            assert outcome.field("outcome") == "restored", outcome
            assert_continues(before, wait_ticks(second.stdout, count=3), "the migrated pod")
            wait_status(page, "Migration of team-a/counter-0: done", timeout=120)
            steps = page.eval(
                "[...document.querySelectorAll('ol.steps li')].map(li => li.textContent)"
            )
            assert steps == ["checkpoint: done", "push: done", "evict: done",
                             "rescheduled: done", "resumed: done"], steps  # fmt: skip
            assert kube.state.nodes["node-a"]["spec"]["unschedulable"] is False, "uncordoned"
            restored = page.eval("lastOperation.result.restoredFrom")
            assert restored == outcome.checkpoint_id
            # The page shows the cluster as it is now: the pod on B, the checkpoint it
            # resumed from on both nodes (pushed from A, pulled by B).
            page.wait(
                "[...document.querySelectorAll('tr')].some(r => r.innerText.includes('counter-1')"
                " && r.innerText.includes('node-b'))",
                what="the replacement pod in the workloads",
            )
            row = page.eval(
                f"[...document.querySelectorAll('tr')].find(r => r.innerText.includes("
                f"{restored!r}))?.innerText"
            )
            assert row and "node-a, node-b" in row and "pushed" in row, row
            page.screenshot(shots / "6-migrated.png")
            # What the registry holds for her checkpoints, in bytes (read by a node agent).
            use = page.eval("document.querySelector('#registry-use').innerText")
            assert "all you may see" in use and f"team-a / {label}" in use, use
            assert "unreadable" not in use and "KiB" in use, use
            # A reload of the page: the migration's steps are still shown (the
            # controller keeps its operations, in a ConfigMap across its restarts).
            page.reload()
            page.wait(
                "document.querySelectorAll('ol.steps li.done').length === 5",
                what="the migration's five steps after a reload",
            )
            assert ("cedana-system", "cedana-operations") in kube.state.config_maps

            page.eval("location.hash = '#/cluster'")
            page.click(f'[aria-label="Delete checkpoint {taken}"]')
            wait_status(page, f"Deleting {taken}: done")
            assert taken not in {e.id for e in node_store(a).catalog.list()}
            assert taken not in pin_tags(registry), "its pin in the registry is gone too"
            page.screenshot(shots / "7-deleted.png")

            # A policy, typed into the namespace view's form: node B's agent applies it
            # to the migrated pod (a checkpoint, as the newest is older than 10 s; pinned).
            page.eval("location.hash = '#/ns/team-a'")
            page.wait("document.querySelector('#policy-form') !== null", what="the policy form")
            for field, value in (
                ("#policy-name", "every-10s"),
                ("#policy-selector", "app=counter"),
                ("#policy-interval", "10s"),
                ("#policy-pin", "1"),
            ):
                page.click(field)
                page.type(value)
            # Before eviction: checkpoint, chosen with the keyboard.
            page.eval("document.querySelector('#policy-eviction').focus()")
            page.press("ArrowDown")
            assert page.eval("document.querySelector('#policy-eviction').value") == "checkpoint"
            page.click("#policy-pin")
            page.press("Enter")
            wait_status(page, "Saving policy every-10s: done")

            def policy_pin() -> str:
                pinned = [
                    e for e in node_store(b).catalog.list(label=label) if e.pinned_by == "policy"
                ]
                return pinned[0].id if pinned else ""

            # Within 10 s of the restored checkpoint the policy pins that one; then it
            # takes a checkpoint of its own and moves its pin there.
            def policy_checkpoint() -> str:
                found = policy_pin()
                return found if found not in ("", restored) else ""

            pinned: str = wait_for(
                policy_checkpoint,
                timeout=90,
                what="node B's agent to checkpoint counter-1 for the policy and pin it",
            )
            assert node_store(b).catalog.get(pinned).metadata["pod"] == "counter-1"
            page.wait(
                "(route(), [...document.querySelectorAll('tr')].some(r => r.innerText.includes("
                f"'every-10s') && r.innerText.includes('counter-1/app') && r.innerText.includes("
                f"'pinned {pinned}')))",
                what="the policy's coverage and what node B did",
                timeout=60,
            )
            page.screenshot(shots / "8-policy.png")
            assert kube.state.config_maps[("team-a", "every-10s")]["data"]["beforeEviction"] == (
                "checkpoint"
            )
            wait_for(
                lambda: ("team-a", label) in read_labels(str(b.store)),
                timeout=60,
                what="node B's agent to make the counter's stop wait for its push",
            )

            audit = [(e["reason"], e["involvedObject"]["name"]) for e in kube.events_by("Cedana")]
            assert audit == [
                ("CedanaCheckpoint", "counter-0"), ("CedanaPin", "counter-0"),
                ("CedanaMigrate", "counter-0"), ("CedanaMigrate", "counter-0"),
                ("CedanaDelete", "counter-0"), ("CedanaPolicy", "every-10s"),
            ], audit  # fmt: skip
            assert all(e["message"].startswith(USER) for e in kube.events_by("Cedana"))
            assert "audit user=alice@example.com action=migrate" in ctl.proc.log.read_text()
            assert page.console == [], page.console
    finally:
        cri_a.close()
        cri_b.close()
        kube.close()


def test_a_drained_pod_of_a_before_eviction_policy_resumes_elsewhere(
    make_node: MakeNode,
    node_env: dict[str, str],
    registry: Registry,
    tls: TlsFiles,
    tmp_path: Path,
) -> None:
    """Nodes whose shims push in the background (``registry_sync = background``: a
    stop does not wait for the registry). A policy saved through the dashboard's API
    with ``beforeEviction: checkpoint`` covers the counter; node A is drained (cordon,
    then the pod's eviction; kubelet's stop played by this test): the stop's
    checkpoint is in the registry before the container exits, and the replacement on
    node B resumes the count from it."""
    env = {**node_env, "CEDANA_REGISTRY_SYNC": "background"}
    a, b = make_node(env), make_node(env)
    kube = FakeKubeApi()
    kube.add_token(TOKEN, USER)
    kube.allow(USER, *namespace_rules("team-a", ("get", "pods"), ("update", "configmaps")))
    label = unique_label("drain")
    port = free_port()
    cri_a, cri_b = a.cri(), b.cri()
    try:
        with (
            agent(kube, a.base, "node-a", "127.0.0.1", port, containerd_socket=a.socket,
                  store=f"/{a.store.name}", extra_config=agent_config(a, registry, tls, node_env)),
            agent(kube, b.base, "node-b", "127.0.0.2", port, containerd_socket=b.socket,
                  store=f"/{b.store.name}", extra_config=agent_config(b, registry, tls, node_env)),
            controller(kube, tmp_path, port) as ctl,
            EventStream(b.socket) as events_b,
            contextlib.ExitStack() as stack,
        ):  # fmt: skip
            first = start_app(stack, a, cri_a, label=label, namespace="team-a",
                              host_network=False, pod_name="counter-0")  # fmt: skip
            kube.add_pod(pod_object("team-a", "counter-0", "node-a", label))
            path = "/api/v1/namespaces/team-a/policies/drain-safe"
            status, doc = ctl.call(
                "POST", path, TOKEN, {"selector": "app=counter", "beforeEviction": "checkpoint"}
            )
            assert status == 200 and doc["beforeEviction"] == "checkpoint", doc
            status, doc = ctl.call("GET", "/api/v1/namespaces/team-a/policies", TOKEN)
            [policy] = doc["policies"]
            assert policy["covers"] == ["counter-0/app"], policy
            assert policy["policy"]["beforeEviction"] == "checkpoint"
            wait_for(
                lambda: ("team-a", label) in read_labels(str(a.store)),
                timeout=60,
                what="node A's agent to tell its shims that the counter's stop waits for the push",
            )
            wait_ticks(first.stdout, count=3)

            # The drain: cordon node A, evict the pod; kubelet on A stops it.
            status, _ = http_json(f"{kube.url}/api/v1/nodes/node-a", "PATCH", TOKEN,
                                  {"spec": {"unschedulable": True}})  # fmt: skip
            assert status == 200
            status, _ = http_json(
                f"{kube.url}/api/v1/namespaces/team-a/pods/counter-0/eviction", "POST", TOKEN, {}
            )
            assert status == 201 and kube.state.evictions == [("team-a", "counter-0")]
            stop_app(cri_a, first)
            before = parse_ticks(first.stdout())
            assert before is not None
            [stopped] = [
                e for e in node_store(a).catalog.list(label=label)
                if e.metadata.get("reason") == "stop"
            ]  # fmt: skip
            # Exited: by then the stop's checkpoint was pushed (its outbox record gone).
            assert stopped.id not in Outbox(str(a.store)).pending(), (
                "the container exited before its checkpoint reached the registry"
            )

            # The ReplicaSet's replacement, scheduled on node B, resumes from the registry.
            kube.add_pod(pod_object("team-a", "counter-1", "node-b", label))
            second = start_app(stack, b, cri_b, label=label, namespace="team-a",
                               host_network=False, pod_name="counter-1")  # fmt: skip
            outcome = events_b.wait_topic(TOPIC_RESTORE, second.cid, timeout=120)
            assert outcome.field("outcome") == "restored", outcome
            assert outcome.checkpoint_id == stopped.id
            assert_continues(before, wait_ticks(second.stdout, count=3), "the drained pod")
    finally:
        cri_a.close()
        cri_b.close()
        kube.close()
