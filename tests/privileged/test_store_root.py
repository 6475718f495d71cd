"""The checkpoint store where only root can test it: a store owned by another uid, and
a full disk (a tiny tmpfs) while writing and while extracting."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from cedana_shim import errors
from cedana_shim.checkpoint.store import Entry, Store, StoreConfig
from cedana_shim.checkpoint.store.layout import MEDIA_TYPE_CRIU


def make_store(tmp_path: Path) -> Store:
    return Store(StoreConfig(root=str(tmp_path / "store")))


def write_tree(root: Path, files: dict[str, tuple[bytes, int]]) -> None:
    for rel, (data, mode) in files.items():
        path = root / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        path.chmod(mode)


def commit(store: Store, files: dict[str, tuple[bytes, int]] | None = None) -> Entry:
    ing = store.writer.begin(scope="ns", label="app", metadata={"container": "c1"})
    write_tree(Path(ing.dir("criu")), files or {"pages-1.img": (os.urandom(1000), 0o600)})
    ing.add_dir_layer("criu", ing.dir("criu"), MEDIA_TYPE_CRIU)
    return store.commit(ing)


def blob_names(store: Store) -> set[str]:
    return set(os.listdir(os.path.join(store.root, "blobs", "sha256")))


def test_refuses_a_root_open_to_others_or_owned_by_someone_else(tmp_path: Path) -> None:
    assert os.geteuid() == 0, "this test needs root (to chown)"
    root = tmp_path / "store"
    make_store(tmp_path)
    root.chmod(0o755)
    with pytest.raises(errors.PermissionDenied, match=r"mode 0755.*chmod 0700"):
        make_store(tmp_path)
    root.chmod(0o700)
    os.chown(root, 12345, 0)
    with pytest.raises(errors.PermissionDenied, match=r"owned by uid 12345"):
        make_store(tmp_path)


# --------------------------------------------------------------------------- ENOSPC


@pytest.fixture
def tiny_fs(tmp_path: Path) -> Iterator[Path]:
    assert os.geteuid() == 0, "the ENOSPC test mounts a tmpfs and needs root"
    mnt = tmp_path / "tiny"
    mnt.mkdir()
    subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=8m,mode=0700", "tmpfs", str(mnt)], check=True
    )
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], check=True)


def test_enospc_is_resource_exhausted_and_leaves_the_store_as_it_was(
    tiny_fs: Path, tmp_path: Path
) -> None:
    store = Store(StoreConfig(root=str(tiny_fs / "store")))
    small = commit(store, files={"a.img": (os.urandom(100_000), 0o600)})
    before_index = Path(store.root, "index.json").read_bytes()
    before_blobs = blob_names(store)

    big = tmp_path / "big"  # outside the tmpfs: only the compressed blob lands there
    write_tree(big, {"pages-1.img": (os.urandom(12 << 20), 0o600)})
    ing = store.writer.begin(scope="ns", label="app", metadata={})
    ing.add_dir_layer("criu", str(big), MEDIA_TYPE_CRIU)
    with pytest.raises(errors.ResourceExhausted) as info:
        store.commit(ing)
    message = str(info.value)
    assert f"checkpoint store {store.root} is full" in message
    assert "writing layer 'criu'" in message and ing.id in message
    assert Path(store.root, "index.json").read_bytes() == before_index
    assert blob_names(store) == before_blobs
    assert os.listdir(os.path.join(store.root, "ingest")) == []
    store.reader.verify(small)
    store.reader.verify(commit(store, files={"b.img": (b"b" * 1000, 0o600)}))  # usable again


def test_a_layer_larger_than_the_free_space_is_refused_before_extracting(
    tiny_fs: Path, tmp_path: Path
) -> None:
    store = make_store(tmp_path)
    entry = commit(store, files={"pages-1.img": (bytes(12 << 20), 0o600)})  # compresses to ~0
    dest = tiny_fs / "restore" / "images"
    with pytest.raises(errors.ResourceExhausted, match=r"needs \d+ bytes .* nothing was extracted"):
        store.reader.extract_layer(entry, "criu", str(dest))
    assert os.listdir(tiny_fs / "restore") == []


def test_enospc_while_extracting_leaves_nothing_behind(tiny_fs: Path, tmp_path: Path) -> None:
    # The free-space check passes (a few hundred KB recorded), but each small file takes
    # a whole page of the tmpfs: the disk fills part way through.
    store = make_store(tmp_path)
    files = {f"f{n:04}.img": (b"x" * 100, 0o600) for n in range(3000)}
    entry = commit(store, files=files)
    dest = tiny_fs / "restore" / "images"
    with pytest.raises(errors.ResourceExhausted, match="no space left"):
        store.reader.extract_layer(entry, "criu", str(dest))
    assert os.listdir(tiny_fs / "restore") == []
