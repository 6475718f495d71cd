"""CRIU's stats-dump / stats-restore images: read back, and never a failure."""

from __future__ import annotations

import struct
from pathlib import Path

from cedana_shim.api.criu import stats_pb2
from cedana_shim.runtime.criu_stats import (
    DUMP_FILE,
    IMG_SERVICE_MAGIC,
    RESTORE_FILE,
    STATS_MAGIC,
    dump_stats,
    restore_stats,
)
from hypothesis import given
from hypothesis import strategies as st


def _image(message: stats_pb2.Stats) -> bytes:
    body = message.SerializeToString()
    return struct.pack("<III", IMG_SERVICE_MAGIC, STATS_MAGIC, len(body)) + body


def _dump_message() -> stats_pb2.Stats:
    stats = stats_pb2.Stats()
    d = stats.dump
    d.freezing_time, d.frozen_time, d.memdump_time, d.memwrite_time = 5400, 92300, 500, 100
    d.pages_scanned, d.pages_skipped_parent, d.pages_written, d.pages_lazy = 47, 0, 33, 0
    return stats


def test_a_dump_image_reads_back_in_seconds(tmp_path: Path) -> None:
    (tmp_path / DUMP_FILE).write_bytes(_image(_dump_message()))
    assert dump_stats(str(tmp_path)) == {
        "freezing_s": 0.0054,
        "frozen_s": 0.0923,
        "memdump_s": 0.0005,
        "memwrite_s": 0.0001,
        "pages_scanned": 47,
        "pages_written": 33,
        "pages_skipped_parent": 0,
        "pages_lazy": 0,
    }


def test_a_restore_image_reads_back_in_seconds(tmp_path: Path) -> None:
    stats = stats_pb2.Stats()
    r = stats.restore
    r.pages_compared, r.pages_skipped_cow, r.forking_time, r.restore_time = 9, 2, 200, 85900
    r.pages_restored = 31
    (tmp_path / RESTORE_FILE).write_bytes(_image(stats))
    assert restore_stats(str(tmp_path)) == {
        "forking_s": 0.0002,
        "restore_s": 0.0859,
        "pages_restored": 31,
        "pages_compared": 9,
        "pages_skipped_cow": 2,
    }


def test_a_missing_file_or_the_other_kind_gives_nothing(tmp_path: Path) -> None:
    assert dump_stats(str(tmp_path)) == {}
    (tmp_path / RESTORE_FILE).write_bytes(_image(_dump_message()))
    assert restore_stats(str(tmp_path)) == {}  # a dump's figures under the restore's name


def test_a_wrong_magic_or_a_long_length_gives_nothing(tmp_path: Path) -> None:
    good = _image(_dump_message())
    (tmp_path / DUMP_FILE).write_bytes(struct.pack("<I", 0x12345678) + good[4:])
    assert dump_stats(str(tmp_path)) == {}
    (tmp_path / DUMP_FILE).write_bytes(good[:8] + struct.pack("<I", 10_000) + good[12:])
    assert dump_stats(str(tmp_path)) == {}


@given(st.binary(max_size=200))
def test_any_bytes_after_a_valid_header_never_raise(body: bytes) -> None:
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        header = struct.pack("<III", IMG_SERVICE_MAGIC, STATS_MAGIC, len(body))
        for name in (DUMP_FILE, RESTORE_FILE):
            (Path(tmp) / name).write_bytes(header + body)
        assert isinstance(dump_stats(tmp), dict)
        assert isinstance(restore_stats(tmp), dict)
