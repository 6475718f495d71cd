"""Publish (the durable point, raw) and compaction (tar+zstd, later) on a real filesystem."""

from __future__ import annotations

import io
import json
import os
import stat
import tarfile
import threading
from pathlib import Path

import pytest
from cedana_shim import errors
from cedana_shim.checkpoint.store import COMPACT_STEPS, Store, StoreConfig
from cedana_shim.checkpoint.store.layout import (
    ANN_ID,
    MEDIA_TYPE_CRIU,
    MEDIA_TYPE_FILE_LIST,
    MEDIA_TYPE_ROOTFS_DIFF,
)
from store_support import (
    CRIU_FILES,
    blob_names,
    index_manifests,
    make_store,
    publish,
    read_blob,
    referenced_blobs,
    stage,
    tar_bytes,
)

DIFF = tar_bytes({"etc/hosts": b"127.0.0.1 x\n", "big": os.urandom(100_000)})


def test_publish_makes_a_raw_checkpoint_a_fresh_store_lists_and_verifies(tmp_path: Path) -> None:
    store = make_store(tmp_path)
    ing = stage(store, diff=DIFF)
    images = Path(ing.dir("criu"))
    staged_inode = (images / "pages-1.img").stat().st_ino
    entry = store.writer.publish(ing)
    assert not os.path.exists(ing.path)
    assert os.listdir(Path(store.root, "ingest")) == []

    fresh = Store(StoreConfig(root=store.root))
    (listed,) = fresh.catalog.list()
    assert listed == entry and listed.state == "raw"
    fresh.reader.verify(listed)
    assert [(x.name, x.media_type) for x in listed.layers] == [
        ("criu", MEDIA_TYPE_FILE_LIST),
        ("rootfs-diff", MEDIA_TYPE_FILE_LIST),
    ]
    raw_bytes = sum(len(d) for d in CRIU_FILES.values()) + len(DIFF)
    assert listed.raw_bytes == raw_bytes
    assert listed.metadata["rawFiles"] == {x.name: x.digest for x in listed.layers}
    assert listed.metadata["sizes"] == {"raw": raw_bytes, "stored": raw_bytes}

    # Nothing was compressed or copied: the staged files moved, small JSON blobs only.
    raw = Path(store.root, "raw", entry.id)
    assert (raw / "criu" / "pages-1.img").stat().st_ino == staged_inode
    assert (raw / "rootfs-diff" / "layer.tar").read_bytes() == DIFF
    assert all(
        Path(store.root, "blobs", "sha256", b).stat().st_size < 4096 for b in blob_names(store)
    )
    for path in [raw, *raw.rglob("*")]:
        mode = stat.S_IMODE(path.lstat().st_mode)
        assert mode == (0o700 if path.is_dir() else 0o600), path
    file_list = json.loads(read_blob(store, listed.layer("criu").digest))
    assert {f["path"]: f["mode"] for f in file_list["files"]} == dict.fromkeys(CRIU_FILES, 0o644)
    assert file_list["mediaType"] == MEDIA_TYPE_CRIU and file_list["cache"] is True


def test_a_raw_checkpoint_reads_like_a_compacted_one(tmp_path: Path) -> None:
    store = make_store(tmp_path)
    entry = publish(store, diff=DIFF)
    dest = tmp_path / "images"
    store.reader.extract_layer(entry, "criu", str(dest))
    for name, data in CRIU_FILES.items():
        assert (dest / name).read_bytes() == data
        assert stat.S_IMODE((dest / name).stat().st_mode) == 0o644, "the recorded mode"
    with store.reader.open_layer(entry, "rootfs-diff") as stream:
        assert stream.read() == DIFF
    with (
        store.reader.open_layer(entry, "criu") as stream,
        tarfile.open(fileobj=stream, mode="r|") as tar,
    ):
        got = {m.name: tar.extractfile(m).read() for m in tar if m.isreg()}  # type: ignore[union-attr]
    assert got == CRIU_FILES
    diff_dir = tmp_path / "diff"
    store.reader.extract_layer(entry, "rootfs-diff", str(diff_dir))
    assert (diff_dir / "etc" / "hosts").read_bytes() == b"127.0.0.1 x\n"


