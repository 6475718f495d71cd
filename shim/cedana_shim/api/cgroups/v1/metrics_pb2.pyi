from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Metrics(_message.Message):
    __slots__ = ("hugetlb", "pids", "cpu", "memory", "blkio", "rdma", "network", "cgroup_stats", "memory_oom_control")
    HUGETLB_FIELD_NUMBER: _ClassVar[int]
    PIDS_FIELD_NUMBER: _ClassVar[int]
    CPU_FIELD_NUMBER: _ClassVar[int]
    MEMORY_FIELD_NUMBER: _ClassVar[int]
    BLKIO_FIELD_NUMBER: _ClassVar[int]
    RDMA_FIELD_NUMBER: _ClassVar[int]
    NETWORK_FIELD_NUMBER: _ClassVar[int]
    CGROUP_STATS_FIELD_NUMBER: _ClassVar[int]
    MEMORY_OOM_CONTROL_FIELD_NUMBER: _ClassVar[int]
    hugetlb: _containers.RepeatedCompositeFieldContainer[HugetlbStat]
    pids: PidsStat
    cpu: CPUStat
    memory: MemoryStat
    blkio: BlkIOStat
    rdma: RdmaStat
    network: _containers.RepeatedCompositeFieldContainer[NetworkStat]
    cgroup_stats: CgroupStats
    memory_oom_control: MemoryOomControl
    def __init__(self, hugetlb: _Optional[_Iterable[_Union[HugetlbStat, _Mapping]]] = ..., pids: _Optional[_Union[PidsStat, _Mapping]] = ..., cpu: _Optional[_Union[CPUStat, _Mapping]] = ..., memory: _Optional[_Union[MemoryStat, _Mapping]] = ..., blkio: _Optional[_Union[BlkIOStat, _Mapping]] = ..., rdma: _Optional[_Union[RdmaStat, _Mapping]] = ..., network: _Optional[_Iterable[_Union[NetworkStat, _Mapping]]] = ..., cgroup_stats: _Optional[_Union[CgroupStats, _Mapping]] = ..., memory_oom_control: _Optional[_Union[MemoryOomControl, _Mapping]] = ...) -> None: ...

class HugetlbStat(_message.Message):
    __slots__ = ("usage", "max", "failcnt", "pagesize")
    USAGE_FIELD_NUMBER: _ClassVar[int]
    MAX_FIELD_NUMBER: _ClassVar[int]
    FAILCNT_FIELD_NUMBER: _ClassVar[int]
    PAGESIZE_FIELD_NUMBER: _ClassVar[int]
    usage: int
    max: int
    failcnt: int
    pagesize: str
    def __init__(self, usage: _Optional[int] = ..., max: _Optional[int] = ..., failcnt: _Optional[int] = ..., pagesize: _Optional[str] = ...) -> None: ...

class PidsStat(_message.Message):
    __slots__ = ("current", "limit")
    CURRENT_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    current: int
    limit: int
    def __init__(self, current: _Optional[int] = ..., limit: _Optional[int] = ...) -> None: ...

class CPUStat(_message.Message):
    __slots__ = ("usage", "throttling")
    USAGE_FIELD_NUMBER: _ClassVar[int]
    THROTTLING_FIELD_NUMBER: _ClassVar[int]
    usage: CPUUsage
    throttling: Throttle
    def __init__(self, usage: _Optional[_Union[CPUUsage, _Mapping]] = ..., throttling: _Optional[_Union[Throttle, _Mapping]] = ...) -> None: ...

class CPUUsage(_message.Message):
    __slots__ = ("total", "kernel", "user", "per_cpu")
    TOTAL_FIELD_NUMBER: _ClassVar[int]
    KERNEL_FIELD_NUMBER: _ClassVar[int]
    USER_FIELD_NUMBER: _ClassVar[int]
    PER_CPU_FIELD_NUMBER: _ClassVar[int]
    total: int
    kernel: int
    user: int
    per_cpu: _containers.RepeatedScalarFieldContainer[int]
    def __init__(self, total: _Optional[int] = ..., kernel: _Optional[int] = ..., user: _Optional[int] = ..., per_cpu: _Optional[_Iterable[int]] = ...) -> None: ...

class Throttle(_message.Message):
    __slots__ = ("periods", "throttled_periods", "throttled_time")
    PERIODS_FIELD_NUMBER: _ClassVar[int]
    THROTTLED_PERIODS_FIELD_NUMBER: _ClassVar[int]
    THROTTLED_TIME_FIELD_NUMBER: _ClassVar[int]
    periods: int
    throttled_periods: int
    throttled_time: int
    def __init__(self, periods: _Optional[int] = ..., throttled_periods: _Optional[int] = ..., throttled_time: _Optional[int] = ...) -> None: ...

