"""Rootfs diff on real overlayfs: capture an upperdir, apply it to a fresh overlay;
owners, file capabilities and overlayfs' trusted.* xattrs (all need root)."""

from __future__ import annotations

import io
import os
import socket
import struct
import tarfile
from pathlib import Path

import pytest
from cedana_shim import errors
from cedana_shim.checkpoint.rootfs_diff import DiffStats, apply, capture
from support.rootfs_diff import diff_snapshots, overlay, snapshot

# security.capability, VFS_CAP_REVISION_2 with the effective bit: cap_net_raw+ep.
CAP_NET_RAW_EP = struct.pack("<IIIII", 0x02000001, 1 << 13, 0, 0, 0)
NON_UTF8 = b"latin1-\xe9t\xe9"
EXCLUDED = ["/etc/hosts", "/data", "/proc", "/sys", "/dev"]


def build_lower(lower: Path) -> None:
    files = {
        "etc/passwd": "root:x:0:0::/root:/bin/sh\n",
        "etc/config": "a=1\n",
        "etc/chmodme": "#!/bin/sh\n",
        "etc/chownme": "owned\n",
        "usr/bin/tool": "binary",
        "deldir/sub/deep/f": "gone",
        "deldir/g": "gone too",
        "opq/old1": "old",
        "opq/sub/old2": "old",
        "keep/file": "untouched",
        "keep/file2": "becomes a dir",
        "dir2/x": "dir2 becomes a file",
        "hardsrc": "linked from upper",
    }
    for rel, text in files.items():
        path = lower / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
    (lower / "link_old").symlink_to("etc/passwd")


def change_through(merged: Path) -> None:
    """What a container does to its rootfs; every kind of change a diff must carry."""
    m = merged
    (m / "new/dir/deep").mkdir(parents=True)
    (m / "new/dir/deep/file.txt").write_text("new content")
    (m / "new/empty").mkdir()
    (m / "etc/config").write_text("a=1\nb=2\n")
    os.chmod(m / "etc/chmodme", 0o4711)
    os.chown(m / "etc/chownme", 1234, 5678)
    (m / "new/abs").symlink_to("/etc/passwd")
    (m / "new/rel").symlink_to("../etc/config")
    (m / "link_old").unlink()
    (m / "link_old").symlink_to("keep/file")
    os.lchown(m / "new/rel", 42, 43)
    (m / "new/h1").write_text("two names")
    os.link(m / "new/h1", m / "new/h2")
    os.link(m / "hardsrc", m / "new/hardsrc_link")
    (m / "usr/bin/tool").unlink()
    for root, dirs, names in os.walk(m / "deldir", topdown=False):
        for n in names:
            os.unlink(os.path.join(root, n))
        for d in dirs:
            os.rmdir(os.path.join(root, d))
    os.rmdir(m / "deldir")
    for p in ("opq/sub/old2", "opq/old1"):
        (m / p).unlink()
    os.rmdir(m / "opq/sub")
    os.rmdir(m / "opq")
    (m / "opq").mkdir(mode=0o750)
    (m / "opq/new").write_text("only this")
    (m / "keep/file2").unlink()
    (m / "keep/file2").mkdir()
    (m / "dir2/x").unlink()
    os.rmdir(m / "dir2")
    (m / "dir2").write_text("now a file")
    (m / "with space and ünïcödé ✓").write_text("names")
    (m / os.fsdecode(NON_UTF8)).write_text("not utf-8")
    (m / "new/sticky").mkdir()
    os.chmod(m / "new/sticky", 0o1777)
    os.chown(m / "new/sticky", 7, 8)
    (m / "new/big").write_bytes(os.urandom(3 << 20))
    (m / "new/ping").write_bytes(b"\x7fELF")
    os.setxattr(m / "new/ping", "security.capability", CAP_NET_RAW_EP)
    os.setxattr(m / "new/h1", "user.note", b"kept")
    os.utime(m / "new/h1", ns=(1, 1_234_567_891_234_567_890))
    os.utime(m / "new/abs", ns=(1, 987_654_321_123_456_789), follow_symlinks=False)
    # Bind-mount targets and kernel filesystems: never layer content.
    (m / "etc/hosts").write_text("127.0.0.1 localhost\n")
    (m / "data/sub").mkdir(parents=True)
    (m / "data/sub/volume-file").write_text("volume")
    for p in ("proc/1", "sys/kernel", "dev/shm"):
        (m / p).mkdir(parents=True)
    (m / "dev/shm/segment").write_text("shm")
    os.mkfifo(m / "new/fifo")
    sock = socket.socket(socket.AF_UNIX)
    sock.bind(str(m / "new/sock"))
    sock.close()


