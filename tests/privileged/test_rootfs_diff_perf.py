"""Throughput: a layer of 10k small files and one 256 MiB file, captured and applied.

Everything lives on a tmpfs mounted for the test, so this measures the diff
code and the kernel, not the disk: on a shared VM whose ext4 is mounted with
online ``discard``, file creation alone varies tenfold from run to run. Bounds
are loose; the timings are printed (``pytest -s``) for the record.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

from cedana_shim.checkpoint.rootfs_diff import apply, capture
from cedana_shim.runtime.mount import Mount, mount_all, unmount_all
from support.rootfs_diff import overlay

SMALL_FILES = 10_000
BIG = 256 << 20


def test_10k_files_and_256mib(tmp_path: Path) -> None:
    fs = tmp_path / "fs"
    fs.mkdir()
    mount_all([Mount("tmpfs", "tmpfs", "", ("size=1200m",))], str(fs))
    try:
        _measure(fs)
    finally:
        unmount_all(str(fs))


def _measure(tmp_path: Path) -> None:
    upper = tmp_path / "layer"
    upper.mkdir()
    chunk = os.urandom(1 << 20)
    with open(upper / "big.bin", "wb") as f:
        for _ in range(BIG // len(chunk)):
            f.write(chunk)
    for i in range(SMALL_FILES):
        d = upper / f"d{i // 100:03d}"
        if i % 100 == 0:
            d.mkdir()
        (d / f"f{i}").write_bytes(chunk[i : i + 200 + i % 1000])
    archive = tmp_path / "diff.tar"
    (tmp_path / "lower").mkdir()

    t0 = time.perf_counter()
    captured = capture(str(upper), str(archive))
    t1 = time.perf_counter()
    with overlay(tmp_path, "new", tmp_path / "lower") as (merged, _):
        t2 = time.perf_counter()
        applied = apply(str(archive), str(merged))
        t3 = time.perf_counter()
        assert os.stat(merged / "big.bin").st_size == BIG
    print(
        f"\nrootfs diff: {captured.files} files, {captured.bytes / 2**20:.0f} MiB, "
        f"archive {archive.stat().st_size / 2**20:.0f} MiB: "
        f"capture {t1 - t0:.2f}s, apply into overlay {t3 - t2:.2f}s"
    )
    assert captured.files == applied.files == SMALL_FILES + 1
    assert t1 - t0 < 15
    assert t3 - t2 < 20
