"""`cedana checkpoints import` refuses crafted archives with a clear reason and leaves
nothing behind; what it takes it takes whole (the real kubelet archive and export round
trip are tests/integration/test_cri_archive.py)."""

from __future__ import annotations

import gzip
import io
import json
import os
import struct
import tarfile
from pathlib import Path

import pytest
import zstandard
from cedana_shim import errors
from cedana_shim.checkpoint.cri_archive import importer
from cedana_shim.checkpoint.cri_archive.documents import read_facts
from cedana_shim.checkpoint.cri_archive.importer import import_archive
from cedana_shim.checkpoint.pagemap_image import (
    IMG_COMMON_MAGIC,
    PAGE_SIZE,
    PE_PRESENT,
    Pagemap,
    PagemapEntry,
    encode,
)
from cedana_shim.checkpoint.store import Store
from support.checkpoints import open_store

INVENTORY = struct.pack("<I", 0x58313116) + b"\0" * 12
PSTREE = struct.pack("<II", IMG_COMMON_MAGIC, 0x50273030) + b"\0" * 8
SPEC = {
    "ociVersion": "1.0.2",
    "process": {"terminal": False},
    "mounts": [{"destination": "/proc"}],
    "annotations": {
        "io.kubernetes.cri.container-name": "counter",
        "io.kubernetes.cri.sandbox-name": "web-0",
        "io.kubernetes.cri.sandbox-namespace": "team-a",
    },
}
CONFIG = {
    "id": "c0ffee",
    "name": "counter",
    "rootfsImageName": "docker.io/library/busybox:latest",
    "rootfsImageRef": "docker.io/library/busybox@sha256:" + "a" * 64,
}


def _member(name: str, data: bytes = b"", kind: bytes = tarfile.REGTYPE) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.type = kind
    info.size = len(data) if kind == tarfile.REGTYPE else 0
    info.mode = 0o755 if kind == tarfile.DIRTYPE else 0o600
    return info


def _images() -> dict[str, bytes]:
    pagemap = Pagemap(pages_id=1, entries=(PagemapEntry(0x400000, 2, PE_PRESENT),))
    return {
        "inventory.img": INVENTORY,
        "pstree.img": PSTREE,
        "pagemap-1.img": encode(pagemap),
        "pages-1.img": b"\x01" * (2 * PAGE_SIZE),
    }


def _rootfs_diff() -> bytes:
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as t:
        t.addfile(_member("var/", kind=tarfile.DIRTYPE))
        t.addfile(_member("var/token", b"tok\n"), io.BytesIO(b"tok\n"))
    return out.getvalue()


def _archive(
    path: Path,
    *,
    drop: tuple[str, ...] = (),
    extra: tuple[tuple[tarfile.TarInfo, bytes], ...] = (),
    images: dict[str, bytes] | None = None,
) -> Path:
    files = {
        "spec.dump": json.dumps(SPEC).encode(),
        "config.dump": json.dumps(CONFIG).encode(),
        "rootfs-diff.tar": gzip.compress(_rootfs_diff()),
        "deleted.files": json.dumps(["/etc/group"]).encode(),
    }
    with tarfile.open(path, "w") as t:
        for name, data in files.items():
            if name not in drop:
                t.addfile(_member(name, data), io.BytesIO(data))
        if "checkpoint" not in drop:
            t.addfile(_member("checkpoint", kind=tarfile.DIRTYPE))
            for name, data in (images if images is not None else _images()).items():
                t.addfile(_member(f"checkpoint/{name}", data), io.BytesIO(data))
        for info, data in extra:
            t.addfile(info, io.BytesIO(data) if info.isreg() else None)
    return path


@pytest.fixture
def store(tmp_path: Path) -> Store:
    return open_store(tmp_path / "store")


def _nothing_left(store: Store) -> None:
    assert store.catalog.list() == []
    assert os.listdir(os.path.join(store.root, "ingest")) == []


def test_an_archive_becomes_a_checkpoint_of_the_namespace(store: Store, tmp_path: Path) -> None:
    entry = import_archive(store, str(_archive(tmp_path / "a.tar")), scope="team-a", label="web")
    assert (entry.scope, entry.label) == ("team-a", "web")
    meta = entry.metadata
    assert (meta["container"], meta["pod"], meta["containerId"]) == ("counter", "web-0", "c0ffee")
    assert meta["imageDigest"] == "sha256:" + "a" * 64
    assert meta["imported"]["engine"] == "containerd"
    store.reader.verify(entry)
    with (
        store.reader.open_layer(entry, "rootfs-diff") as layer,
        tarfile.open(fileobj=layer, mode="r|") as t,
    ):
        names = [m.name for m in t]
    assert names == ["var", "var/token", "etc/.wh.group"]


