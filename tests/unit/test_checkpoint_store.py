"""The checkpoint store against a real filesystem: commits, crashes, races, damage.

Crash and concurrency tests run real child processes (killed with SIGKILL at
each commit step); ENOSPC uses a real 8 MiB tmpfs, so those tests need root and
fail, not skip, without it.
"""

from __future__ import annotations

import errno
import gc as gc_module
import io
import json
import os
import signal
import stat
import subprocess
import sys
import tarfile
import textwrap
import threading
import time
from pathlib import Path

import pytest
from cedana_shim import errors
from cedana_shim.checkpoint.store import COMMIT_STEPS, Entry, Ingest, Store, StoreConfig
from cedana_shim.checkpoint.store.layout import (
    ANN_CHUNK_FILE,
    ANN_CHUNK_OFFSET,
    ANN_CHUNK_RAW_SIZE,
    ANN_CREATED,
    ANN_ID,
    ANN_LABEL,
    ANN_SCOPE,
    ANN_TITLE,
    MEDIA_TYPE_CONFIG,
    MEDIA_TYPE_CRIU,
    MEDIA_TYPE_CRIU_CHUNK,
    MEDIA_TYPE_MANIFEST,
    MEDIA_TYPE_ROOTFS_DIFF,
    parse_created,
)
from store_support import blob_names, make_store, read_blob, referenced_blobs

# --------------------------------------------------------------------------- helpers


def write_tree(root: Path, files: dict[str, tuple[bytes, int]]) -> None:
    for rel, (data, mode) in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        path.chmod(mode)


def commit(
    store: Store,
    scope: str = "ns",
    label: str = "app",
    files: dict[str, tuple[bytes, int]] | None = None,
    **metadata: object,
) -> Entry:
    ing = store.writer.begin(scope=scope, label=label, metadata={"container": "c1", **metadata})
    write_tree(Path(ing.dir("criu")), files or {"pages-1.img": (os.urandom(1000), 0o600)})
    ing.add_dir_layer("criu", ing.dir("criu"), MEDIA_TYPE_CRIU)
    return store.commit(ing)


def begin_with_files(store: Store, scope: str = "ns", label: str = "app") -> Ingest:
    ing = store.writer.begin(scope=scope, label=label, metadata={"container": "c1"})
    write_tree(Path(ing.dir("criu")), {"pages-1.img": (os.urandom(1000), 0o600)})
    ing.add_dir_layer("criu", ing.dir("criu"), MEDIA_TYPE_CRIU)
    return ing


def blob_path(store: Store, digest: str) -> Path:
    return Path(store.root, "blobs", "sha256", digest.removeprefix("sha256:"))


def tree_snapshot(root: Path) -> dict[str, tuple[int, bytes | None]]:
    snap: dict[str, tuple[int, bytes | None]] = {}
    for dirpath, dirs, files in os.walk(root):
        for name in dirs + files:
            p = Path(dirpath, name)
            st = p.lstat()
            data = p.read_bytes() if stat.S_ISREG(st.st_mode) else None
            snap[str(p.relative_to(root))] = (st.st_mode, data)
    return snap


def run_child(code: str, *args: str, timeout: float = 30) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )


CHILD_PRELUDE = """
import os, signal, sys
from pathlib import Path
from cedana_shim.checkpoint.store import Store, StoreConfig
from cedana_shim.checkpoint.store.layout import MEDIA_TYPE_CRIU

def commit(store, scope, label, data):
    ing = store.writer.begin(scope=scope, label=label, metadata={"container": "c"})
    Path(ing.dir("criu"), "pages-1.img").write_bytes(data)
    ing.add_dir_layer("criu", ing.dir("criu"), MEDIA_TYPE_CRIU)
    return store.commit(ing)
"""


# --------------------------------------------------------------------------- round trip


