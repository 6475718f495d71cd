"""Every action is audited twice: a line in the controller's log, and a Kubernetes
Event on the pod it concerns (``kubectl describe pod``, ``kubectl get events``):
who, what, when, and how it ended."""

from __future__ import annotations

import logging
import uuid
from datetime import UTC, datetime
from typing import Final

from ..node.kube import KubeError
from ..node.kube_events import MESSAGE_LIMIT
from .kube import ClusterApi

COMPONENT: Final = "cedana-controller"

log = logging.getLogger("cedana.controller.audit")


class Audit:
    def __init__(self, api: ClusterApi) -> None:
        self._api = api

    def record(
        self,
        user: str,
        action: str,
        namespace: str,
        pod: str,
        outcome: str,
        detail: str,
        kind: str = "Pod",
    ) -> None:
        """``pod``: the name of the object the Event goes on (a ``kind``, Pod by default)."""
        log.info(
            "audit user=%s action=%s namespace=%s %s=%s outcome=%s detail=%s",
            user, action, namespace, kind.lower(), pod, outcome, detail,
        )  # fmt: skip
        if not pod:
            return
        when = datetime.now(UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
        message = f"{user}: {action} {outcome}: {detail}"
        if len(message) > MESSAGE_LIMIT:
            message = message[: MESSAGE_LIMIT - 3] + "..."
        event = {
            "apiVersion": "v1",
            "kind": "Event",
            "metadata": {"name": f"{pod}.cedana-{uuid.uuid4().hex[:12]}", "namespace": namespace},
            "involvedObject": {"apiVersion": "v1", "kind": kind, "namespace": namespace,
                               "name": pod},
            "type": "Normal" if outcome in ("done", "requested") else "Warning",
            "reason": "Cedana" + "".join(p.capitalize() for p in action.split("-")),
            "message": message,
            "source": {"component": COMPONENT},
            "reportingComponent": COMPONENT,
            "reportingInstance": COMPONENT,
            "firstTimestamp": when,
            "lastTimestamp": when,
            "count": 1,
        }  # fmt: skip
        try:
            self._api.create_event(namespace, event)
        except KubeError as err:
            # The log line above is the record that stays; the Event is a convenience.
            log.warning("audit event for %s/%s not posted: %s", namespace, pod, err)
