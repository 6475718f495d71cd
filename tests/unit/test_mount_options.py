"""Pure parts of runtime/mount.py: option parsing, target resolution, lowerdir compaction."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from cedana_shim import errors
from cedana_shim.runtime import mount as m
from cedana_shim.runtime.mount import (
    KNOWN_FLAGS,
    PROPAGATION_FLAGS,
    ParsedOptions,
    compact_lowerdir,
    parse_options,
    resolve_target,
)
from hypothesis import given
from hypothesis import strategies as st

FLAG_WORDS = [
    "async", "atime", "bind", "dev", "diratime", "dirsync", "exec", "lazytime", "mand",
    "noatime", "nodev", "nodiratime", "noexec", "nolazytime", "nomand", "norelatime",
    "nostrictatime", "nosuid", "nosymfollow", "rbind", "relatime", "remount", "ro", "rw",
    "strictatime", "suid", "sync",
]  # fmt: skip
PROPAGATION_WORDS = [
    "private", "rprivate", "shared", "rshared", "slave", "rslave", "unbindable", "runbindable",
]  # fmt: skip
PROPAGATION_BITS = m.MS_SHARED | m.MS_PRIVATE | m.MS_SLAVE | m.MS_UNBINDABLE


@pytest.mark.parametrize(
    ("options", "expected"),
    [
        ([], ParsedOptions(0, (), "", ())),
        (["defaults"], ParsedOptions(0, (), "", ())),
        ([""], ParsedOptions(0, (), "", ())),
        (["ro"], ParsedOptions(m.MS_RDONLY, (), "", ())),
        (["rw"], ParsedOptions(0, (), "", ())),
        (["ro", "rw"], ParsedOptions(0, (), "", ())),
        (["rw", "ro"], ParsedOptions(m.MS_RDONLY, (), "", ())),
        (["bind"], ParsedOptions(m.MS_BIND, (), "", ())),
        (["rbind", "rw"], ParsedOptions(m.MS_BIND | m.MS_REC, (), "", ())),
        (["rbind", "ro"], ParsedOptions(m.MS_BIND | m.MS_REC | m.MS_RDONLY, (), "", ())),
        (
            ["nosuid", "nodev", "noexec"],
            ParsedOptions(m.MS_NOSUID | m.MS_NODEV | m.MS_NOEXEC, (), "", ()),
        ),
        (["nosuid", "suid", "nodev", "dev", "noexec", "exec"], ParsedOptions(0, (), "", ())),
        (
            ["remount", "ro", "bind"],
            ParsedOptions(m.MS_REMOUNT | m.MS_RDONLY | m.MS_BIND, (), "", ()),
        ),
        (["sync"], ParsedOptions(m.MS_SYNCHRONOUS, (), "", ())),
        (["sync", "async"], ParsedOptions(0, (), "", ())),
        (["dirsync"], ParsedOptions(m.MS_DIRSYNC, (), "", ())),
        (["noatime", "atime"], ParsedOptions(0, (), "", ())),
        (["noatime", "nodiratime"], ParsedOptions(m.MS_NOATIME | m.MS_NODIRATIME, (), "", ())),
        (["relatime"], ParsedOptions(m.MS_RELATIME, (), "", ())),
        (["relatime", "norelatime"], ParsedOptions(0, (), "", ())),
        (["strictatime"], ParsedOptions(m.MS_STRICTATIME, (), "", ())),
        (["strictatime", "nostrictatime"], ParsedOptions(0, (), "", ())),
        (["mand", "nomand"], ParsedOptions(0, (), "", ())),
        (["lazytime"], ParsedOptions(m.MS_LAZYTIME, (), "", ())),
        (["nosymfollow"], ParsedOptions(m.MS_NOSYMFOLLOW, (), "", ())),
        (["private"], ParsedOptions(0, (m.MS_PRIVATE,), "", ())),
        (["rprivate"], ParsedOptions(0, (m.MS_PRIVATE | m.MS_REC,), "", ())),
        (["shared", "rslave"], ParsedOptions(0, (m.MS_SHARED, m.MS_SLAVE | m.MS_REC), "", ())),
        (["runbindable"], ParsedOptions(0, (m.MS_UNBINDABLE | m.MS_REC,), "", ())),
        (
            ["ro", "lowerdir=/a:/b", "upperdir=/u", "workdir=/w", "index=off", "userxattr"],
            ParsedOptions(
                m.MS_RDONLY, (), "lowerdir=/a:/b,upperdir=/u,workdir=/w,index=off,userxattr", ()
            ),
        ),
        (
            ["nosuid", "size=65536k", "mode=755", "rprivate"],
            ParsedOptions(m.MS_NOSUID, (m.MS_PRIVATE | m.MS_REC,), "size=65536k,mode=755", ()),
        ),
        (["loop", "ro"], ParsedOptions(m.MS_RDONLY, (), "", ("loop",))),
        (
            ["uidmap=0:1000:1", "gidmap=0:1000:1"],
            ParsedOptions(0, (), "", ("uidmap=0:1000:1", "gidmap=0:1000:1")),
        ),
        (["X-containerd.mkdir.path=/x"], ParsedOptions(0, (), "", ("X-containerd.mkdir.path=/x",))),
    ],
)
def test_parse_options(options: list[str], expected: ParsedOptions) -> None:
    assert parse_options(options) == expected
    flags, propagation, data, unsupported = parse_options(options)  # a plain tuple too
    assert (flags, propagation, data, unsupported) == expected


@pytest.mark.parametrize("word", FLAG_WORDS)
def test_every_flag_word_is_known(word: str) -> None:
    parsed = parse_options([word])
    assert parsed.data == "" and parsed.propagation == ()
    assert parsed.flags & ~KNOWN_FLAGS == 0


@pytest.mark.parametrize("word", PROPAGATION_WORDS)
def test_every_propagation_word_is_separate(word: str) -> None:
    parsed = parse_options([word])
    assert parsed.flags == 0 and parsed.data == ""
    assert len(parsed.propagation) == 1 and parsed.propagation[0] in PROPAGATION_FLAGS


def test_known_flags_hold_no_propagation_bits() -> None:
    assert KNOWN_FLAGS & PROPAGATION_BITS == 0


words = st.one_of(
    st.sampled_from([*FLAG_WORDS, *PROPAGATION_WORDS, "defaults", "loop", "uidmap=0:1:1"]),
    st.text(max_size=20),
    st.from_regex(r"[a-z]{1,8}=[^,]{0,12}", fullmatch=True),
)


@given(st.lists(words, max_size=20))
def test_parse_never_crashes_and_uses_known_bits(options: list[str]) -> None:
    parsed = parse_options(options)
    assert parsed.flags & ~KNOWN_FLAGS == 0
    assert parsed.flags & PROPAGATION_BITS == 0
    assert all(p in PROPAGATION_FLAGS for p in parsed.propagation)
    known = {*FLAG_WORDS, *PROPAGATION_WORDS, "defaults", ""}
    rest = [w for w in options if w not in known]
    passed = [w for w in rest if w not in parsed.unsupported]
    assert parsed.data == ",".join(passed)  # unknown words pass through, in order
    assert set(parsed.unsupported) <= set(rest)


@given(st.lists(st.sampled_from(["ro", "rw", "nosuid", "bind"]), min_size=1))
def test_last_of_ro_and_rw_wins(options: list[str]) -> None:
    last = next((w for w in reversed(options) if w in ("ro", "rw")), "rw")
    assert bool(parse_options(options).flags & m.MS_RDONLY) == (last == "ro")


# --- resolve_target -----------------------------------------------------------


@pytest.fixture
def root(tmp_path: Path) -> str:
    r = tmp_path / "rootfs"
    (r / "a" / "b").mkdir(parents=True)
    (r / "etc").mkdir()
    os.symlink("/etc", r / "abs-link")
    os.symlink("../../../../..", r / "a" / "up-link")
    os.symlink("b", r / "a" / "rel-link")
    os.symlink("loop2", r / "loop1")
    os.symlink("loop1", r / "loop2")
    return str(r)


@pytest.mark.parametrize(
    ("target", "expected"),
    [
        ("", ""),
        ("/", ""),
        ("/a/b", "a/b"),
        ("a/b", "a/b"),
        ("/a/./b/", "a/b"),
        ("/a/../etc", "etc"),
        ("/abs-link", "etc"),  # absolute link: relative to the rootfs, not the host
        ("/abs-link/x", "etc/x"),
        ("/a/up-link", ""),  # a link climbing out is clamped at the rootfs
        ("/a/up-link/etc", "etc"),
        ("/a/rel-link/c", "a/b/c"),
        ("/missing/deeper", "missing/deeper"),
    ],
)
def test_resolve_target(root: str, target: str, expected: str) -> None:
    assert resolve_target(root, target) == (os.path.join(root, expected) if expected else root)


@pytest.mark.parametrize("target", ["..", "/..", "../x", "a/../../x", "/a/b/../../../etc"])
def test_resolve_target_refuses_escapes(root: str, target: str) -> None:
    with pytest.raises(errors.InvalidArgument, match="escapes"):
        resolve_target(root, target)


def test_resolve_target_symlink_loop(root: str) -> None:
    with pytest.raises(errors.InvalidArgument, match="symlinks"):
        resolve_target(root, "/loop1")


# --- compact_lowerdir ---------------------------------------------------------


def test_compact_lowerdir_relative_to_common_parent() -> None:
    base = "/var/lib/containerd/io.containerd.snapshotter.v1.overlayfs/snapshots"
    lowers = [f"{base}/{i}/fs" for i in range(200, 100, -1)]
    data = f"index=off,lowerdir={':'.join(lowers)},upperdir={base}/7/fs,workdir={base}/7/work"
    assert len(data) > os.sysconf("SC_PAGE_SIZE")
    chdir, compact = compact_lowerdir(data)
    assert chdir == base
    assert compact == (
        "index=off,lowerdir="
        + ":".join(f"{i}/fs" for i in range(200, 100, -1))
        + f",upperdir={base}/7/fs,workdir={base}/7/work"
    )


def test_compact_single_lowerdir_uses_its_parent() -> None:
    chdir, compact = compact_lowerdir("lowerdir=/x/y/z,upperdir=/u")
    assert (chdir, compact) == ("/x/y", "lowerdir=z,upperdir=/u")


@pytest.mark.parametrize(
    "data",
    [
        "upperdir=/u,workdir=/w",  # nothing to shorten
        "lowerdir=/a/1:/b/2",  # no common parent but /
        "lowerdir=" + ":".join(f"/l/{'x' * 200}{i}" for i in range(40)),  # still over a page
    ],
)
def test_compact_lowerdir_refuses(data: str) -> None:
    with pytest.raises(errors.InvalidArgument):
        compact_lowerdir(data)
