"""Property test: random trees, with any owners, modes, mtimes, xattrs, hard links and
non-UTF-8 names, survive capture_dir -> apply_dir exactly (chown: needs root)."""

from __future__ import annotations

import io
import os
import tempfile
from dataclasses import dataclass, field
from random import Random

from cedana_shim.checkpoint.rootfs_diff import apply_dir, capture_dir
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from support.rootfs_diff import diff_snapshots, snapshot

_CHARS = st.characters(blacklist_categories=("Cs",), blacklist_characters="/\x00")
names = st.one_of(
    st.text(_CHARS, min_size=1, max_size=12),
    # Not UTF-8: names are bytes on Linux and must survive as bytes.
    st.binary(min_size=1, max_size=8)
    .filter(lambda b: b"/" not in b and b"\0" not in b)
    .map(os.fsdecode),
).filter(lambda n: n not in (".", "..") and len(os.fsencode(n)) <= 255)
modes = st.integers(0, 0o7777)
ids = st.sampled_from([0, 1, 1000, 65534, 100000])
mtimes = st.integers(-(10**18), 4 * 10**18)  # 1938 .. 2096, ns precision


@dataclass
class Meta:
    mode: int
    uid: int
    gid: int
    mtime_ns: int


@dataclass
class File:
    meta: Meta
    data: bytes
    xattrs: dict[str, bytes] = field(default_factory=dict)


@dataclass
class Link:
    meta: Meta
    target: str


@dataclass
class Dir:
    meta: Meta
    children: dict[str, File | Link | Dir]


metas = st.builds(Meta, modes, ids, ids, mtimes)
# Big enough to take the copy_file_range path, cheap for Hypothesis to generate.
big = st.builds(
    lambda n, seed: Random(seed).randbytes(n), st.integers(262_145, 300_000), st.integers(0, 2**32)
)
files = st.builds(
    File,
    metas,
    st.one_of(st.binary(max_size=600), big),
    # '=' cannot be in a pax key (see xattr_allowed); such names are not captured.
    st.dictionaries(
        names.filter(lambda n: "=" not in n).map(lambda n: "user." + n),
        st.binary(max_size=40),
        max_size=2,
    ),
)
links = st.builds(Link, metas, st.text(_CHARS | st.just("/"), min_size=1, max_size=40))
trees = st.recursive(
    files | links,
    lambda kids: st.builds(Dir, metas, st.dictionaries(names, kids, max_size=5)),
    max_leaves=25,
)


def materialize(node: File | Link | Dir, path: bytes, made: list[bytes]) -> None:
    m = node.meta
    if isinstance(node, File):
        with open(path, "wb") as f:
            f.write(node.data)
        for key, value in node.xattrs.items():
            os.setxattr(path, key.encode("utf-8", "surrogateescape"), value)
        made.append(path)
    elif isinstance(node, Link):
        os.symlink(node.target, path)
    else:
        os.mkdir(path)
        for name, child in node.children.items():
            materialize(child, os.path.join(path, os.fsencode(name)), made)
    os.chown(path, m.uid, m.gid, follow_symlinks=False)
    if not isinstance(node, Link):
        os.chmod(path, m.mode)  # after chown, which clears setuid/setgid
    os.utime(path, ns=(m.mtime_ns, m.mtime_ns), follow_symlinks=False)


@settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
)
@given(
    top=st.dictionaries(names, trees, max_size=6),
    hardlinks=st.lists(st.tuples(st.integers(0, 1000), names), max_size=3),
    via_file=st.booleans(),
)
def test_random_trees_round_trip(
    top: dict[str, File | Link | Dir], hardlinks: list[tuple[int, str]], via_file: bool
) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        src, dest = os.path.join(tmp, "src"), os.path.join(tmp, "dest")
        os.mkdir(src)
        os.mkdir(dest)
        made: list[bytes] = []
        for name, node in top.items():
            materialize(node, os.path.join(os.fsencode(src), os.fsencode(name)), made)
        for index, name in hardlinks:
            link = os.path.join(os.fsencode(src), b"hl-" + os.fsencode(name)[:200])
            if made and not os.path.lexists(link):
                os.link(made[index % len(made)], link)
        expected = snapshot(src)
        if via_file:  # descriptors both ways: copy_file_range/sendfile
            archive = os.path.join(tmp, "diff.tar")
            written = capture_dir(src, archive)
            applied = apply_dir(archive, dest)
        else:
            buf = io.BytesIO()
            written = capture_dir(src, buf)
            buf.seek(0)
            applied = apply_dir(buf, dest)
        assert diff_snapshots(expected, snapshot(dest)) == []
        assert written == applied
        assert applied.files + applied.dirs + applied.symlinks == len(expected)
