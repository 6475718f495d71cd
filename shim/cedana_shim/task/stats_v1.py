"""cgroup v1 metrics, as ``github.com/containerd/cgroups`` reads them (``memory.go``,
``cpu.go``, ``cpuacct.go``, ``pids.go``, ``blkio.go``, ``hugetlb.go``, ``rdma.go``, called
with ``IgnoreNotExist``); see task/stats.py for what we do differently on bad files."""

from __future__ import annotations

import logging
import os
import re
from typing import TYPE_CHECKING

from cedana_shim.errors import NotFound
from cedana_shim.task.cgroups import Cgroup
from cedana_shim.task.stats_common import (
    block_devices,
    hugetlb_sizes,
    parse_strict_uint,
    parse_uint,
    rdma_entries,
    read_kv,
    read_text,
    read_uint,
)

if TYPE_CHECKING:
    from google.protobuf.internal.containers import RepeatedCompositeFieldContainer

    from cedana_shim.api.cgroups.v1 import metrics_pb2 as v1pb

__all__ = ["metrics_v1"]

log = logging.getLogger(__name__)

# USER_HZ for cpuacct.stat; upstream hard-codes it too (ticks.go), it is 100 on Linux.
CLOCK_TICKS = 100
_NANOSECONDS_PER_SECOND = 1_000_000_000

# memory.stat key for each MemoryStat field (memory.go parseStats).
_V1_MEMORY_STAT = (
    ("cache", "cache"),
    ("rss", "rss"),
    ("rss_huge", "rss_huge"),
    ("mapped_file", "mapped_file"),
    ("dirty", "dirty"),
    ("writeback", "writeback"),
    ("pg_pg_in", "pgpgin"),
    ("pg_pg_out", "pgpgout"),
    ("pg_fault", "pgfault"),
    ("pg_maj_fault", "pgmajfault"),
    ("inactive_anon", "inactive_anon"),
    ("active_anon", "active_anon"),
    ("inactive_file", "inactive_file"),
    ("active_file", "active_file"),
    ("unevictable", "unevictable"),
    ("hierarchical_memory_limit", "hierarchical_memory_limit"),
    ("hierarchical_swap_limit", "hierarchical_memsw_limit"),
    ("total_cache", "total_cache"),
    ("total_rss", "total_rss"),
    ("total_rss_huge", "total_rss_huge"),
    ("total_mapped_file", "total_mapped_file"),
    ("total_dirty", "total_dirty"),
    ("total_writeback", "total_writeback"),
    ("total_pg_pg_in", "total_pgpgin"),
    ("total_pg_pg_out", "total_pgpgout"),
    ("total_pg_fault", "total_pgfault"),
    ("total_pg_maj_fault", "total_pgmajfault"),
    ("total_inactive_anon", "total_inactive_anon"),
    ("total_active_anon", "total_active_anon"),
    ("total_inactive_file", "total_inactive_file"),
    ("total_active_file", "total_active_file"),
    ("total_unevictable", "total_unevictable"),
)

# MemoryEntry field -> file name prefix (memory.go Stat). The v1 "unlimited" limit is
# reported raw (9223372036854771712 on 4 KiB pages), exactly as upstream does.
_V1_MEMORY_ENTRIES = (
    ("usage", "memory."),
    ("swap", "memory.memsw."),
    ("kernel", "memory.kmem."),
    ("kernel_tcp", "memory.kmem.tcp."),
)
_V1_MEMORY_ENTRY_FILES = (
    ("usage", "usage_in_bytes"),
    ("max", "max_usage_in_bytes"),
    ("failcnt", "failcnt"),
    ("limit", "limit_in_bytes"),
)

# Lstat'ed to decide between the CFQ files and the throttle.* fallback (blkio.go).
_V1_BLKIO_CFQ_PROBE = "blkio.io_serviced_recursive"
_V1_BLKIO_CFQ = (
    ("sectors_recursive", "sectors_recursive"),
    ("io_service_bytes_recursive", "io_service_bytes_recursive"),
    ("io_serviced_recursive", "io_serviced_recursive"),
    ("io_queued_recursive", "io_queued_recursive"),
    ("io_service_time_recursive", "io_service_time_recursive"),
    ("io_wait_time_recursive", "io_wait_time_recursive"),
    ("io_merged_recursive", "io_merged_recursive"),
    ("io_time_recursive", "time_recursive"),
)
_V1_BLKIO_THROTTLE = (
    ("io_serviced_recursive", "throttle.io_serviced"),
    ("io_service_bytes_recursive", "throttle.io_service_bytes"),
)