def test_layer_source_is_the_open_raw_tar_and_outlives_compaction(tmp_path: Path) -> None:
    store = make_store(tmp_path)
    entry = publish(store, diff=DIFF)
    assert store.reader.layer_source(entry, "criu") is None  # a directory, not a tar
    source = store.reader.layer_source(entry, "rootfs-diff")
    assert source is not None
    with source:
        assert source.seekable() and source.read(512) == DIFF[:512]
        compacted = store.compactor.compact(entry.id)
        assert compacted is not None
        assert not Path(store.root, "raw", entry.id, "rootfs-diff").exists()
        source.seek(0)
        assert source.read() == DIFF  # open: the deleted file is still readable
    assert store.reader.layer_source(entry, "rootfs-diff") is None  # compressed now
    with store.reader.open_layer(entry, "rootfs-diff") as stream:  # the stale raw entry still works
        assert stream.read() == DIFF


def test_a_changed_raw_tar_is_refused(tmp_path: Path) -> None:
    store = make_store(tmp_path)
    entry = publish(store, diff=DIFF)
    tar = Path(store.root, "raw", entry.id, "rootfs-diff", "layer.tar")
    data = bytearray(tar.read_bytes())
    data[700] ^= 1
    tar.write_bytes(bytes(data))
    for call in (store.reader.layer_source, store.reader.open_layer):
        with pytest.raises(errors.DataLoss, match=r"layer\.tar does not match its file list"):
            call(entry, "rootfs-diff")
    with pytest.raises(errors.DataLoss, match="CRC-32"):
        store.reader.verify(entry)
    store.reader.verify(entry, deep=False)  # same size: only the CRC can tell


def test_compaction_swaps_the_state_keeping_id_created_and_position(tmp_path: Path) -> None:
    store = make_store(tmp_path, retain=0)
    entries = [publish(store) for _ in range(3)]
    before = index_manifests(store)
    middle = entries[1]
    compacted = store.compactor.compact(middle.id)
    assert compacted is not None and compacted.state == "compacted"
    assert (compacted.id, compacted.created) == (middle.id, middle.created)
    assert compacted.manifest_digest != middle.manifest_digest
    after = index_manifests(store)
    assert [m["annotations"] for m in after] == [m["annotations"] for m in before]
    assert [m["digest"] for m in after] == [
        before[0]["digest"], compacted.manifest_digest, before[2]["digest"],
    ]  # fmt: skip
    assert [e.state for e in store.catalog.list()] == ["raw", "compacted", "raw"]
    assert compacted.layer("criu").media_type == MEDIA_TYPE_CRIU
    assert compacted.metadata["rawFiles"] == middle.metadata["rawFiles"]
    store.reader.verify(compacted)
    # Not the newest of its label: its raw files are gone, not kept as a cache.
    assert not Path(store.root, "raw", middle.id).exists() and compacted.raw_bytes == 0
    dest = tmp_path / "images"
    store.reader.extract_layer(middle, "criu", str(dest))  # the stale raw entry finds the blob
    assert {p.name: p.read_bytes() for p in dest.iterdir()} == CRIU_FILES
    assert store.compactor.compact(middle.id) == compacted  # idempotent
    assert blob_names(store) == referenced_blobs(store)


def test_the_newest_keeps_its_criu_images_as_the_cache(tmp_path: Path) -> None:
    store = make_store(tmp_path)
    entry = publish(store, diff=DIFF)
    compacted = store.compactor.compact(entry.id)
    assert compacted is not None
    raw = Path(store.root, "raw", entry.id)
    assert sorted(os.listdir(raw)) == ["criu", "criu.files.json"]  # no rootfs-diff copy
    assert compacted.raw_bytes == sum(len(d) for d in CRIU_FILES.values())
    assert store.raw.raw_images(compacted, "criu") == str(raw / "criu")


def test_compaction_refuses_a_crc_mismatch_and_leaves_it_raw(tmp_path: Path) -> None:
    store = make_store(tmp_path)
    entry = publish(store)
    blobs = blob_names(store)
    pages = Path(store.root, "raw", entry.id, "criu", "pages-1.img")
    data = bytearray(pages.read_bytes())
    data[-1] ^= 0x80
    pages.write_bytes(bytes(data))
    with pytest.raises(errors.DataLoss, match=r"pages-1\.img does not match its file list"):
        store.compactor.compact(entry.id)
    assert store.catalog.get(entry.id) == entry and entry.state == "raw"
    assert os.listdir(Path(store.root, "ingest")) == [], "the work dir is gone"
    store.maintenance.gc()
    assert blob_names(store) == blobs