def test_round_trip_preserves_bytes_and_modes(tmp_path: Path) -> None:
    store = make_store(tmp_path)
    files = {
        "pages-1.img": (os.urandom(3 << 20), 0o600),
        "core-1.img": (b"core" * 1000, 0o644),
        "empty.img": (b"", 0o400),
        "sub/dir/exe": (b"#!/bin/sh\n", 0o755),
    }
    ing = store.writer.begin(scope="ns", label="app", metadata={"container": "c1", "pid": 42})
    write_tree(Path(ing.dir("criu")), files)
    Path(ing.dir("criu"), "sub").chmod(0o750)
    ing.add_dir_layer("criu", ing.dir("criu"), MEDIA_TYPE_CRIU)
    ing.set_metadata(runc_version="1.2")
    entry = store.commit(ing)

    assert not os.path.exists(ing.path), "the ingest must be gone after commit"
    assert [e.id for e in store.catalog.list()] == [entry.id]
    assert store.catalog.get(entry.id) == entry
    store.reader.verify(entry)

    raw = sum(len(d) for d, _ in files.values())
    (layer,) = entry.layers
    assert layer.name == "criu" and layer.media_type == MEDIA_TYPE_CRIU
    assert layer.raw_size > raw  # tar headers on top of the data
    meta = entry.metadata
    assert meta["container"] == "c1" and meta["pid"] == 42 and meta["runc_version"] == "1.2"
    assert (meta["id"], meta["scope"], meta["label"]) == (entry.id, "ns", "app")
    assert meta["created"] == entry.created and parse_created(entry.created) is not None
    assert meta["sizes"] == {"raw": layer.raw_size, "stored": layer.size}
    assert meta["layers"][0]["raw_size"] == layer.raw_size
    assert entry.size == layer.size + len(read_blob(store, entry.manifest_digest)) + len(
        read_blob(store, json.loads(read_blob(store, entry.manifest_digest))["config"]["digest"])
    )

    dest = tmp_path / "restore" / "images"
    store.reader.extract_layer(entry, "criu", str(dest))
    assert stat.S_IMODE(dest.stat().st_mode) == 0o700
    for rel, (data, mode) in files.items():
        assert (dest / rel).read_bytes() == data
        assert stat.S_IMODE((dest / rel).stat().st_mode) == mode, rel
    assert stat.S_IMODE((dest / "sub").stat().st_mode) == 0o750
    assert sorted(os.listdir(dest.parent)) == ["images"], "no temp sibling may remain"


def test_layout_on_disk_is_an_oci_image_layout(tmp_path: Path) -> None:
    store = make_store(tmp_path)
    entry = commit(store)
    root = Path(store.root)
    assert json.loads((root / "oci-layout").read_text()) == {"imageLayoutVersion": "1.0.0"}
    index = json.loads((root / "index.json").read_text())
    assert index["schemaVersion"] == 2
    (desc,) = index["manifests"]
    assert desc["mediaType"] == MEDIA_TYPE_MANIFEST
    assert desc["digest"] == entry.manifest_digest
    assert desc["annotations"] == {
        ANN_ID: entry.id,
        ANN_SCOPE: "ns",
        ANN_LABEL: "app",
        ANN_CREATED: entry.created,
    }
    manifest = json.loads(read_blob(store, entry.manifest_digest))
    assert manifest["mediaType"] == MEDIA_TYPE_MANIFEST
    assert manifest["config"]["mediaType"] == MEDIA_TYPE_CONFIG
    # The criu layer's tar, then its page image's one chunk, both titled with the layer.
    assert [x["annotations"][ANN_TITLE] for x in manifest["layers"]] == ["criu", "criu"]
    assert [x["mediaType"] for x in manifest["layers"]] == [MEDIA_TYPE_CRIU, MEDIA_TYPE_CRIU_CHUNK]
    assert manifest["layers"][1]["annotations"] == {
        ANN_TITLE: "criu",
        ANN_CHUNK_FILE: "pages-1.img",
        ANN_CHUNK_OFFSET: "0",
        ANN_CHUNK_RAW_SIZE: "1000",
    }
    assert entry.to_json()["layers"][0]["chunks"] == 1
    assert entry.created.endswith("Z") and "T" in entry.created
    assert entry.to_json()["namespace"] == "ns" and entry.to_json()["container"] == "c1"


def test_file_layer_and_open_layer_stream_the_tar(tmp_path: Path) -> None:
    store = make_store(tmp_path)
    tar_path = tmp_path / "diff.tar"
    with tarfile.open(tar_path, "w") as tar:
        for name, data in (("etc/hosts", b"127.0.0.1 x\n"), ("big", os.urandom(300_000))):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    ing = store.writer.begin(scope="ns", label="app", metadata={})
    ing.add_file_layer("rootfs-diff", str(tar_path), MEDIA_TYPE_ROOTFS_DIFF)
    write_tree(Path(ing.dir("criu")), {"a.img": (b"a", 0o600)})
    ing.add_dir_layer("criu", ing.dir("criu"), MEDIA_TYPE_CRIU)
    entry = store.commit(ing)
    assert [x.name for x in entry.layers] == ["rootfs-diff", "criu"]
    assert entry.layer("rootfs-diff").raw_size == tar_path.stat().st_size
    with store.reader.open_layer(entry, "rootfs-diff") as stream:
        assert stream.read() == tar_path.read_bytes()
    with pytest.raises(errors.NotFound, match="has no layer 'nope'"):
        store.reader.open_layer(entry, "nope")