def _controller_dir(cgroup: Cgroup, name: str) -> str | None:
    directory = cgroup.controller_dir(name)
    if directory is None or not os.path.isdir(directory):
        return None
    return directory


def _v1_present(cgroup: Cgroup) -> bool:
    # The memory directory decides: a container may share other hierarchies' cgroups
    # with its parent (those never go away), and runc removes memory with the rest.
    memory = cgroup.controllers.get("memory")
    if memory is not None:
        return os.path.isdir(memory)
    return any(os.path.isdir(d) for d in cgroup.dirs)


def _v1_pids(directory: str, metrics: v1pb.Metrics) -> None:
    current = read_uint(os.path.join(directory, "pids.current"))
    max_text = read_text(os.path.join(directory, "pids.max"))
    if current is None and max_text is None:
        return
    metrics.pids.SetInParent()
    metrics.pids.current = current or 0
    if max_text is not None and max_text.strip() != "max":
        # v1 reports "max" (no limit) as 0; only v2 uses MaxUint64 (pids.go).
        metrics.pids.limit = parse_uint(max_text.strip()) or 0


def _v1_cpu(directory: str, metrics: v1pb.Metrics) -> None:
    stat = read_kv(os.path.join(directory, "cpu.stat"))
    if stat is None:
        return
    throttling = metrics.cpu.throttling
    throttling.periods = stat.get("nr_periods", 0)
    throttling.throttled_periods = stat.get("nr_throttled", 0)
    throttling.throttled_time = stat.get("throttled_time", 0)


def _v1_cpuacct(directory: str, metrics: v1pb.Metrics) -> None:
    usage = metrics.cpu.usage
    stat = read_kv(os.path.join(directory, "cpuacct.stat"))
    if stat is not None:
        # cpuacct.stat counts USER_HZ ticks; the proto wants nanoseconds. Go computes
        # this in uint64 and would wrap after ~1.8e10 ticks; we do not reproduce that.
        usage.user = stat.get("user", 0) * _NANOSECONDS_PER_SECOND // CLOCK_TICKS
        usage.kernel = stat.get("system", 0) * _NANOSECONDS_PER_SECOND // CLOCK_TICKS
    total = read_uint(os.path.join(directory, "cpuacct.usage"))
    if total is not None:
        usage.total = total
    percpu_path = os.path.join(directory, "cpuacct.usage_percpu")
    percpu = read_text(percpu_path)
    if percpu is not None:
        values = [parse_strict_uint(v) for v in percpu.split()]
        if any(v is None for v in values):
            log.debug("ignoring malformed per-cpu usage", extra={"path": percpu_path})
        else:
            usage.per_cpu.extend(v for v in values if v is not None)


def _v1_memory(directory: str, metrics: v1pb.Metrics) -> None:
    memory = metrics.memory
    # Upstream always sends all four entries, zero or not.
    for entry_name, _ in _V1_MEMORY_ENTRIES:
        getattr(memory, entry_name).SetInParent()
    stat = read_kv(os.path.join(directory, "memory.stat"))
    if stat is not None:
        for field_name, key in _V1_MEMORY_STAT:
            setattr(memory, field_name, stat.get(key, 0))
    oom = read_kv(os.path.join(directory, "memory.oom_control"))
    if oom is not None:
        metrics.memory_oom_control.oom_kill_disable = oom.get("oom_kill_disable", 0)
        metrics.memory_oom_control.under_oom = oom.get("under_oom", 0)
        metrics.memory_oom_control.oom_kill = oom.get("oom_kill", 0)
        metrics.memory_oom_control.SetInParent()
    for entry_name, prefix in _V1_MEMORY_ENTRIES:
        entry = getattr(memory, entry_name)
        for field_name, suffix in _V1_MEMORY_ENTRY_FILES:
            value = read_uint(os.path.join(directory, prefix + suffix))
            if value is not None:
                setattr(entry, field_name, value)


def _v1_blkio_entries(
    path: str,
    devices: dict[tuple[int, int], str],
    out: RepeatedCompositeFieldContainer[v1pb.BlkIOEntry],
) -> int | None:
    """Append the entries of ``blkio.*`` file ``path`` to ``out``; None if it is missing."""
    text = read_text(path)
    if text is None:
        return None
    added = 0
    for line in text.splitlines():
        # "MAJ:MIN Op value" or "MAJ:MIN value"; a trailing "Total N" line is dropped.
        fields = [f for f in re.split(r"[ :]", line) if f]
        if len(fields) == 2 and fields[0] == "Total":
            continue
        major = parse_strict_uint(fields[0]) if len(fields) in (3, 4) else None
        minor = parse_strict_uint(fields[1]) if major is not None else None
        value = parse_strict_uint(fields[-1]) if minor is not None else None
        if major is None or minor is None or value is None:
            if fields:
                log.debug("ignoring malformed blkio line", extra={"path": path, "line": line})
            continue
        out.add(
            device=devices.get((major, minor), ""),
            major=major,
            minor=minor,
            op=fields[2] if len(fields) == 4 else "",
            value=value,
        )
        added += 1
    return added


