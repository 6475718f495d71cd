"""The operations kept in a ConfigMap: the controller has no disk of its own.

``cedana-operations`` in the controller's namespace, one key per operation (its id)
holding its JSON (operations.py). Written whole at each change of a step: a handful
of small writes per migration. The controller's ClusterRole already grants
``configmaps`` get, create and update (for the namespace policies).
"""

from __future__ import annotations

import json
import logging
from typing import Any, Final

from ..node.kube import KubeError
from .kube import ClusterApi

NAME: Final = "cedana-operations"

log = logging.getLogger("cedana.controller")


class ConfigMapOperations:
    def __init__(self, api: ClusterApi, namespace: str) -> None:
        self._api = api
        self._namespace = namespace

    def load(self) -> list[dict[str, Any]]:
        try:
            found = self._api.get_config_map(self._namespace, NAME)
        except KubeError as err:
            log.warning("cannot read the operations kept in %s/%s: %s", self._namespace, NAME, err)
            return []
        out = []
        for key, text in ((found or {}).get("data") or {}).items():
            try:
                doc = json.loads(text)
            except ValueError:
                log.warning(
                    "operation %s in %s/%s is not JSON: skipped", key, self._namespace, NAME
                )
                continue
            if isinstance(doc, dict):
                out.append(doc)
        return out

    def save(self, ops: list[dict[str, Any]]) -> None:
        self._api.save_config_map(
            self._namespace,
            {
                "apiVersion": "v1",
                "kind": "ConfigMap",
                "metadata": {
                    "name": NAME,
                    "namespace": self._namespace,
                    "labels": {"app.kubernetes.io/part-of": "cedana"},
                },
                "data": {str(o["id"]): json.dumps(o, sort_keys=True) for o in ops},
            },
        )