def test_file_layer_refuses_a_non_tar(tmp_path: Path) -> None:
    store = make_store(tmp_path)
    bogus = tmp_path / "bogus.tar"
    bogus.write_bytes(b"hello" * 400)
    with store.writer.begin(scope="ns", label="app", metadata={}) as ing:
        with pytest.raises(errors.InvalidArgument, match="not a tar archive"):
            ing.add_file_layer("x", str(bogus), MEDIA_TYPE_ROOTFS_DIFF)
        with pytest.raises(errors.NotFound):
            ing.add_file_layer("x", str(tmp_path / "missing.tar"), MEDIA_TYPE_ROOTFS_DIFF)


def test_abort_and_with_block_leave_nothing(tmp_path: Path) -> None:
    store = make_store(tmp_path)
    ing = store.writer.begin(scope="ns", label="app", metadata={})
    Path(ing.dir("criu"), "x").write_bytes(b"x")
    store.writer.abort(ing)
    store.writer.abort(ing)  # idempotent
    assert not os.path.exists(ing.path)
    with pytest.raises(errors.FailedPrecondition, match="already committed or aborted"):
        store.commit(ing)
    with store.writer.begin(scope="ns", label="app", metadata={}) as ing2:
        ing2.dir("criu")
    assert not os.path.exists(ing2.path)
    assert store.catalog.list() == []
    assert os.listdir(os.path.join(store.root, "ingest")) == []


def test_arguments_are_validated(tmp_path: Path) -> None:
    store = make_store(tmp_path)
    with pytest.raises(errors.InvalidArgument, match="scope"):
        store.writer.begin(scope="", label="x", metadata={})
    with pytest.raises(errors.InvalidArgument, match="control characters"):
        store.writer.begin(scope="ns", label="a\nb", metadata={})
    with pytest.raises(errors.InvalidArgument, match="reserved"):
        store.writer.begin(scope="ns", label="x", metadata={"id": "mine"})
    with pytest.raises(errors.InvalidArgument, match="JSON"):
        store.writer.begin(scope="ns", label="x", metadata={"f": float("nan")})
    with store.writer.begin(scope="ns", label="x", metadata={}) as ing:
        with pytest.raises(errors.InvalidArgument, match="layer name"):
            ing.add_dir_layer("../x", ing.dir("criu"), MEDIA_TYPE_CRIU)
        with pytest.raises(errors.InvalidArgument, match="media type"):
            ing.add_dir_layer("criu", ing.dir("criu"), "not a media type")
        with pytest.raises(errors.InvalidArgument, match="reserved"):
            ing.set_metadata(sizes=1)
        with pytest.raises(errors.InvalidArgument, match="nothing to commit"):
            store.commit(ing)
        ing.add_dir_layer("criu", ing.dir("criu"), MEDIA_TYPE_CRIU)
        with pytest.raises(errors.InvalidArgument, match="added twice"):
            ing.add_dir_layer("criu", ing.dir("criu"), MEDIA_TYPE_CRIU)
    with pytest.raises(errors.InvalidArgument, match="not a checkpoint id"):
        store.catalog.get("../../etc")
    with pytest.raises(errors.NotFound, match="20991231T000000Z-00000000 not found"):
        store.catalog.get("20991231T000000Z-00000000")
    with pytest.raises(errors.NotFound):
        store.maintenance.remove("20991231T000000Z-00000000")
    for bad in (
        StoreConfig(root=str(tmp_path / "s2"), compression_level=99),
        StoreConfig(root=str(tmp_path / "s2"), threads=-1),
        StoreConfig(root=str(tmp_path / "s2"), retain=-1),
    ):
        with pytest.raises(errors.InvalidArgument):
            Store(bad)


# --------------------------------------------------------------------------- permissions


def assert_private(root: str) -> None:
    for dirpath, _dirs, files in os.walk(root):
        assert stat.S_IMODE(os.stat(dirpath).st_mode) == 0o700, dirpath
        for name in files:
            path = os.path.join(dirpath, name)
            assert stat.S_IMODE(os.lstat(path).st_mode) == 0o600, path


def test_everything_created_is_private_even_mid_commit(tmp_path: Path) -> None:
    seen: list[str] = []

    def hook(step: str) -> None:
        assert_private(str(tmp_path / "store"))  # temp blobs, ingest dir, index temp
        seen.append(step)

    old = os.umask(0o022)  # a typical umask must not widen anything
    try:
        store = Store(StoreConfig(root=str(tmp_path / "store")), step_hook=hook)
        commit(store)
    finally:
        os.umask(old)
    assert seen == list(COMMIT_STEPS)
    assert_private(store.root)


def test_refuses_a_non_empty_directory_that_is_not_a_layout(tmp_path: Path) -> None:
    root = tmp_path / "store"
    root.mkdir(mode=0o700)
    (root / "precious.txt").write_text("mine")
    with pytest.raises(errors.FailedPrecondition, match="not an OCI image layout"):
        make_store(tmp_path)
    assert (root / "precious.txt").read_text() == "mine"


