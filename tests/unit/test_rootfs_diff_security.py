"""Hostile rootfs diffs: each is refused whole, with nothing written anywhere.

The archive may come from another node or a shared registry and is applied as
root, so every case checks that neither the rootfs nor a sentinel directory
beside it changed at all (paths, content, modes, owners, mtimes).
"""

from __future__ import annotations

import io
import os
import tarfile
from collections.abc import Callable
from pathlib import Path

import pytest
from cedana_shim import errors
from cedana_shim.checkpoint.rootfs_diff import Limits, apply, apply_dir
from support.rootfs_diff import Member, Unseekable, archive, node, reg, snapshot


@pytest.fixture
def world(tmp_path: Path) -> Path:
    """tmp/rootfs (the target) and tmp/outside (must never change)."""
    rootfs = tmp_path / "rootfs"
    (rootfs / "etc").mkdir(parents=True)
    (rootfs / "etc/passwd").write_text("root:x:0:0\n")
    (rootfs / "usr/bin").mkdir(parents=True)
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "secret").write_text("host secret")
    (outside / "shadow").write_text("host shadow")
    return tmp_path


DIR, SYM, LNK = tarfile.DIRTYPE, tarfile.SYMTYPE, tarfile.LNKTYPE
# Owned by whoever runs the test: these cases are about links and descriptors,
# and restoring a foreign owner needs root (tests/privileged covers owners).
MINE: dict[str, object] = {"uid": os.getuid(), "gid": os.getgid()}

REFUSED: list[tuple[str, Callable[[], io.BytesIO], str]] = [
    ("dotdot", lambda: archive(reg("../escape")), r"'\.\.' component"),
    ("absolute", lambda: archive(reg("/etc/passwd")), "absolute path"),
    ("dotdot-inside", lambda: archive(reg("a/../../x")), r"'\.\.' component"),
    ("dotdot-only", lambda: archive(node("..", DIR)), r"'\.\.' component"),
    (
        "chardev",
        lambda: archive(node("null", tarfile.CHRTYPE, devmajor=1, devminor=3)),
        "character device",
    ),
    ("blockdev", lambda: archive(node("sda", tarfile.BLKTYPE, devmajor=8)), "block device"),
    ("fifo", lambda: archive(node("pipe", tarfile.FIFOTYPE)), "FIFO"),
    ("chardev-whiteout-style", lambda: archive(node("gone", tarfile.CHRTYPE)), "character device"),
    ("hardlink-absolute", lambda: archive(node("h", LNK, "/etc/shadow")), "absolute path"),
    (
        "hardlink-dotdot",
        lambda: archive(node("h", LNK, "../outside/shadow")),
        "leaves the archive root",
    ),
    (
        "hardlink-to-rootfs-file",
        lambda: archive(node("h", LNK, "etc/passwd")),
        "not a regular file earlier",
    ),
    (
        "hardlink-to-symlink",
        lambda: archive(node("s", SYM, "/etc/shadow"), node("h", LNK, "s")),
        "not a regular file earlier",
    ),
    (
        "hardlink-forward",
        lambda: archive(node("h", LNK, "later"), reg("later")),
        "not a regular file earlier",
    ),
    (
        "symlink-then-through",
        lambda: archive(node("evil", SYM, "/"), reg("evil/pwned")),
        "makes a symlink",
    ),
    (
        "relative-symlink-then-through",
        lambda: archive(node("evil", SYM, "../outside"), node("evil/d", DIR), reg("evil/d/x")),
        "makes a symlink",
    ),
    ("file-then-through", lambda: archive(reg("f"), reg("f/x")), "makes a regular file"),
    (
        "hardlink-then-through",
        lambda: archive(reg("f"), node("h", LNK, "f"), reg("h/x")),
        "makes a hard link",
    ),
    ("duplicate-swap", lambda: archive(reg("a"), node("a", SYM, "/etc/shadow")), "twice"),
    ("whiteout-dotdot", lambda: archive(reg(".wh...", b"")), "names no ordinary file"),
    ("whiteout-dot", lambda: archive(reg(".wh..", b"")), "names no ordinary file"),
    ("whiteout-empty", lambda: archive(reg(".wh.", b"")), "names no ordinary file"),
    ("whiteout-dotdot-path", lambda: archive(reg(".wh.../..", b"")), r"'\.\.' component"),
    (
        "whiteout-nested-dotdot",
        lambda: archive(node("a", DIR), reg("a/.wh...", b"")),
        "names no ordinary file",
    ),
    ("whiteout-reserved", lambda: archive(reg(".wh..wh.plnk", b"")), "names no ordinary file"),
    ("whiteout-as-dir", lambda: archive(reg(".wh.etc/passwd")), "whiteout name as a directory"),
    ("whiteout-symlink", lambda: archive(node(".wh.etc", SYM, "/")), "not an empty regular"),
    ("whiteout-with-data", lambda: archive(reg(".wh.etc", b"data")), "not an empty regular"),
    ("opaque-root", lambda: archive(reg(".wh..wh..opq", b"")), "empty the rootfs"),
    (
        "opaque-without-dir",
        lambda: archive(reg("etc/.wh..wh..opq", b"")),
        "directory the archive does not contain",
    ),
    (
        "opaque-under-symlink",
        lambda: archive(node("l", SYM, "/"), node("l/etc", DIR), reg("l/etc/.wh..wh..opq", b"")),
        "makes a symlink",
    ),
    ("whiteout-under-file", lambda: archive(reg("f"), reg("f/.wh.x", b"")), "makes a regular file"),
    (
        "xattr-overlay-private",
        lambda: archive(reg("f", pax_headers={"SCHILY.xattr.trusted.overlay.opaque": "y"})),
        "trusted.overlay.opaque",
    ),
    (
        "xattr-selinux",
        lambda: archive(reg("f", pax_headers={"SCHILY.xattr.security.selinux": "system_u"})),
        "security.selinux",
    ),
    (
        "xattr-libarchive",
        lambda: archive(reg("f", pax_headers={"LIBARCHIVE.xattr.user.x": "eA=="})),
        "libarchive",
    ),
    ("sparse", lambda: archive(reg("f", pax_headers={"GNU.sparse.map": "0,1"})), "sparse"),
    ("global-header", lambda: archive(pax_headers={"path": "etc/passwd"}), "global header"),
    ("long-component", lambda: archive(reg("x" * 256)), "longer than 255"),
    ("trailing-slash-file", lambda: archive(reg("etc/")), "not a directory"),
    ("impossible-owner", lambda: archive(reg("f", uid=2**32 - 1)), "impossible owner"),
    ("root-as-file", lambda: archive(reg("./")), "rootfs itself"),
]


