"""What the dashboard's API does for a signed-in user: the views, filtered by the
user's rights, and the actions, each checked, audited and carried out through the
node agents and the Kubernetes API (the HTTP routing is api.py)."""

from __future__ import annotations

import logging
import time
import uuid
from collections.abc import Callable
from typing import Any, Final

from ..node import policies
from ..node.kube import Identity, KubeError
from . import views
from .access import CHANGE, COPY, DROP_POLICY, MIGRATE, NODES, POLICIES, SEE, Access, Denied
from .agents import AgentError, AgentRef, Agents
from .audit import Audit
from .kube import ClusterApi
from .operations import Operation, Operations, StepFailed
from .registry_use import registry_use

MIGRATION_STEPS: Final = ["checkpoint", "push", "evict", "rescheduled", "resumed"]
WAIT_S: Final = 300.0
POLL_S: Final = 0.5

log = logging.getLogger("cedana.controller")


class NotFoundError(Exception):
    pass


class Dashboard:
    def __init__(
        self,
        api: ClusterApi,
        access: Access,
        agents: Agents,
        *,
        wait_s: float = WAIT_S,
        sleep: Callable[[float], None] = time.sleep,
        operations: Operations | None = None,
    ) -> None:
        self.api = api
        self.access = access
        self.agents = agents
        self.audit = Audit(api)
        self.operations = operations or Operations()
        self._wait_s = wait_s
        self._sleep = sleep

    # -- views -------------------------------------------------------------------------

    def _gather(self) -> tuple[list[dict[str, Any]], list[dict[str, Any]], list[str]]:
        states, failed = self.agents.gather("/v1/node")
        lists, failed_lists = self.agents.gather("/v1/checkpoints")
        return states, lists, sorted(set(failed + failed_lists))

    def _visible(self, who: Identity, namespaces: set[str]) -> set[str]:
        return {ns for ns in namespaces if ns and self.access.can(who, ns, SEE)}

    def whoami(self, who: Identity) -> dict[str, Any]:
        states, lists, _ = self._gather()
        known = {c.get("namespace") or "" for a in lists for c in a.get("checkpoints") or ()}
        known |= {r.get("namespace") or "" for r in views.all_records(states)}
        known |= {w["namespace"] for w in views.workloads(self.api.all_pods())}
        return {
            "user": who.user,
            "groups": list(who.groups),
            "namespaces": sorted(self._visible(who, known)),
            "seesNodes": self.access.can(who, "", NODES),
        }

    def cluster(self, who: Identity) -> dict[str, Any]:
        states, lists, unreachable = self._gather()
        records = views.all_records(states)
        checkpoints = views.merged_checkpoints(lists, records)
        work = views.workloads(self.api.all_pods())
        ns = self._visible(
            who,
            {c.get("namespace") or "" for c in checkpoints}
            | {r.get("namespace") or "" for r in records}
            | {w["namespace"] for w in work},
        )
        _mark_registry(checkpoints, states)
        sees_nodes = self.access.can(who, "", NODES)
        return {
            "namespaces": sorted(ns),
            "nodes": views.node_rows(states) if sees_nodes else None,
            "registryUse": registry_use(self.agents, states, ns) if ns else [],
            "unreachable": unreachable if sees_nodes else [],
            "workloads": [w for w in work if w["namespace"] in ns],
            "checkpoints": [c for c in checkpoints if c.get("namespace") in ns],
            "failures": [r for r in views.failures(records) if r.get("namespace") in ns][:50],
            "operations": self.recent_operations(who),
        }

    def namespace(self, who: Identity, namespace: str, label: str = "") -> dict[str, Any]:
        self.access.require(who, namespace, SEE)
        states, lists, _ = self._gather()
        records = [r for r in views.all_records(states) if r.get("namespace") == namespace]
        checkpoints = [
            c for c in views.merged_checkpoints(lists, records) if c.get("namespace") == namespace
        ]
        _mark_registry(checkpoints, states)
        labels = sorted({c.get("label") or "" for c in checkpoints} - {""})
        if label:
            checkpoints = [c for c in checkpoints if c.get("label") == label]
            records = [r for r in records if r.get("label") == label]
        return {
            "namespace": namespace,
            "label": label,
            "labels": labels,
            "checkpoints": checkpoints,
            "timeline": views.namespace_timeline(checkpoints, records),
        }

    def checkpoint(self, who: Identity, checkpoint_id: str) -> dict[str, Any]:
        states, lists, _ = self._gather()
        records = views.all_records(states)
        found = [c for c in views.merged_checkpoints(lists, records) if c["id"] == checkpoint_id]
        if not found:
            raise NotFoundError(f"no node holds checkpoint {checkpoint_id}")
        item = found[0]
        self.access.require(who, str(item.get("namespace")), SEE)
        registries = sorted(
            {s.get("registry") or "" for s in states if s.get("node") in item["nodes"]} - {""}
        )
        return {
            "checkpoint": item,
            "registry": registries,
            "inRegistry": bool(registries) and not item["pendingPush"],
            "restores": [
                r
                for r in records
                if r.get("kind") == "restore" and r.get("checkpoint_id") == checkpoint_id
            ],
            "restoreByHand": views.restore_by_hand(item),
        }

    def operation(self, who: Identity, op_id: str) -> dict[str, Any]:
        op = self.operations.get(op_id)
        if op is None or not (op.user == who.user or self.access.can(who, op.namespace, SEE)):
            raise NotFoundError(f"no operation {op_id} (operations are kept an hour)")
        return op.to_json()

    def recent_operations(self, who: Identity, limit: int = 5) -> list[dict[str, Any]]:
        """The newest operations the user may see (theirs, or in a namespace they see),
        kept across controller restarts (operations.py)."""
        seen: list[dict[str, Any]] = []
        for op in self.operations.recent():
            if len(seen) == limit:
                break
            if op.user == who.user or self.access.can(who, op.namespace, SEE):
                seen.append(op.to_json())
        return seen

    def policies(self, who: Identity, namespace: str) -> dict[str, Any]:
        """The namespace's policies, the workloads each covers (from the API server's
        pods) and how each node agent applied it."""
        self.access.require(who, namespace, SEE)
        states, _ = self.agents.gather("/v1/node")
        pods = self.api.all_pods(namespace)
        out = []
        for config_map in self.api.list_policies():
            meta = config_map.get("metadata") or {}
            if meta.get("namespace") != namespace:
                continue
            key = f"{namespace}/{meta.get('name')}"
            item: dict[str, Any] = {"name": meta.get("name"), "data": config_map.get("data") or {}}
            try:
                policy = policies.from_config_map(config_map)
                item["policy"] = policy.to_json()
                item["covers"] = [
                    f"{(p.get('metadata') or {}).get('name')}/{c['name']}"
                    for p in pods
                    if policies.selects(
                        policy.selector, (p.get("metadata") or {}).get("labels") or {}
                    )
                    for c in policies.opted_in(p)
                ]
                item["error"] = ""
            except policies.PolicyError as err:
                item.update(policy=None, covers=[], error=str(err))
            item["applied"] = [
                a for s in states for a in s.get("policies") or () if a.get("policy") == key
            ]
            out.append(item)
        return {"namespace": namespace, "policies": sorted(out, key=lambda p: str(p["name"]))}

    def save_policy(
        self, who: Identity, namespace: str, name: str, data: dict[str, Any]
    ) -> dict[str, Any]:
        self.access.require(who, namespace, POLICIES)
        clean = {k: str(v) for k, v in data.items() if v is not None and str(v).strip()}
        try:
            policy = policies.parse(namespace, name, clean)
        except policies.PolicyError as err:
            raise ValueError(str(err)) from None
        try:
            self.api.save_config_map(namespace, policies.to_config_map(policy, clean))
        except KubeError as err:
            self.audit.record(
                who.user, "policy", namespace, name, "failed", str(err), kind="ConfigMap"
            )
            raise
        self.audit.record(
            who.user, "policy", namespace, name, "done",
            ", ".join(f"{k}={v}" for k, v in clean.items()) or "(empty)", kind="ConfigMap",
        )  # fmt: skip
        return policy.to_json()

    def delete_policy(self, who: Identity, namespace: str, name: str) -> dict[str, Any]:
        """Remove a policy (its ConfigMap); the agents stop applying it next round.
        Its pins stay: they are checkpoints someone chose to keep until unpinned."""
        self.access.require(who, namespace, DROP_POLICY)
        if not any(
            (c.get("metadata") or {}).get("namespace") == namespace
            and (c.get("metadata") or {}).get("name") == name
            for c in self.api.list_policies()
        ):
            raise NotFoundError(f"no policy {name} in namespace {namespace}")
        try:
            self.api.delete_config_map(namespace, name)
        except KubeError as err:
            self.audit.record(
                who.user, "policy-delete", namespace, name, "failed", str(err), kind="ConfigMap"
            )
            raise
        self.audit.record(
            who.user, "policy-delete", namespace, name, "done", "removed", kind="ConfigMap"
        )
        return {"namespace": namespace, "name": name, "deleted": True}

    # -- actions -----------------------------------------------------------------------

    def checkpoint_now(
        self, who: Identity, namespace: str, pod: str, container: str = ""
    ) -> dict[str, Any]:
        self.access.require(who, namespace, CHANGE)
        target = self._pod(namespace, pod)
        agent = self.agents.on(_node_of(target, namespace, pod))
        container = container or _first_opted_in(target, namespace, pod)
        detail = f"container {container} on node {agent.node}"
        try:
            taken: dict[str, Any] = self.agents.call(
                agent,
                "POST",
                "/v1/checkpoint",
                {"namespace": namespace, "pod": pod, "container": container, "leaveRunning": True},
            )
        except AgentError as err:
            self.audit.record(who.user, "checkpoint", namespace, pod, "failed", str(err))
            raise
        self.audit.record(
            who.user, "checkpoint", namespace, pod, "done", f"{taken.get('id')} of {detail}"
        )
        return taken

    def pin(self, who: Identity, checkpoint_id: str, pinned: bool) -> dict[str, Any]:
        return self._on_holders(who, checkpoint_id, "pin" if pinned else "unpin", pinned)

    def delete(self, who: Identity, checkpoint_id: str) -> dict[str, Any]:
        return self._on_holders(who, checkpoint_id, "delete", None)

    def _on_holders(
        self, who: Identity, checkpoint_id: str, action: str, pinned: bool | None
    ) -> dict[str, Any]:
        lists, _ = self.agents.gather("/v1/checkpoints")
        holders = [
            (str(a.get("node")), c)
            for a in lists
            for c in a.get("checkpoints") or ()
            if c["id"] == checkpoint_id
        ]
        if not holders:
            raise NotFoundError(f"no node holds checkpoint {checkpoint_id}")
        item = holders[0][1]
        namespace, pod = str(item.get("namespace")), str(item.get("pod") or "")
        self.access.require(who, namespace, CHANGE)
        done: list[str] = []
        for node, _ in holders:
            agent = self.agents.on(node)
            try:
                if pinned is None:
                    self.agents.call(agent, "POST", "/v1/delete", {"id": checkpoint_id})
                else:
                    self.agents.call(
                        agent, "POST", "/v1/pin", {"id": checkpoint_id, "pinned": pinned}
                    )
            except AgentError as err:
                self.audit.record(
                    who.user, action, namespace, pod, "failed",
                    f"{checkpoint_id}: {err} (done on: {', '.join(done) or 'no node'})",
                )  # fmt: skip
                raise
            done.append(node)
        self.audit.record(
            who.user, action, namespace, pod, "done", f"{checkpoint_id} on {', '.join(done)}"
        )
        return {"id": checkpoint_id, "nodes": done, "action": action}

    def copy(self, who: Identity, checkpoint_id: str) -> dict[str, Any]:
        """A new pod like the one the checkpoint came from, started from exactly it
        (the ``cedana.ai/restore`` annotation); without the source's labels, so that
        no controller adopts it."""
        found = self.checkpoint(who, checkpoint_id)["checkpoint"]
        namespace, pod = str(found.get("namespace")), str(found.get("pod") or "")
        self.access.require(who, namespace, COPY)
        source = self.api.get_pod(namespace, pod) if pod else None
        if source is None:
            raise NotFoundError(
                f"pod {namespace}/{pod or '?'} that checkpoint {checkpoint_id} came from is "
                "gone: start a pod by hand with the lines of 'Restore by hand'"
            )
        spec = dict(source.get("spec") or {})
        for key in ("nodeName", "hostname"):
            spec.pop(key, None)
        name = f"{pod[:40]}-copy-{uuid.uuid4().hex[:5]}"
        body = {
            "apiVersion": "v1",
            "kind": "Pod",
            "metadata": {
                "name": name,
                "namespace": namespace,
                "labels": {"cedana.ai/copy-of": pod[:63]},
                "annotations": {"cedana.ai/restore": checkpoint_id},
            },
            "spec": spec,
        }
        try:
            self.api.create_pod(namespace, body)
        except KubeError as err:
            self.audit.record(who.user, "copy", namespace, pod, "failed", str(err))
            raise
        self.audit.record(
            who.user, "copy", namespace, pod, "done", f"pod {name} from {checkpoint_id}"
        )
        return {"pod": name, "namespace": namespace, "checkpoint": checkpoint_id}

    def migrate(
        self, who: Identity, namespace: str, pod: str, *, avoid_node: bool = False
    ) -> Operation:
        """Checkpoint, wait for the push, evict; then follow the pod's replacement to
        its node and its restore. Returns at once; the steps are polled.
        ``avoid_node``: the pod's node is cordoned from the eviction until the
        replacement is scheduled (uncordoned then, or on failure, unless it was
        cordoned already), so the scheduler places it elsewhere."""
        self.access.require(who, namespace, MIGRATE)
        source = self._pod(namespace, pod)
        node = _node_of(source, namespace, pod)
        container = _first_opted_in(source, namespace, pod)
        agent = self.agents.on(node)
        self.audit.record(who.user, "migrate", namespace, pod, "requested", f"from node {node}")

        def work(op: Operation) -> None:
            self._migrate(op, agent, source, container, avoid_node)

        def done(op: Operation) -> None:
            outcome = "done" if op.state == "done" else "failed"
            summary = "; ".join(f"{s.name}: {s.state} {s.detail}".strip() for s in op.steps)
            self.audit.record(who.user, "migrate", namespace, pod, outcome, summary)

        return self.operations.start(
            "migrate", who.user, namespace, f"{namespace}/{pod}", MIGRATION_STEPS, work, done
        )

    def _migrate(
        self,
        op: Operation,
        agent: AgentRef,
        source: dict[str, Any],
        container: str,
        avoid_node: bool,
    ) -> None:
        meta = source.get("metadata") or {}
        namespace, pod, uid = meta.get("namespace"), meta.get("name"), meta.get("uid")
        with op.step("checkpoint") as step:
            taken = self._agent(
                agent,
                "POST",
                "/v1/checkpoint",
                {"namespace": namespace, "pod": pod, "container": container, "leaveRunning": True},
            )
            step.detail = f"{taken['id']} on {agent.node}"
            op.result["checkpoint"] = taken["id"]
        with op.step("push") as step:
            state = self._agent(agent, "GET", "/v1/node")
            if not state.get("registry"):
                step.state = "skipped"
                step.detail = (
                    f"node {agent.node} has no registry: the pod can resume only if it "
                    "lands on the same node"
                )
            else:
                self._wait(
                    lambda: (
                        not any(
                            c["id"] == taken["id"] and c.get("pendingPush")
                            for c in self._agent(agent, "GET", "/v1/checkpoints")["checkpoints"]
                        )
                    ),
                    f"checkpoint {taken['id']} to reach the registry {state['registry']}",
                )
                step.detail = f"in {state['registry']}"
        cordoned = False
        try:
            with op.step("evict") as step:
                cordoned = avoid_node and self._cordon(agent.node, True)
                try:
                    self.api.evict_pod(str(namespace), str(pod))
                except KubeError as err:
                    raise StepFailed(
                        f"eviction of {namespace}/{pod} refused: {err} (a PodDisruptionBudget? "
                        "try again later)"
                    ) from None
                step.detail = f"{namespace}/{pod} evicted; its stop checkpoints it once more"
                if avoid_node:
                    step.detail += f"; node {agent.node} cordoned until it is rescheduled"
            self._rescheduled(op, namespace, pod, uid, meta)
        finally:
            if cordoned:
                self._cordon(agent.node, False)
        new_pod, new_node = op.result["pod"], op.result["node"]
        with op.step("resumed") as step:
            try:
                target = self.agents.on(str(new_node))
            except AgentError as err:
                raise StepFailed(str(err)) from None
            record = self._wait(
                lambda: _restore_of(self._agent(target, "GET", "/v1/node"), namespace, new_pod),
                f"pod {namespace}/{new_pod} to start on node {new_node}",
            )
            if record.get("outcome") != "restored":
                raise StepFailed(
                    f"pod {new_pod} started without resuming ({record.get('outcome')}): "
                    f"{record.get('detail') or '; '.join(record.get('skipped') or ())}"
                )
            step.detail = f"{new_pod} resumed from {record.get('checkpoint_id')} on {new_node}"
            op.result["restoredFrom"] = record.get("checkpoint_id")

    def _rescheduled(
        self, op: Operation, namespace: Any, pod: Any, uid: Any, meta: dict[str, Any]
    ) -> None:
        owners = {o.get("uid") for o in meta.get("ownerReferences") or () if o.get("controller")}
        with op.step("rescheduled") as step:
            moved = self._wait(
                lambda: replacement(self.api.all_pods(str(namespace)), pod, uid, owners),
                f"a pod to replace {namespace}/{pod} (is it owned by a controller?)",
            )
            new_meta = moved.get("metadata") or {}
            new_pod, new_node = new_meta.get("name"), moved["spec"]["nodeName"]
            step.detail = f"{namespace}/{new_pod} on node {new_node}"
            op.result.update(pod=new_pod, node=new_node)

    def _cordon(self, node: str, on: bool) -> bool:
        """Mark the node (un)schedulable; True when this call changed it (a node an
        operator cordoned already stays cordoned after the migration)."""
        try:
            current = self.api.get_node(node)
            if bool((current.get("spec") or {}).get("unschedulable")) == on:
                return False
            self.api.patch_node(node, {"spec": {"unschedulable": on}})
        except KubeError as err:
            what = "cordon" if on else "uncordon"
            if on:
                raise StepFailed(f"cannot {what} node {node}: {err}") from None
            log.warning("cannot %s node %s after a migration: %s; do it by hand", what, node, err)
            return False
        return True

    def _agent(self, agent: AgentRef, method: str, path: str, body: Any = None) -> Any:
        try:
            return self.agents.call(agent, method, path, body)
        except AgentError as err:
            raise StepFailed(str(err)) from None

    def _wait(self, probe: Callable[[], Any], what: str) -> Any:
        deadline = time.monotonic() + self._wait_s
        while True:
            found = probe()
            if found:
                return found
            if time.monotonic() > deadline:
                raise StepFailed(f"gave up waiting {self._wait_s:.0f}s for {what}")
            self._sleep(POLL_S)

    def _pod(self, namespace: str, pod: str) -> dict[str, Any]:
        found = self.api.get_pod(namespace, pod)
        if found is None:
            raise NotFoundError(f"no pod {pod} in namespace {namespace}")
        return found