def test_missing_index_over_existing_blobs_is_repaired_not_a_fresh_start(tmp_path: Path) -> None:
    store = make_store(tmp_path)
    entry = commit(store)
    os.unlink(os.path.join(store.root, "index.json"))
    with pytest.raises(errors.DataLoss, match=r"index\.json is missing.*checkpoints repair"):
        store.catalog.list()
    reopened = make_store(tmp_path)  # opening the store rebuilds the index
    assert blob_names(store), "blobs must survive"
    assert reopened.catalog.list() == [entry]
    reopened.reader.verify(entry)


# ------------------------------------------------------------------ order, retention, scope


def test_newest_first_everywhere(tmp_path: Path) -> None:
    store = make_store(tmp_path, retain=0)
    ids = [commit(store).id for _ in range(4)]
    assert [e.id for e in store.catalog.list()] == ids[::-1]
    assert [e.id for e in store.reader.candidates("ns", "app")] == ids[::-1]
    created = [parse_created(e.created) for e in store.catalog.list()]
    assert created == sorted(created, reverse=True)  # type: ignore[type-var]


def test_retention_keeps_newest_n_per_scope_and_label(tmp_path: Path) -> None:
    store = make_store(tmp_path, retain=2)
    other_label = commit(store, "ns", "other")
    other_scope = commit(store, "ns-b", "app")
    ids = [commit(store, "ns", "app").id for _ in range(5)]
    assert [e.id for e in store.reader.candidates("ns", "app")] == ids[:2:-1]
    assert [e.id for e in store.reader.candidates("ns", "other")] == [other_label.id]
    assert [e.id for e in store.reader.candidates("ns-b", "app")] == [other_scope.id]
    assert blob_names(store) == referenced_blobs(store), "dropped checkpoints' blobs must go"
    for e in store.catalog.list():
        store.reader.verify(e)


def test_prune_and_remove(tmp_path: Path) -> None:
    store = make_store(tmp_path, retain=0)
    a = [commit(store, "ns", "a").id for _ in range(3)]
    b = [commit(store, "ns", "b").id for _ in range(2)]
    assert store.maintenance.prune(scope="ns", label="a", keep=1) == [a[1], a[0]]
    assert [e.id for e in store.catalog.list()] == [b[1], b[0], a[2]]
    store.maintenance.remove(b[1])
    assert [e.id for e in store.catalog.list()] == [b[0], a[2]]
    assert store.maintenance.prune(keep=0) == [b[0], a[2]]
    assert blob_names(store) == set()
    with pytest.raises(errors.InvalidArgument):
        store.maintenance.prune(keep=-1)


def test_blobs_shared_between_checkpoints_survive_removal_of_one(tmp_path: Path) -> None:
    store = make_store(tmp_path, retain=0, threads=1)
    shared = tmp_path / "shared"
    write_tree(shared, {"pages.img": (os.urandom(50_000), 0o600)})
    entries = []
    for label in ("x", "y"):
        ing = store.writer.begin(scope="ns", label=label, metadata={})
        ing.add_dir_layer("rootfs", str(shared), MEDIA_TYPE_ROOTFS_DIFF)
        entries.append(store.commit(ing))
    assert entries[0].layers[0].digest == entries[1].layers[0].digest
    store.maintenance.remove(entries[0].id)
    assert store.maintenance.gc() == 0
    store.reader.verify(entries[1])
    assert blob_names(store) == referenced_blobs(store)


def test_scope_isolation(tmp_path: Path) -> None:
    store = make_store(tmp_path)
    a = commit(store, "ns-a", "x")
    b = commit(store, "ns-b", "x")
    assert [e.id for e in store.reader.candidates("ns-a", "x")] == [a.id]
    assert [e.id for e in store.reader.candidates("ns-b", "x")] == [b.id]
    assert store.reader.candidates("ns-c", "x") == []
    assert {e.scope for e in store.catalog.list(label="x")} == {"ns-a", "ns-b"}
    assert [e.id for e in store.catalog.list(scope="ns-a")] == [a.id]


# --------------------------------------------------------------------------- concurrency


