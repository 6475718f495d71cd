"""Rootfs diff without root: plain-directory snapshots through a pipe, xattr names,
finding the upperdir. Real overlays and foreign owners: tests/privileged."""

from __future__ import annotations

import io
import os
import threading
from pathlib import Path

import pytest
from cedana_shim import errors
from cedana_shim.checkpoint.rootfs_diff import apply_dir, capture_dir, upperdir_of
from cedana_shim.runtime.mount import Mount
from support.rootfs_diff import diff_snapshots, snapshot


def test_archive_streams_through_a_pipe(tmp_path: Path) -> None:
    src = tmp_path / "src"
    (src / "d").mkdir(parents=True)
    (src / "d/f").write_bytes(os.urandom(300_000))
    (src / ".wh.not-a-whiteout").write_text("a plain dir keeps any name")
    buf = io.BytesIO()
    assert capture_dir(str(src), buf).files == 2
    r, w = os.pipe()

    def feed() -> None:
        with os.fdopen(w, "wb") as pipe:
            pipe.write(buf.getvalue())

    writer = threading.Thread(target=feed)
    writer.start()
    dest = tmp_path / "dest"
    dest.mkdir()
    spool = tmp_path / "spool"
    spool.mkdir()
    with os.fdopen(r, "rb") as pipe:
        stats = apply_dir(pipe, str(dest), spool_dir=str(spool))
    assert os.listdir(spool) == []  # unlinked while in use, gone after
    writer.join()
    assert stats.files == 2
    assert diff_snapshots(snapshot(src), snapshot(dest)) == []


@pytest.mark.parametrize(
    ("mounts", "expected"),
    [
        pytest.param([], None, id="no-mounts"),
        pytest.param(
            [
                Mount(
                    "overlay",
                    "overlay",
                    "",
                    ("index=off", "workdir=/s/2/work", "upperdir=/s/2/fs", "lowerdir=/s/1/fs"),
                )
            ],
            "/s/2/fs",
            id="overlay",
        ),
        pytest.param(
            [Mount("overlay", "overlay", "/", ("lowerdir=/s/1/fs,upperdir=/s/3/fs,workdir=/w",))],
            "/s/3/fs",
            id="overlay-comma-joined-at-slash",
        ),
        pytest.param(
            [Mount("overlay", "overlay", "", ("lowerdir=/s/2/fs:/s/1/fs",))],
            None,
            id="read-only-overlay",
        ),
        pytest.param([Mount("bind", "/snap/7/fs", "", ("rbind", "rw"))], None, id="native-bind"),
        pytest.param(
            [
                Mount("overlay", "overlay", "", ("upperdir=/s/2/fs", "lowerdir=/s/1/fs")),
                Mount("tmpfs", "tmpfs", "/dev/shm", ("size=64m",)),
            ],
            "/s/2/fs",
            id="submounts-ignored",
        ),
        pytest.param(
            [
                Mount("overlay", "overlay", "", ("upperdir=/s/2/fs", "lowerdir=/s/1/fs")),
                Mount("bind", "/elsewhere", "", ("rbind",)),
            ],
            None,
            id="later-root-mount-hides-overlay",
        ),
        pytest.param(
            [Mount("fuse3.fuse-overlayfs", "overlay", "", ("upperdir=/s/2/fs",))],
            None,
            id="fuse-overlayfs-unsupported",
        ),
    ],
)
def test_upperdir_of(mounts: list[Mount], expected: str | None) -> None:
    assert upperdir_of(mounts) == expected


def test_upperdir_of_refuses_relative_upper() -> None:
    with pytest.raises(errors.InvalidArgument, match="relative upperdir"):
        upperdir_of([Mount("overlay", "overlay", "", ("upperdir=fs", "lowerdir=/l"))])


def test_xattr_names_pax_cannot_carry_are_skipped(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "f").write_text("x")
    os.setxattr(src / "f", "user.a=b", b"1")
    os.setxattr(src / "f", "user.ok", b"2")
    buf = io.BytesIO()
    capture_dir(str(src), buf)
    buf.seek(0)
    dest = tmp_path / "dest"
    dest.mkdir()
    apply_dir(buf, str(dest))
    assert os.listxattr(dest / "f") == ["user.ok"]
