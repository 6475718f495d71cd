"""Container resource metrics for the Task ``Stats`` call.

The numbers are the ones containerd's runc shim reports, read from the same files
and encoded the same way, because CRI and ``ctr task metrics`` interpret them:
cgroup v1 follows ``github.com/containerd/cgroups`` (``memory.go``, ``cpu.go``,
``cpuacct.go``, ``pids.go``, ``blkio.go``, ``hugetlb.go``, ``rdma.go``) as called with
``IgnoreNotExist``; cgroup v2 follows ``v2/manager.go`` ``Stat()`` and ``v2/utils.go``.

Where upstream gives up on a whole controller because one of its files is missing
or one line is malformed, we skip just that file or line: every value we do report
is the value upstream would report from that file. The Any carries a bare type name
(no ``type.googleapis.com/`` prefix), which is what containerd's typeurl registry
resolves.
"""

from __future__ import annotations

import errno
import logging
import os
import re
from typing import TYPE_CHECKING

from cedana_shim.errors import NotFound
from cedana_shim.task.cgroups import Cgroup

if TYPE_CHECKING:
    from google.protobuf.any_pb2 import Any
    from google.protobuf.internal.containers import RepeatedCompositeFieldContainer

    from cedana_shim.api.cgroups.v1 import metrics_pb2 as v1pb
    from cedana_shim.api.cgroups.v2 import metrics_pb2 as v2pb

__all__ = [
    "MAX_UINT32",
    "MAX_UINT64",
    "V1_TYPE_URL",
    "V2_TYPE_URL",
    "collect_metrics",
    "metrics_v1",
    "metrics_v2",
]

log = logging.getLogger(__name__)

V1_TYPE_URL = "io.containerd.cgroups.v1.Metrics"
V2_TYPE_URL = "io.containerd.cgroups.v2.Metrics"

MAX_UINT64 = (1 << 64) - 1
MAX_UINT32 = (1 << 32) - 1
# USER_HZ for cpuacct.stat; upstream hard-codes it too (ticks.go), it is 100 on Linux.
CLOCK_TICKS = 100
_NANOSECONDS_PER_SECOND = 1_000_000_000

# A cgroup file of a cgroup being removed fails with ENODEV rather than ENOENT.
_MISSING = frozenset((errno.ENOENT, errno.ENODEV, errno.ENOTDIR))
_DIGITS = re.compile(r"[0-9]+")
_NEGATIVE = re.compile(r"-[0-9]+")


# -- reading --------------------------------------------------------------------------


def _read(path: str) -> str | None:
    """The file's text, or None when it does not exist (controller absent, cgroup gone)."""
    try:
        with open(path, encoding="utf-8", errors="replace") as f:
            return f.read()
    except OSError as err:
        if err.errno in _MISSING:
            return None
        raise


def _parse_uint(text: str, limit: int = MAX_UINT64) -> int | None:
    """Go's cgroups ``parseUint``: negative numbers (e.g. ``-1``) read as 0; junk is None."""
    if _DIGITS.fullmatch(text):
        value = int(text)
        return value if value <= limit else None
    if _NEGATIVE.fullmatch(text):
        return 0
    return None


def _parse_strict_uint(text: str) -> int | None:
    """Go's ``strconv.ParseUint``, which some upstream readers call directly: no sign."""
    if _DIGITS.fullmatch(text):
        value = int(text)
        return value if value <= MAX_UINT64 else None
    return None


def _read_uint(path: str) -> int | None:
    text = _read(path)
    if text is None:
        return None
    value = _parse_uint(text.strip())
    if value is None:
        log.debug("ignoring unparsable cgroup value", extra={"path": path, "value": text.strip()})
    return value


def _parse_kv_lines(text: str, path: str, out: dict[str, int]) -> None:
    for line in text.splitlines():
        parts = line.split()
        value = _parse_uint(parts[1]) if len(parts) == 2 else None
        if value is None:
            if line.strip():
                log.debug("ignoring malformed cgroup stat line", extra={"path": path, "line": line})
            continue
        out[parts[0]] = value


