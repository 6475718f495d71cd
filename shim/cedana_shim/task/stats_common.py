"""Parsing shared by the cgroup v1 and v2 metrics readers (task/stats_v1.py, stats_v2.py).

The parsers follow ``github.com/containerd/cgroups``' own (``utils.go``): where a
number is junk the value is skipped, never guessed.
"""

from __future__ import annotations

import errno
import logging
import os
import re

__all__ = [
    "DIGITS",
    "MAX_UINT32",
    "MAX_UINT64",
    "MISSING",
    "block_devices",
    "hugetlb_sizes",
    "pagesize_bytes",
    "parse_kv_lines",
    "parse_strict_uint",
    "parse_uint",
    "rdma_entries",
    "read_kv",
    "read_text",
    "read_uint",
]

log = logging.getLogger(__name__)

MAX_UINT64 = (1 << 64) - 1
MAX_UINT32 = (1 << 32) - 1

# A cgroup file of a cgroup being removed fails with ENODEV rather than ENOENT.
MISSING = frozenset((errno.ENOENT, errno.ENODEV, errno.ENOTDIR))
DIGITS = re.compile(r"[0-9]+")
_NEGATIVE = re.compile(r"-[0-9]+")


def read_text(path: str) -> str | None:
    """The file's text, or None when it does not exist (controller absent, cgroup gone)."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError as err:
        if err.errno in MISSING:
            return None
        raise


def parse_uint(text: str, limit: int = MAX_UINT64) -> int | None:
    """Go's cgroups ``parseUint``: negative numbers (e.g. ``-1``) read as 0; junk is None."""
    if DIGITS.fullmatch(text):
        value = int(text)
        return value if value <= limit else None
    if _NEGATIVE.fullmatch(text):
        return 0
    return None


def parse_strict_uint(text: str) -> int | None:
    """Go's ``strconv.ParseUint``, which some upstream readers call directly: no sign."""
    if DIGITS.fullmatch(text):
        value = int(text)
        return value if value <= MAX_UINT64 else None
    return None


def read_uint(path: str) -> int | None:
    text = read_text(path)
    if text is None:
        return None
    value = parse_uint(text.strip())
    if value is None:
        log.debug("ignoring unparsable cgroup value", extra={"path": path, "value": text.strip()})
    return value


def parse_kv_lines(text: str, path: str, out: dict[str, int]) -> None:
    for line in text.splitlines():
        parts = line.split()
        value = parse_uint(parts[1]) if len(parts) == 2 else None
        if value is None:
            if line.strip():
                log.debug("ignoring malformed cgroup stat line", extra={"path": path, "line": line})
            continue
        out[parts[0]] = value


def read_kv(path: str) -> dict[str, int] | None:
    text = read_text(path)
    if text is None:
        return None
    out: dict[str, int] = {}
    parse_kv_lines(text, path, out)
    return out


_PAGESIZE_UNITS = {"KB": 1 << 10, "MB": 1 << 20, "GB": 1 << 30, "TB": 1 << 40, "PB": 1 << 50}
_PAGESIZE = re.compile(r"([0-9]+)(KB|MB|GB|TB|PB)")


def pagesize_bytes(pagesize: str) -> int:
    match = _PAGESIZE.fullmatch(pagesize)
    if match is None:
        return 0
    return int(match.group(1)) * _PAGESIZE_UNITS[match.group(2)]


def _rdma_value(text: str) -> int | None:
    if text == "max":
        return MAX_UINT32
    return parse_uint(text, MAX_UINT32)


def rdma_entries(text: str) -> list[tuple[str, int, int]]:
    """rdma.go/v2 utils.go toRdmaEntry: (device, hca_handles, hca_objects) per line.

    Lines look like "mlx5_0 hca_handle=2 hca_object=max"; anything else is skipped.
    """
    entries: list[tuple[str, int, int]] = []
    for line in text.split("\n"):
        parts = line.split()
        if len(parts) != 3:
            continue
        values: dict[str, int] = {}
        for kv in parts[1:]:
            key, sep, raw = kv.partition("=")
            value = _rdma_value(raw) if sep and "=" not in raw else None
            if value is not None:
                values[key] = value
        entries.append((parts[0], values.get("hca_handle", 0), values.get("hca_object", 0)))
    return entries


def block_devices(proc: str) -> dict[tuple[int, int], str]:
    """(major, minor) -> /dev/<name> from /proc/partitions, first occurrence wins."""
    text = read_text(os.path.join(proc, "partitions"))
    devices: dict[tuple[int, int], str] = {}
    if text is None:
        return devices
    for line in text.splitlines()[2:]:  # header line, then a blank line
        fields = line.split()
        if len(fields) < 4 or not (DIGITS.fullmatch(fields[0]) and DIGITS.fullmatch(fields[1])):
            continue
        devices.setdefault((int(fields[0]), int(fields[1])), "/dev/" + fields[3])
    return devices


def hugetlb_sizes(directory: str, marker: str) -> list[str]:
    """Page sizes ("2MB", "1GB") that have a ``hugetlb.<size>.<marker>`` file.

    Upstream lists /sys/kernel/mm/hugepages instead; the kernel creates exactly one
    file set per hstate, so the sizes are the same, and sorting by the sysfs directory
    name ("hugepages-<kB>kB") reproduces upstream's order.
    """
    try:
        names = os.listdir(directory)
    except OSError as err:
        if err.errno in MISSING:
            return []
        raise
    sizes = {
        parts[1]
        for parts in (name.split(".") for name in names)
        if len(parts) >= 3 and parts[0] == "hugetlb" and parts[2] == marker
    }
    return sorted(sizes, key=lambda s: f"hugepages-{pagesize_bytes(s) // 1024}kB")
