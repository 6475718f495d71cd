"""Registry use in bytes, for the cluster view: what each registry holds for the
checkpoints the user may see.

The controller holds no registry credentials: for each registry the nodes push to it
asks one node agent that pushes there (``GET /v1/registry``, node/registry_use.py),
which reads the tags and manifests with the node's own. The sizes are added up
here, each blob once however many checkpoints share it (a registry stores a blob
once): per label, per namespace and in all. Blobs outside the checkpoints' manifests
(in-flight uploads, pins, signatures) are not counted.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any
from urllib.parse import quote

from .agents import AgentError, AgentRef, Agents


def distinct_bytes(items: Iterable[Mapping[str, Any]]) -> int:
    """The sum of the distinct blobs' sizes of ``items`` (each with ``blobs``)."""
    sizes: dict[str, int] = {}
    for item in items:
        for digest, size in item.get("blobs") or ():
            sizes[str(digest)] = int(size)
    return sum(sizes.values())


def summarize(answer: Mapping[str, Any]) -> dict[str, Any]:
    """One registry's use: total, per namespace and per label (see the module doc)."""
    items = list(answer.get("checkpoints") or ())
    by_namespace: dict[str, list[Mapping[str, Any]]] = {}
    for item in items:
        by_namespace.setdefault(str(item.get("namespace")), []).append(item)
    namespaces = []
    for namespace in sorted(by_namespace):
        mine = by_namespace[namespace]
        by_label: dict[str, list[Mapping[str, Any]]] = {}
        for item in mine:
            by_label.setdefault(str(item.get("label") or ""), []).append(item)
        namespaces.append(
            {
                "namespace": namespace,
                "bytes": distinct_bytes(mine),
                "checkpoints": len(mine),
                "labels": [
                    {"label": label, "bytes": distinct_bytes(of), "checkpoints": len(of)}
                    for label, of in sorted(by_label.items())
                ],
            }
        )
    return {
        "registry": answer.get("registry") or "",
        "via": answer.get("node") or "",
        "bytes": distinct_bytes(items),
        "checkpoints": len(items),
        "namespaces": namespaces,
        "errors": list(answer.get("errors") or ()),
    }


def registry_use(
    agents: Agents, states: Iterable[Mapping[str, Any]], namespaces: Iterable[str]
) -> list[dict[str, Any]]:
    """Every registry the nodes push to, with its use for ``namespaces``; a registry
    no agent could read for us says why."""
    by_registry: dict[str, list[str]] = {}
    for state in states:
        if state.get("registry"):
            by_registry.setdefault(str(state["registry"]), []).append(str(state.get("node")))
    wanted = ",".join(quote(n, safe="") for n in sorted(set(namespaces)))
    refs: dict[str, AgentRef] = {a.node: a for a in agents.find()} if by_registry else {}
    out = []
    for registry, nodes in sorted(by_registry.items()):
        tried = []
        for node in sorted(n for n in nodes if n in refs):  # the first that answers
            try:
                answer = agents.call(
                    refs[node], "GET", f"/v1/registry?namespaces={wanted}", timeout=30.0
                )
            except AgentError as err:
                tried.append(str(err))
                continue
            out.append({**summarize(answer), "registry": registry})
            break
        else:
            out.append(
                {"registry": registry, "via": "", "bytes": None, "checkpoints": 0,
                 "namespaces": [], "errors": tried}
            )  # fmt: skip
    return out
