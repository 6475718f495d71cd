"""What the registry holds for a node's namespaces: each checkpoint's blobs and sizes.

The node agent reads the registry with the node's own credentials (the node config's
``registry_auth_file``), so the controller needs none: it asks one agent per
registry and adds the sizes up itself (controller/registry_use.py), counting a blob
that several checkpoints share once. A checkpoint's tag is immutable (tags.py), so
what its manifest lists is remembered by tag: a page costs one tag list per
namespace, and a manifest read for a checkpoint pushed since.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable
from typing import Any, Final

from .. import errors
from ..checkpoint.remote.tags import parse_tag
from ..checkpoint.store.layout import ANN_LABEL, load_json
from ..registry import Registry

__all__ = ["RegistryUse"]

MAX_REMEMBERED: Final = 50_000  # manifests' blob lists kept (a few hundred bytes each)

Blobs = list[tuple[str, int]]


class RegistryUse:
    def __init__(self) -> None:
        self._blobs: dict[tuple[str, str], tuple[str, Blobs]] = {}  # (repo, tag) -> label, blobs
        self._lock = threading.Lock()

    def read(self, client: Registry, namespaces: Iterable[str]) -> dict[str, Any]:
        """``{"registry", "checkpoints": [{namespace, label, id, blobs: [[digest, size]]}],
        "errors": [...]}`` for the complete checkpoints of ``namespaces``."""
        found: list[dict[str, Any]] = []
        problems: list[str] = []
        for namespace in sorted(set(namespaces)):
            repo = client.repository_for(namespace)
            try:
                names = list(client.list_tags(repo))
            except errors.NotFound:
                continue
            except errors.ShimError as err:
                problems.append(f"{repo}: {err}")
                continue
            for name in names:
                tag = parse_tag(name)
                if tag is None or tag.pending:
                    continue  # a marker, a pin, a signature or another tool's tag
                try:
                    label, blobs = self._manifest_blobs(client, repo, name)
                except errors.NotFound:
                    continue  # deleted by retention since the list
                except errors.ShimError as err:
                    problems.append(f"{repo}:{name}: {err}")
                    continue
                found.append(
                    {
                        "namespace": namespace,
                        "label": tag.label or label,
                        "id": tag.checkpoint_id,
                        "blobs": [[d, s] for d, s in blobs],
                    }
                )
        return {"registry": client.host, "checkpoints": found, "errors": problems}

    def _manifest_blobs(self, client: Registry, repo: str, tag: str) -> tuple[str, Blobs]:
        with self._lock:
            hit = self._blobs.get((repo, tag))
        if hit is not None:
            return hit
        data, _, digest = client.get_manifest(repo, tag)
        where = f"{client.host}: {repo}:{tag}"
        doc = load_json(data, where)
        if not isinstance(doc, dict):
            raise errors.DataLoss(f"{where}: the manifest is not an object")
        blobs: Blobs = [(digest, len(data))]
        for desc in [doc.get("config"), *(doc.get("layers") or ())]:
            if not isinstance(desc, dict):
                raise errors.DataLoss(f"{where}: a descriptor is not an object")
            size, blob = desc.get("size"), desc.get("digest")
            if not isinstance(size, int) or size < 0 or not isinstance(blob, str):
                raise errors.DataLoss(f"{where}: a descriptor without digest and size")
            blobs.append((blob, size))
        annotations = doc.get("annotations")
        label = annotations.get(ANN_LABEL) if isinstance(annotations, dict) else ""
        found = (label if isinstance(label, str) else "", blobs)
        with self._lock:
            if len(self._blobs) >= MAX_REMEMBERED:
                self._blobs.clear()
            self._blobs[(repo, tag)] = found
        return found
