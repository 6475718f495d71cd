"""Real mounts (tmpfs, bind, overlay) under tmp_path; needs root, fails without it."""

from __future__ import annotations

import errno
import os
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from cedana_shim import errors
from cedana_shim.runtime.mount import Mount, mount_all, mountpoints_under, unmount_all


@pytest.fixture
def rootfs(tmp_path: Path) -> Iterator[Path]:
    assert os.geteuid() == 0, "mount tests need root"
    root = tmp_path / "rootfs"
    root.mkdir()
    try:
        yield root
    finally:
        try:
            unmount_all(str(tmp_path))
        finally:
            leaked = mountpoints_under(os.path.realpath(tmp_path))
            for point in leaked:  # the code under test failed; don't leave it behind
                subprocess.run(["umount", "-l", point], check=False)
            assert not leaked, f"mounts leaked: {leaked}"


def mounted(root: Path) -> list[str]:
    return mountpoints_under(os.path.realpath(root))


def mountinfo_line(point: Path) -> str:
    real = os.path.realpath(point)
    with open("/proc/self/mountinfo") as f:
        lines = [line for line in f if line.split()[4] == real]
    assert lines, f"{point} is not mounted"
    return lines[-1]


def test_tmpfs_bind_and_nested_target(rootfs: Path, tmp_path: Path) -> None:
    image = tmp_path / "image"
    (image / "mnt").mkdir(parents=True)
    (image / "hello").write_text("from the image")
    mount_all(
        [
            Mount("bind", str(image), "", ("rbind", "rw")),
            Mount("tmpfs", "tmpfs", "/mnt", ("nosuid", "size=1m", "mode=700")),
        ],
        str(rootfs),
    )
    assert (rootfs / "hello").read_text() == "from the image"
    assert mounted(rootfs) == [str(rootfs / "mnt"), str(rootfs)]
    assert os.stat(rootfs / "mnt").st_mode & 0o777 == 0o700
    assert "nosuid" in mountinfo_line(rootfs / "mnt").split()[5]
    (rootfs / "mnt" / "scratch").write_text("x")
    assert not (image / "mnt" / "scratch").exists()

    unmount_all(str(rootfs))
    assert mounted(rootfs) == []
    assert not (rootfs / "hello").exists()
    unmount_all(str(rootfs))  # idempotent


def test_read_only_bind_is_read_only(rootfs: Path, tmp_path: Path) -> None:
    source = tmp_path / "source"
    source.mkdir()
    mount_all([Mount("bind", str(source), "", ("bind", "ro"))], str(rootfs))
    with pytest.raises(OSError) as info:
        (rootfs / "file").write_text("no")
    assert info.value.errno == errno.EROFS
    (source / "file").write_text("yes")  # the source stays writable
    assert (rootfs / "file").read_text() == "yes"
    assert mountinfo_line(rootfs).split()[5].startswith("ro")


def test_remount_read_only(rootfs: Path) -> None:
    mount_all(
        [
            Mount("tmpfs", "tmpfs", "", ("size=1m",)),
            Mount("none", "", "", ("remount", "ro")),
        ],
        str(rootfs),
    )
    assert mounted(rootfs) == [str(rootfs)]  # the remount added nothing
    with pytest.raises(OSError) as info:
        (rootfs / "file").write_text("no")
    assert info.value.errno == errno.EROFS


def test_propagation(rootfs: Path, tmp_path: Path) -> None:
    other = tmp_path / "other"
    other.mkdir()
    mount_all([Mount("tmpfs", "tmpfs", "", ("private",))], str(rootfs))
    mount_all([Mount("tmpfs", "tmpfs", "", ("shared",))], str(other))
    assert "shared:" not in mountinfo_line(rootfs)
    assert "shared:" in mountinfo_line(other)


def test_overlay(rootfs: Path, tmp_path: Path) -> None:
    lower1, lower2, upper, work = (tmp_path / n for n in ("l1", "l2", "upper", "work"))
    for d in (lower1, lower2, upper, work):
        d.mkdir()
    (lower1 / "top").write_text("l1")
    (lower2 / "top").write_text("l2")
    (lower2 / "bottom").write_text("l2")
    options = (f"lowerdir={lower1}:{lower2}", f"upperdir={upper}", f"workdir={work}")
    mount_all([Mount("overlay", "overlay", "", options)], str(rootfs))
    assert (rootfs / "top").read_text() == "l1"
    assert (rootfs / "bottom").read_text() == "l2"
    (rootfs / "new").write_text("written")
    assert (upper / "new").read_text() == "written"
    unmount_all(str(rootfs))
    assert mounted(rootfs) == []


