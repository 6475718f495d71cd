"""Nothing under the store root is followed through a symlink, whoever planted it.

Each test plants a link where the store keeps a directory or file of its own,
pointing outside the store, and checks that nothing outside is read, written or
deleted, and that the store says what is wrong.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest
from cedana_shim import errors
from cedana_shim.checkpoint.store import Store, StoreConfig
from store_support import CRIU_FILES, make_store, publish, stage


def outside_dir(tmp_path: Path) -> tuple[Path, dict[str, bytes]]:
    target = tmp_path / "outside"
    target.mkdir(exist_ok=True)
    (target / "precious").write_bytes(b"not the store's")
    return target, {"precious": b"not the store's"}


def contents(path: Path) -> dict[str, bytes]:
    return {str(p.relative_to(path)): p.read_bytes() for p in path.rglob("*") if p.is_file()}


def test_a_symlinked_cache_dir_is_unlinked_not_followed(tmp_path: Path) -> None:
    store = make_store(tmp_path)
    target, before = outside_dir(tmp_path)
    os.symlink(target, Path(store.root, "cache"))
    entry = store.compactor.compact(publish(store).id)
    assert entry is not None
    store.maintenance.gc()
    assert contents(target) == before
    assert not os.path.lexists(Path(store.root, "cache"))


def test_the_previous_formats_cache_dir_is_garbage(tmp_path: Path) -> None:
    store = make_store(tmp_path)
    old = Path(store.root, "cache", "20200101T000000Z-deadbeef", "criu")
    old.mkdir(parents=True)
    (old / "pages-1.img").write_bytes(b"p" * 1000)
    assert store.maintenance.gc() == 1000
    assert not Path(store.root, "cache").exists()


@pytest.mark.parametrize("where", ["raw/<id>", "raw/<id>/criu", "raw/<id>/criu/pages-1.img"])
def test_symlinked_raw_images_are_refused(tmp_path: Path, where: str) -> None:
    store = make_store(tmp_path)
    entry = publish(store)
    raw = Path(store.root, "raw", entry.id)
    planted = {
        "raw/<id>": raw,
        "raw/<id>/criu": raw / "criu",
        "raw/<id>/criu/pages-1.img": raw / "criu" / "pages-1.img",
    }[where]
    target = tmp_path / "copy"
    if planted.is_dir():
        shutil.copytree(planted, target)
    else:
        shutil.copy(planted, target)
    before = contents(tmp_path / "copy") if target.is_dir() else {"": target.read_bytes()}
    shutil.rmtree(planted) if planted.is_dir() else planted.unlink()
    os.symlink(target, planted)

    assert store.raw.raw_images(entry, "criu") is None
    checks: list[Callable[[], object]] = [
        lambda: store.raw.verify_raw(entry, "criu"),
        lambda: store.reader.verify(entry, deep=False),
        lambda: store.compactor.compact(entry.id),
        lambda: store.reader.extract_layer(entry, "criu", str(tmp_path / "out")),
    ]
    for check in checks:
        with pytest.raises(errors.DataLoss, match="symbolic link"):
            check()
    assert store.catalog.get(entry.id).state == "raw"
    store.maintenance.gc()
    after = contents(tmp_path / "copy") if target.is_dir() else {"": target.read_bytes()}
    assert after == before, "nothing outside the store was touched"


def test_a_symlinked_cache_layer_of_a_compacted_checkpoint_is_not_used(tmp_path: Path) -> None:
    store = make_store(tmp_path)
    entry = store.compactor.compact(publish(store).id)
    assert entry is not None
    cached = Path(store.root, "raw", entry.id, "criu")
    shutil.copytree(cached, tmp_path / "copy")
    shutil.rmtree(cached)
    os.symlink(tmp_path / "copy", cached)
    assert store.raw.raw_images(entry, "criu") is None
    with pytest.raises(errors.DataLoss, match="symbolic link"):
        store.raw.verify_raw(entry, "criu")
    store.reader.verify(entry)  # the blob is untouched and good


@pytest.mark.parametrize("name", ["ingest", "blobs", "raw"])
def test_a_symlinked_store_dir_stops_the_store_from_opening(tmp_path: Path, name: str) -> None:
    store = make_store(tmp_path)
    target, before = outside_dir(tmp_path)
    moved = tmp_path / f"moved-{name}"
    os.rename(Path(store.root, name), moved)
    os.symlink(target, Path(store.root, name))
    with pytest.raises(errors.DataLoss, match=rf"{name} is a symbolic link.*refusing"):
        Store(StoreConfig(root=store.root))
    assert contents(target) == before


def test_the_store_root_itself_may_be_a_symlink(tmp_path: Path) -> None:
    disk = tmp_path / "other-disk"
    disk.mkdir(mode=0o700)
    link = tmp_path / "store"
    os.symlink(disk, link)
    store = Store(StoreConfig(root=str(link)))
    entry = store.compactor.compact(publish(store).id)
    assert entry is not None
    store.reader.verify(entry)
    assert (disk / "index.json").exists()


def test_symlinks_planted_in_ingest_are_refused_or_unlinked(tmp_path: Path) -> None:
    store = make_store(tmp_path)
    target, before = outside_dir(tmp_path)
    os.symlink(target, Path(store.root, "ingest", "20200101T000000Z-deadbeef"))
    store.maintenance.gc()
    assert not os.path.lexists(Path(store.root, "ingest", "20200101T000000Z-deadbeef"))

    ing = store.writer.begin(scope="ns", label="app", metadata={})
    os.symlink(target, Path(ing.path, "dirs"))
    with pytest.raises(errors.DataLoss, match=r"dirs is a symbolic link"):
        ing.dir("criu")
    store.writer.abort(ing)
    ing = store.writer.begin(scope="ns", label="app", metadata={})
    Path(ing.path, "dirs").mkdir()
    os.symlink(target, Path(ing.path, "dirs", "criu"))
    with pytest.raises(errors.DataLoss, match=r"criu is a symbolic link"):
        ing.dir("criu")
    store.writer.abort(ing)
    assert contents(target) == before, "CRIU's dir was never made outside the store"


def test_a_symlinked_blob_is_refused_and_left_alone(tmp_path: Path) -> None:
    store = make_store(tmp_path)
    entry = store.compactor.compact(publish(store).id)
    assert entry is not None
    blob = Path(store.root, "blobs", "sha256", entry.layers[0].digest.removeprefix("sha256:"))
    copy = tmp_path / "blob-copy"
    shutil.copy(blob, copy)
    blob.unlink()
    os.symlink(copy, blob)
    with pytest.raises(errors.DataLoss, match="symbolic link"):
        store.reader.verify(entry)
    with pytest.raises(errors.DataLoss, match="symbolic link"):
        store.reader.open_layer(entry, "criu")
    store.maintenance.gc()
    assert os.path.islink(blob) and copy.exists()


def test_ingest_staging_dirs_are_private(tmp_path: Path) -> None:
    store = make_store(tmp_path)
    old = os.umask(0o022)
    try:
        ing = stage(store)
    finally:
        os.umask(old)
    for path in (Path(ing.path), Path(ing.path, "dirs"), Path(ing.dir("criu"))):
        assert path.stat().st_mode & 0o777 == 0o700, path
    assert sorted(p.name for p in Path(ing.dir("criu")).iterdir()) == sorted(CRIU_FILES)
    store.writer.abort(ing)