def test_concurrent_threads_lose_nothing(tmp_path: Path) -> None:
    store = make_store(tmp_path, retain=0)
    results: list[str] = []
    failures: list[BaseException] = []

    def writer(n: int) -> None:
        try:
            for _ in range(5):
                results.append(commit(store, "ns", f"t{n}").id)
        except BaseException as err:
            failures.append(err)

    threads = [threading.Thread(target=writer, args=(n,)) for n in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert failures == []
    listed = store.catalog.list()
    assert sorted(e.id for e in listed) == sorted(results) and len(results) == 40
    for e in listed:
        assert e.damage is None
    assert blob_names(store) == referenced_blobs(store)


def test_concurrent_processes_lose_nothing(tmp_path: Path) -> None:
    root = str(tmp_path / "store")
    Store(StoreConfig(root=root, retain=0))
    code = (
        CHILD_PRELUDE
        + """
store = Store(StoreConfig(root=sys.argv[1], retain=0))
for i in range(10):
    print(commit(store, "ns", "p" + sys.argv[2], os.urandom(2000)).id, flush=True)
"""
    )
    procs = [
        subprocess.Popen(
            [sys.executable, "-c", code, root, str(n)], stdout=subprocess.PIPE, text=True
        )
        for n in range(4)
    ]
    outputs = [p.communicate(timeout=60)[0] for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0, 0]
    committed = sorted(line for out in outputs for line in out.split())
    store = Store(StoreConfig(root=root, retain=0))
    assert len(committed) == 40
    assert sorted(e.id for e in store.catalog.list()) == committed
    for n in range(4):
        assert len(store.reader.candidates("ns", f"p{n}")) == 10
    for e in store.catalog.list():
        store.reader.verify(e)


# --------------------------------------------------------------------------- crashes


@pytest.mark.parametrize("step", COMMIT_STEPS)
def test_sigkill_at_every_commit_step_leaves_only_complete_checkpoints(
    tmp_path: Path, step: str
) -> None:
    root = str(tmp_path / "store")
    code = (
        CHILD_PRELUDE
        + """
store = Store(StoreConfig(root=sys.argv[1], retain=1))
good = commit(store, "ns", "app", os.urandom(300_000))
print(good.id, flush=True)

def hook(name):
    if name == sys.argv[2]:
        os.kill(os.getpid(), signal.SIGKILL)

store = Store(StoreConfig(root=sys.argv[1], retain=1), step_hook=hook)
commit(store, "ns", "app", os.urandom(300_000))
print("survived", flush=True)
"""
    )
    child = run_child(code, root, step)
    assert child.returncode == -signal.SIGKILL, child.stderr
    good_id = child.stdout.split()[0]

    store = Store(StoreConfig(root=root, retain=1))
    listed = store.catalog.list()
    published = COMMIT_STEPS.index(step) >= COMMIT_STEPS.index("index-replaced")
    assert len(listed) == 1
    if published:  # retain=1: the new one replaced the good one
        assert listed[0].id != good_id
    else:
        assert listed[0].id == good_id
    store.reader.verify(listed[0])
    store.reader.extract_layer(listed[0], "criu", str(tmp_path / "out"))
    assert len((tmp_path / "out" / "pages-1.img").read_bytes()) == 300_000

    store.maintenance.gc()
    assert os.listdir(os.path.join(root, "ingest")) == []
    assert blob_names(store) == referenced_blobs(store)
    assert sorted(os.listdir(root)) == [
        "blobs", "index.json", "index.lock", "ingest", "oci-layout", "raw",
    ]  # fmt: skip


def test_gc_spares_the_ingest_of_a_live_writer_in_another_process(tmp_path: Path) -> None:
    root = str(tmp_path / "store")
    Store(StoreConfig(root=root))
    code = (
        CHILD_PRELUDE
        + """
store = Store(StoreConfig(root=sys.argv[1]))
ing = store.writer.begin(scope="ns", label="app", metadata={})
Path(ing.dir("criu"), "pages-1.img").write_bytes(b"p" * 100_000)
print(ing.path, flush=True)
sys.stdin.read()  # hold the ingest until told to go
"""
    )
    child = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code), root],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert child.stdout is not None
        ingest_path = child.stdout.readline().strip()
        store = Store(StoreConfig(root=root))
        store.maintenance.gc()
        assert os.path.exists(os.path.join(ingest_path, "dirs", "criu", "pages-1.img"))
    finally:
        child.kill()
        child.wait()
    assert store.maintenance.gc() >= 100_000
    assert not os.path.exists(ingest_path)


def test_gc_waits_for_a_commit_that_is_placing_blobs(tmp_path: Path) -> None:
    """A commit in another process between placing blobs and writing the index."""
    root = str(tmp_path / "store")
    store = Store(StoreConfig(root=root))
    code = (
        CHILD_PRELUDE
        + """
import time
def hook(name):
    if name == "manifest-placed":
        print("placed", flush=True)
        time.sleep(1.0)

store = Store(StoreConfig(root=sys.argv[1]), step_hook=hook)
print(commit(store, "ns", "app", os.urandom(10_000)).id, flush=True)
"""
    )
    child = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code), root], stdout=subprocess.PIPE, text=True
    )
    assert child.stdout is not None
    assert child.stdout.readline().strip() == "placed"
    started = time.monotonic()
    store.maintenance.gc()  # must block on index.lock, then find the blobs referenced
    assert time.monotonic() - started > 0.3
    checkpoint_id = child.stdout.readline().strip()
    assert child.wait(timeout=30) == 0
    store.reader.verify(store.catalog.get(checkpoint_id))