class MemoryStat(_message.Message):
    __slots__ = ("cache", "rss", "rss_huge", "mapped_file", "dirty", "writeback", "pg_pg_in", "pg_pg_out", "pg_fault", "pg_maj_fault", "inactive_anon", "active_anon", "inactive_file", "active_file", "unevictable", "hierarchical_memory_limit", "hierarchical_swap_limit", "total_cache", "total_rss", "total_rss_huge", "total_mapped_file", "total_dirty", "total_writeback", "total_pg_pg_in", "total_pg_pg_out", "total_pg_fault", "total_pg_maj_fault", "total_inactive_anon", "total_active_anon", "total_inactive_file", "total_active_file", "total_unevictable", "usage", "swap", "kernel", "kernel_tcp")
    CACHE_FIELD_NUMBER: _ClassVar[int]
    RSS_FIELD_NUMBER: _ClassVar[int]
    RSS_HUGE_FIELD_NUMBER: _ClassVar[int]
    MAPPED_FILE_FIELD_NUMBER: _ClassVar[int]
    DIRTY_FIELD_NUMBER: _ClassVar[int]
    WRITEBACK_FIELD_NUMBER: _ClassVar[int]
    PG_PG_IN_FIELD_NUMBER: _ClassVar[int]
    PG_PG_OUT_FIELD_NUMBER: _ClassVar[int]
    PG_FAULT_FIELD_NUMBER: _ClassVar[int]
    PG_MAJ_FAULT_FIELD_NUMBER: _ClassVar[int]
    INACTIVE_ANON_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_ANON_FIELD_NUMBER: _ClassVar[int]
    INACTIVE_FILE_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_FILE_FIELD_NUMBER: _ClassVar[int]
    UNEVICTABLE_FIELD_NUMBER: _ClassVar[int]
    HIERARCHICAL_MEMORY_LIMIT_FIELD_NUMBER: _ClassVar[int]
    HIERARCHICAL_SWAP_LIMIT_FIELD_NUMBER: _ClassVar[int]
    TOTAL_CACHE_FIELD_NUMBER: _ClassVar[int]
    TOTAL_RSS_FIELD_NUMBER: _ClassVar[int]
    TOTAL_RSS_HUGE_FIELD_NUMBER: _ClassVar[int]
    TOTAL_MAPPED_FILE_FIELD_NUMBER: _ClassVar[int]
    TOTAL_DIRTY_FIELD_NUMBER: _ClassVar[int]
    TOTAL_WRITEBACK_FIELD_NUMBER: _ClassVar[int]
    TOTAL_PG_PG_IN_FIELD_NUMBER: _ClassVar[int]
    TOTAL_PG_PG_OUT_FIELD_NUMBER: _ClassVar[int]
    TOTAL_PG_FAULT_FIELD_NUMBER: _ClassVar[int]
    TOTAL_PG_MAJ_FAULT_FIELD_NUMBER: _ClassVar[int]
    TOTAL_INACTIVE_ANON_FIELD_NUMBER: _ClassVar[int]
    TOTAL_ACTIVE_ANON_FIELD_NUMBER: _ClassVar[int]
    TOTAL_INACTIVE_FILE_FIELD_NUMBER: _ClassVar[int]
    TOTAL_ACTIVE_FILE_FIELD_NUMBER: _ClassVar[int]
    TOTAL_UNEVICTABLE_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    SWAP_FIELD_NUMBER: _ClassVar[int]
    KERNEL_FIELD_NUMBER: _ClassVar[int]
    KERNEL_TCP_FIELD_NUMBER: _ClassVar[int]
    cache: int
    rss: int
    rss_huge: int
    mapped_file: int
    dirty: int
    writeback: int
    pg_pg_in: int
    pg_pg_out: int
    pg_fault: int
    pg_maj_fault: int
    inactive_anon: int
    active_anon: int
    inactive_file: int
    active_file: int
    unevictable: int
    hierarchical_memory_limit: int
    hierarchical_swap_limit: int
    total_cache: int
    total_rss: int
    total_rss_huge: int
    total_mapped_file: int
    total_dirty: int
    total_writeback: int
    total_pg_pg_in: int
    total_pg_pg_out: int
    total_pg_fault: int
    total_pg_maj_fault: int
    total_inactive_anon: int
    total_active_anon: int
    total_inactive_file: int
    total_active_file: int
    total_unevictable: int
    usage: MemoryEntry
    swap: MemoryEntry
    kernel: MemoryEntry
    kernel_tcp: MemoryEntry
    def __init__(self, cache: _Optional[int] = ..., rss: _Optional[int] = ..., rss_huge: _Optional[int] = ..., mapped_file: _Optional[int] = ..., dirty: _Optional[int] = ..., writeback: _Optional[int] = ..., pg_pg_in: _Optional[int] = ..., pg_pg_out: _Optional[int] = ..., pg_fault: _Optional[int] = ..., pg_maj_fault: _Optional[int] = ..., inactive_anon: _Optional[int] = ..., active_anon: _Optional[int] = ..., inactive_file: _Optional[int] = ..., active_file: _Optional[int] = ..., unevictable: _Optional[int] = ..., hierarchical_memory_limit: _Optional[int] = ..., hierarchical_swap_limit: _Optional[int] = ..., total_cache: _Optional[int] = ..., total_rss: _Optional[int] = ..., total_rss_huge: _Optional[int] = ..., total_mapped_file: _Optional[int] = ..., total_dirty: _Optional[int] = ..., total_writeback: _Optional[int] = ..., total_pg_pg_in: _Optional[int] = ..., total_pg_pg_out: _Optional[int] = ..., total_pg_fault: _Optional[int] = ..., total_pg_maj_fault: _Optional[int] = ..., total_inactive_anon: _Optional[int] = ..., total_active_anon: _Optional[int] = ..., total_inactive_file: _Optional[int] = ..., total_active_file: _Optional[int] = ..., total_unevictable: _Optional[int] = ..., usage: _Optional[_Union[MemoryEntry, _Mapping]] = ..., swap: _Optional[_Union[MemoryEntry, _Mapping]] = ..., kernel: _Optional[_Union[MemoryEntry, _Mapping]] = ..., kernel_tcp: _Optional[_Union[MemoryEntry, _Mapping]] = ...) -> None: ...