def test_overlay_round_trip(tmp_path: Path) -> None:
    lower = tmp_path / "lower"
    build_lower(lower)
    archive = tmp_path / "rootfs-diff.tar"
    ignore = [*EXCLUDED, "new/fifo", "new/sock"]
    with overlay(tmp_path, "a", lower) as (merged, upper):
        change_through(merged)
        expected = snapshot(merged, ignore=ignore)
    # The premise: overlayfs wrote its own whiteouts and opaque marker.
    assert os.stat(upper / "usr/bin/tool", follow_symlinks=False).st_rdev == 0
    assert os.getxattr(upper / "opq", "trusted.overlay.opaque") == b"y"

    stats = capture(str(upper), str(archive), exclude=["/etc/hosts", "/data"])
    # Whiteouts for usr/bin/tool and deldir; opaque markers for opq and for
    # keep/file2 (a directory made where a whiteout was is opaque too).
    assert stats.deletions == 4
    assert stats.skipped == 2  # the FIFO and the socket
    assert stats.symlinks == 3

    with tarfile.open(archive) as tf:  # also proves tarfile reads what we write
        names = tf.getnames()
        members = {m.name: m for m in tf.getmembers()}
    assert "usr/bin/.wh.tool" in names
    assert ".wh.deldir" in names
    assert names[names.index("opq") + 1] == "opq/.wh..wh..opq"
    assert "keep/file2/.wh..wh..opq" in names
    assert members["new/ping"].pax_headers["SCHILY.xattr.security.capability"]
    assert members["new/h2"].type == tarfile.LNKTYPE
    assert members["new/h2"].linkname == "new/h1"
    for name in names:
        top = name.split("/")[0]
        assert top not in ("proc", "sys", "dev", "data"), name
        assert name != "etc/hosts"

    with overlay(tmp_path, "b", lower) as (merged, _):
        applied = apply(str(archive), str(merged))
        restored = snapshot(merged, ignore=ignore)
    assert diff_snapshots(expected, restored) == []
    assert applied == DiffStats(
        files=stats.files,
        dirs=stats.dirs,
        symlinks=stats.symlinks,
        deletions=stats.deletions,
        bytes=stats.bytes,
    )
    assert restored[b"new/h1"]["nlink"] == 2
    assert restored[b"new/hardsrc_link"]["nlink"] == 2
    assert restored[b"etc/chmodme"]["mode"] == oct(0o4711)
    assert restored[b"new/ping"]["xattrs"]["security.capability"] == CAP_NET_RAW_EP
    assert NON_UTF8 in restored
    for gone in (b"usr/bin/tool", b"deldir", b"opq/old1", b"opq/sub", b"dir2/x"):
        assert gone not in restored


def test_excludes_and_kernel_filesystems_never_captured(tmp_path: Path) -> None:
    layer = tmp_path / "upper"
    for rel in (
        "etc/hosts",
        "etc/resolv.conf",
        "etc/keep",
        "data/x/y",
        "proc/self/status",
        "sys/fs/cgroup/x",
        "dev/shm/seg",
        "dev/null",
        "run/secrets/token",
        "var/lib/app.db",
        "procfs-lookalike",
    ):
        (layer / rel).parent.mkdir(parents=True, exist_ok=True)
        (layer / rel).write_text(rel)
    out = io.BytesIO()
    capture(
        str(layer),
        out,
        # As containerd/kubelet hand them over: with odd spellings.
        exclude=["/etc/hosts", "etc/resolv.conf", "/data/", "//run/../run/secrets"],
    )
    out.seek(0)
    with tarfile.open(fileobj=out) as tf:
        names = set(tf.getnames())
    assert names == {
        "etc",
        "etc/keep",
        "run",
        "var",
        "var/lib",
        "var/lib/app.db",
        "procfs-lookalike",
    }


def test_exclude_of_the_whole_rootfs_is_refused(tmp_path: Path) -> None:
    with pytest.raises(errors.InvalidArgument, match="whole rootfs"):
        capture(str(tmp_path), io.BytesIO(), exclude=["/.."])


def test_failed_capture_leaves_no_partial_archive(tmp_path: Path) -> None:
    with pytest.raises(errors.NotFound):
        capture(str(tmp_path / "missing"), str(tmp_path / "out.tar"))
    layer = tmp_path / "layer"
    (layer / "renamed").mkdir(parents=True)
    (layer / "a").write_text("x")
    os.setxattr(layer / "renamed", "trusted.overlay.redirect", b"/orig")
    with pytest.raises(errors.FailedPrecondition, match="redirect_dir"):
        capture(str(layer), str(tmp_path / "out.tar"))
    assert not (tmp_path / "out.tar").exists()


def test_tarfile_written_archives_apply(tmp_path: Path) -> None:
    """Interop: GNU and pax archives from another writer apply too."""
    for fmt in (tarfile.GNU_FORMAT, tarfile.PAX_FORMAT, tarfile.USTAR_FORMAT):
        buf = io.BytesIO()
        with tarfile.open(fileobj=buf, mode="w", format=fmt) as tf:
            d = tarfile.TarInfo("./dir")
            d.type, d.mode, d.mtime = tarfile.DIRTYPE, 0o711, 1_000_000
            tf.addfile(d)
            data = b"x" * 1000
            f = tarfile.TarInfo("./dir/" + "n" * (90 if fmt == tarfile.USTAR_FORMAT else 150))
            f.size, f.mode, f.uid, f.gid, f.mtime = len(data), 0o640, 3, 4, 2_000_000
            tf.addfile(f, io.BytesIO(data))
            link = tarfile.TarInfo("dir/sym")
            link.type, link.linkname = tarfile.SYMTYPE, "/somewhere/else"
            tf.addfile(link)
        dest = tmp_path / f"fmt{fmt}"
        dest.mkdir()
        buf.seek(0)
        stats = apply(buf, str(dest))
        assert (stats.files, stats.dirs, stats.symlinks) == (1, 1, 1)
        (f_path,) = (dest / "dir").glob("n*")
        assert f_path.read_bytes() == data
        assert (f_path.stat().st_uid, f_path.stat().st_gid) == (3, 4)
        assert oct((dest / "dir").stat().st_mode & 0o7777) == oct(0o711)
        assert (dest / "dir").stat().st_mtime == 1_000_000
        assert os.readlink(dest / "dir/sym") == "/somewhere/else"
