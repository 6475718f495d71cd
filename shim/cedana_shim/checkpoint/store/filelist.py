"""The file list of a raw layer: what was published, file by file.

A raw layer is a directory of files in ``<store>/raw/<id>/<layer>/`` (CRIU's
images, or one tar for a file layer) plus this list, stored as a blob: each
entry's relative path, type, size, CRC-32, mode and mtime, in tar order (a
directory before what it holds). Compaction turns the list and the files into
the tar it stands for; restores check files against it.

The list is read back from disk, so it is untrusted: :func:`parse_file_list`
returns a fully validated value or raises DataLoss. Paths are relative, made of
components that are neither empty, ``.`` nor ``..`` and hold no NUL (so, with
the store's no-symlink descent, a path can only name something inside the
layer's directory); the document, the number of entries and every path are
bounded.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any, Final, Literal

from cedana_shim import errors

from .layout import check_layer_name, check_media_type, dump_json, load_json

__all__ = [
    "CACHE_LIST_SUFFIX",
    "FILE_LAYER_NAME",
    "MAX_FILE_LIST_BYTES",
    "FileList",
    "RawFile",
    "check_rel_path",
    "dump_file_list",
    "parse_file_list",
]

MAX_FILE_LIST_BYTES: Final = 16 << 20
MAX_FILES: Final = 100_000
MAX_PATH_BYTES: Final = 4096
MAX_NAME_BYTES: Final = 255
MAX_DEPTH: Final = 32
# A file layer's tar is kept under this name in its raw directory.
FILE_LAYER_NAME: Final = "layer.tar"
# raw/<id>/<layer><suffix>: the file list of a compacted checkpoint's raw-image cache.
CACHE_LIST_SUFFIX: Final = ".files.json"
_SCHEMA: Final = 1
_MAX_MTIME: Final = 1 << 40
_MAX_SIZE: Final = (1 << 63) - 1


@dataclass(frozen=True)
class RawFile:
    path: str  # relative, "/"-separated
    kind: Literal["file", "dir"]
    mode: int  # permission bits to restore (the raw copy itself is 0600/0700)
    mtime: int
    size: int = 0
    crc32: int = 0


@dataclass(frozen=True)
class FileList:
    layer: str
    kind: Literal["dir", "file"]  # a directory's contents, or one tar file
    media_type: str  # of the compressed layer compaction makes
    cache: bool  # keep the raw files as the raw-image cache after compaction
    files: tuple[RawFile, ...]

    @property
    def total_bytes(self) -> int:
        return sum(f.size for f in self.files)

    def regular_files(self) -> Iterable[RawFile]:
        return (f for f in self.files if f.kind == "file")


def check_rel_path(path: object) -> str | None:
    """Why ``path`` is not a safe relative path inside a layer, or None."""
    if not isinstance(path, str):
        return f"path {path!r} is not a string"
    try:
        encoded = path.encode("utf-8")
    except UnicodeEncodeError:
        return f"path {path!r} is not valid UTF-8"
    if not encoded or len(encoded) > MAX_PATH_BYTES:
        return f"path {path!r} is empty or longer than {MAX_PATH_BYTES} bytes"
    if "\x00" in path:
        return f"path {path!r} contains NUL"
    parts = path.split("/")
    if len(parts) > MAX_DEPTH:
        return f"path {path!r} is deeper than {MAX_DEPTH} levels"
    for part in parts:
        if part in ("", ".", ".."):
            return f"path {path!r} has an empty, '.' or '..' component"
        if len(part.encode("utf-8")) > MAX_NAME_BYTES:
            return f"path {path!r} has a component longer than {MAX_NAME_BYTES} bytes"
    return None


def dump_file_list(files: FileList) -> bytes:
    entries: list[dict[str, Any]] = []
    for f in files.files:
        entry: dict[str, Any] = {"path": f.path, "type": f.kind, "mode": f.mode, "mtime": f.mtime}
        if f.kind == "file":
            entry.update(size=f.size, crc32=f.crc32)
        entries.append(entry)
    return dump_json(
        {
            "schemaVersion": _SCHEMA,
            "layer": files.layer,
            "kind": files.kind,
            "mediaType": files.media_type,
            "cache": files.cache,
            "files": entries,
        }
    )


def _int(value: Any, low: int, high: int, where: str) -> int:
    # bool is an int in Python but never a number in this document.
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise errors.DataLoss(f"{where}: expected an integer in [{low}, {high}], got {value!r}")
    return value


def _entry(item: Any, where: str) -> RawFile:
    if not isinstance(item, dict):
        raise errors.DataLoss(f"{where}: expected a JSON object")
    path = item.get("path")
    if (why := check_rel_path(path)) is not None:
        raise errors.DataLoss(f"{where}: {why}")
    assert isinstance(path, str)
    kind = item.get("type")
    mode = _int(item.get("mode"), 0, 0o7777, f"{where}: mode")
    mtime = _int(item.get("mtime"), -_MAX_MTIME, _MAX_MTIME, f"{where}: mtime")
    if kind == "dir":
        return RawFile(path, "dir", mode, mtime)
    if kind == "file":
        size = _int(item.get("size"), 0, _MAX_SIZE, f"{where}: size")
        crc = _int(item.get("crc32"), 0, 0xFFFFFFFF, f"{where}: crc32")
        return RawFile(path, "file", mode, mtime, size, crc)
    raise errors.DataLoss(f"{where}: type {kind!r} is neither 'file' nor 'dir'")


def _check_tree(files: list[RawFile], where: str) -> None:
    dirs: set[str] = set()
    seen: set[str] = set()
    for f in files:
        if f.path in seen:
            raise errors.DataLoss(f"{where}: {f.path!r} is listed twice")
        seen.add(f.path)
        parent = f.path.rpartition("/")[0]
        if parent and parent not in dirs:
            raise errors.DataLoss(f"{where}: {f.path!r} comes before its directory {parent!r}")
        if f.kind == "dir":
            dirs.add(f.path)


def parse_file_list(data: bytes, where: str) -> FileList:
    if len(data) > MAX_FILE_LIST_BYTES:
        raise errors.DataLoss(f"{where}: larger than the {MAX_FILE_LIST_BYTES} bytes allowed")
    obj = load_json(data, where)
    if not isinstance(obj, dict):
        raise errors.DataLoss(f"{where}: expected a JSON object")
    if obj.get("schemaVersion") != _SCHEMA:
        raise errors.DataLoss(f"{where}: schemaVersion is {obj.get('schemaVersion')!r}, not 1")
    layer = obj.get("layer")
    if (why := check_layer_name(layer)) is not None:
        raise errors.DataLoss(f"{where}: layer: {why}")
    kind = obj.get("kind")
    if kind not in ("dir", "file"):
        raise errors.DataLoss(f"{where}: kind {kind!r} is neither 'dir' nor 'file'")
    media_type = obj.get("mediaType")
    if (why := check_media_type(media_type)) is not None:
        raise errors.DataLoss(f"{where}: mediaType: {why}")
    cache = obj.get("cache")
    if not isinstance(cache, bool):
        raise errors.DataLoss(f"{where}: cache {cache!r} is not a boolean")
    items = obj.get("files")
    if not isinstance(items, list) or len(items) > MAX_FILES:
        raise errors.DataLoss(f"{where}: 'files' is not a list of at most {MAX_FILES} entries")
    files = [_entry(item, f"{where}: files[{i}]") for i, item in enumerate(items)]
    _check_tree(files, where)
    if kind == "file" and [(f.path, f.kind) for f in files] != [(FILE_LAYER_NAME, "file")]:
        raise errors.DataLoss(f"{where}: a file layer lists exactly one file, {FILE_LAYER_NAME}")
    assert isinstance(layer, str) and isinstance(media_type, str)
    return FileList(layer, kind, media_type, cache, tuple(files))