class MemoryEntry(_message.Message):
    __slots__ = ("limit", "usage", "max", "failcnt")
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    MAX_FIELD_NUMBER: _ClassVar[int]
    FAILCNT_FIELD_NUMBER: _ClassVar[int]
    limit: int
    usage: int
    max: int
    failcnt: int
    def __init__(self, limit: _Optional[int] = ..., usage: _Optional[int] = ..., max: _Optional[int] = ..., failcnt: _Optional[int] = ...) -> None: ...

class MemoryOomControl(_message.Message):
    __slots__ = ("oom_kill_disable", "under_oom", "oom_kill")
    OOM_KILL_DISABLE_FIELD_NUMBER: _ClassVar[int]
    UNDER_OOM_FIELD_NUMBER: _ClassVar[int]
    OOM_KILL_FIELD_NUMBER: _ClassVar[int]
    oom_kill_disable: int
    under_oom: int
    oom_kill: int
    def __init__(self, oom_kill_disable: _Optional[int] = ..., under_oom: _Optional[int] = ..., oom_kill: _Optional[int] = ...) -> None: ...

class BlkIOStat(_message.Message):
    __slots__ = ("io_service_bytes_recursive", "io_serviced_recursive", "io_queued_recursive", "io_service_time_recursive", "io_wait_time_recursive", "io_merged_recursive", "io_time_recursive", "sectors_recursive")
    IO_SERVICE_BYTES_RECURSIVE_FIELD_NUMBER: _ClassVar[int]
    IO_SERVICED_RECURSIVE_FIELD_NUMBER: _ClassVar[int]
    IO_QUEUED_RECURSIVE_FIELD_NUMBER: _ClassVar[int]
    IO_SERVICE_TIME_RECURSIVE_FIELD_NUMBER: _ClassVar[int]
    IO_WAIT_TIME_RECURSIVE_FIELD_NUMBER: _ClassVar[int]
    IO_MERGED_RECURSIVE_FIELD_NUMBER: _ClassVar[int]
    IO_TIME_RECURSIVE_FIELD_NUMBER: _ClassVar[int]
    SECTORS_RECURSIVE_FIELD_NUMBER: _ClassVar[int]
    io_service_bytes_recursive: _containers.RepeatedCompositeFieldContainer[BlkIOEntry]
    io_serviced_recursive: _containers.RepeatedCompositeFieldContainer[BlkIOEntry]
    io_queued_recursive: _containers.RepeatedCompositeFieldContainer[BlkIOEntry]
    io_service_time_recursive: _containers.RepeatedCompositeFieldContainer[BlkIOEntry]
    io_wait_time_recursive: _containers.RepeatedCompositeFieldContainer[BlkIOEntry]
    io_merged_recursive: _containers.RepeatedCompositeFieldContainer[BlkIOEntry]
    io_time_recursive: _containers.RepeatedCompositeFieldContainer[BlkIOEntry]
    sectors_recursive: _containers.RepeatedCompositeFieldContainer[BlkIOEntry]
    def __init__(self, io_service_bytes_recursive: _Optional[_Iterable[_Union[BlkIOEntry, _Mapping]]] = ..., io_serviced_recursive: _Optional[_Iterable[_Union[BlkIOEntry, _Mapping]]] = ..., io_queued_recursive: _Optional[_Iterable[_Union[BlkIOEntry, _Mapping]]] = ..., io_service_time_recursive: _Optional[_Iterable[_Union[BlkIOEntry, _Mapping]]] = ..., io_wait_time_recursive: _Optional[_Iterable[_Union[BlkIOEntry, _Mapping]]] = ..., io_merged_recursive: _Optional[_Iterable[_Union[BlkIOEntry, _Mapping]]] = ..., io_time_recursive: _Optional[_Iterable[_Union[BlkIOEntry, _Mapping]]] = ..., sectors_recursive: _Optional[_Iterable[_Union[BlkIOEntry, _Mapping]]] = ...) -> None: ...