def _v1_blkio(directory: str, metrics: v1pb.Metrics, proc: str) -> None:
    blkio = metrics.blkio
    blkio.SetInParent()
    devices = block_devices(proc)
    if os.path.lexists(os.path.join(directory, _V1_BLKIO_CFQ_PROBE)):
        size = 0
        for field_name, name in _V1_BLKIO_CFQ:
            path = os.path.join(directory, "blkio." + name)
            size += _v1_blkio_entries(path, devices, getattr(blkio, field_name)) or 0
        if size > 0:
            return
    # The kernel may have CFQ while this cgroup's devices use another scheduler; then
    # only the throttle.* counters (not recursive, despite the field names) have data.
    for field_name, name in _V1_BLKIO_THROTTLE:
        path = os.path.join(directory, "blkio." + name)
        _v1_blkio_entries(path, devices, getattr(blkio, field_name))


def _v1_hugetlb(directory: str, metrics: v1pb.Metrics) -> None:
    for size in hugetlb_sizes(directory, "usage_in_bytes"):
        stat = metrics.hugetlb.add(pagesize=size)
        for field_name, suffix in (
            ("usage", "usage_in_bytes"),
            ("max", "max_usage_in_bytes"),
            ("failcnt", "failcnt"),
        ):
            value = read_uint(os.path.join(directory, f"hugetlb.{size}.{suffix}"))
            if value is not None:
                setattr(stat, field_name, value)


def _v1_rdma(directory: str, metrics: v1pb.Metrics) -> None:
    current = read_text(os.path.join(directory, "rdma.current"))
    limit = read_text(os.path.join(directory, "rdma.max"))
    if current is None or limit is None:
        return
    if current.count("\n") != limit.count("\n"):
        return  # a device went away between the two reads; upstream reports nothing
    metrics.rdma.SetInParent()
    for device, handles, objects in rdma_entries(current):
        metrics.rdma.current.add(device=device, hca_handles=handles, hca_objects=objects)
    for device, handles, objects in rdma_entries(limit):
        metrics.rdma.limit.add(device=device, hca_handles=handles, hca_objects=objects)


def metrics_v1(cgroup: Cgroup, *, proc: str = "/proc") -> v1pb.Metrics:
    """The ``io.containerd.cgroups.v1.Metrics`` of a v1 cgroup.

    ``proc`` is where ``partitions`` (block device names) is read from.
    Raises :class:`~cedana_shim.errors.NotFound` when the cgroup no longer exists.
    """
    from cedana_shim.api.cgroups.v1 import metrics_pb2

    if cgroup.version != 1:
        raise ValueError("metrics_v1 needs a cgroup v1 Cgroup")
    if not _v1_present(cgroup):
        raise NotFound(f"cgroup {sorted(cgroup.dirs)} does not exist")
    metrics = metrics_pb2.Metrics()
    # Upstream pre-creates both CPU sub-messages, so they are always present.
    metrics.cpu.usage.SetInParent()
    metrics.cpu.throttling.SetInParent()
    if (d := _controller_dir(cgroup, "pids")) is not None:
        _v1_pids(d, metrics)
    if (d := _controller_dir(cgroup, "cpu")) is not None:
        _v1_cpu(d, metrics)
    if (d := _controller_dir(cgroup, "cpuacct")) is not None:
        _v1_cpuacct(d, metrics)
    if (d := _controller_dir(cgroup, "memory")) is not None:
        _v1_memory(d, metrics)
    if (d := _controller_dir(cgroup, "blkio")) is not None:
        _v1_blkio(d, metrics, proc)
    if (d := _controller_dir(cgroup, "hugetlb")) is not None:
        _v1_hugetlb(d, metrics)
    if (d := _controller_dir(cgroup, "rdma")) is not None:
        _v1_rdma(d, metrics)
    # Files of a cgroup removed while we read come back empty or missing; report
    # that as gone rather than as a container that uses nothing.
    if not _v1_present(cgroup):
        raise NotFound(f"cgroup {sorted(cgroup.dirs)} was removed")
    return metrics