def test_gc_spares_an_open_ingest_of_this_process_and_commit_still_works(tmp_path: Path) -> None:
    store = make_store(tmp_path)
    ing = store.writer.begin(scope="ns", label="app", metadata={})
    Path(ing.dir("criu"), "pages-1.img").write_bytes(b"p" * 1000)
    assert store.maintenance.gc() == 0
    ing.add_dir_layer("criu", ing.dir("criu"), MEDIA_TYPE_CRIU)
    entry = store.commit(ing)
    store.reader.verify(entry, require=["criu"])
    with pytest.raises(errors.DataLoss, match="has no 'rootfs-diff' layer"):
        store.reader.verify(entry, require=["criu", "rootfs-diff"])


def test_a_forgotten_ingest_becomes_garbage_once_collected(tmp_path: Path) -> None:
    store = make_store(tmp_path)
    ing = store.writer.begin(scope="ns", label="app", metadata={})
    Path(ing.dir("criu"), "x").write_bytes(b"x" * 100)
    path = ing.path
    del ing
    gc_module.collect()
    assert store.maintenance.gc() > 100 and not os.path.exists(path)


def test_gc_removes_a_lockless_ingest_only_after_the_grace_period(tmp_path: Path) -> None:
    store = make_store(tmp_path)
    stale = Path(store.root, "ingest", "20200101T000000Z-deadbeef")
    stale.mkdir(mode=0o700)
    (stale / "junk").write_bytes(b"j" * 10)
    store.maintenance.gc()
    assert stale.exists(), "might be a begin() in progress"
    os.utime(stale, (time.time() - 3600, time.time() - 3600))
    assert store.maintenance.gc() == 10
    assert not stale.exists()


def test_failure_after_placing_blobs_rolls_them_back(tmp_path: Path) -> None:
    store = make_store(tmp_path)
    first = commit(store)
    before_index = Path(store.root, "index.json").read_bytes()
    before_blobs = blob_names(store)

    def hook(step: str) -> None:
        if step == "index-temp-written":
            raise OSError(errno.ENOSPC, "No space left on device")

    failing = Store(StoreConfig(root=store.root), step_hook=hook)
    with pytest.raises(errors.ResourceExhausted, match=r"is full.*publishing"):
        commit(failing)
    assert Path(store.root, "index.json").read_bytes() == before_index
    assert blob_names(store) == before_blobs
    assert os.listdir(os.path.join(store.root, "ingest")) == []
    assert [f for f in os.listdir(store.root) if f.startswith("index.json.tmp")] == []
    store.reader.verify(first)


# --------------------------------------------------------------------------- damage


def test_flipped_byte_is_data_loss_and_the_older_checkpoint_still_verifies(
    tmp_path: Path,
) -> None:
    store = make_store(tmp_path)
    old = commit(store)
    new = commit(store)
    # The page image's chunk: the two checkpoints' tars of the rest may be the same blob.
    path = blob_path(store, new.layers[0].chunks[0].digest)
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))

    assert [e.id for e in store.reader.candidates("ns", "app")] == [new.id, old.id]
    with pytest.raises(errors.DataLoss) as info:
        store.reader.verify(new)
    assert new.id in str(info.value) and str(path) in str(info.value)
    store.reader.verify(new, deep=False)  # same size: only the digest can tell
    store.reader.verify(old)

    dest = tmp_path / "out"
    with pytest.raises(errors.DataLoss, match=new.id):
        store.reader.extract_layer(new, "criu", str(dest))
    assert not dest.exists() and os.listdir(tmp_path) == ["store"]
    with pytest.raises(errors.DataLoss, match="corrupt"):
        store.reader.open_layer(new, "criu")