def test_compacting_a_checkpoint_removed_meanwhile_returns_none(tmp_path: Path) -> None:
    root = str(tmp_path / "store")
    entry = publish(Store(StoreConfig(root=root)))
    Store(StoreConfig(root=root)).maintenance.remove(entry.id)
    assert Store(StoreConfig(root=root)).compactor.compact(entry.id) is None

    second = publish(Store(StoreConfig(root=root)))
    other = Store(StoreConfig(root=root))

    def hook(step: str) -> None:
        if step == "layer-written":
            other.maintenance.remove(second.id)  # retention or prune while it compresses

    assert Store(StoreConfig(root=root), step_hook=hook).compactor.compact(second.id) is None
    other.maintenance.gc()
    assert other.catalog.list() == [] and blob_names(other) == set()
    assert os.listdir(Path(root, "raw")) == [] and os.listdir(Path(root, "ingest")) == []


def test_two_compactions_of_one_checkpoint_never_overlap(tmp_path: Path) -> None:
    root = str(tmp_path / "store")
    entry = publish(Store(StoreConfig(root=root)))
    steps: list[str] = []
    inside = threading.Event()

    def hook(step: str) -> None:
        steps.append(step)
        if step == "compact-locked" and not inside.is_set():
            inside.set()
            threading.Event().wait(0.3)  # the other compaction must wait here

    results: list[object] = []

    def compact() -> None:
        results.append(Store(StoreConfig(root=root), step_hook=hook).compactor.compact(entry.id))

    threads = [threading.Thread(target=compact) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    store = Store(StoreConfig(root=root))
    (listed,) = store.catalog.list()
    assert results == [listed, listed] and listed.state == "compacted"
    assert steps.count("layer-written") == 1, "only one of them compressed"
    assert blob_names(store) == referenced_blobs(store)


def test_compaction_runs_niced_in_a_thread_of_its_own(tmp_path: Path) -> None:
    seen: list[tuple[int, int]] = []

    def hook(step: str) -> None:
        if step == "layer-writing":
            tid = threading.get_native_id()
            seen.append((tid, os.getpriority(os.PRIO_PROCESS, tid)))

    store = Store(StoreConfig(root=str(tmp_path / "store")), step_hook=hook)
    mine = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    store.compactor.compact(publish(store).id)
    ((tid, nice),) = seen
    assert tid != threading.get_native_id() and nice >= 10
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == mine


def test_retention_counts_raw_and_compacted_alike(tmp_path: Path) -> None:
    store = make_store(tmp_path, retain=2)
    first = publish(store)
    store.compactor.compact(first.id)
    second = publish(store)
    third = publish(store)
    assert [e.id for e in store.catalog.list()] == [third.id, second.id]
    assert [e.state for e in store.catalog.list()] == ["raw", "raw"]
    store.maintenance.gc()
    assert sorted(os.listdir(Path(store.root, "raw"))) == sorted([second.id, third.id])
    assert blob_names(store) == referenced_blobs(store)


def test_files_staged_outside_the_ingest_are_copied_and_left_alone(tmp_path: Path) -> None:
    store = make_store(tmp_path)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "pages-1.img").write_bytes(b"p" * 1000)
    (outside / "pages-1.img").chmod(0o644)
    tar = tmp_path / "diff.tar"
    tar.write_bytes(DIFF)
    ing = store.writer.begin(scope="ns", label="app", metadata={})
    ing.add_dir_layer("criu", str(outside), MEDIA_TYPE_CRIU)
    ing.add_file_layer("rootfs-diff", str(tar), MEDIA_TYPE_ROOTFS_DIFF)
    entry = store.writer.publish(ing)
    assert stat.S_IMODE((outside / "pages-1.img").stat().st_mode) == 0o644
    assert tar.read_bytes() == DIFF
    store.reader.verify(entry)
    copy = Path(store.root, "raw", entry.id, "criu", "pages-1.img")
    assert copy.read_bytes() == b"p" * 1000 and stat.S_IMODE(copy.stat().st_mode) == 0o600


def test_layers_that_overlap_in_the_ingest_are_refused(tmp_path: Path) -> None:
    store = make_store(tmp_path)
    with store.writer.begin(scope="ns", label="app", metadata={}) as ing:
        images = ing.dir("criu")
        Path(images, "sub").mkdir()
        ing.add_dir_layer("criu", images, MEDIA_TYPE_CRIU)
        with pytest.raises(errors.InvalidArgument, match="overlaps layer 'criu'"):
            ing.add_dir_layer("sub", str(Path(images, "sub")), MEDIA_TYPE_CRIU)
        Path(ing.path, "out").mkdir()
        with pytest.raises(errors.InvalidArgument, match="belongs to the store"):
            ing.add_dir_layer("out", str(Path(ing.path, "out")), MEDIA_TYPE_CRIU)


