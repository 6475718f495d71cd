"""Property tests for the raw layers' file-list parser: it reads untrusted bytes from disk.

Whatever the bytes, the parser returns a valid list or raises DataLoss; what it
accepts only names paths inside the layer's directory; what the store writes
reads back the same.
"""

from __future__ import annotations

import contextlib
import json
import posixpath
from typing import Any

import pytest
from cedana_shim import errors
from cedana_shim.checkpoint.store.filelist import (
    FILE_LAYER_NAME,
    MAX_FILE_LIST_BYTES,
    FileList,
    RawFile,
    dump_file_list,
    parse_file_list,
)
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.examples import examples

json_values = st.recursive(
    st.none()
    | st.booleans()
    | st.integers(-(2**70), 2**70)
    | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20),
    lambda children: (
        st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=12), children, max_size=4)
    ),
    max_leaves=20,
)
# Path components: anything but "/" and NUL, including names that look like "..".
components = st.text(
    alphabet=st.characters(blacklist_characters="/\x00", blacklist_categories=["Cs"]),
    min_size=1,
    max_size=12,
).filter(lambda c: c not in (".", ".."))
modes = st.integers(0, 0o7777)
mtimes = st.integers(-(2**40), 2**40)


@st.composite
def file_lists(draw: st.DrawFn) -> FileList:
    paths = draw(st.lists(st.lists(components, min_size=1, max_size=4), max_size=8))
    dirs = sorted({"/".join(p[:i]) for p in paths for i in range(1, len(p))})
    files = [
        "/".join(p) for p in paths if "/".join(p) not in dirs
    ]  # a path that is some file's parent is a directory
    entries = [RawFile(d, "dir", draw(modes), draw(mtimes)) for d in dirs]
    entries += [
        RawFile(f, "file", draw(modes), draw(mtimes), draw(st.integers(0, 2**40)),
                draw(st.integers(0, 2**32 - 1)))
        for f in dict.fromkeys(files)
    ]  # fmt: skip
    return FileList("criu", "dir", "application/vnd.x+zstd", draw(st.booleans()), tuple(entries))


def assert_safe(files: FileList) -> None:
    seen_dirs: set[str] = set()
    for f in files.files:
        assert "\x00" not in f.path and not f.path.startswith("/")
        parts = f.path.split("/")
        assert all(p not in ("", ".", "..") for p in parts)
        assert posixpath.normpath(posixpath.join("/layer", f.path)).startswith("/layer/")
        parent = f.path.rpartition("/")[0]
        assert not parent or parent in seen_dirs
        if f.kind == "dir":
            seen_dirs.add(f.path)


@settings(max_examples=examples(300))
@given(st.binary(max_size=300))
def test_any_bytes_are_a_file_list_or_data_loss(data: bytes) -> None:
    with contextlib.suppress(errors.DataLoss):
        assert_safe(parse_file_list(data, "file list"))


@settings(max_examples=examples(300), suppress_health_check=[HealthCheck.too_slow])
@given(json_values)
def test_any_json_document_is_a_file_list_or_data_loss(value: Any) -> None:
    with contextlib.suppress(errors.DataLoss):
        assert_safe(parse_file_list(json.dumps(value).encode(), "file list"))


@settings(max_examples=examples(200))
@given(file_lists())
def test_what_the_store_writes_reads_back_the_same(files: FileList) -> None:
    parsed = parse_file_list(dump_file_list(files), "file list")
    assert parsed == files
    assert_safe(parsed)


@settings(max_examples=examples(300), suppress_health_check=[HealthCheck.too_slow])
@given(file_lists().filter(lambda f: bool(f.files)), st.data())
def test_any_single_corruption_is_caught_or_harmless(files: FileList, data: st.DataObject) -> None:
    doc = json.loads(dump_file_list(files))
    entry = data.draw(st.sampled_from(doc["files"]))
    key = data.draw(st.sampled_from(["path", "type", "mode", "mtime", "size", "crc32"]))
    entry[key] = data.draw(json_values | components.map(lambda c: f"../{c}") | st.just("a//b"))
    try:
        parsed = parse_file_list(json.dumps(doc).encode(), "file list")
    except errors.DataLoss as err:
        assert str(err).startswith("file list")
        return
    assert_safe(parsed)


@pytest.mark.parametrize(
    ("path", "why"),
    [
        ("../etc/passwd", "'..'"),
        ("/etc/passwd", "empty, '.' or '..'"),
        ("a/../../b", "'..'"),
        ("a//b", "empty"),
        ("./a", "'.'"),
        ("a\x00b", "NUL"),
        ("a/" * 40 + "b", "deeper than"),
        ("x" * 256, "longer than 255"),
        ("\udc80", "not valid UTF-8"),
        (7, "not a string"),
    ],
)
def test_unsafe_paths_are_data_loss(path: object, why: str) -> None:
    doc = {
        "schemaVersion": 1,
        "layer": "criu",
        "kind": "dir",
        "mediaType": "a/b",
        "cache": False,
        "files": [{"path": path, "type": "file", "mode": 0o600, "mtime": 0, "size": 1, "crc32": 0}],
    }
    data = json.dumps(doc).encode()
    with pytest.raises(errors.DataLoss, match=why.replace("(", r"\(")):
        parse_file_list(data, "file list")


def test_structure_is_checked() -> None:
    def doc(**over: Any) -> bytes:
        base: dict[str, Any] = {
            "schemaVersion": 1,
            "layer": "shm",
            "kind": "file",
            "mediaType": "a/b",
            "cache": False,
            "files": [{"path": FILE_LAYER_NAME, "type": "file", "mode": 0o644, "mtime": 0,
                       "size": 10, "crc32": 1}],
        }  # fmt: skip
        base.update(over)
        return json.dumps(base).encode()

    assert parse_file_list(doc(), "l").files[0].size == 10
    bad = {
        "listed twice": doc(
            kind="dir", files=[{"path": "a", "type": "dir", "mode": 0, "mtime": 0}] * 2
        ),
        "before its directory": doc(
            kind="dir", files=[{"path": "a/b", "type": "dir", "mode": 0, "mtime": 0}]
        ),
        "exactly one file": doc(files=[]),
        "neither 'dir' nor 'file'": doc(kind="tar"),
        "not a boolean": doc(cache=1),
        "schemaVersion": doc(schemaVersion=2),
        "expected an integer": doc(files=[{"path": FILE_LAYER_NAME, "type": "file", "mode": 0,
                                           "mtime": 0, "size": True, "crc32": 0}]),
    }  # fmt: skip
    for why, data in bad.items():
        with pytest.raises(errors.DataLoss, match=why):
            parse_file_list(data, "l")


def test_size_is_bounded_before_parsing() -> None:
    data = b"{" + b" " * MAX_FILE_LIST_BYTES + b"}"
    with pytest.raises(errors.DataLoss, match="larger than"):
        parse_file_list(data, "file list")