@pytest.mark.parametrize(
    ("extra", "reason"),
    [
        ((_member("../escape", b"x"), b"x"), "leaves the archive"),
        ((_member("checkpoint/../../etc/passwd", b"x"), b"x"), "leaves the archive"),
        ((_member("/abs", b"x"), b"x"), "absolute"),
        ((_member("checkpoint/sub/x.img", b"x"), b"x"), "nothing nested"),
        ((_member("checkpoint/pages-1.img", b"x"), b"x"), "appears twice"),
    ],
)
def test_names_that_leave_or_nest_are_refused(
    store: Store, tmp_path: Path, extra: tuple[tarfile.TarInfo, bytes], reason: str
) -> None:
    archive = _archive(tmp_path / "a.tar", extra=(extra,))
    with pytest.raises(errors.InvalidArgument, match=reason):
        import_archive(store, str(archive), scope="team-a", label="web")
    _nothing_left(store)


def test_a_symlinked_checkpoint_dir_is_refused(store: Store, tmp_path: Path) -> None:
    link = _member("checkpoint", kind=tarfile.SYMTYPE)
    link.linkname = "/etc"
    archive = _archive(tmp_path / "a.tar", drop=("checkpoint",), extra=((link, b""),))
    with pytest.raises(errors.InvalidArgument, match="'checkpoint' is a symlink"):
        import_archive(store, str(archive), scope="team-a", label="web")
    _nothing_left(store)


def test_a_device_node_is_refused(store: Store, tmp_path: Path) -> None:
    dev = _member("checkpoint/tty.img", kind=tarfile.CHRTYPE)
    archive = _archive(tmp_path / "a.tar", extra=((dev, b""),))
    with pytest.raises(errors.InvalidArgument, match="character device"):
        import_archive(store, str(archive), scope="team-a", label="web")
    _nothing_left(store)


def test_a_missing_spec_dump_is_refused(store: Store, tmp_path: Path) -> None:
    archive = _archive(tmp_path / "a.tar", drop=("spec.dump",))
    with pytest.raises(errors.InvalidArgument, match=r"no spec\.dump"):
        import_archive(store, str(archive), scope="team-a", label="web")
    _nothing_left(store)


def test_images_that_are_not_criu_dumps_are_refused(store: Store, tmp_path: Path) -> None:
    images = _images()
    images["pages-1.img"] = images["pages-1.img"][:PAGE_SIZE]  # truncated
    archive = _archive(tmp_path / "a.tar", images=images)
    with pytest.raises(errors.InvalidArgument, match="truncated or not this dump's"):
        import_archive(store, str(archive), scope="team-a", label="web")
    images = _images()
    images["pstree.img"] = b"#!/bin/sh\n"
    archive = _archive(tmp_path / "b.tar", images=images)
    with pytest.raises(errors.InvalidArgument, match=r"pstree\.img is not a CRIU image"):
        import_archive(store, str(archive), scope="team-a", label="web")
    _nothing_left(store)


def test_a_decompression_bomb_is_cut_off_at_the_stores_room(
    store: Store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A 64 MiB archive of zeros compresses to a few KiB; the store has 8 MiB of room
    (the free-space figure is what is patched, not the cut-off under test)."""
    monkeypatch.setattr(importer, "_room", lambda _store: 8 << 20)
    plain = _archive(
        tmp_path / "a.tar", extra=((_member("pad", bytes(64 << 20)), bytes(64 << 20)),)
    )
    bomb = tmp_path / "bomb.tar.zst"
    bomb.write_bytes(zstandard.ZstdCompressor().compress(plain.read_bytes()))
    assert bomb.stat().st_size < 1 << 20
    with pytest.raises(errors.InvalidArgument, match="decompression bomb"):
        import_archive(store, str(bomb), scope="team-a", label="web")
    _nothing_left(store)


def test_a_plain_archive_larger_than_the_room_is_refused_before_copying(
    store: Store, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(importer, "_room", lambda _store: 4096)
    with pytest.raises(errors.ResourceExhausted, match="nothing was imported"):
        import_archive(store, str(_archive(tmp_path / "a.tar")), scope="team-a", label="web")
    _nothing_left(store)


def test_documents_with_control_characters_are_refused() -> None:
    bad_id = json.dumps({**CONFIG, "id": "a\x1b[31m"}).encode()
    with pytest.raises(errors.InvalidArgument, match="'id' is not a short single-line"):
        read_facts(bad_id, json.dumps(SPEC).encode(), "a.tar")
    annotations = {**SPEC["annotations"], "io.kubernetes.cri.container-name": "x\ny"}  # type: ignore[dict-item]
    bad_spec = json.dumps({**SPEC, "annotations": annotations}).encode()
    with pytest.raises(errors.InvalidArgument, match="container-name' is not a short"):
        read_facts(json.dumps(CONFIG).encode(), bad_spec, "a.tar")