def test_overlay_with_lowerdirs_longer_than_a_page(rootfs: Path, tmp_path: Path) -> None:
    # What containerd's overlayfs snapshotter produces: many layers under one
    # (here deliberately long) snapshots directory.
    snapshots = tmp_path / ("snapshots-" + "x" * 200)
    layers = []
    for i in range(60):
        layer = snapshots / str(i) / "fs"
        layer.mkdir(parents=True)
        (layer / f"file{i}").write_text(str(i))
        layers.append(str(layer))
    upper, work = tmp_path / "upper", tmp_path / "work"
    upper.mkdir()
    work.mkdir()
    lowerdir = "lowerdir=" + ":".join(layers)
    assert len(lowerdir) > os.sysconf("SC_PAGE_SIZE")
    cwd = os.getcwd()
    options = (lowerdir, f"upperdir={upper}", f"workdir={work}")
    mount_all([Mount("overlay", "overlay", "", options)], str(rootfs))
    assert os.getcwd() == cwd  # the chdir happened on another thread's fs context
    assert (rootfs / "file0").read_text() == "0"
    assert (rootfs / "file59").read_text() == "59"


def test_failure_in_the_middle_unwinds(rootfs: Path, tmp_path: Path) -> None:
    image = tmp_path / "image"
    (image / "mnt").mkdir(parents=True)
    mounts = [
        Mount("bind", str(image), "", ("rbind",)),
        Mount("tmpfs", "tmpfs", "/mnt", ()),
        Mount("nosuchfs", "whatever", "/mnt", ()),
    ]
    with pytest.raises(errors.InvalidArgument, match="nosuchfs whatever") as info:
        mount_all(mounts, str(rootfs))
    assert str(rootfs / "mnt") in str(info.value)
    assert mounted(rootfs) == []


def test_missing_target_is_invalid_and_unwinds(rootfs: Path) -> None:
    mounts = [Mount("tmpfs", "tmpfs", "", ()), Mount("tmpfs", "tmpfs", "/no/such/dir", ())]
    with pytest.raises(errors.InvalidArgument, match="/no/such/dir"):
        mount_all(mounts, str(rootfs))
    assert mounted(rootfs) == []


def test_escaping_target_mounts_nothing(rootfs: Path) -> None:
    mounts = [Mount("tmpfs", "tmpfs", "", ()), Mount("tmpfs", "tmpfs", "../../escape", ())]
    with pytest.raises(errors.InvalidArgument, match="escapes"):
        mount_all(mounts, str(rootfs))
    assert mounted(rootfs) == []


def test_unsupported_option(rootfs: Path) -> None:
    with pytest.raises(errors.Unimplemented, match="loop"):
        mount_all([Mount("ext4", "/img.raw", "", ("loop",))], str(rootfs))
    assert mounted(rootfs) == []


def test_unmount_all_stacked_and_nested(rootfs: Path) -> None:
    mount_all([Mount("tmpfs", "tmpfs", "", ())], str(rootfs))
    (rootfs / "a" / "b").mkdir(parents=True)
    mount_all(
        [
            Mount("tmpfs", "tmpfs", "/a/b", ()),
            Mount("tmpfs", "tmpfs", "/a/b", ()),
        ],
        str(rootfs),
    )
    assert len(mounted(rootfs)) == 3
    unmount_all(str(rootfs))
    assert mounted(rootfs) == []


def test_unmount_all_detaches_a_busy_mount(rootfs: Path) -> None:
    mount_all([Mount("tmpfs", "tmpfs", "", ())], str(rootfs))
    with open(rootfs / "held", "w") as held:
        unmount_all(str(rootfs))
        assert mounted(rootfs) == []
        held.write("still usable after a lazy unmount")


def test_unmount_all_of_nothing(tmp_path: Path) -> None:
    unmount_all(str(tmp_path / "never-created"))
    unmount_all(str(tmp_path))


def test_unmount_all_refuses_root() -> None:
    with pytest.raises(errors.InvalidArgument):
        unmount_all("/")


def test_mount_point_with_spaces(rootfs: Path) -> None:
    odd = rootfs / "with space\tand tab"
    odd.mkdir()
    mount_all([Mount("tmpfs", "tmpfs", "/with space\tand tab", ())], str(rootfs))
    assert mounted(rootfs) == [str(odd)]
    unmount_all(str(rootfs))
    assert mounted(rootfs) == []
