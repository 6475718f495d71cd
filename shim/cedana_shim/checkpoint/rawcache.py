"""Uncompressed CRIU images of the newest checkpoint of each label.

A restore from the compressed blob first verifies and decompresses every byte:
for a GiB of process memory that costs more than the restore itself. So, beside
each committed checkpoint's compressed layers, the store keeps the raw images of
the newest checkpoint per (scope, label) in ``<store>/cache/<id>/<layer>``, with
a manifest of each file's size and SHA-256. A restore runs CRIU straight from
there while the digests are checked in parallel; on any mismatch the restored
container is discarded and the verified blob is used instead. The blob stays the
source of truth: the cache only ever saves time.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from collections.abc import Iterable
from typing import Any

from .. import errors
from . import fsutil

log = logging.getLogger(__name__)

MANIFEST_SUFFIX = ".manifest.json"
HASH_CHUNK = 1 << 20


def _file_digest(path: str) -> str:
    import hashlib

    digest = hashlib.sha256()
    with open(path, "rb") as f:
        while chunk := f.read(HASH_CHUNK):
            digest.update(chunk)
    return digest.hexdigest()


class RawCache:
    def __init__(self, store_root: str) -> None:
        self.root = os.path.join(store_root, "cache")

    def _dir(self, entry_id: str) -> str:
        return os.path.join(self.root, entry_id)

    def adopt(
        self, entry_id: str, scope: str, label: str, layer: str, digest: str, source: str
    ) -> None:
        """Move ``source`` (the staged images of a just-committed layer) into the cache."""
        os.makedirs(self.root, mode=0o700, exist_ok=True)
        target_dir = self._dir(entry_id)
        os.makedirs(target_dir, mode=0o700, exist_ok=True)
        target = os.path.join(target_dir, layer)
        os.rename(source, target)
        files: dict[str, list[Any]] = {}
        for dirpath, _, names in os.walk(target):
            for name in names:
                path = os.path.join(dirpath, name)
                files[os.path.relpath(path, target)] = [os.path.getsize(path), _file_digest(path)]
        manifest = {
            "id": entry_id,
            "scope": scope,
            "label": label,
            "layer": layer,
            "digest": digest,
            "files": files,
        }
        fsutil.create_file(target + MANIFEST_SUFFIX, json.dumps(manifest).encode())
        self._drop_older(entry_id, scope, label)

    def _manifests(self) -> Iterable[tuple[str, dict[str, Any]]]:
        try:
            ids = os.listdir(self.root)
        except FileNotFoundError:
            return
        for entry_id in ids:
            directory = self._dir(entry_id)
            for name in os.listdir(directory) if os.path.isdir(directory) else ():
                if name.endswith(MANIFEST_SUFFIX):
                    try:
                        with open(os.path.join(directory, name), "rb") as f:
                            yield entry_id, json.load(f)
                    except (OSError, ValueError):
                        yield entry_id, {}

    def _drop_older(self, newest: str, scope: str, label: str) -> None:
        for entry_id, manifest in list(self._manifests()):
            same = manifest.get("scope") == scope and manifest.get("label") == label
            if entry_id != newest and (same or not manifest):
                self.drop(entry_id)

    def lookup(self, entry_id: str, layer: str, digest: str) -> str | None:
        """The cached images for this layer if present and complete (sizes match)."""
        target = os.path.join(self._dir(entry_id), layer)
        try:
            with open(target + MANIFEST_SUFFIX, "rb") as f:
                manifest = json.load(f)
            if manifest.get("digest") != digest:
                return None
            for rel, (size, _) in manifest["files"].items():
                if os.path.getsize(os.path.join(target, rel)) != size:
                    return None
        except (OSError, ValueError, KeyError, TypeError):
            return None
        return target

    def verify(self, entry_id: str, layer: str) -> None:
        """Every cached file has its recorded SHA-256; DataLoss if not.

        The caller drops a bad cache once nothing reads it any more.
        """
        target = os.path.join(self._dir(entry_id), layer)
        try:
            with open(target + MANIFEST_SUFFIX, "rb") as f:
                files = json.load(f)["files"]
            for rel, (size, digest) in files.items():
                path = os.path.join(target, rel)
                if os.path.getsize(path) != size or _file_digest(path) != digest:
                    raise errors.DataLoss(
                        f"cached images of checkpoint {entry_id}: {rel} does not match its digest"
                    )
        except (OSError, ValueError, KeyError, TypeError) as err:
            raise errors.DataLoss(f"cached images of checkpoint {entry_id}: {err}") from err

    def drop(self, entry_id: str) -> None:
        shutil.rmtree(self._dir(entry_id), ignore_errors=True)

    def retain_only(self, ids: set[str]) -> None:
        """Forget the cache of every checkpoint no longer in the index."""
        try:
            present = os.listdir(self.root)
        except FileNotFoundError:
            return
        for entry_id in present:
            if entry_id not in ids:
                self.drop(entry_id)