def _apply(world: Path, src: io.BytesIO, limits: Limits | None = None) -> None:
    apply(src, str(world / "rootfs"), limits=limits or Limits())


@pytest.mark.parametrize(("make", "rule"), [pytest.param(m, r, id=i) for i, m, r in REFUSED])
def test_refused_with_nothing_written(
    world: Path, make: Callable[[], io.BytesIO], rule: str
) -> None:
    before = snapshot(world)
    with pytest.raises(errors.InvalidArgument, match=rule) as info:
        _apply(world, make())
    assert "nothing was applied" in str(info.value)
    assert snapshot(world) == before


@pytest.mark.parametrize(
    ("limits", "members", "rule"),
    [
        pytest.param(
            Limits(max_member_bytes=10), [reg("big", b"x" * 11)], "over the 10", id="member-size"
        ),
        pytest.param(
            Limits(max_total_bytes=15),
            [reg("a", b"x" * 10), reg("b", b"x" * 10)],
            "past 15",
            id="total-size",
        ),
        pytest.param(
            Limits(max_members=3), [reg("a"), reg("b"), reg("c")], "limit of 3", id="member-count"
        ),
        pytest.param(Limits(max_depth=3), [reg("a/b/c/d")], "3 directories deep", id="depth"),
        pytest.param(
            Limits(max_header_bytes=100),
            [reg("f", pax_headers={"SCHILY.xattr.user.big": "v" * 200})],
            "extended header",
            id="pax-header-size",
        ),
        pytest.param(
            Limits(max_xattr_bytes=8),
            [reg("f", pax_headers={"SCHILY.xattr.user.big": "v" * 9})],
            "9-byte xattr",
            id="xattr-size",
        ),
        pytest.param(
            Limits(max_archive_bytes=1000),
            [reg("f", b"x" * 1000)],
            "over the 1000-byte limit",
            id="archive-size",
        ),
    ],
)
def test_limits(world: Path, limits: Limits, members: list[Member], rule: str) -> None:
    spool = world / "outside" / "spool"
    spool.mkdir()
    before = snapshot(world)
    src = archive(*members)
    # A pipe, not a seekable buffer, for the archive-size case: spooling stops early.
    stream = io.BufferedReader(Unseekable(src.getvalue()))
    with pytest.raises(errors.InvalidArgument, match=rule):
        apply(stream, str(world / "rootfs"), limits=limits, spool_dir=str(spool))
    assert snapshot(world) == before


