"""CRIU's own statistics of a dump or a restore, read from its work dir.

CRIU writes ``stats-dump`` / ``stats-restore`` into the work dir runc hands it
(``--work-path``): two magic numbers, a 4-byte little-endian length, and one
protobuf message (protos/local/criu_stats.proto). They split CRIU's part of a
checkpoint into freezing, frozen, memory dump and memory write times, which is
what tells a slow dump on a busy node from a slow shim around it.

A missing or malformed file yields ``{}``: statistics never fail a checkpoint.
"""

from __future__ import annotations

import os
import struct
from collections.abc import Mapping
from typing import Any

from google.protobuf.message import DecodeError

IMG_SERVICE_MAGIC = 0x55105940
STATS_MAGIC = 0x57093306
HEADER = struct.Struct("<III")  # service magic, stats magic, entry length
MAX_BYTES = 4096  # the message is a few dozen bytes

DUMP_FILE = "stats-dump"
RESTORE_FILE = "stats-restore"


def _read(work_dir: str, name: str) -> bytes:
    try:
        with open(os.path.join(work_dir, name), "rb") as f:
            data = f.read(MAX_BYTES + 1)
    except OSError:
        return b""
    if len(data) < HEADER.size or len(data) > MAX_BYTES:
        return b""
    service, magic, length = HEADER.unpack_from(data)
    if service != IMG_SERVICE_MAGIC or magic != STATS_MAGIC or length > len(data) - HEADER.size:
        return b""
    return data[HEADER.size : HEADER.size + length]


def _seconds(microseconds: int) -> float:
    return round(microseconds / 1e6, 4)


def _entry(work_dir: str, name: str, field: str) -> Any:
    """The ``field`` ("dump" or "restore") of the stats image ``name``, or None."""
    from ..api.criu import stats_pb2

    stats = stats_pb2.Stats()
    try:
        stats.ParseFromString(_read(work_dir, name))
    except DecodeError:
        return None
    return getattr(stats, field) if stats.HasField(field) else None


def dump_stats(work_dir: str) -> dict[str, float | int]:
    """CRIU's figures for the dump whose work dir this is (times in seconds)."""
    d = _entry(work_dir, DUMP_FILE, "dump")
    if d is None:
        return {}
    return {
        "freezing_s": _seconds(d.freezing_time),
        "frozen_s": _seconds(d.frozen_time),
        "memdump_s": _seconds(d.memdump_time),
        "memwrite_s": _seconds(d.memwrite_time),
        "pages_scanned": d.pages_scanned,
        "pages_written": d.pages_written,
        "pages_skipped_parent": d.pages_skipped_parent,
        "pages_lazy": d.pages_lazy,
    }


def restore_stats(work_dir: str) -> dict[str, float | int]:
    """CRIU's figures for the restore whose work dir this is (times in seconds)."""
    r = _entry(work_dir, RESTORE_FILE, "restore")
    if r is None:
        return {}
    return {
        "forking_s": _seconds(r.forking_time),
        "restore_s": _seconds(r.restore_time),
        "pages_restored": r.pages_restored,
        "pages_compared": r.pages_compared,
        "pages_skipped_cow": r.pages_skipped_cow,
    }


def encode_dump_stats(figures: Mapping[str, Any]) -> bytes:
    """The ``stats-dump`` image that :func:`dump_stats` read ``figures`` from, for tools
    that read CRIU's own (a Kubernetes checkpoint archive carries it); the times are
    back in microseconds, to the precision they were kept with."""
    from ..api.criu import stats_pb2

    def number(key: str) -> int:
        value = figures.get(key)
        if isinstance(value, bool) or not isinstance(value, int | float) or value < 0:
            return 0
        return round(value * 1e6) if key.endswith("_s") else int(value)

    dump = stats_pb2.DumpStats(
        freezing_time=number("freezing_s"),
        frozen_time=number("frozen_s"),
        memdump_time=number("memdump_s"),
        memwrite_time=number("memwrite_s"),
        pages_scanned=number("pages_scanned"),
        pages_skipped_parent=number("pages_skipped_parent"),
        pages_written=number("pages_written"),
        pages_lazy=number("pages_lazy"),
    )
    body = stats_pb2.Stats(dump=dump).SerializeToString()
    return HEADER.pack(IMG_SERVICE_MAGIC, STATS_MAGIC, len(body)) + body
