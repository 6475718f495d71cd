"""The raw-image cache: kept for the newest checkpoint per label, checked by digest."""

import os
from pathlib import Path

import pytest
from cedana_shim.checkpoint.rawcache import RawCache
from cedana_shim.errors import DataLoss


def images(tmp_path: Path, name: str, content: bytes = b"x" * 5000) -> str:
    d = tmp_path / name
    d.mkdir()
    (d / "pages-1.img").write_bytes(content)
    (d / "inventory.img").write_bytes(b"inv")
    return str(d)


def test_adopt_lookup_verify_and_drop(tmp_path: Path) -> None:
    cache = RawCache(str(tmp_path / "store"))
    cache.adopt("id1", "ns", "lbl", "criu", "sha256:aa", images(tmp_path, "a"))
    path = cache.lookup("id1", "criu", "sha256:aa")
    assert path is not None and (Path(path) / "pages-1.img").read_bytes() == b"x" * 5000
    cache.verify("id1", "criu")
    assert cache.lookup("id1", "criu", "sha256:other") is None  # not the committed layer
    cache.drop("id1")
    assert cache.lookup("id1", "criu", "sha256:aa") is None


def test_flipped_byte_fails_verification_but_not_lookup(tmp_path: Path) -> None:
    cache = RawCache(str(tmp_path / "store"))
    cache.adopt("id1", "ns", "lbl", "criu", "sha256:aa", images(tmp_path, "a"))
    path = cache.lookup("id1", "criu", "sha256:aa")
    assert path is not None
    data = bytearray((Path(path) / "pages-1.img").read_bytes())
    data[10] ^= 0xFF
    (Path(path) / "pages-1.img").write_bytes(bytes(data))
    assert cache.lookup("id1", "criu", "sha256:aa") == path  # sizes alone look fine
    with pytest.raises(DataLoss, match=r"pages-1\.img does not match"):
        cache.verify("id1", "criu")


def test_truncation_is_seen_by_lookup(tmp_path: Path) -> None:
    cache = RawCache(str(tmp_path / "store"))
    cache.adopt("id1", "ns", "lbl", "criu", "sha256:aa", images(tmp_path, "a"))
    path = cache.lookup("id1", "criu", "sha256:aa")
    assert path is not None
    os.truncate(Path(path) / "pages-1.img", 10)
    assert cache.lookup("id1", "criu", "sha256:aa") is None


def test_only_the_newest_per_label_is_kept(tmp_path: Path) -> None:
    cache = RawCache(str(tmp_path / "store"))
    cache.adopt("id1", "ns", "lbl", "criu", "sha256:aa", images(tmp_path, "a"))
    cache.adopt("id2", "ns", "other", "criu", "sha256:bb", images(tmp_path, "b"))
    cache.adopt("id3", "ns", "lbl", "criu", "sha256:cc", images(tmp_path, "c"))
    assert cache.lookup("id1", "criu", "sha256:aa") is None
    assert cache.lookup("id2", "criu", "sha256:bb") is not None
    assert cache.lookup("id3", "criu", "sha256:cc") is not None
    cache.retain_only({"id3"})
    assert cache.lookup("id2", "criu", "sha256:bb") is None