@pytest.mark.parametrize(
    ("damage", "rule"),
    [
        pytest.param(lambda b: b[: len(b) // 2], "truncated|without an end", id="truncated"),
        pytest.param(lambda b: b[:1024] + b"\x01" + b[1025:], "checksum", id="bad-checksum"),
        pytest.param(lambda b: b.rstrip(b"\0"), "end-of-archive|truncated", id="no-end-marker"),
        pytest.param(
            lambda b: b"not a tar at all".ljust(512, b"\0") + bytes(1024),
            "checksum|ustar",
            id="garbage",
        ),
    ],
)
def test_damaged_archives_are_data_loss(
    world: Path, damage: Callable[[bytes], bytes], rule: str
) -> None:
    good = archive(reg("etc/new", b"y" * 3000), reg("later", b"z")).getvalue()
    before = snapshot(world)
    with pytest.raises(errors.DataLoss, match=rule):
        _apply(world, io.BytesIO(damage(good)))
    assert snapshot(world) == before


def test_symlink_in_rootfs_parent_is_refused_not_followed(world: Path) -> None:
    """rootfs/etc -> outside, archive writes etc/x without listing etc: refuse."""
    rootfs, outside = world / "rootfs", world / "outside"
    for p in (rootfs / "etc/passwd",):
        p.unlink()
    (rootfs / "etc").rmdir()
    (rootfs / "etc").symlink_to(outside)
    before = snapshot(world)
    with pytest.raises(errors.InvalidArgument, match="symlink in the target rootfs"):
        _apply(world, archive(reg("etc/x", b"pwned")))
    assert snapshot(world) == before
    # The same through a deeper component and a file in the way.
    (rootfs / "usr/bin").rmdir()
    (rootfs / "usr/bin").symlink_to(outside)
    (rootfs / "plain").write_text("a file")
    for members, rule in (
        ([node("usr", DIR), reg("usr/bin/x")], "symlink in the target rootfs"),
        ([reg("plain/x")], "not a directory in the target rootfs"),
    ):
        before = snapshot(world)
        with pytest.raises(errors.InvalidArgument, match=rule):
            _apply(world, archive(*members))
        assert snapshot(world) == before


def test_symlink_in_rootfs_replaced_where_archive_makes_a_directory(world: Path) -> None:
    """OCI semantics: a directory entry replaces a non-directory; the link is never followed."""
    rootfs, outside = world / "rootfs", world / "outside"
    (rootfs / "etc/passwd").unlink()
    (rootfs / "etc").rmdir()
    (rootfs / "etc").symlink_to(outside)
    (rootfs / "leaf").symlink_to(outside / "secret")
    (rootfs / "gone").symlink_to(outside)
    (rootfs / "wh").symlink_to(outside)
    (rootfs / "opq").symlink_to(outside)
    outside_before = snapshot(outside)
    stats = apply(
        archive(
            node("etc", DIR, mode=0o755, **MINE),
            reg("etc/x", b"inside", **MINE),
            reg("leaf", b"replaced the link", **MINE),
            reg(".wh.gone", b""),
            reg("wh/.wh.secret", b""),
            node("opq", DIR, mode=0o755, **MINE),
            reg("opq/.wh..wh..opq", b""),
            reg("opq/new", b"n", **MINE),
        ),
        str(rootfs),
    )
    assert stats.deletions == 3
    assert snapshot(outside) == outside_before
    assert not (rootfs / "etc").is_symlink()
    assert (rootfs / "etc/x").read_text() == "inside"
    assert not (rootfs / "leaf").is_symlink()
    assert (rootfs / "leaf").read_text() == "replaced the link"
    assert not os.path.lexists(rootfs / "gone")
    assert (rootfs / "wh").is_symlink()  # the whiteout's parent is not a directory: no-op
    assert os.listdir(rootfs / "opq") == ["new"]


def test_apply_dir_has_the_same_rules(world: Path) -> None:
    before = snapshot(world)
    with pytest.raises(errors.InvalidArgument, match="makes a symlink"):
        apply_dir(archive(node("evil", SYM, "/"), reg("evil/pwned")), str(world / "rootfs"))
    assert snapshot(world) == before


def test_missing_rootfs(world: Path) -> None:
    with pytest.raises(errors.NotFound):
        apply(archive(), str(world / "nowhere"))


def test_no_descriptor_leaks(world: Path) -> None:
    """Refusals at every stage and a successful apply close every descriptor."""
    rootfs = world / "rootfs"
    (rootfs / "usr/bin").rmdir()
    (rootfs / "usr/bin").symlink_to(world / "outside")

    def open_fds() -> int:
        return len(os.listdir("/proc/self/fd"))

    before = open_fds()
    for src in (
        archive(reg("../x")),  # validation
        archive(node("usr", DIR), reg("usr/bin/x")),  # preflight, deep in a chain
        io.BytesIO(archive(reg("f")).getvalue()[:700]),  # truncated
    ):
        with pytest.raises((errors.InvalidArgument, errors.DataLoss)):
            apply(src, str(rootfs))
    apply(
        archive(
            node("a/b/c", DIR, mode=0o755, **MINE),
            reg("a/b/c/f", **MINE),
            node("a/h", LNK, "a/b/c/f", **MINE),
        ),
        str(rootfs),
    )
    assert open_fds() == before