def _read_kv(path: str) -> dict[str, int] | None:
    text = _read(path)
    if text is None:
        return None
    out: dict[str, int] = {}
    _parse_kv_lines(text, path, out)
    return out


# -- cgroup v1 ----------------------------------------------------------------------

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
    current = _read_uint(os.path.join(directory, "pids.current"))
    max_text = _read(os.path.join(directory, "pids.max"))
    if current is None and max_text is None:
        return
    metrics.pids.SetInParent()
    metrics.pids.current = current or 0
    if max_text is not None and max_text.strip() != "max":
        # v1 reports "max" (no limit) as 0; only v2 uses MaxUint64 (pids.go).
        metrics.pids.limit = _parse_uint(max_text.strip()) or 0


def _v1_cpu(directory: str, metrics: v1pb.Metrics) -> None:
    stat = _read_kv(os.path.join(directory, "cpu.stat"))
    if stat is None:
        return
    throttling = metrics.cpu.throttling
    throttling.periods = stat.get("nr_periods", 0)
    throttling.throttled_periods = stat.get("nr_throttled", 0)
    throttling.throttled_time = stat.get("throttled_time", 0)


def _v1_cpuacct(directory: str, metrics: v1pb.Metrics) -> None:
    usage = metrics.cpu.usage
    stat = _read_kv(os.path.join(directory, "cpuacct.stat"))
    if stat is not None:
        # cpuacct.stat counts USER_HZ ticks; the proto wants nanoseconds. Go computes
        # this in uint64 and would wrap after ~1.8e10 ticks; we do not reproduce that.
        usage.user = stat.get("user", 0) * _NANOSECONDS_PER_SECOND // CLOCK_TICKS
        usage.kernel = stat.get("system", 0) * _NANOSECONDS_PER_SECOND // CLOCK_TICKS
    total = _read_uint(os.path.join(directory, "cpuacct.usage"))
    if total is not None:
        usage.total = total
    percpu_path = os.path.join(directory, "cpuacct.usage_percpu")
    percpu = _read(percpu_path)
    if percpu is not None:
        values = [_parse_strict_uint(v) for v in percpu.split()]
        if any(v is None for v in values):
            log.debug("ignoring malformed per-cpu usage", extra={"path": percpu_path})
        else:
            usage.per_cpu.extend(v for v in values if v is not None)


def _v1_memory(directory: str, metrics: v1pb.Metrics) -> None:
    memory = metrics.memory
    # Upstream always sends all four entries, zero or not.
    for entry_name, _ in _V1_MEMORY_ENTRIES:
        getattr(memory, entry_name).SetInParent()
    stat = _read_kv(os.path.join(directory, "memory.stat"))
    if stat is not None:
        for field_name, key in _V1_MEMORY_STAT:
            setattr(memory, field_name, stat.get(key, 0))
    oom = _read_kv(os.path.join(directory, "memory.oom_control"))
    if oom is not None:
        metrics.memory_oom_control.oom_kill_disable = oom.get("oom_kill_disable", 0)
        metrics.memory_oom_control.under_oom = oom.get("under_oom", 0)
        metrics.memory_oom_control.oom_kill = oom.get("oom_kill", 0)
        metrics.memory_oom_control.SetInParent()
    for entry_name, prefix in _V1_MEMORY_ENTRIES:
        entry = getattr(memory, entry_name)
        for field_name, suffix in _V1_MEMORY_ENTRY_FILES:
            value = _read_uint(os.path.join(directory, prefix + suffix))
            if value is not None:
                setattr(entry, field_name, value)


def _block_devices(proc: str) -> dict[tuple[int, int], str]:
    """(major, minor) -> /dev/<name> from /proc/partitions, first occurrence wins."""
    text = _read(os.path.join(proc, "partitions"))
    devices: dict[tuple[int, int], str] = {}
    if text is None:
        return devices
    for line in text.splitlines()[2:]:  # header line, then a blank line
        fields = line.split()
        if len(fields) < 4 or not (_DIGITS.fullmatch(fields[0]) and _DIGITS.fullmatch(fields[1])):
            continue
        devices.setdefault((int(fields[0]), int(fields[1])), "/dev/" + fields[3])
    return devices