def test_truncated_layer_is_data_loss(tmp_path: Path) -> None:
    store = make_store(tmp_path)
    entry = commit(store, files={"pages-1.img": (os.urandom(200_000), 0o600)})
    path = blob_path(store, entry.layers[0].digest)
    os.truncate(path, path.stat().st_size // 2)
    with pytest.raises(errors.DataLoss, match=r"truncated"):
        store.reader.verify(entry, deep=False)
    with pytest.raises(errors.DataLoss, match=r"truncated"):
        store.reader.extract_layer(entry, "criu", str(tmp_path / "out"))
    assert not (tmp_path / "out").exists()


def test_missing_blob_names_the_checkpoint_and_the_blob(tmp_path: Path) -> None:
    store = make_store(tmp_path)
    entry = commit(store)
    os.unlink(blob_path(store, entry.layers[0].digest))
    with pytest.raises(errors.DataLoss, match=rf"{entry.id}.*'criu'.*missing"):
        store.reader.verify(entry)


def test_damaged_manifest_or_config_is_listed_but_fails_verify(tmp_path: Path) -> None:
    store = make_store(tmp_path, retain=0)
    good = commit(store)
    bad_manifest = commit(store)
    bad_config = commit(store)
    blob_path(store, bad_manifest.manifest_digest).write_bytes(b"{}")
    config_digest = json.loads(read_blob(store, bad_config.manifest_digest))["config"]["digest"]
    os.unlink(blob_path(store, config_digest))

    listed = {e.id: e for e in store.reader.candidates("ns", "app")}
    assert list(listed) == [bad_config.id, bad_manifest.id, good.id]
    assert listed[bad_manifest.id].damage is not None
    assert "missing" in (listed[bad_config.id].damage or "")
    for damaged in (bad_manifest, bad_config, listed[bad_manifest.id]):
        with pytest.raises(errors.DataLoss, match=damaged.id):
            store.reader.verify(damaged)
    store.reader.verify(listed[good.id])
    # gc cannot know what an unreadable manifest references: it deletes nothing.
    before = blob_names(store)
    assert store.maintenance.gc() == 0 and blob_names(store) == before


def test_checkpoint_removed_while_in_use_is_reported_as_such(tmp_path: Path) -> None:
    store = make_store(tmp_path)
    entry = commit(store)
    store.maintenance.remove(entry.id)
    with pytest.raises(errors.DataLoss, match="no longer in"):
        store.reader.verify(entry)


MALFORMED_INDEXES = {
    "not json": b"{not json",
    "not an object": b"[]",
    "bad schemaVersion": b'{"schemaVersion": 1, "manifests": []}',
    "manifests not a list": b'{"schemaVersion": 2, "manifests": {}}',
    "duplicate key": b'{"schemaVersion": 2, "manifests": [], "manifests": []}',
    "bad digest": (
        b'{"schemaVersion": 2, "manifests": [{"mediaType": "a/b", "digest": "sha256:xyz",'
        b' "size": 1}]}'
    ),
    "negative size": (
        b'{"schemaVersion": 2, "manifests": [{"mediaType": "a/b", "digest": "sha256:'
        + b"0" * 64
        + b'", "size": -1}]}'
    ),
    "checkpoint without scope": json.dumps(
        {
            "schemaVersion": 2,
            "manifests": [
                {
                    "mediaType": MEDIA_TYPE_MANIFEST,
                    "digest": "sha256:" + "0" * 64,
                    "size": 10,
                    "annotations": {ANN_ID: "20261129T183000Z-3f9a1c2b", ANN_LABEL: "x"},
                }
            ],
        }
    ).encode(),
    "not utf-8": b'{"schemaVersion": 2, "manifests": [], "x": "\xff"}',
}


@pytest.mark.parametrize("case", sorted(MALFORMED_INDEXES))
def test_malformed_index_is_data_loss_naming_the_file(tmp_path: Path, case: str) -> None:
    store = make_store(tmp_path)
    commit(store)
    index_path = Path(store.root, "index.json")
    index_path.write_bytes(MALFORMED_INDEXES[case])
    blobs = blob_names(store)
    for call in (store.catalog.list, lambda: store.reader.candidates("ns", "app")):
        with pytest.raises(errors.DataLoss, match=str(index_path)) as info:
            call()
        assert "cedana checkpoints repair" in str(info.value)
    assert index_path.read_bytes() == MALFORMED_INDEXES[case], "reads never touch the index"
    assert blob_names(store) == blobs


@pytest.mark.parametrize("write", ["gc", "commit", "begin", "remove", "prune", "compact"])
def test_a_write_path_repairs_a_malformed_index_first(tmp_path: Path, write: str) -> None:
    store = make_store(tmp_path, retain=0)
    entry = commit(store)
    raw = store.writer.publish(begin_with_files(store))
    index_path = Path(store.root, "index.json")
    damaged = MALFORMED_INDEXES["not json"]
    index_path.write_bytes(damaged)
    calls = {
        "gc": store.maintenance.gc,
        "commit": lambda: commit(store),
        "begin": lambda: store.writer.abort(
            store.writer.begin(scope="ns", label="app", metadata={})
        ),
        "remove": lambda: store.maintenance.remove(entry.id),
        "prune": lambda: store.maintenance.prune(label="other", keep=0),
        "compact": lambda: store.compactor.compact(raw.id),
    }
    calls[write]()
    (copy,) = [p for p in Path(store.root).iterdir() if p.name.startswith("index.json.damaged-")]
    assert copy.read_bytes() == damaged, "the damaged index is kept aside, as it was"
    listed = {e.id: e for e in store.catalog.list()}
    assert raw.id in listed and (entry.id in listed) == (write != "remove")
    for e in listed.values():
        store.reader.verify(e)
    assert blob_names(store) == referenced_blobs(store)


def test_foreign_index_entries_and_their_blobs_are_kept(tmp_path: Path) -> None:
    store = make_store(tmp_path)
    layer = b"foreign layer"
    import hashlib

    def put(data: bytes) -> str:
        digest = hashlib.sha256(data).hexdigest()
        blob_path(store, digest).write_bytes(data)
        return "sha256:" + digest

    config = put(b"{}")
    layer_digest = put(layer)
    manifest = json.dumps(
        {
            "schemaVersion": 2,
            "mediaType": MEDIA_TYPE_MANIFEST,
            "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": config,
                       "size": 2},
            "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar", "digest":
                        layer_digest, "size": len(layer)}],
        }
    ).encode()  # fmt: skip
    index_path = Path(store.root, "index.json")
    index = json.loads(index_path.read_text())
    index["manifests"].append(
        {"mediaType": MEDIA_TYPE_MANIFEST, "digest": put(manifest), "size": len(manifest),
         "annotations": {"org.opencontainers.image.ref.name": "other:tool"}}
    )  # fmt: skip
    index_path.write_text(json.dumps(index))
    commit(store)
    store.maintenance.gc()
    after = json.loads(index_path.read_text())["manifests"]
    assert any(m["annotations"].get("org.opencontainers.image.ref.name") for m in after)
    assert len(store.catalog.list()) == 1
    assert blob_path(store, layer_digest).read_bytes() == layer


