"""Where a streamed rootfs diff is kept while it is validated: only in the caller's
spool_dir, unlinked and private, never in $TMPDIR, and never more than it may take."""

from __future__ import annotations

import io
import os
import stat
import tempfile
from pathlib import Path

import pytest
from cedana_shim import errors
from cedana_shim.checkpoint.rootfs_diff import Limits, apply, apply_dir
from support.rootfs_diff import archive, reg, snapshot


def open_files_under(directory: Path) -> list[tuple[str, int]]:
    """(link target, mode) of this process' descriptors on files under ``directory``."""
    found = []
    prefix = str(directory) + "/"
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
            mode = os.stat(f"/proc/self/fd/{fd}").st_mode
        except FileNotFoundError:
            continue  # the descriptor listdir itself used
        if target.startswith(prefix):
            found.append((target, mode))
    return found


class Watched(io.RawIOBase):
    """A non-seekable stream (a decompressor) that looks, at every read, at which
    files the apply has open under the watched directories."""

    def __init__(self, data: bytes, *watch: Path, endless: bool = False) -> None:
        self._data = io.BytesIO(data)
        self._watch = watch
        self._endless = endless
        self.delivered = 0
        self.seen: dict[Path, list[tuple[str, int]]] = {d: [] for d in watch}

    def readable(self) -> bool:
        return True

    def readinto(self, b: memoryview) -> int:  # type: ignore[override]
        for d in self._watch:
            self.seen[d].extend(open_files_under(d))
        n = self._data.readinto(b)
        if n == 0 and self._endless:
            b[: len(b)] = bytes(len(b))
            n = len(b)
        self.delivered += n
        return n


@pytest.fixture
def dirs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> dict[str, Path]:
    """An empty $TMPDIR (watched: nothing may land there), a spool dir, a rootfs."""
    made = {name: tmp_path / name for name in ("tmpdir", "spool", "rootfs")}
    for d in made.values():
        d.mkdir()
    monkeypatch.setenv("TMPDIR", str(made["tmpdir"]))
    monkeypatch.setattr(tempfile, "tempdir", str(made["tmpdir"]))
    return made


def payload() -> bytes:
    return archive(reg("etc/app.conf", b"x" * 300_000, uid=os.getuid(), gid=os.getgid())).read()


def test_a_stream_is_spooled_only_in_spool_dir_unlinked_and_private(
    dirs: dict[str, Path],
) -> None:
    data = payload()
    stream = Watched(data, dirs["tmpdir"], dirs["spool"])
    stats = apply(
        stream, str(dirs["rootfs"]), spool_dir=str(dirs["spool"]), expected_bytes=len(data)
    )
    assert stats.files == 2
    assert (dirs["rootfs"] / "etc/app.conf").read_bytes() == b"x" * 300_000
    assert stream.seen[dirs["tmpdir"]] == []
    spooled = stream.seen[dirs["spool"]]
    assert spooled, "the stream was not spooled in spool_dir"
    for target, mode in spooled:
        assert target.endswith("(deleted)"), f"spool file {target} has a name"
        assert stat.S_IMODE(mode) == 0o600
    assert os.listdir(dirs["tmpdir"]) == []
    assert os.listdir(dirs["spool"]) == []


@pytest.mark.parametrize("entry", [apply, apply_dir])
def test_a_stream_without_spool_dir_is_refused_unread(dirs: dict[str, Path], entry: object) -> None:
    stream = Watched(payload(), dirs["tmpdir"])
    before = snapshot(dirs["rootfs"].parent)
    with pytest.raises(errors.InvalidArgument, match="pass spool_dir="):
        entry(stream, str(dirs["rootfs"]))  # type: ignore[operator]
    assert stream.delivered == 0
    assert snapshot(dirs["rootfs"].parent) == before


def test_expected_bytes_over_the_limit_is_refused_unread(dirs: dict[str, Path]) -> None:
    stream = Watched(payload(), dirs["spool"])
    before = snapshot(dirs["rootfs"].parent)
    with pytest.raises(errors.InvalidArgument, match="5000 bytes uncompressed, over the 1000"):
        apply(
            stream,
            str(dirs["rootfs"]),
            limits=Limits(max_archive_bytes=1000),
            spool_dir=str(dirs["spool"]),
            expected_bytes=5000,
        )
    assert stream.delivered == 0
    assert snapshot(dirs["rootfs"].parent) == before


def test_expected_bytes_over_the_free_space_is_refused_unread(dirs: dict[str, Path]) -> None:
    st = os.statvfs(dirs["spool"])
    # Far beyond what this filesystem has free, however busy the machine is.
    expected = st.f_bavail * st.f_frsize + (64 << 30)
    stream = Watched(payload(), dirs["spool"])
    before = snapshot(dirs["rootfs"].parent)
    with pytest.raises(errors.ResourceExhausted) as info:
        apply(
            stream,
            str(dirs["rootfs"]),
            limits=Limits(max_archive_bytes=1 << 62),
            spool_dir=str(dirs["spool"]),
            expected_bytes=expected,
        )
    message = str(info.value)
    assert str(dirs["spool"]) in message
    assert f"{expected} bytes" in message and "bytes free" in message
    assert "Free space there" in message
    assert stream.delivered == 0
    assert stream.seen[dirs["spool"]] == []
    assert snapshot(dirs["rootfs"].parent) == before


def test_a_stream_longer_than_expected_is_cut_off(dirs: dict[str, Path]) -> None:
    expected = 64 << 10
    stream = Watched(b"", endless=True)
    before = snapshot(dirs["rootfs"].parent)
    with pytest.raises(errors.DataLoss, match=f"longer than the {expected} bytes"):
        apply(stream, str(dirs["rootfs"]), spool_dir=str(dirs["spool"]), expected_bytes=expected)
    assert stream.delivered <= expected + 1
    assert snapshot(dirs["rootfs"].parent) == before


def test_a_stream_over_the_limit_is_cut_off_without_expected_bytes(
    dirs: dict[str, Path],
) -> None:
    stream = Watched(b"", endless=True)
    with pytest.raises(errors.InvalidArgument, match="over the 100000-byte limit"):
        apply(
            stream,
            str(dirs["rootfs"]),
            limits=Limits(max_archive_bytes=100_000),
            spool_dir=str(dirs["spool"]),
        )
    assert stream.delivered <= 100_001


def test_a_path_or_a_seekable_file_needs_no_spool(dirs: dict[str, Path]) -> None:
    data = payload()
    path = dirs["spool"].parent / "diff.tar"
    path.write_bytes(data)
    assert apply(str(path), str(dirs["rootfs"])).files == 2
    with open(path, "rb") as f:
        assert apply_dir(f, str(dirs["rootfs"])).files == 2
    assert os.listdir(dirs["tmpdir"]) == []


def test_missing_spool_dir_is_not_found(dirs: dict[str, Path]) -> None:
    with pytest.raises(errors.NotFound, match=r"spool directory .*nowhere does not exist"):
        apply(Watched(payload()), str(dirs["rootfs"]), spool_dir=str(dirs["spool"] / "nowhere"))