def test_a_layer_holding_a_symlink_or_fifo_is_refused_at_publish(tmp_path: Path) -> None:
    store = make_store(tmp_path)
    for make in (lambda p: os.symlink("/etc/passwd", p), os.mkfifo):
        ing = stage(store)
        make(str(Path(ing.dir("criu"), "odd")))
        with pytest.raises(errors.InvalidArgument, match="not a regular file or directory"):
            store.writer.publish(ing)
        assert store.catalog.list() == [] and os.listdir(Path(store.root, "ingest")) == []


def test_spool_dir_is_private_and_on_the_store(tmp_path: Path) -> None:
    store = make_store(tmp_path)
    spool = store.reader.spool_dir()
    assert spool == os.path.join(store.root, "spool")
    assert stat.S_IMODE(os.stat(spool).st_mode) == 0o700
    assert os.stat(spool).st_dev == os.stat(store.root).st_dev


def test_damage_names_a_disagreement_between_index_and_config(tmp_path: Path) -> None:
    store = make_store(tmp_path, retain=0)
    entry = publish(store)
    index_path = Path(store.root, "index.json")
    index = json.loads(index_path.read_text())
    (desc,) = index["manifests"]
    desc["annotations"]["org.opencontainers.image.created"] = "2020-01-01T00:00:00Z"
    index_path.write_text(json.dumps(index))
    (listed,) = store.catalog.list()
    assert listed.damage is not None and entry.id in listed.damage
    assert f"created is '{entry.created}' but index.json says '2020-01-01" in listed.damage
    desc["annotations"]["org.opencontainers.image.created"] = entry.created
    desc["annotations"]["cedana.ai/checkpoint.label"] = "other"
    index_path.write_text(json.dumps(index))
    (listed,) = store.catalog.list()
    assert "label is 'app' but index.json says 'other'" in (listed.damage or "")
    with pytest.raises(errors.DataLoss, match="label is 'app'"):
        store.reader.verify(listed)


def test_the_file_lists_are_what_the_manifest_references_while_raw(tmp_path: Path) -> None:
    store = make_store(tmp_path)
    entry = publish(store, diff=DIFF)
    manifest = json.loads(read_blob(store, entry.manifest_digest))
    assert [x["mediaType"] for x in manifest["layers"]] == [MEDIA_TYPE_FILE_LIST] * 2
    assert manifest["annotations"][ANN_ID] == entry.id
    listed = json.loads(read_blob(store, manifest["layers"][1]["digest"]))
    assert listed["kind"] == "file" and listed["files"][0]["size"] == len(DIFF)
    assert "layer-listed" not in COMPACT_STEPS


def test_open_layer_of_a_raw_dir_layer_reports_damage_at_the_end(tmp_path: Path) -> None:
    store = make_store(tmp_path)
    entry = publish(store)
    pages = Path(store.root, "raw", entry.id, "criu", "pages-1.img")
    data = bytearray(pages.read_bytes())
    data[5] ^= 1
    pages.write_bytes(bytes(data))
    with (
        store.reader.open_layer(entry, "criu") as stream,
        pytest.raises(errors.DataLoss, match="CRC"),
    ):
        io.BytesIO(stream.read())


def test_gc_collects_spool_files_left_behind_only_when_old(tmp_path: Path) -> None:
    store = make_store(tmp_path)
    spool = Path(store.reader.spool_dir())
    (spool / "old").write_bytes(b"o" * 100)
    os.utime(spool / "old", (0, 0))
    (spool / "fresh").write_bytes(b"f" * 10)
    assert store.maintenance.gc() == 100
    assert os.listdir(spool) == ["fresh"]


def test_compacting_a_damaged_checkpoint_is_data_loss(tmp_path: Path) -> None:
    store = make_store(tmp_path)
    entry = publish(store)
    config = json.loads(read_blob(store, entry.manifest_digest))["config"]["digest"]
    os.unlink(Path(store.root, "blobs", "sha256", config.removeprefix("sha256:")))
    with pytest.raises(errors.DataLoss, match=rf"checkpoint {entry.id} is damaged: .*missing"):
        store.compactor.compact(entry.id)
    assert store.compactor.pending_compaction() == []
