"""cgroup v2 metrics, as ``github.com/containerd/cgroups`` reads them (``v2/manager.go``
``Stat()``, ``v2/utils.go``); see task/stats.py for what we do differently on bad files."""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

from cedana_shim.errors import NotFound
from cedana_shim.task.cgroups import Cgroup
from cedana_shim.task.stats_common import (
    MAX_UINT64,
    MISSING,
    pagesize_bytes,
    parse_kv_lines,
    parse_strict_uint,
    parse_uint,
    rdma_entries,
    read_kv,
    read_text,
)

if TYPE_CHECKING:
    from cedana_shim.api.cgroups.v2 import metrics_pb2 as v2pb

__all__ = ["metrics_v2"]

log = logging.getLogger(__name__)

_V2_CPU_STAT = ("usage_usec", "user_usec", "system_usec", "nr_periods", "nr_throttled")
_V2_MEMORY_STAT = (
    "anon",
    "file",
    "kernel_stack",
    "slab",
    "sock",
    "shmem",
    "file_mapped",
    "file_dirty",
    "file_writeback",
    "anon_thp",
    "inactive_anon",
    "active_anon",
    "inactive_file",
    "active_file",
    "unevictable",
    "slab_reclaimable",
    "slab_unreclaimable",
    "pgfault",
    "pgmajfault",
    "workingset_refault",
    "workingset_activate",
    "workingset_nodereclaim",
    "pgrefill",
    "pgscan",
    "pgsteal",
    "pgactivate",
    "pgdeactivate",
    "pglazyfree",
    "pglazyfreed",
    "thp_fault_alloc",
    "thp_collapse_alloc",
)
_V2_MEMORY_FILES = (
    ("usage", "memory.current"),
    ("usage_limit", "memory.max"),
    ("swap_usage", "memory.swap.current"),
    ("swap_limit", "memory.swap.max"),
)
_V2_MEMORY_EVENTS = ("low", "high", "max", "oom", "oom_kill")


def _v2_single_value(path: str) -> int:
    """utils.go getStatFileContentUint64: "max" is MaxUint64, missing or junk is 0."""
    text = read_text(path)
    if text is None:
        return 0
    text = text.strip()
    if text == "max":
        return MAX_UINT64
    value = parse_uint(text)
    if value is None:
        log.debug("ignoring unparsable cgroup value", extra={"path": path, "value": text})
        return 0
    return value


def _v2_pids_value(path: str) -> int:
    """manager.go getPidValue: a number, "max" as MaxUint64, anything else 0."""
    text = read_text(path)
    if text is None:
        return 0
    text = text.strip()
    if text == "max":
        return MAX_UINT64
    return parse_uint(text) or 0


def _v2_io(path: str, metrics: v2pb.Metrics) -> None:
    metrics.io.SetInParent()
    text = read_text(os.path.join(path, "io.stat"))
    if text is None:
        return
    for line in text.split("\n"):
        parts = line.split(" ")
        if len(parts) < 2:
            continue
        majmin = parts[0].split(":")
        if len(majmin) != 2:
            continue
        major, minor = parse_strict_uint(majmin[0]), parse_strict_uint(majmin[1])
        if major is None or minor is None:
            return  # upstream stops reading io.stat at the first bad device number
        entry = metrics.io.usage.add(major=major, minor=minor)
        for pair in parts[1:]:
            key, sep, raw = pair.partition("=")
            value = parse_strict_uint(raw) if sep and "=" not in raw else None
            if value is not None and key in ("rbytes", "wbytes", "rios", "wios"):
                setattr(entry, key, value)


def _v2_hugetlb(path: str, metrics: v2pb.Metrics) -> None:
    try:
        names = os.listdir(path)
    except OSError as err:
        if err.errno in MISSING:
            return
        raise
    found: dict[str, dict[str, int]] = {}  # page size -> {"max": .., "current": ..}
    for name in names:
        if "hugetlb" not in name or not name.endswith(("max", "current")):
            continue
        parts = name.split(".")
        if len(parts) < 3:
            continue
        text = read_text(os.path.join(path, name))
        if text is None:
            continue
        text = text.strip()
        value = MAX_UINT64 if text == "max" else parse_strict_uint(text)
        if value is None:
            continue
        # hugetlb.<size>.rsvd.max and friends still create the page size's entry.
        values = found.setdefault(parts[1], {})
        if parts[2] in ("max", "current"):
            values[parts[2]] = value
    # Upstream's order is Go map order (random); sort by page size to be deterministic.
    for pagesize in sorted(found, key=lambda s: (pagesize_bytes(s), s)):
        values = found[pagesize]
        metrics.hugetlb.add(
            pagesize=pagesize, max=values.get("max", 0), current=values.get("current", 0)
        )


def metrics_v2(cgroup: Cgroup) -> v2pb.Metrics:
    """The ``io.containerd.cgroups.v2.Metrics`` of a v2 cgroup.

    Raises :class:`~cedana_shim.errors.NotFound` when the cgroup no longer exists.
    """
    from cedana_shim.api.cgroups.v2 import metrics_pb2

    if cgroup.version != 2:
        raise ValueError("metrics_v2 needs a cgroup v2 Cgroup")
    path = cgroup.path
    if not os.path.isdir(path):
        raise NotFound(f"cgroup {path} does not exist")
    controllers = (read_text(os.path.join(path, "cgroup.controllers")) or "").split()
    out: dict[str, int] = {}
    for controller in controllers:
        # Like upstream, cpu.stat is only read when the cpu controller is enabled here,
        # even though the kernel always provides its usage_usec.
        if controller in ("cpu", "memory"):
            stat_path = os.path.join(path, controller + ".stat")
            text = read_text(stat_path)
            if text is not None:
                parse_kv_lines(text, stat_path, out)

    metrics = metrics_pb2.Metrics()
    metrics.pids.SetInParent()
    metrics.pids.current = _v2_pids_value(os.path.join(path, "pids.current"))
    metrics.pids.limit = _v2_pids_value(os.path.join(path, "pids.max"))

    metrics.cpu.SetInParent()
    for name in _V2_CPU_STAT:
        setattr(metrics.cpu, name, out.get(name, 0))
    metrics.cpu.throttled_usec = out.get("throttled_usec", 0)

    metrics.memory.SetInParent()
    for name in _V2_MEMORY_STAT:
        setattr(metrics.memory, name, out.get(name, 0))
    for field_name, file_name in _V2_MEMORY_FILES:
        setattr(metrics.memory, field_name, _v2_single_value(os.path.join(path, file_name)))

    events = read_kv(os.path.join(path, "memory.events"))
    if events:  # upstream leaves memory_events unset when the file is missing or empty
        for name in _V2_MEMORY_EVENTS:
            setattr(metrics.memory_events, name, events.get(name, 0))
        metrics.memory_events.SetInParent()

    _v2_io(path, metrics)

    metrics.rdma.SetInParent()
    for device, handles, objects in rdma_entries(
        read_text(os.path.join(path, "rdma.current")) or ""
    ):
        metrics.rdma.current.add(device=device, hca_handles=handles, hca_objects=objects)
    for device, handles, objects in rdma_entries(read_text(os.path.join(path, "rdma.max")) or ""):
        metrics.rdma.limit.add(device=device, hca_handles=handles, hca_objects=objects)

    _v2_hugetlb(path, metrics)

    if not os.path.isdir(path):
        raise NotFound(f"cgroup {path} was removed")
    return metrics
