"""The Kubernetes API calls the helper makes, behind a small typed surface.

The rest of the package sees plain JSON dicts and two exceptions; which version of
the ``kubernetes`` client is installed (typed models or not) stays in this file.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

STRATEGIC_MERGE = "application/strategic-merge-patch+json"


class KubeError(Exception):
    pass


class Conflict(KubeError):
    """The object changed since it was read (HTTP 409): read again and retry."""


class Rejected(KubeError):
    """The API server refused the request itself (HTTP 4xx): retrying cannot help."""


class Missing(Rejected):
    """No such object (HTTP 404)."""


@dataclass(frozen=True)
class Identity:
    """Who a bearer token belongs to, as TokenReview says."""

    user: str
    groups: tuple[str, ...] = ()
    uid: str = ""


class TokenApi(Protocol):
    def review_token(self, token: str) -> Identity | None:
        """The token's user; None when the API server does not authenticate it."""
        ...


class NodeApi(Protocol):
    def get_node(self, name: str) -> dict[str, Any]: ...

    def patch_node(self, name: str, patch: dict[str, Any]) -> dict[str, Any]: ...

    def list_pods(self, namespace: str, node: str, label_selector: str) -> list[dict[str, Any]]: ...


class EventApi(Protocol):
    def create_event(self, namespace: str, event: dict[str, Any]) -> None:
        """Post a core/v1 Event; one of that name already there counts as posted."""
        ...

    def pod_uid(self, namespace: str, name: str) -> str:
        """The uid of a pod; "" when there is no such pod."""
        ...


class KubernetesApi:
    """``NodeApi`` over the official client: in-cluster credentials by default, a
    kubeconfig file, or a plain URL (``--kube-api``, for tests and proxies)."""

    def __init__(self, *, kubeconfig: str | None = None, api_url: str | None = None) -> None:
        from kubernetes import client, config

        configuration = client.Configuration()
        if api_url:
            configuration.host = api_url
        elif kubeconfig:
            config.load_kube_config(  # type: ignore[no-untyped-call, unused-ignore]
                config_file=kubeconfig, client_configuration=configuration
            )
        else:
            config.load_incluster_config(  # type: ignore[no-untyped-call, unused-ignore]
                client_configuration=configuration
            )
        self._client: Any = client.ApiClient(configuration)
        self._core: Any = client.CoreV1Api(self._client)
        self._exception: type[Exception] = client.ApiException

    def _plain(self, obj: Any) -> Any:
        return self._client.sanitize_for_serialization(obj)

    def _call(self, what: str, fn: Any, *args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except self._exception as err:
            status = getattr(err, "status", None)
            reason = getattr(err, "reason", "") or ""
            if status == 409:
                raise Conflict(f"{what}: conflict ({reason})") from None
            if status == 404:
                raise Missing(f"{what}: not found") from None
            if isinstance(status, int) and 400 <= status < 500:
                raise Rejected(f"{what}: HTTP {status} {reason}".strip()) from None
            raise KubeError(f"{what}: HTTP {status} {reason}".strip()) from None
        except OSError as err:  # urllib3 wraps connection failures in OSError subclasses
            raise KubeError(f"{what}: {err}") from None

    def get_node(self, name: str) -> dict[str, Any]:
        node: dict[str, Any] = self._plain(
            self._call(f"GET node {name}", self._core.read_node, name)
        )
        return node

    def patch_node(self, name: str, patch: dict[str, Any]) -> dict[str, Any]:
        node: dict[str, Any] = self._plain(
            self._call(
                f"PATCH node {name}",
                self._core.patch_node,
                name,
                patch,
                _content_type=STRATEGIC_MERGE,
            )
        )
        return node

    def list_pods(self, namespace: str, node: str, label_selector: str) -> list[dict[str, Any]]:
        pods = self._call(
            f"LIST pods in {namespace}",
            self._core.list_namespaced_pod,
            namespace,
            field_selector=f"spec.nodeName={node}",
            label_selector=label_selector,
        )
        items: list[dict[str, Any]] = [self._plain(p) for p in pods.items]
        return items

    def create_event(self, namespace: str, event: dict[str, Any]) -> None:
        name = event.get("metadata", {}).get("name", "")
        try:
            self._call(
                f"POST event {name} in {namespace}",
                self._core.create_namespaced_event,
                namespace,
                event,
            )
        except Conflict:
            return  # posted by an earlier round whose answer was lost

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

    def pod_uid(self, namespace: str, name: str) -> str:
        pod = self.get_pod(namespace, name) or {}
        return str((pod.get("metadata") or {}).get("uid") or "")

    def review_token(self, token: str) -> Identity | None:
        from kubernetes import client

        api = client.AuthenticationV1Api(self._client)
        body = {
            "apiVersion": "authentication.k8s.io/v1",
            "kind": "TokenReview",
            "spec": {"token": token},
        }
        review = self._plain(self._call("POST tokenreview", api.create_token_review, body))
        status = review.get("status") or {}
        if not status.get("authenticated"):
            return None
        user = status.get("user") or {}
        return Identity(
            str(user.get("username") or ""),
            tuple(str(g) for g in user.get("groups") or ()),
            str(user.get("uid") or ""),
        )

    def list_policies(self) -> list[dict[str, Any]]:
        """The checkpoint policies of every namespace (node/policies.py)."""
        found = self._call(
            "LIST configmaps",
            self._core.list_config_map_for_all_namespaces,
            label_selector="cedana.ai/policy=true",
        )
        return [self._plain(c) for c in found.items]
