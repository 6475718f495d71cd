"""The Kubernetes API calls the controller makes (beside the node agent's), on the
same client wrapper (node/kube.py): plain JSON dicts in and out."""

from __future__ import annotations

from typing import Any, Protocol

from ..node.kube import Identity, KubernetesApi, Missing


class ClusterApi(Protocol):
    def review_token(self, token: str) -> Identity | None: ...

    def allowed(
        self, who: Identity, namespace: str, verb: str, resource: str, subresource: str = ""
    ) -> bool: ...

    def all_pods(self, namespace: str = "", label_selector: str = "") -> list[dict[str, Any]]: ...

    def get_pod(self, namespace: str, name: str) -> dict[str, Any] | None: ...

    def create_pod(self, namespace: str, pod: dict[str, Any]) -> dict[str, Any]: ...

    def evict_pod(self, namespace: str, name: str) -> None: ...

    def get_node(self, name: str) -> dict[str, Any]: ...

    def patch_node(self, name: str, patch: dict[str, Any]) -> dict[str, Any]: ...

    def create_event(self, namespace: str, event: dict[str, Any]) -> None: ...

    def list_policies(self) -> list[dict[str, Any]]: ...

    def save_config_map(self, namespace: str, config_map: dict[str, Any]) -> None: ...

    def get_config_map(self, namespace: str, name: str) -> dict[str, Any] | None: ...

    def delete_config_map(self, namespace: str, name: str) -> None: ...


class ControllerKube(KubernetesApi):
    """``ClusterApi`` over the official client."""

    def allowed(
        self, who: Identity, namespace: str, verb: str, resource: str, subresource: str = ""
    ) -> bool:
        from kubernetes import client

        attributes: dict[str, Any] = {"verb": verb, "resource": resource, "group": ""}
        if namespace:
            attributes["namespace"] = namespace
        if subresource:
            attributes["subresource"] = subresource
        body = {
            "apiVersion": "authorization.k8s.io/v1",
            "kind": "SubjectAccessReview",
            "spec": {
                "user": who.user,
                "groups": list(who.groups),
                "uid": who.uid,
                "resourceAttributes": attributes,
            },
        }
        api = client.AuthorizationV1Api(self._client)
        review = self._plain(
            self._call("POST subjectaccessreview", api.create_subject_access_review, body)
        )
        return bool((review.get("status") or {}).get("allowed"))

    def all_pods(self, namespace: str = "", label_selector: str = "") -> list[dict[str, Any]]:
        if namespace:
            found = self._call(
                f"LIST pods in {namespace}",
                self._core.list_namespaced_pod,
                namespace,
                label_selector=label_selector,
            )
        else:
            found = self._call(
                "LIST pods", self._core.list_pod_for_all_namespaces, label_selector=label_selector
            )
        return [self._plain(p) for p in found.items]

    def get_pod(self, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            pod: dict[str, Any] = self._plain(
                self._call(
                    f"GET pod {name} in {namespace}",
                    self._core.read_namespaced_pod,
                    name,
                    namespace,
                )
            )
        except Missing:
            return None
        return pod

    def create_pod(self, namespace: str, pod: dict[str, Any]) -> dict[str, Any]:
        name = pod.get("metadata", {}).get("name", "")
        made: dict[str, Any] = self._plain(
            self._call(
                f"POST pod {name} in {namespace}", self._core.create_namespaced_pod, namespace, pod
            )
        )
        return made

    def evict_pod(self, namespace: str, name: str) -> None:
        body = {
            "apiVersion": "policy/v1",
            "kind": "Eviction",
            "metadata": {"name": name, "namespace": namespace},
        }
        self._call(
            f"POST eviction of pod {name} in {namespace}",
            self._core.create_namespaced_pod_eviction,
            name,
            namespace,
            body,
        )

    def get_config_map(self, namespace: str, name: str) -> dict[str, Any] | None:
        try:
            found: dict[str, Any] = self._plain(
                self._call(
                    f"GET configmap {name} in {namespace}",
                    self._core.read_namespaced_config_map,
                    name,
                    namespace,
                )
            )
        except Missing:
            return None
        return found

    def save_config_map(self, namespace: str, config_map: dict[str, Any]) -> None:
        """Create the ConfigMap, or replace the one of that name."""
        name = config_map["metadata"]["name"]
        try:
            self._call(
                f"GET configmap {name} in {namespace}",
                self._core.read_namespaced_config_map,
                name,
                namespace,
            )
        except Missing:
            self._call(
                f"POST configmap {name} in {namespace}",
                self._core.create_namespaced_config_map,
                namespace,
                config_map,
            )
            return
        self._call(
            f"PUT configmap {name} in {namespace}",
            self._core.replace_namespaced_config_map,
            name,
            namespace,
            config_map,
        )

    def delete_config_map(self, namespace: str, name: str) -> None:
        self._call(
            f"DELETE configmap {name} in {namespace}",
            self._core.delete_namespaced_config_map,
            name,
            namespace,
        )
