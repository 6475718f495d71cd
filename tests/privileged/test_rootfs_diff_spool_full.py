"""A rootfs diff spooled into a really small filesystem (a 1 MiB tmpfs): refused up
front when the checkpoint says it will not fit, ResourceExhausted when a stream
without a recorded size fills it; either way nothing is applied and nothing stays."""

from __future__ import annotations

import io
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from cedana_shim import errors
from cedana_shim.checkpoint.rootfs_diff import apply
from cedana_shim.runtime.mount import Mount, mount_all, unmount_all
from support.rootfs_diff import Unseekable, archive, reg, snapshot


@pytest.fixture
def small_spool(tmp_path: Path) -> Iterator[Path]:
    spool = tmp_path / "spool"
    spool.mkdir()
    mount_all([Mount("tmpfs", "tmpfs", "", ("size=1m", "mode=0700"))], str(spool))
    try:
        yield spool
    finally:
        unmount_all(str(spool))


@pytest.mark.parametrize("recorded", [True, False], ids=["size-recorded", "size-unknown"])
def test_a_diff_larger_than_the_spool_filesystem(
    tmp_path: Path, small_spool: Path, recorded: bool
) -> None:
    data = archive(reg("big", os.urandom(4 << 20))).getvalue()
    rootfs = tmp_path / "rootfs"
    rootfs.mkdir()
    stream = Unseekable(data)
    expected = len(data) if recorded else None
    with pytest.raises(errors.ResourceExhausted) as info:
        apply(
            io.BufferedReader(stream),
            str(rootfs),
            spool_dir=str(small_spool),
            expected_bytes=expected,
        )
    assert str(small_spool) in str(info.value)
    if recorded:
        assert stream.delivered == 0
        assert "bytes free" in str(info.value)
    assert snapshot(rootfs) == {}
    assert os.listdir(small_spool) == []
    st = os.statvfs(small_spool)
    assert st.f_bfree == st.f_blocks  # the spool's blocks were given back