def _v1_blkio_entries(
    path: str,
    devices: dict[tuple[int, int], str],
    out: RepeatedCompositeFieldContainer[v1pb.BlkIOEntry],
) -> int | None:
    """Append the entries of ``blkio.*`` file ``path`` to ``out``; None if it is missing."""
    text = _read(path)
    if text is None:
        return None
    added = 0
    for line in text.splitlines():
        # "MAJ:MIN Op value" or "MAJ:MIN value"; a trailing "Total N" line is dropped.
        fields = [f for f in re.split(r"[ :]", line) if f]
        if len(fields) == 2 and fields[0] == "Total":
            continue
        major = _parse_strict_uint(fields[0]) if len(fields) in (3, 4) else None
        minor = _parse_strict_uint(fields[1]) if major is not None else None
        value = _parse_strict_uint(fields[-1]) if minor is not None else None
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
    devices = _block_devices(proc)
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


_PAGESIZE_UNITS = {"KB": 1 << 10, "MB": 1 << 20, "GB": 1 << 30, "TB": 1 << 40, "PB": 1 << 50}
_PAGESIZE = re.compile(r"([0-9]+)(KB|MB|GB|TB|PB)")


def _pagesize_bytes(pagesize: str) -> int:
    match = _PAGESIZE.fullmatch(pagesize)
    if match is None:
        return 0
    return int(match.group(1)) * _PAGESIZE_UNITS[match.group(2)]


def _hugetlb_sizes(directory: str, marker: str) -> list[str]:
    """Page sizes ("2MB", "1GB") that have a ``hugetlb.<size>.<marker>`` file.

    Upstream lists /sys/kernel/mm/hugepages instead; the kernel creates exactly one
    file set per hstate, so the sizes are the same, and sorting by the sysfs directory
    name ("hugepages-<kB>kB") reproduces upstream's order.
    """
    try:
        names = os.listdir(directory)
    except OSError as err:
        if err.errno in _MISSING:
            return []
        raise
    sizes = {
        parts[1]
        for parts in (name.split(".") for name in names)
        if len(parts) >= 3 and parts[0] == "hugetlb" and parts[2] == marker
    }
    return sorted(sizes, key=lambda s: f"hugepages-{_pagesize_bytes(s) // 1024}kB")


def _v1_hugetlb(directory: str, metrics: v1pb.Metrics) -> None:
    for size in _hugetlb_sizes(directory, "usage_in_bytes"):
        stat = metrics.hugetlb.add(pagesize=size)
        for field_name, suffix in (
            ("usage", "usage_in_bytes"),
            ("max", "max_usage_in_bytes"),
            ("failcnt", "failcnt"),
        ):
            value = _read_uint(os.path.join(directory, f"hugetlb.{size}.{suffix}"))
            if value is not None:
                setattr(stat, field_name, value)


def _rdma_value(text: str) -> int | None:
    if text == "max":
        return MAX_UINT32
    return _parse_uint(text, MAX_UINT32)


def _rdma_entries(text: str) -> list[tuple[str, int, int]]:
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


def _v1_rdma(directory: str, metrics: v1pb.Metrics) -> None:
    current = _read(os.path.join(directory, "rdma.current"))
    limit = _read(os.path.join(directory, "rdma.max"))
    if current is None or limit is None:
        return
    if current.count("\n") != limit.count("\n"):
        return  # a device went away between the two reads; upstream reports nothing
    metrics.rdma.SetInParent()
    for device, handles, objects in _rdma_entries(current):
        metrics.rdma.current.add(device=device, hca_handles=handles, hca_objects=objects)
    for device, handles, objects in _rdma_entries(limit):
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


# -- cgroup v2 ----------------------------------------------------------------------

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
    text = _read(path)
    if text is None:
        return 0
    text = text.strip()
    if text == "max":
        return MAX_UINT64
    value = _parse_uint(text)
    if value is None:
        log.debug("ignoring unparsable cgroup value", extra={"path": path, "value": text})
        return 0
    return value


def _v2_pids_value(path: str) -> int:
    """manager.go getPidValue: a number, "max" as MaxUint64, anything else 0."""
    text = _read(path)
    if text is None:
        return 0
    text = text.strip()
    if text == "max":
        return MAX_UINT64
    return _parse_uint(text) or 0


