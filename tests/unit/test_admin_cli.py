"""The `cedana` admin CLI against a real checkpoint store and a real ttrpc server.

Checkpoints are committed through the real Store API in tmp_path. `cedana
checkpoint` talks to a ttrpc server in a thread of this process that serves
`cedana.shim.v1.Checkpoint` the way the shim daemon does (a fake at the edge: no
container is checkpointed here; tests/integration/test_admin_cli.py does that).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import errno
import io
import json
import os
import pty
import re
import select
import shutil
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from datetime import UTC, datetime, timedelta
from pathlib import Path

# Imported up front: a forked child that drops root may not be able to read the
# interpreter's own library directory to import them later.
import cedana_shim.checkpoint.store
import cedana_shim.cli.admin_store
import cedana_shim.config
import pytest
from cedana_shim import errors
from cedana_shim.api.cedana.v1.cedana_pb2 import CheckpointRequest, CheckpointResponse
from cedana_shim.checkpoint.store import Entry, Store, StoreConfig
from cedana_shim.checkpoint.store.layout import MEDIA_TYPE_CRIU
from cedana_shim.cli import admin
from cedana_shim.cli.admin_checkpoint import Progress, find_bundle
from cedana_shim.cli.admin_common import (
    format_elapsed,
    format_relative,
    human_size,
    render_progress,
    render_table,
)
from cedana_shim.ttrpc.server import CallContext, Method, Server

CEDANA_BIN = Path(sys.executable).parent / "cedana"
CONTRACT_KEYS = {"id", "namespace", "label", "container", "created", "size"}
RFC3339 = re.compile(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(\.\d+)?(Z|[+-]\d\d:\d\d)")
CREATED_CELL = re.compile(r"\d{4}-\d\d-\d\d \d\d:\d\d \((just now|\d+s ago)\)")
VERSIONS = {"shim": "0.1.0", "runc": "runc version 1.1.12", "criu": "Version: 4.1"}
NETWORK = {
    "addresses": [{"interface": "eth0", "family": "ipv4", "address": "10.88.0.7", "prefixlen": 16}],
    "routes": [{"destination": "default", "gateway": "10.88.0.1", "interface": "eth0"}],
}


# --------------------------------------------------------------------------- helpers


@dataclass
class Result:
    rc: int
    out: str
    err: str


def cli(capsys: pytest.CaptureFixture[str], *argv: str) -> Result:
    capsys.readouterr()
    rc = admin.main(list(argv))
    out, err = capsys.readouterr()
    assert "Traceback" not in err
    return Result(rc, out, err)


def commit(
    store: Store, scope: str, label: str, container: str, payload: int = 3000, **meta: object
) -> Entry:
    metadata = {
        "container": container,
        "containerId": f"{container}-id",
        "containerdNamespace": "k8s.io",
        "pod": f"{container}-pod",
        "image": "docker.io/library/busybox:1.36",
        "reason": "manual",
        "node": "node-1",
        "versions": VERSIONS,
        "network": NETWORK,
        **meta,
    }
    ing = store.writer.begin(scope=scope, label=label, metadata=metadata)
    criu = Path(ing.dir("criu"))
    (criu / "pages-1.img").write_bytes(os.urandom(payload))
    (criu / "inventory.img").write_bytes(b"x" * 100)
    ing.add_dir_layer("criu", str(criu), MEDIA_TYPE_CRIU)
    ing.keep_raw("criu")
    return store.commit(ing)


@dataclass
class Populated:
    root: str
    store: Store
    old: Entry  # default/train, oldest
    web: Entry  # team-a/web
    new: Entry  # default/train, newest

    def args(self, *argv: str) -> list[str]:
        return [*argv, "--store", self.root]


@pytest.fixture
def populated(tmp_path: Path) -> Populated:
    root = str(tmp_path / "store")
    store = Store(StoreConfig(root=root, retain=0))
    assert os.stat(root).st_mode & 0o777 == 0o700
    old = commit(store, "default", "train", "trainer", payload=2000)
    web = commit(store, "team-a", "web", "nginx", payload=40_000)
    new = commit(store, "default", "train", "trainer", payload=5000, gpu={"devices": 0})
    return Populated(root, store, old, web, new)


def blob(store: Store, digest: str) -> Path:
    return Path(store.root, "blobs", "sha256", digest.removeprefix("sha256:"))


def table_rows(out: str) -> list[list[str]]:
    return [re.split(r" {3,}", line) for line in out.splitlines()]


# --------------------------------------------------------------------------- list


def test_list_table_is_aligned_newest_first(
    populated: Populated, capsys: pytest.CaptureFixture[str]
) -> None:
    r = cli(capsys, "checkpoints", "list", "--store", populated.root)
    assert (r.rc, r.err) == (0, "")
    lines = r.out.splitlines()
    header = lines[0]
    assert header.split() == [
        "ID", "NAMESPACE", "LABEL", "CONTAINER", "CREATED", "SIZE", "RAW",
        "RESTORE", "WITH", "STATE", "STATUS",
    ]  # fmt: skip
    # Aligned: every column starts where its header does.
    starts = [
        header.index(h) for h in ("NAMESPACE", "LABEL", "CONTAINER", "CREATED", "SIZE", "STATE")
    ]
    for line in lines[1:]:
        for col in starts:
            assert line[col - 1] == " " and line[col] != " ", (line, col)
    rows = table_rows(r.out)[1:]
    assert [row[0] for row in rows] == [populated.new.id, populated.web.id, populated.old.id]
    for row, entry in zip(rows, [populated.new, populated.web, populated.old], strict=True):
        assert row[1:4] == [entry.scope, entry.label, entry.metadata["container"]]
        assert CREATED_CELL.fullmatch(row[4]), row[4]
        assert row[5] == f"{entry.size / 1024:.1f} KiB"
        assert row[7:] == [f"CEDANA_RESTORE={entry.id}", "compacted", "-"]
    # The newest checkpoint of each label keeps its raw images (the cache).
    assert [row[6] for row in rows] == [
        human_size(populated.new.raw_bytes), human_size(populated.web.raw_bytes), "-",
    ]  # fmt: skip
    assert populated.new.raw_bytes == 5100  # pages-1.img and inventory.img
    assert populated.store.catalog.get(populated.old.id).raw_bytes == 0


def test_list_json_follows_the_contract(
    populated: Populated, capsys: pytest.CaptureFixture[str]
) -> None:
    r = cli(capsys, "--store", populated.root, "checkpoints", "list", "--json")
    assert r.rc == 0
    items = json.loads(r.out)
    assert isinstance(items, list)
    assert [i["id"] for i in items] == [populated.new.id, populated.web.id, populated.old.id]
    for item, entry in zip(items, [populated.new, populated.web, populated.old], strict=True):
        assert set(item) >= CONTRACT_KEYS
        assert (item["namespace"], item["label"], item["container"]) == (
            entry.scope,
            entry.label,
            entry.metadata["container"],
        )
        assert type(item["size"]) is int and item["size"] == entry.size > 0
        assert RFC3339.fullmatch(item["created"]), item["created"]
        created = datetime.fromisoformat(item["created"])
        assert created.tzinfo is not None
        assert abs(datetime.now(UTC) - created) < timedelta(minutes=5)
        assert item["pod"] == f"{entry.metadata['container']}-pod"
        assert item["layers"][0]["name"] == "criu"
        assert item["damage"] is None
    assert [datetime.fromisoformat(i["created"]) for i in items] == sorted(
        (datetime.fromisoformat(i["created"]) for i in items), reverse=True
    )


def test_list_filters(populated: Populated, capsys: pytest.CaptureFixture[str]) -> None:
    def ids(*argv: str) -> list[str]:
        r = cli(capsys, "checkpoints", "list", "--json", *populated.args(*argv))
        assert r.rc == 0
        return [i["id"] for i in json.loads(r.out)]

    assert ids("--namespace", "team-a") == [populated.web.id]
    assert ids("--label", "train") == [populated.new.id, populated.old.id]
    assert ids("-n", "default", "-l", "train") == [populated.new.id, populated.old.id]
    assert ids("-n", "team-a", "-l", "train") == []

    r = cli(capsys, "checkpoints", "ls", "-q", *populated.args("--label", "train"))
    assert r.out == f"{populated.new.id}\n{populated.old.id}\n"

    r = cli(capsys, "checkpoints", "list", *populated.args("-n", "nope", "-l", "x"))
    assert (r.rc, r.out) == (0, "")
    assert r.err == f"No checkpoints in {populated.root} (namespace nope, label x).\n"


def test_list_shows_damage(populated: Populated, capsys: pytest.CaptureFixture[str]) -> None:
    manifest = json.loads(blob(populated.store, populated.old.manifest_digest).read_bytes())
    config = blob(populated.store, manifest["config"]["digest"])
    config.unlink()
    r = cli(capsys, "checkpoints", "list", "--store", populated.root)
    assert r.rc == 0
    row = next(x for x in table_rows(r.out) if x[0] == populated.old.id)
    assert row[-1] == f"damaged: config: blob {config} is missing"
    r = cli(capsys, "checkpoints", "list", "--json", "--store", populated.root)
    item = next(i for i in json.loads(r.out) if i["id"] == populated.old.id)
    assert set(item) >= CONTRACT_KEYS
    assert "is missing" in item["damage"]


def test_list_status_shows_a_truncated_blob_or_raw_file_without_hashing(
    populated: Populated, capsys: pytest.CaptureFixture[str]
) -> None:
    # A page-image chunk: web's alone (the layer's tar of small images can be shared).
    chunk = populated.web.layers[0].chunks[0]
    layer = blob(populated.store, chunk.digest)
    os.truncate(layer, layer.stat().st_size - 1)
    raw = publish_raw(populated.store, "default", "train")
    pages = Path(populated.root, "raw", raw.id, "criu", "pages-1.img")
    os.truncate(pages, 100)
    r = cli(capsys, "checkpoints", "list", "--store", populated.root)
    assert r.rc == 0
    rows = {row[0]: row for row in table_rows(r.out)[1:]}
    assert rows[populated.web.id][-1].startswith("damaged: layer 'criu'"), rows
    assert (
        f"{layer}" in rows[populated.web.id][-1] and f"{chunk.size}" in rows[populated.web.id][-1]
    )
    assert rows[raw.id][-2:] == [
        "raw",
        f"damaged: layer 'criu' ({pages.parent}): pages-1.img is 100 bytes, the file list "
        "says 1000 (truncated or changed after it was published)",
    ]
    assert rows[populated.new.id][-1] == "-"
    r = cli(capsys, "checkpoints", "list", "--json", "--store", populated.root)
    items = {i["id"]: i for i in json.loads(r.out)}
    assert "truncated" in items[populated.web.id]["damage"]
    assert items[populated.new.id]["damage"] is None


def publish_raw(store: Store, scope: str, label: str) -> Entry:
    ing = store.writer.begin(scope=scope, label=label, metadata={"container": "trainer"})
    criu = Path(ing.dir("criu"))
    (criu / "pages-1.img").write_bytes(os.urandom(1000))
    ing.add_dir_layer("criu", str(criu), MEDIA_TYPE_CRIU)
    ing.keep_raw("criu")
    return store.writer.publish(ing)


def test_list_and_inspect_show_the_state_and_the_raw_bytes(
    populated: Populated, capsys: pytest.CaptureFixture[str]
) -> None:
    raw = publish_raw(populated.store, "default", "train")
    r = cli(capsys, "checkpoints", "list", "--json", "--store", populated.root)
    items = {i["id"]: i for i in json.loads(r.out)}
    assert (items[raw.id]["state"], items[raw.id]["rawBytes"]) == ("raw", 1000)
    assert (items[populated.web.id]["state"], items[populated.web.id]["rawBytes"]) == (
        "compacted",
        40_100,
    )
    r = cli(capsys, "checkpoints", "list", "--store", populated.root)
    rows = {row[0]: row for row in table_rows(r.out)[1:]}
    assert rows[raw.id][6:] == ["1000 B", f"CEDANA_RESTORE={raw.id}", "raw", "-"]
    r = cli(capsys, "checkpoints", "inspect", raw.id, "--verify", "--store", populated.root)
    assert (r.rc, r.err) == (0, "")
    assert "\nState:     raw (uncompressed, compaction pending)\n" in r.out
    assert "\nRaw:       1000 B (1000 bytes) kept: its files\n" in r.out
    assert r.out.endswith(
        "\nVerify:    OK (manifest, config and 1 raw layer(s): every file's size and "
        "CRC-32 intact)\n"
    )
    r = cli(capsys, "checkpoints", "inspect", populated.web.id, "--store", populated.root)
    assert "\nState:     compacted (tar+zstd blobs)\n" in r.out
    assert "kept: raw-image cache for fast restores\n" in r.out


def repair(root: str, capsys: pytest.CaptureFixture[str], *, as_json: bool = False) -> Result:
    capsys.readouterr()
    rc = cedana_shim.cli.admin_store.cmd_repair(argparse.Namespace(store=root, json=as_json))
    out, err = capsys.readouterr()
    return Result(rc, out, err)


def test_repair_rebuilds_a_damaged_or_missing_index(
    populated: Populated, capsys: pytest.CaptureFixture[str]
) -> None:
    r = repair(populated.root, capsys)
    assert (r.rc, r.out) == (0, f"{populated.root}/index.json is intact: nothing to repair\n")
    index = Path(populated.root, "index.json")
    index.write_text("{not json")
    r = repair(populated.root, capsys)
    assert r.rc == 0, r.err
    lines = r.out.splitlines()
    assert lines[0].startswith(f"rebuilt {index} ({index}: not valid JSON")
    assert lines[1].startswith(f"the damaged index was kept as {index}.damaged-")
    ids = [populated.old.id, populated.web.id, populated.new.id]
    assert lines[2:5] == [f"recovered {i} (compacted)" for i in ids]
    assert lines[5] == "recovered 3 checkpoints, dropped 0"
    assert [e.id for e in populated.store.catalog.list()] == ids[::-1]

    index.unlink()
    r = repair(populated.root, capsys, as_json=True)
    doc = json.loads(r.out)
    assert doc["rebuilt"] is True and doc["damagedCopy"] is None
    assert "is missing" in doc["reason"]
    assert [x["id"] for x in doc["recovered"]] == ids and doc["dropped"] == []


# --------------------------------------------------------------------------- inspect


def test_inspect_shows_all_metadata(
    populated: Populated, capsys: pytest.CaptureFixture[str]
) -> None:
    e = populated.new
    r = cli(capsys, "checkpoints", "inspect", e.id, "--store", populated.root)
    assert (r.rc, r.err) == (0, "")
    fields = {
        k.strip(): v.strip()
        for k, _, v in (line.partition(":") for line in r.out.splitlines())
        if not k.startswith(" ")
    }
    assert fields["ID"] == e.id
    assert (fields["Namespace"], fields["Label"]) == ("default", "train")
    assert (fields["Pod"], fields["Container"]) == ("trainer-pod", "trainer")
    assert fields["Image"] == "docker.io/library/busybox:1.36"
    assert fields["Reason"] == "manual"
    assert fields["Task"] == "trainer-id (containerd namespace k8s.io)"
    assert fields["Status"] == "committed"
    assert f"({e.size} bytes)" in fields["Size"]
    assert e.created in fields["Created"]
    layer = e.layers[0]
    assert re.search(
        rf"^  criu +{re.escape(human_size(layer.size))} +{re.escape(human_size(layer.raw_size))}"
        rf" +{re.escape(MEDIA_TYPE_CRIU)}$",
        r.out,
        re.M,
    ), r.out
    assert re.search(r"^  runc +runc version 1\.1\.12$", r.out, re.M)
    assert re.search(r"^  criu +Version: 4\.1$", r.out, re.M)
    assert "  address  eth0  10.88.0.7/16 (ipv4)\n" in r.out
    assert "  route    default via 10.88.0.1 dev eth0\n" in r.out
    assert 'Other metadata:\n  gpu: {"devices": 0}\n' in r.out
    assert "Verify" not in r.out


def test_inspect_json_and_prefix(populated: Populated, capsys: pytest.CaptureFixture[str]) -> None:
    e = populated.web
    r = cli(capsys, "checkpoints", "inspect", e.id[:-3], "--json", "--store", populated.root)
    assert r.rc == 0, r.err
    doc = json.loads(r.out)
    assert set(doc) >= CONTRACT_KEYS
    assert doc["id"] == e.id
    assert doc["manifestDigest"] == e.manifest_digest
    assert doc["metadata"]["network"] == NETWORK
    assert doc["metadata"]["layers"][0]["raw_size"] == e.layers[0].raw_size
    assert "verify" not in doc


def test_inspect_verify_good_and_corrupt(
    populated: Populated, capsys: pytest.CaptureFixture[str]
) -> None:
    e = populated.web
    r = cli(capsys, "checkpoints", "inspect", e.id, "--verify", "--store", populated.root)
    assert (r.rc, r.err) == (0, "")
    assert r.out.endswith("\nVerify:    OK (manifest, config and 1 layer blob(s) intact)\n")

    layer = blob(populated.store, e.layers[0].digest)
    data = bytearray(layer.read_bytes())
    data[len(data) // 2] ^= 0xFF  # same size, different content
    layer.write_bytes(bytes(data))
    r = cli(capsys, "checkpoints", "inspect", e.id, "--verify", "--store", populated.root)
    assert r.rc == 1
    reason = f"checkpoint {e.id}: layer 'criu' ({layer}): blob is corrupt (sha256 is sha256:"
    assert f"\nVerify:    FAILED: {reason}" in r.out
    assert r.err.startswith(f"cedana: checkpoint {e.id} is damaged: {reason}")

    r = cli(capsys, "checkpoints", "inspect", e.id, "--verify", "--json", "--store", populated.root)
    assert r.rc == 1
    verdict = json.loads(r.out)["verify"]
    assert verdict["ok"] is False and verdict["error"].startswith(reason)


def test_inspect_unknown_bad_and_ambiguous_ids(
    populated: Populated, capsys: pytest.CaptureFixture[str]
) -> None:
    root = populated.root
    r = cli(capsys, "checkpoints", "inspect", "20000101T000000Z-00000000", "--store", root)
    assert (r.rc, r.out) == (1, "")
    assert r.err == f"cedana: checkpoint 20000101T000000Z-00000000: not found in {root}\n"
    r = cli(capsys, "checkpoints", "inspect", "no-such", "--store", root)
    assert r.rc == 1
    assert r.err.startswith(f"cedana: checkpoint no-such: not found in {root} (ids look like")
    r = cli(capsys, "checkpoints", "inspect", populated.old.id[:8], "--store", root)
    assert r.rc == 1
    assert r.err.startswith(f"cedana: checkpoint {populated.old.id[:8]}: ambiguous, 3 ids")


# --------------------------------------------------------------------------- rm / prune


def test_rm_removes_and_reports_unknown_ids(
    populated: Populated, capsys: pytest.CaptureFixture[str]
) -> None:
    unknown = "20000101T000000Z-00000000"
    r = cli(capsys, "checkpoints", "rm", populated.old.id, unknown, populated.web.id,
            "--store", populated.root)  # fmt: skip
    assert r.rc == 1
    assert r.out == f"{populated.old.id}\n{populated.web.id}\n"
    assert r.err == f"cedana: checkpoint {unknown}: not found in {populated.root}\n"
    assert [e.id for e in populated.store.catalog.list()] == [populated.new.id]
    r = cli(capsys, "checkpoints", "remove", populated.new.id, "--store", populated.root)
    assert (r.rc, r.out, r.err) == (0, f"{populated.new.id}\n", "")
    assert populated.store.catalog.list() == []
    assert os.listdir(Path(populated.root, "blobs", "sha256")) == []


def test_prune_keep_one_with_gc(populated: Populated, capsys: pytest.CaptureFixture[str]) -> None:
    stale = Path(populated.root, "index.json.tmp-4242-deadbeef")  # a crashed index write
    stale.write_bytes(b"x" * 700)
    r = cli(capsys, "checkpoints", "prune", "--keep", "1", "--gc", "--store", populated.root)
    assert (r.rc, r.err) == (0, "")
    old = populated.old
    removed, *rest = r.out.splitlines()
    # The age is the clock's (a loaded machine may take seconds between the two).
    assert re.fullmatch(
        rf"removed {old.id} \(default/train, created (just now|\d+s ago), "
        rf"{re.escape(human_size(old.size))}\)",
        removed,
    ), removed
    assert rest == [
        "pruned 1 checkpoint, kept the newest 1 of each namespace/label",
        "gc: freed 700 B (700 bytes) of unreferenced blobs and stale files",
    ]
    assert not stale.exists()
    assert [e.id for e in populated.store.catalog.list()] == [populated.new.id, populated.web.id]

    r = cli(capsys, "checkpoints", "prune", "--keep", "1", "--store", populated.root)
    assert r.out == "pruned 0 checkpoints, kept the newest 1 of each namespace/label\n"


def test_prune_filters_and_json(populated: Populated, capsys: pytest.CaptureFixture[str]) -> None:
    r = cli(
        capsys, "checkpoints", "prune", "--json", *populated.args("-n", "team-a", "--keep", "0")
    )
    assert r.rc == 0
    doc = json.loads(r.out)
    assert [i["id"] for i in doc["removed"]] == [populated.web.id]
    assert set(doc["removed"][0]) >= CONTRACT_KEYS
    assert doc["gcFreedBytes"] is None
    assert [e.id for e in populated.store.catalog.list()] == [populated.new.id, populated.old.id]


# --------------------------------------------------------------------------- errors


def test_missing_store_and_not_a_directory(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    missing = tmp_path / "none"
    r = cli(capsys, "checkpoints", "list", "--store", str(missing))
    assert (r.rc, r.out) == (1, "")
    assert r.err == f"cedana: checkpoint store {missing} does not exist (--store)\n"
    assert not missing.exists(), "a read-only command must not create a store"
    config = tmp_path / "shim.toml"
    config.write_text(f'store_path = "{missing}"\n')
    r = cli(capsys, "checkpoints", "list", "--config", str(config))
    assert r.rc == 1
    assert r.err == (
        f"cedana: checkpoint store {missing} does not exist: no checkpoint was taken on this "
        f"node yet, or the store is elsewhere (pass --store, or see store_path in {config} "
        "and env CEDANA_STORE_PATH)\n"
    )
    (tmp_path / "file").write_text("x")
    r = cli(capsys, "checkpoints", "rm", "x", "--store", str(tmp_path / "file"))
    assert (r.rc, r.err) == (
        1,
        f"cedana: checkpoint store {tmp_path / 'file'} is not a directory\n",
    )


def test_damaged_index_is_an_error_not_a_traceback(
    populated: Populated, capsys: pytest.CaptureFixture[str]
) -> None:
    index = Path(populated.root, "index.json")
    index.write_text("{not json")
    for argv in (["list"], ["inspect", populated.old.id[:10]]):
        r = cli(capsys, "checkpoints", *argv, "--store", populated.root)
        assert (r.rc, r.out) == (1, ""), argv
        assert r.err.startswith(f"cedana: {index}"), r.err
        assert "The store's index is damaged" in r.err
        assert "run `cedana checkpoints repair`" in r.err
    # A write repairs it first, then does its job.
    r = cli(capsys, "checkpoints", "rm", populated.old.id, "--store", populated.root)
    assert (r.rc, r.out) == (0, f"{populated.old.id}\n"), r.err
    assert [e.id for e in populated.store.catalog.list()] == [populated.new.id, populated.web.id]


def test_store_path_comes_from_node_config_and_env(
    populated: Populated,
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    config = tmp_path / "shim.toml"
    config.write_text(f'store_path = "{populated.root}"\n')
    r = cli(capsys, "checkpoints", "list", "-q", "--config", str(config))
    assert r.out.splitlines() == [populated.new.id, populated.web.id, populated.old.id]

    monkeypatch.setenv("CEDANA_CONFIG", str(tmp_path / "absent.toml"))
    monkeypatch.setenv("CEDANA_STORE_PATH", populated.root)
    r = cli(capsys, "checkpoints", "list", "-q", "-n", "team-a")
    assert r.out == f"{populated.web.id}\n"

    r = cli(capsys, "checkpoints", "list", "--config", str(tmp_path / "nope.toml"))
    assert (r.rc, r.err) == (
        1,
        f"cedana: cedana node config {tmp_path / 'nope.toml'} does not exist\n",
    )
    config.write_text("store_pth = 1\n")
    r = cli(capsys, "checkpoints", "list", "--config", str(config))
    assert (r.rc, r.err) == (1, f"cedana: cedana node config {config}: unknown keys store_pth\n")


def test_store_open_to_others_is_refused(
    populated: Populated, capsys: pytest.CaptureFixture[str]
) -> None:
    os.chmod(populated.root, 0o755)
    r = cli(capsys, "checkpoints", "list", "--store", populated.root)
    assert r.rc == 1
    assert r.err.startswith(f"cedana: checkpoint store {populated.root} is accessible to group/")
    assert f"Fix: chmod 0700 {populated.root}" in r.err


def _as_unprivileged(argv: list[str]) -> Result:
    """Run main() as uid/gid 65534 in a forked child (as ourselves when not root)."""
    if os.geteuid() != 0:
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = admin.main(argv)
        return Result(rc, out.getvalue(), err.getvalue())
    rfd, wfd = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: never returns into pytest
        try:
            os.close(rfd)
            os.setgroups([])
            os.setgid(65534)
            os.setuid(65534)
            out, err = io.StringIO(), io.StringIO()
            with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
                rc = admin.main(argv)
            os.write(wfd, json.dumps([rc, out.getvalue(), err.getvalue()]).encode())
        except BaseException as exc:
            os.write(wfd, json.dumps([99, "", repr(exc)]).encode())
        finally:
            os._exit(0)
    os.close(wfd)
    with os.fdopen(rfd, "rb") as f:
        data = f.read()
    os.waitpid(pid, 0)
    rc, out, err = json.loads(data)
    return Result(rc, out, err)


def test_unreadable_store_says_run_as_root(tmp_path: Path) -> None:
    locked = tmp_path / "locked"
    locked.mkdir()
    store = locked / "store"
    Store(StoreConfig(root=str(store)))
    locked.chmod(0o000)
    try:
        r = _as_unprivileged(["checkpoints", "list", "--store", str(store)])
    finally:
        locked.chmod(0o700)
    assert (r.rc, r.out) == (1, "")
    assert r.err == (
        f"cedana: cannot access checkpoint store {store}: permission denied; "
        "run cedana as root (sudo cedana ...)\n"
    )


def test_store_of_another_user_says_run_as_root(
    populated: Populated, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # The message path for a non-root user and a root-owned store (uid 4242 is not
    # the owner of anything here).
    monkeypatch.setattr(os, "geteuid", lambda: 4242)
    r = cli(capsys, "checkpoints", "inspect", populated.new.id, "--store", populated.root)
    assert r.rc == 1
    assert r.err == (
        f"cedana: checkpoint store {populated.root} belongs to uid {os.getuid()} and holds "
        "process memory, so only its owner may read it: run cedana as root (sudo cedana ...)\n"
    )


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        ([], "cedana: a command is required"),
        (["checkpoints"], "cedana: a subcommand is required"),
        (["checkpoints", "prune"], "the following arguments are required: --keep"),
        (["checkpoints", "prune", "--keep", "-1"], "argument --keep: -1 is negative"),
        (["checkpoints", "frobnicate"], "invalid choice: 'frobnicate'"),
        (["checkpoints", "list", "--json", "-q"], "not allowed with argument"),
        (["checkpoint"], "the following arguments are required: CONTAINER_ID"),
        (["checkpoint", "c1", "--timeout", "0"], "must be a positive number of seconds"),
    ],
)
def test_usage_errors_exit_2(
    argv: list[str], needle: str, capsys: pytest.CaptureFixture[str]
) -> None:
    r = cli(capsys, *argv)
    assert r.rc == 2
    assert r.out == ""
    assert r.err.startswith("usage: cedana")
    assert needle in r.err


def test_help_and_version(capsys: pytest.CaptureFixture[str]) -> None:
    r = cli(capsys, "--version")
    assert (r.rc, r.out) == (0, "cedana 0.1.0\n")
    for argv, needle in [
        (["--help"], "checkpoint a running container now"),
        (["checkpoints", "--help"], "NAMESPACE is the scope of a"),
        (["checkpoints", "list", "--help"], "created (RFC 3339), size (bytes)"),
        (["checkpoints", "inspect", "-h"], "--verify also checks every blob"),
        (["checkpoints", "rm", "-h"], "the others are still removed"),
        (["checkpoints", "prune", "-h"], "--keep N"),
        (["checkpoint", "-h"], "--leave-running"),
    ]:
        r = cli(capsys, *argv)
        assert r.rc == 0, argv
        assert needle in r.out, (argv, r.out)
        assert "--store PATH" in r.out


def test_console_script(populated: Populated, tmp_path: Path) -> None:
    proc = subprocess.run(
        [str(CEDANA_BIN), "checkpoints", "list", "--json", "--store", populated.root],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert (proc.returncode, proc.stderr) == (0, "")
    assert [i["id"] for i in json.loads(proc.stdout)] == [
        populated.new.id,
        populated.web.id,
        populated.old.id,
    ]
    proc = subprocess.run(
        [str(CEDANA_BIN), "checkpoints", "inspect", "x", "--store", str(tmp_path / "none")],
        capture_output=True,
        text=True,
        timeout=30,
        check=False,
    )
    assert (proc.returncode, proc.stdout) == (1, "")
    assert proc.stderr == f"cedana: checkpoint store {tmp_path / 'none'} does not exist (--store)\n"


# --------------------------------------------------------------------------- formatting


def test_human_size_and_elapsed() -> None:
    assert [human_size(n) for n in (0, 1023, 1024, 1536, 12_900_000, 1024**3 - 1, 5 * 1024**4)] == [
        "0 B", "1023 B", "1.0 KiB", "1.5 KiB", "12.3 MiB", "1.0 GiB", "5.0 TiB",
    ]  # fmt: skip
    assert [format_elapsed(s) for s in (0, 3.24, 59.94, 65, 3723)] == [
        "0.0s", "3.2s", "59.9s", "1m05s", "1h02m03s",
    ]  # fmt: skip
    now = datetime(2026, 11, 29, 18, 30, tzinfo=UTC)
    ago = [
        format_relative(now - timedelta(seconds=s), now) for s in (0.2, 45, 300, 7200, 86400 * 3)
    ]
    assert ago == ["just now", "45s ago", "5m ago", "2h ago", "3d ago"]
    assert format_relative(now + timedelta(minutes=5), now) == "in the future"


def test_render_table_pads_all_but_the_last_column() -> None:
    text = render_table(("A", "LONGER", "C"), [("xx", "y", "z z"), ("x", "yyyyyyyy", "")])
    assert text == "A    LONGER     C\nxx   y          z z\nx    yyyyyyyy\n"


def test_render_progress_is_one_line_that_fits() -> None:
    line = render_progress("checkpointing container c1 (stop)", 3.21, 0, 80)
    assert line == "⠋ checkpointing container c1 (stop)  [===         ]  3.2s"
    # The spinner and the bar move from one redraw to the next.
    assert render_progress("x", 3.3, 4, 80) == "⠼ x  [    ===     ]  3.3s"
    assert render_progress("x", 0.0, 9, 80) == "⠏ x  [         ===]  0.0s"
    assert render_progress("x", 0.0, 12, 80) == "⠹ x  [      ===   ]  0.0s"
    assert render_progress("x", 75, 1, 80, ascii=True) == "/ x  [ ===        ]  1m15s"
    # Narrow terminals: the description is cut, then the bar goes; the time stays.
    what = "checkpointing container a-very-long-container-id-0123456789 (leave running)"
    for width in (100, 60, 30, 20):
        line = render_progress(what, 12.5, 3, width)
        assert len(line) <= width - 1, (width, line)
        assert line.endswith("12.5s") and "\n" not in line and "\r" not in line
    assert render_progress(what, 12.5, 3, 60).endswith("...  [   ===      ]  12.5s")
    assert "[" not in render_progress(what, 12.5, 3, 20)


def test_progress_redraws_in_place() -> None:
    clock = iter([100.0, 100.5, 101.7])
    stream = io.StringIO()
    progress = Progress(stream, "checkpointing container c1 (stop)", clock=lambda: next(clock))
    progress.draw()
    progress.draw()
    progress.clear()
    assert stream.getvalue() == (
        "\r⠋ checkpointing container c1 (stop)  [===         ]  0.5s\x1b[K"
        "\r⠙ checkpointing container c1 (stop)  [ ===        ]  1.7s\x1b[K"
        "\r\x1b[K"
    )


# --------------------------------------------------------------------------- checkpoint

CHECKPOINT_ID = "20261129T183000Z-3f9a1c2b"


@dataclass
class FakeShim:
    """A ttrpc server serving cedana.shim.v1.Checkpoint from a thread, as the shim does."""

    delay: float = 0.0
    error: errors.ShimError | None = None
    serve_cedana: bool = True
    requests: list[tuple[str, bool, float | None]] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.dir = tempfile.mkdtemp(prefix="cedana-admin-", dir="/tmp")  # short socket path
        self.socket = os.path.join(self.dir, "s")
        self.address = f"unix://{self.socket}"
        self._ready = threading.Event()
        self._stop: asyncio.Event | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread = threading.Thread(target=lambda: asyncio.run(self._main()), daemon=True)

    async def _checkpoint(self, req: CheckpointRequest, ctx: CallContext) -> CheckpointResponse:
        self.requests.append((req.container_id, req.leave_running, ctx.timeout))
        await asyncio.sleep(self.delay)
        if self.error is not None:
            raise self.error
        return CheckpointResponse(
            checkpoint_id=CHECKPOINT_ID, label="trainer", scope="team-a", size=12_900_000
        )

    async def _main(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(self.socket)
        listener.listen()
        methods = {"Checkpoint": Method(CheckpointRequest, self._checkpoint)}
        server = Server({"cedana.shim.v1.Checkpoint" if self.serve_cedana else "other": methods})
        task = asyncio.create_task(server.serve_socket(listener))
        self._ready.set()
        await self._stop.wait()
        server.close()
        await server.wait_closed()
        await task
        listener.close()

    def __enter__(self) -> FakeShim:
        self._thread.start()
        assert self._ready.wait(10)
        return self

    def __exit__(self, *exc: object) -> None:
        assert self._loop is not None and self._stop is not None
        self._loop.call_soon_threadsafe(self._stop.set)
        self._thread.join(10)
        shutil.rmtree(self.dir, ignore_errors=True)


def make_bundle(state: Path, namespace: str, cid: str, address: str) -> Path:
    bundle = state / "io.containerd.runtime.v2.task" / namespace / cid
    bundle.mkdir(parents=True)
    (bundle / "address").write_text(address)
    return bundle


@pytest.fixture
def shim(tmp_path: Path) -> Iterator[FakeShim]:
    with FakeShim() as fake:
        make_bundle(tmp_path / "state", "default", "c1", fake.address)
        yield fake


def test_checkpoint_prints_only_the_id_when_not_a_tty(
    shim: FakeShim, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    state = str(tmp_path / "state")
    r = cli(capsys, "checkpoint", "c1", "--containerd-state", state)
    assert (r.rc, r.out, r.err) == (0, f"{CHECKPOINT_ID}\n", "")
    r = cli(capsys, "checkpoint", "c1", "--leave-running", "--containerd-state", state,
            "--timeout", "30")  # fmt: skip
    assert (r.rc, r.out) == (0, f"{CHECKPOINT_ID}\n")
    assert shim.requests == [("c1", False, None), ("c1", True, pytest.approx(30, abs=1))]


def test_checkpoint_json(
    shim: FakeShim, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    r = cli(capsys, "checkpoint", "c1", "-n", "default", "--json",
            "--containerd-state", str(tmp_path / "state"))  # fmt: skip
    assert r.rc == 0
    doc = json.loads(r.out)
    assert doc.pop("elapsedSeconds") >= 0
    assert doc == {
        "id": CHECKPOINT_ID,
        "namespace": "team-a",
        "label": "trainer",
        "containerId": "c1",
        "containerdNamespace": "default",
        "size": 12_900_000,
        "leaveRunning": False,
    }


def _run_on_pty(argv: list[str], timeout: float = 20) -> tuple[int, str, str]:
    """The console script with its stdout on a fresh pty; returns (rc, tty output, stderr)."""
    master, slave = pty.openpty()
    env = {**os.environ, "TERM": "xterm", "PYTHONIOENCODING": "utf-8"}
    proc = subprocess.Popen(
        [str(CEDANA_BIN), *argv],
        stdin=subprocess.DEVNULL,
        stdout=slave,
        stderr=subprocess.PIPE,
        env=env,
    )
    os.close(slave)
    output = bytearray()
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            ready, _, _ = select.select([master], [], [], 0.1)
            if ready:
                try:
                    chunk = os.read(master, 65536)
                except OSError as exc:  # EIO: the child closed its side
                    if exc.errno != errno.EIO:
                        raise
                    chunk = b""
                if not chunk:
                    break
                output += chunk
            elif proc.poll() is not None:
                break
        rc = proc.wait(timeout=5)
        assert proc.stderr is not None
        err = proc.stderr.read().decode()
    finally:
        os.close(master)
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    return rc, output.decode(), err


def test_checkpoint_shows_progress_on_a_tty(tmp_path: Path) -> None:
    with FakeShim(delay=1.0) as fake:
        make_bundle(tmp_path / "state", "default", "c1", fake.address)
        rc, out, err = _run_on_pty(
            ["checkpoint", "c1", "--leave-running", "--containerd-state", str(tmp_path / "state")]
        )
    assert (rc, err) == (0, "")
    frames = [f for f in out.split("\r") if "checkpointing container c1 (leave running)" in f]
    assert len(frames) >= 5, out  # redrawn about ten times a second
    elapsed = [float(m.group(1)) for f in frames if (m := re.search(r"(\d+\.\d)s\x1b\[K$", f))]
    assert len(elapsed) == len(frames), frames
    assert elapsed == sorted(elapsed) and elapsed[-1] >= 0.8
    # The progress line is erased, then a summary and the id (the pty turns \n into \r\n).
    lines = out.replace("\r\n", "\n").split("\x1b[K")[-1].splitlines()
    assert re.fullmatch(
        r"✓ checkpointed container c1 in 1\.\ds \(label trainer, namespace team-a, "
        r"12\.3 MiB\); container left running",
        lines[-2],
    ), lines
    assert lines[-1] == CHECKPOINT_ID


def test_checkpoint_on_a_tty_with_json_has_no_progress(shim: FakeShim, tmp_path: Path) -> None:
    rc, out, _ = _run_on_pty(["checkpoint", "c1", "--json", "--containerd-state",
                              str(tmp_path / "state")])  # fmt: skip
    assert rc == 0
    assert "\x1b" not in out and "checkpointing" not in out
    assert json.loads(out)["id"] == CHECKPOINT_ID


def test_checkpoint_shim_errors(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    state = tmp_path / "state"
    opted_out = errors.FailedPrecondition(
        "container c1 has not opted in to checkpoints: set CEDANA_ENABLE=1 or "
        "CEDANA_CHECKPOINT=<label> in its environment"
    )
    with FakeShim(error=opted_out) as fake:
        make_bundle(state, "default", "c1", fake.address)
        r = cli(capsys, "checkpoint", "c1", "--containerd-state", str(state))
    assert (r.rc, r.out) == (1, "")
    assert r.err == f"cedana: {opted_out}\n"

    with FakeShim(error=errors.Internal("runc checkpoint: criu failed")) as fake:
        make_bundle(state, "ns2", "c2", fake.address)
        r = cli(capsys, "checkpoint", "c2", "--containerd-state", str(state))
    assert (r.rc, r.err) == (1, "cedana: checkpoint of container c2 failed: runc checkpoint: "
                                "criu failed\n")  # fmt: skip

    with FakeShim(serve_cedana=False) as fake:
        make_bundle(state, "ns3", "c3", fake.address)
        r = cli(capsys, "checkpoint", "c3", "--containerd-state", str(state))
    assert r.rc == 1
    assert r.err.startswith(
        f"cedana: the shim of container c3 ({fake.address}) does not serve "
        "cedana.shim.v1.Checkpoint: is the container running under the `cedana` handler?"
    )

    with FakeShim(delay=5) as fake:
        make_bundle(state, "ns4", "c4", fake.address)
        r = cli(capsys, "checkpoint", "c4", "--timeout", "0.3", "--containerd-state", str(state))
    assert r.rc == 1
    assert r.err.startswith("cedana: checkpoint of container c4 did not finish within 0.3s")

    dead = f"unix://{tmp_path}/gone.sock"
    make_bundle(state, "ns5", "c5", dead)
    r = cli(capsys, "checkpoint", "c5", "--containerd-state", str(state))
    assert r.rc == 1
    assert r.err.startswith(f"cedana: cannot reach the shim of container c5 at {dead}: ")


def test_checkpoint_finds_the_bundle(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    state = tmp_path / "state"
    tasks = state / "io.containerd.runtime.v2.task"
    r = cli(capsys, "checkpoint", "c1", "--containerd-state", str(state))
    assert r.rc == 1
    assert r.err.startswith(f"cedana: no containerd task state in {tasks}: ")

    with FakeShim() as fake:
        make_bundle(state, "k8s.io", "c1", fake.address)
        make_bundle(state, "default", "other", fake.address)
        # 2.x: no address file, the address is in bootstrap.json.
        b = make_bundle(state, "default", "boot", "")
        (b / "bootstrap.json").write_text(json.dumps({"version": 2, "address": fake.address}))
        assert find_bundle(str(state), "c1").namespace == "k8s.io"
        r = cli(capsys, "checkpoint", "boot", "--containerd-state", str(state))
        assert (r.rc, r.out) == (0, f"{CHECKPOINT_ID}\n")

        r = cli(capsys, "checkpoint", "nope", "--containerd-state", str(state))
        assert (r.rc, r.err) == (
            1,
            "cedana: container nope: no running task in any containerd namespace, looked "
            f"for {tasks}/<namespace>/nope in default, k8s.io\n",
        )
        r = cli(capsys, "checkpoint", "c1", "-n", "default", "--containerd-state", str(state))
        assert (r.rc, r.err) == (
            1,
            f"cedana: container c1: no running task, looked for {tasks}/default/c1 "
            "(namespaces with tasks: default, k8s.io)\n",
        )
        make_bundle(state, "default", "c1", fake.address)
        r = cli(capsys, "checkpoint", "c1", "--containerd-state", str(state))
        assert (r.rc, r.err) == (
            1,
            "cedana: container c1 has tasks in several containerd namespaces "
            "(default, k8s.io): pass --namespace\n",
        )
        r = cli(capsys, "checkpoint", "c1", "-n", "k8s.io", "--containerd-state", str(state))
        assert (r.rc, r.out) == (0, f"{CHECKPOINT_ID}\n")
    assert [req[0] for req in fake.requests] == ["boot", "c1"]

    (state / "io.containerd.runtime.v2.task" / "default" / "noaddr").mkdir()
    r = cli(capsys, "checkpoint", "noaddr", "--containerd-state", str(state))
    assert r.rc == 1
    assert "has no shim address; is its task still starting or being deleted?" in r.err
    r = cli(capsys, "checkpoint", "../etc", "--containerd-state", str(state))
    assert (r.rc, r.err) == (
        1,
        "cedana: '../etc' is not a valid container id (letters and digits, separated by "
        "single '.', '_' or '-')\n",
    )


def test_repair_is_a_checkpoints_subcommand(
    populated: Populated, capsys: pytest.CaptureFixture[str]
) -> None:
    (Path(populated.root) / "index.json").write_text("{not json")
    r = cli(capsys, "--store", populated.root, "checkpoints", "repair", "--json")
    assert r.rc == 0, r.err
    report = json.loads(r.out)
    assert report["rebuilt"] is True
    assert {x["id"] for x in report["recovered"]} == {
        populated.old.id,
        populated.web.id,
        populated.new.id,
    }
