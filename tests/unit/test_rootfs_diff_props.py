"""Property test: damaged archives fail only with the diff's own error classes and
never write outside their destination. (Random trees round-tripping with their owners
need root: tests/privileged/test_rootfs_diff_round_trip.py.)"""

from __future__ import annotations

import contextlib
import io
import os
import tempfile
from pathlib import Path

from cedana_shim import errors
from cedana_shim.checkpoint.rootfs_diff import apply_dir, capture_dir
from hypothesis import given, settings
from hypothesis import strategies as st
from support.examples import examples
from support.rootfs_diff import snapshot

_SAMPLE: bytes | None = None


def _sample_archive(tmp: Path) -> bytes:
    global _SAMPLE
    if _SAMPLE is None:
        src = tmp / "sample"
        (src / "d/e").mkdir(parents=True)
        (src / "d/e/f").write_bytes(b"content" * 100)
        (src / ("long-" + "n" * 120)).write_text("pax path")
        (src / "d/l").symlink_to("../x")
        os.link(src / "d/e/f", src / "d/h")
        buf = io.BytesIO()
        capture_dir(str(src), buf)
        _SAMPLE = buf.getvalue()
    return _SAMPLE


@settings(max_examples=examples(150), deadline=None)
@given(
    edits=st.lists(st.tuples(st.integers(0, 10**6), st.integers(0, 255)), min_size=1, max_size=4)
)
def test_damaged_archive_fails_cleanly(edits: list[tuple[int, int]]) -> None:
    """Any byte edits: apply succeeds or raises a ShimError, and never writes
    outside its destination."""
    with tempfile.TemporaryDirectory() as tmp:
        data = bytearray(_sample_archive(Path(tmp)))
        for pos, value in edits:
            data[pos % len(data)] = value
        dest = Path(tmp, "box", "dest")
        dest.mkdir(parents=True)
        outside_before = snapshot(Path(tmp), ignore=["box"])
        with contextlib.suppress(errors.ShimError):
            apply_dir(io.BytesIO(bytes(data)), str(dest))
        assert snapshot(Path(tmp), ignore=["box"]) == outside_before
        assert os.listdir(Path(tmp, "box")) == ["dest"]
