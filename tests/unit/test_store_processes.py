"""The store across processes: concurrent compactions, writers in flight, crashes mid-compaction.

Real child processes, killed with SIGKILL where a crash is the subject.
"""

from __future__ import annotations

import os
import signal
import threading
from pathlib import Path

import pytest
from cedana_shim.checkpoint.store import COMPACT_STEPS, Store, StoreConfig
from store_support import (
    CRIU_FILES,
    blob_names,
    make_store,
    publish,
    referenced_blobs,
    run_child,
    stage,
    start_child,
)


def test_two_processes_compacting_one_checkpoint_agree(tmp_path: Path) -> None:
    root = str(tmp_path / "store")
    entry = publish(Store(StoreConfig(root=root)))
    code = """
def hook(step):
    if step == "compact-locked":
        time.sleep(0.3)  # hold the lock long enough for the other to queue behind it
store = Store(StoreConfig(root=sys.argv[1]), step_hook=hook)
print(store.compactor.compact(sys.argv[2]).manifest_digest, flush=True)
"""
    children = [start_child(code, root, entry.id) for _ in range(2)]
    outputs = [c.communicate(timeout=60)[0].strip() for c in children]
    assert [c.returncode for c in children] == [0, 0]
    store = Store(StoreConfig(root=root))
    (listed,) = store.catalog.list()
    assert listed.state == "compacted" and outputs == [listed.manifest_digest] * 2
    store.reader.verify(listed)
    assert blob_names(store) == referenced_blobs(store)
    assert os.listdir(Path(root, "ingest")) == []


def test_in_flight_sees_a_live_writer_of_another_process_not_a_dead_one(tmp_path: Path) -> None:
    root = str(tmp_path / "store")
    store = Store(StoreConfig(root=root))
    code = """
store = Store(StoreConfig(root=sys.argv[1]))
ing = begin(store, "ns", "app", b"x" * 1000)
print(ing.id, flush=True)
sys.stdin.read()  # hold the ingest until killed
"""
    child = start_child(code, root)
    try:
        assert child.stdout is not None
        checkpoint_id = child.stdout.readline().strip()
        assert store.reader.in_flight("ns", "app") == [checkpoint_id]
        assert (
            store.reader.in_flight("ns", "other") == []
            and store.reader.in_flight("ns2", "app") == []
        )
    finally:
        child.kill()
        child.wait()
    assert store.reader.in_flight("ns", "app") == []
    assert Path(root, "ingest", checkpoint_id).exists(), "in_flight only looks"


def test_in_flight_sees_this_process_until_publish(tmp_path: Path) -> None:
    store = make_store(tmp_path)
    ing = stage(store)
    assert store.reader.in_flight("ns", "app") == [ing.id]
    store.writer.publish(ing)
    assert store.reader.in_flight("ns", "app") == []
    assert store.reader.in_flight("ns", "app") == [], "a compaction is not a checkpoint in flight"


def test_pending_compaction_lists_raw_checkpoints_nobody_compacts(tmp_path: Path) -> None:
    root = str(tmp_path / "store")
    store = Store(StoreConfig(root=root, retain=0))
    first, second = publish(store), publish(store)
    assert store.compactor.pending_compaction() == [first.id, second.id]
    inside, release = threading.Event(), threading.Event()

    def hook(step: str) -> None:
        if step == "compact-locked":
            inside.set()
            release.wait(10)

    busy = Store(StoreConfig(root=root), step_hook=hook)
    worker = threading.Thread(target=busy.compactor.compact, args=(first.id,))
    worker.start()
    try:
        assert inside.wait(10)
        assert store.compactor.pending_compaction() == [second.id]
    finally:
        release.set()
        worker.join()
    assert store.compactor.pending_compaction() == [second.id]
    store.compactor.compact(second.id)
    assert store.compactor.pending_compaction() == []


@pytest.mark.parametrize("step", COMPACT_STEPS)
def test_sigkill_during_compaction_leaves_it_whole_and_a_new_one_finishes(
    tmp_path: Path, step: str
) -> None:
    root = str(tmp_path / "store")
    entry = publish(Store(StoreConfig(root=root, retain=1)))
    code = """
def hook(name):
    if name == sys.argv[3]:
        os.kill(os.getpid(), signal.SIGKILL)
Store(StoreConfig(root=sys.argv[1], retain=1), step_hook=hook).compactor.compact(sys.argv[2])
print("survived", flush=True)
"""
    child = run_child(code, root, entry.id, step)
    assert child.returncode == -signal.SIGKILL, child.stderr

    store = Store(StoreConfig(root=root, retain=1))
    (listed,) = store.catalog.list()
    swapped = COMPACT_STEPS.index(step) >= COMPACT_STEPS.index("compact-index-replaced")
    assert listed.id == entry.id and listed.state == ("compacted" if swapped else "raw")
    store.reader.verify(listed)
    assert store.compactor.pending_compaction() == ([] if swapped else [entry.id])
    compacted = store.compactor.compact(entry.id)
    assert compacted is not None and compacted.state == "compacted"
    store.reader.verify(compacted)
    dest = tmp_path / "images"
    store.reader.extract_layer(compacted, "criu", str(dest))
    assert {p.name: p.read_bytes() for p in dest.iterdir()} == CRIU_FILES

    store.maintenance.gc()
    assert os.listdir(Path(root, "ingest")) == []
    assert blob_names(store) == referenced_blobs(store)
    assert sorted(os.listdir(Path(root, "raw", entry.id))) == ["criu", "criu.files.json"]
    assert store.raw.raw_images(compacted, "criu") is not None
    store.raw.verify_raw(compacted, "criu")
