"""Raw images: a raw checkpoint's own files, or the cache kept for the newest per label.

raw_images() answers from sizes alone; verify_raw() checks every CRC-32;
discard_raw() forgets a bad cache, or moves a bad raw checkpoint aside.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest
from cedana_shim.checkpoint.store import Entry, Store, StoreConfig
from cedana_shim.checkpoint.store.layout import MEDIA_TYPE_CRIU
from cedana_shim.errors import DataLoss


def make_store(tmp_path: Path, **kw: object) -> Store:
    return Store(StoreConfig(root=str(tmp_path / "store"), retain=0, **kw))  # type: ignore[arg-type]


def publish(store: Store, label: str = "lbl", content: bytes = b"x" * 5000) -> Entry:
    ing = store.writer.begin(scope="ns", label=label, metadata={})
    images = Path(ing.dir("criu"))
    (images / "pages-1.img").write_bytes(content)
    (images / "inventory.img").write_bytes(b"inv")
    # CRIU writes its images 0644: the store keeps them private.
    for f in images.iterdir():
        f.chmod(0o644)
    ing.add_dir_layer("criu", str(images), MEDIA_TYPE_CRIU)
    ing.keep_raw("criu")
    return store.writer.publish(ing)


def commit(store: Store, label: str = "lbl", content: bytes = b"x" * 5000) -> Entry:
    compacted = store.compactor.compact(publish(store, label, content).id)
    assert compacted is not None and compacted.state == "compacted"
    return compacted


@pytest.mark.parametrize("compacted", [False, True], ids=["raw", "cache"])
def test_lookup_verify_and_drop(tmp_path: Path, compacted: bool) -> None:
    store = make_store(tmp_path)
    entry = commit(store) if compacted else publish(store)
    path = store.raw.raw_images(entry, "criu")
    assert path is not None and (Path(path) / "pages-1.img").read_bytes() == b"x" * 5000
    assert path == os.path.join(store.root, "raw", entry.id, "criu")
    for f in Path(path).iterdir():
        assert stat.S_IMODE(f.stat().st_mode) == 0o600, f
    assert stat.S_IMODE(Path(path).stat().st_mode) == 0o700
    store.raw.verify_raw(entry, "criu")
    assert store.raw.raw_images(entry, "rootfs-diff") is None  # no such layer kept
    store.raw.discard_raw(entry)
    assert store.raw.raw_images(entry, "criu") is None
    if compacted:  # the blob is still good: only the cache went
        store.reader.verify(store.catalog.get(entry.id))
    else:  # nothing else to restore from: moved aside, out of the index
        assert store.catalog.list() == []
        kept = Path(store.root, "damaged", entry.id)
        assert (kept / "criu" / "pages-1.img").read_bytes() == b"x" * 5000
        assert (kept / "config.json").exists() and (kept / "criu.files.json").exists()


@pytest.mark.parametrize("compacted", [False, True], ids=["raw", "cache"])
def test_flipped_byte_fails_verification_but_not_lookup(tmp_path: Path, compacted: bool) -> None:
    store = make_store(tmp_path)
    entry = commit(store) if compacted else publish(store)
    path = store.raw.raw_images(entry, "criu")
    assert path is not None
    data = bytearray((Path(path) / "pages-1.img").read_bytes())
    data[10] ^= 0xFF
    (Path(path) / "pages-1.img").write_bytes(bytes(data))
    assert store.raw.raw_images(entry, "criu") == path  # sizes alone look fine
    with pytest.raises(DataLoss, match=r"pages-1\.img does not match its file list"):
        store.raw.verify_raw(entry, "criu")


@pytest.mark.parametrize("compacted", [False, True], ids=["raw", "cache"])
def test_truncation_is_seen_by_lookup(tmp_path: Path, compacted: bool) -> None:
    store = make_store(tmp_path)
    entry = commit(store) if compacted else publish(store)
    path = store.raw.raw_images(entry, "criu")
    assert path is not None
    os.truncate(Path(path) / "pages-1.img", 10)
    assert store.raw.raw_images(entry, "criu") is None
    with pytest.raises(DataLoss, match=r"pages-1\.img is 10 bytes, the file list says 5000"):
        store.raw.verify_raw(entry, "criu")


def test_only_the_newest_per_label_is_kept(tmp_path: Path) -> None:
    store = make_store(tmp_path)
    id1 = commit(store, "lbl")
    id2 = commit(store, "other")
    id3 = commit(store, "lbl")
    assert store.raw.raw_images(id1, "criu") is None
    assert store.raw.raw_images(id2, "criu") is not None
    assert store.raw.raw_images(id3, "criu") is not None
    assert store.catalog.get(id1.id).raw_bytes == 0 and store.catalog.get(id3.id).raw_bytes == 5003
    store.maintenance.remove(id2.id)
    assert not Path(store.root, "raw", id2.id).exists()


def test_no_cache_without_keep_raw_or_with_cache_raw_off(tmp_path: Path) -> None:
    store = make_store(tmp_path, cache_raw=False)
    entry = commit(store)
    assert store.raw.raw_images(entry, "criu") is None
    assert os.listdir(Path(store.root, "raw")) == []


def test_a_cache_list_that_does_not_match_the_config_is_refused(tmp_path: Path) -> None:
    store = make_store(tmp_path)
    entry = commit(store)
    files = Path(store.root, "raw", entry.id, "criu.files.json")
    files.write_bytes(files.read_bytes().replace(b'"size":5000', b'"size":5001'))
    assert store.raw.raw_images(entry, "criu") is None
    with pytest.raises(DataLoss, match="does not match the digest in the config"):
        store.raw.verify_raw(entry, "criu")