class BlkIOEntry(_message.Message):
    __slots__ = ("op", "device", "major", "minor", "value")
    OP_FIELD_NUMBER: _ClassVar[int]
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    MAJOR_FIELD_NUMBER: _ClassVar[int]
    MINOR_FIELD_NUMBER: _ClassVar[int]
    VALUE_FIELD_NUMBER: _ClassVar[int]
    op: str
    device: str
    major: int
    minor: int
    value: int
    def __init__(self, op: _Optional[str] = ..., device: _Optional[str] = ..., major: _Optional[int] = ..., minor: _Optional[int] = ..., value: _Optional[int] = ...) -> None: ...

class RdmaStat(_message.Message):
    __slots__ = ("current", "limit")
    CURRENT_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    current: _containers.RepeatedCompositeFieldContainer[RdmaEntry]
    limit: _containers.RepeatedCompositeFieldContainer[RdmaEntry]
    def __init__(self, current: _Optional[_Iterable[_Union[RdmaEntry, _Mapping]]] = ..., limit: _Optional[_Iterable[_Union[RdmaEntry, _Mapping]]] = ...) -> None: ...

class RdmaEntry(_message.Message):
    __slots__ = ("device", "hca_handles", "hca_objects")
    DEVICE_FIELD_NUMBER: _ClassVar[int]
    HCA_HANDLES_FIELD_NUMBER: _ClassVar[int]
    HCA_OBJECTS_FIELD_NUMBER: _ClassVar[int]
    device: str
    hca_handles: int
    hca_objects: int
    def __init__(self, device: _Optional[str] = ..., hca_handles: _Optional[int] = ..., hca_objects: _Optional[int] = ...) -> None: ...

class NetworkStat(_message.Message):
    __slots__ = ("name", "rx_bytes", "rx_packets", "rx_errors", "rx_dropped", "tx_bytes", "tx_packets", "tx_errors", "tx_dropped")
    NAME_FIELD_NUMBER: _ClassVar[int]
    RX_BYTES_FIELD_NUMBER: _ClassVar[int]
    RX_PACKETS_FIELD_NUMBER: _ClassVar[int]
    RX_ERRORS_FIELD_NUMBER: _ClassVar[int]
    RX_DROPPED_FIELD_NUMBER: _ClassVar[int]
    TX_BYTES_FIELD_NUMBER: _ClassVar[int]
    TX_PACKETS_FIELD_NUMBER: _ClassVar[int]
    TX_ERRORS_FIELD_NUMBER: _ClassVar[int]
    TX_DROPPED_FIELD_NUMBER: _ClassVar[int]
    name: str
    rx_bytes: int
    rx_packets: int
    rx_errors: int
    rx_dropped: int
    tx_bytes: int
    tx_packets: int
    tx_errors: int
    tx_dropped: int
    def __init__(self, name: _Optional[str] = ..., rx_bytes: _Optional[int] = ..., rx_packets: _Optional[int] = ..., rx_errors: _Optional[int] = ..., rx_dropped: _Optional[int] = ..., tx_bytes: _Optional[int] = ..., tx_packets: _Optional[int] = ..., tx_errors: _Optional[int] = ..., tx_dropped: _Optional[int] = ...) -> None: ...

class CgroupStats(_message.Message):
    __slots__ = ("nr_sleeping", "nr_running", "nr_stopped", "nr_uninterruptible", "nr_io_wait")
    NR_SLEEPING_FIELD_NUMBER: _ClassVar[int]
    NR_RUNNING_FIELD_NUMBER: _ClassVar[int]
    NR_STOPPED_FIELD_NUMBER: _ClassVar[int]
    NR_UNINTERRUPTIBLE_FIELD_NUMBER: _ClassVar[int]
    NR_IO_WAIT_FIELD_NUMBER: _ClassVar[int]
    nr_sleeping: int
    nr_running: int
    nr_stopped: int
    nr_uninterruptible: int
    nr_io_wait: int
    def __init__(self, nr_sleeping: _Optional[int] = ..., nr_running: _Optional[int] = ..., nr_stopped: _Optional[int] = ..., nr_uninterruptible: _Optional[int] = ..., nr_io_wait: _Optional[int] = ...) -> None: ...