# --------------------------------------------------------------------------- unsafe tars


def crafted_tar(path: Path, *members: tarfile.TarInfo) -> None:
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tar:
        for m in members:
            data = b"owned\n" if m.isreg() else None
            if data is not None:
                m.size = len(data)
            tar.addfile(m, io.BytesIO(data) if data is not None else None)


def member(name: str, kind: bytes = tarfile.REGTYPE, linkname: str = "") -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.linkname = linkname
    info.mode = 0o644
    return info


UNSAFE_TARS = {
    "dotdot": ([member("ok.img"), member("../escaped")], "'..'"),
    "absolute": ([member("/tmp/escaped-abs")], "absolute path"),
    "device": ([member("dev", tarfile.CHRTYPE)], "device node"),
    "fifo": ([member("fifo", tarfile.FIFOTYPE)], "FIFO"),
    "symlink then through it": (
        [member("link", tarfile.SYMTYPE, "../.."), member("link/escaped")],
        "symbolic link",
    ),
    "hardlink": ([member("passwd", tarfile.LNKTYPE, "/etc/passwd")], "hard link"),
}


@pytest.mark.parametrize("case", sorted(UNSAFE_TARS))
def test_extract_refuses_unsafe_members_and_writes_nothing(tmp_path: Path, case: str) -> None:
    members, why = UNSAFE_TARS[case]
    work = tmp_path / "work"
    work.mkdir()
    tar_path = tmp_path / "evil.tar"
    crafted_tar(tar_path, *members)
    store = make_store(tmp_path)
    ing = store.writer.begin(scope="ns", label="app", metadata={})
    ing.add_file_layer("criu", str(tar_path), MEDIA_TYPE_CRIU)
    entry = store.commit(ing)

    before = tree_snapshot(tmp_path)
    dest = work / "restore" / "images"
    with pytest.raises(errors.DataLoss, match=rf"unsafe tar member .*{why}"):
        store.reader.extract_layer(entry, "criu", str(dest))
    after = tree_snapshot(tmp_path)
    assert set(after) - set(before) == {"work/restore"}  # the parent it was asked to use
    assert {k: after[k] for k in before} == before
    assert os.listdir(work / "restore") == []
    assert not os.path.exists("/tmp/escaped-abs")


def test_extract_into_a_non_empty_directory_is_refused(tmp_path: Path) -> None:
    store = make_store(tmp_path)
    entry = commit(store)
    dest = tmp_path / "dest"
    dest.mkdir()
    (dest / "keep").write_text("x")
    with pytest.raises(errors.FailedPrecondition, match="not an empty directory"):
        store.reader.extract_layer(entry, "criu", str(dest))
    assert os.listdir(dest) == ["keep"]
    empty = tmp_path / "empty"
    empty.mkdir()
    store.reader.extract_layer(entry, "criu", str(empty))
    assert os.listdir(empty) == ["pages-1.img"]