def _mark_registry(checkpoints: list[dict[str, Any]], states: list[dict[str, Any]]) -> None:
    """Give each checkpoint ``registry``: where its nodes push ("" when none does)."""
    registries = {s.get("node"): s.get("registry") or "" for s in states}
    for c in checkpoints:
        c["registry"] = next((registries[n] for n in c["nodes"] if registries.get(n)), "")


def _first_opted_in(pod: dict[str, Any], namespace: str, name: str) -> str:
    """The container to checkpoint when none is named: the first that opts in (a
    sidecar that does not has no checkpoint to take)."""
    found = policies.opted_in(pod)
    if not found:
        raise NotFoundError(
            f"pod {namespace}/{name} has no container that opts in (CEDANA_CHECKPOINT or "
            "CEDANA_ENABLE): there is nothing cedana may checkpoint"
        )
    return found[0]["name"]


def _node_of(pod: dict[str, Any], namespace: str, name: str) -> str:
    node = (pod.get("spec") or {}).get("nodeName") or ""
    if not node:
        raise NotFoundError(f"pod {namespace}/{name} is not scheduled on a node yet")
    return str(node)


def replacement(
    pods: list[dict[str, Any]], name: Any, uid: Any, owners: set[Any]
) -> dict[str, Any] | None:
    """The pod that replaced the evicted one: another uid, the same controller (or,
    for a StatefulSet's or a bare pod's, the same name), scheduled on a node."""
    for pod in pods:
        meta = pod.get("metadata") or {}
        if meta.get("uid") == uid or meta.get("deletionTimestamp"):
            continue
        mine = {o.get("uid") for o in meta.get("ownerReferences") or () if o.get("controller")}
        if ((owners and mine & owners) or meta.get("name") == name) and (
            (pod.get("spec") or {}).get("nodeName")
        ):
            return pod
    return None


def _restore_of(state: dict[str, Any], namespace: Any, pod: Any) -> dict[str, Any] | None:
    for record in state.get("recent") or ():
        if (
            record.get("kind") == "restore"
            and record.get("namespace") == namespace
            and record.get("pod") == pod
        ):
            return dict(record)
    return None


__all__ = ["Dashboard", "Denied", "NotFoundError"]