def _v2_io(path: str, metrics: v2pb.Metrics) -> None:
    metrics.io.SetInParent()
    text = _read(os.path.join(path, "io.stat"))
    if text is None:
        return
    for line in text.split("\n"):
        parts = line.split(" ")
        if len(parts) < 2:
            continue
        majmin = parts[0].split(":")
        if len(majmin) != 2:
            continue
        major, minor = _parse_strict_uint(majmin[0]), _parse_strict_uint(majmin[1])
        if major is None or minor is None:
            return  # upstream stops reading io.stat at the first bad device number
        entry = metrics.io.usage.add(major=major, minor=minor)
        for pair in parts[1:]:
            key, sep, raw = pair.partition("=")
            value = _parse_strict_uint(raw) if sep and "=" not in raw else None
            if value is not None and key in ("rbytes", "wbytes", "rios", "wios"):
                setattr(entry, key, value)


def _v2_hugetlb(path: str, metrics: v2pb.Metrics) -> None:
    try:
        names = os.listdir(path)
    except OSError as err:
        if err.errno in _MISSING:
            return
        raise
    found: dict[str, dict[str, int]] = {}  # page size -> {"max": .., "current": ..}
    for name in names:
        if "hugetlb" not in name or not name.endswith(("max", "current")):
            continue
        parts = name.split(".")
        if len(parts) < 3:
            continue
        text = _read(os.path.join(path, name))
        if text is None:
            continue
        text = text.strip()
        value = MAX_UINT64 if text == "max" else _parse_strict_uint(text)
        if value is None:
            continue
        # hugetlb.<size>.rsvd.max and friends still create the page size's entry.
        values = found.setdefault(parts[1], {})
        if parts[2] in ("max", "current"):
            values[parts[2]] = value
    # Upstream's order is Go map order (random); sort by page size to be deterministic.
    for pagesize in sorted(found, key=lambda s: (_pagesize_bytes(s), s)):
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
    controllers = (_read(os.path.join(path, "cgroup.controllers")) or "").split()
    out: dict[str, int] = {}
    for controller in controllers:
        # Like upstream, cpu.stat is only read when the cpu controller is enabled here,
        # even though the kernel always provides its usage_usec.
        if controller in ("cpu", "memory"):
            stat_path = os.path.join(path, controller + ".stat")
            text = _read(stat_path)
            if text is not None:
                _parse_kv_lines(text, stat_path, out)

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

    events = _read_kv(os.path.join(path, "memory.events"))
    if events:  # upstream leaves memory_events unset when the file is missing or empty
        for name in _V2_MEMORY_EVENTS:
            setattr(metrics.memory_events, name, events.get(name, 0))
        metrics.memory_events.SetInParent()

    _v2_io(path, metrics)

    metrics.rdma.SetInParent()
    for device, handles, objects in _rdma_entries(_read(os.path.join(path, "rdma.current")) or ""):
        metrics.rdma.current.add(device=device, hca_handles=handles, hca_objects=objects)
    for device, handles, objects in _rdma_entries(_read(os.path.join(path, "rdma.max")) or ""):
        metrics.rdma.limit.add(device=device, hca_handles=handles, hca_objects=objects)

    _v2_hugetlb(path, metrics)

    if not os.path.isdir(path):
        raise NotFound(f"cgroup {path} was removed")
    return metrics


# -- the Stats payload ------------------------------------------------------------


def collect_metrics(cgroup: Cgroup, *, proc: str = "/proc") -> Any:
    """The ``StatsResponse.stats`` Any for ``cgroup``: v1 or v2 Metrics, bare type URL.

    Raises :class:`~cedana_shim.errors.NotFound` when the cgroup no longer exists,
    which containerd's CRI plugin skips silently.
    """
    from google.protobuf.any_pb2 import Any

    if cgroup.version == 1:
        type_url, value = V1_TYPE_URL, metrics_v1(cgroup, proc=proc).SerializeToString()
    else:
        type_url, value = V2_TYPE_URL, metrics_v2(cgroup).SerializeToString()
    return Any(type_url=type_url, value=value)
