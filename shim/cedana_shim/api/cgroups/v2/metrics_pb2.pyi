from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class Metrics(_message.Message):
    __slots__ = ("pids", "cpu", "memory", "rdma", "io", "hugetlb", "memory_events")
    PIDS_FIELD_NUMBER: _ClassVar[int]
    CPU_FIELD_NUMBER: _ClassVar[int]
    MEMORY_FIELD_NUMBER: _ClassVar[int]
    RDMA_FIELD_NUMBER: _ClassVar[int]
    IO_FIELD_NUMBER: _ClassVar[int]
    HUGETLB_FIELD_NUMBER: _ClassVar[int]
    MEMORY_EVENTS_FIELD_NUMBER: _ClassVar[int]
    pids: PidsStat
    cpu: CPUStat
    memory: MemoryStat
    rdma: RdmaStat
    io: IOStat
    hugetlb: _containers.RepeatedCompositeFieldContainer[HugeTlbStat]
    memory_events: MemoryEvents
    def __init__(self, pids: _Optional[_Union[PidsStat, _Mapping]] = ..., cpu: _Optional[_Union[CPUStat, _Mapping]] = ..., memory: _Optional[_Union[MemoryStat, _Mapping]] = ..., rdma: _Optional[_Union[RdmaStat, _Mapping]] = ..., io: _Optional[_Union[IOStat, _Mapping]] = ..., hugetlb: _Optional[_Iterable[_Union[HugeTlbStat, _Mapping]]] = ..., memory_events: _Optional[_Union[MemoryEvents, _Mapping]] = ...) -> None: ...

class PidsStat(_message.Message):
    __slots__ = ("current", "limit")
    CURRENT_FIELD_NUMBER: _ClassVar[int]
    LIMIT_FIELD_NUMBER: _ClassVar[int]
    current: int
    limit: int
    def __init__(self, current: _Optional[int] = ..., limit: _Optional[int] = ...) -> None: ...

class CPUStat(_message.Message):
    __slots__ = ("usage_usec", "user_usec", "system_usec", "nr_periods", "nr_throttled", "throttled_usec")
    USAGE_USEC_FIELD_NUMBER: _ClassVar[int]
    USER_USEC_FIELD_NUMBER: _ClassVar[int]
    SYSTEM_USEC_FIELD_NUMBER: _ClassVar[int]
    NR_PERIODS_FIELD_NUMBER: _ClassVar[int]
    NR_THROTTLED_FIELD_NUMBER: _ClassVar[int]
    THROTTLED_USEC_FIELD_NUMBER: _ClassVar[int]
    usage_usec: int
    user_usec: int
    system_usec: int
    nr_periods: int
    nr_throttled: int
    throttled_usec: int
    def __init__(self, usage_usec: _Optional[int] = ..., user_usec: _Optional[int] = ..., system_usec: _Optional[int] = ..., nr_periods: _Optional[int] = ..., nr_throttled: _Optional[int] = ..., throttled_usec: _Optional[int] = ...) -> None: ...

class MemoryStat(_message.Message):
    __slots__ = ("anon", "file", "kernel_stack", "slab", "sock", "shmem", "file_mapped", "file_dirty", "file_writeback", "anon_thp", "inactive_anon", "active_anon", "inactive_file", "active_file", "unevictable", "slab_reclaimable", "slab_unreclaimable", "pgfault", "pgmajfault", "workingset_refault", "workingset_activate", "workingset_nodereclaim", "pgrefill", "pgscan", "pgsteal", "pgactivate", "pgdeactivate", "pglazyfree", "pglazyfreed", "thp_fault_alloc", "thp_collapse_alloc", "usage", "usage_limit", "swap_usage", "swap_limit")
    ANON_FIELD_NUMBER: _ClassVar[int]
    FILE_FIELD_NUMBER: _ClassVar[int]
    KERNEL_STACK_FIELD_NUMBER: _ClassVar[int]
    SLAB_FIELD_NUMBER: _ClassVar[int]
    SOCK_FIELD_NUMBER: _ClassVar[int]
    SHMEM_FIELD_NUMBER: _ClassVar[int]
    FILE_MAPPED_FIELD_NUMBER: _ClassVar[int]
    FILE_DIRTY_FIELD_NUMBER: _ClassVar[int]
    FILE_WRITEBACK_FIELD_NUMBER: _ClassVar[int]
    ANON_THP_FIELD_NUMBER: _ClassVar[int]
    INACTIVE_ANON_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_ANON_FIELD_NUMBER: _ClassVar[int]
    INACTIVE_FILE_FIELD_NUMBER: _ClassVar[int]
    ACTIVE_FILE_FIELD_NUMBER: _ClassVar[int]
    UNEVICTABLE_FIELD_NUMBER: _ClassVar[int]
    SLAB_RECLAIMABLE_FIELD_NUMBER: _ClassVar[int]
    SLAB_UNRECLAIMABLE_FIELD_NUMBER: _ClassVar[int]
    PGFAULT_FIELD_NUMBER: _ClassVar[int]
    PGMAJFAULT_FIELD_NUMBER: _ClassVar[int]
    WORKINGSET_REFAULT_FIELD_NUMBER: _ClassVar[int]
    WORKINGSET_ACTIVATE_FIELD_NUMBER: _ClassVar[int]
    WORKINGSET_NODERECLAIM_FIELD_NUMBER: _ClassVar[int]
    PGREFILL_FIELD_NUMBER: _ClassVar[int]
    PGSCAN_FIELD_NUMBER: _ClassVar[int]
    PGSTEAL_FIELD_NUMBER: _ClassVar[int]
    PGACTIVATE_FIELD_NUMBER: _ClassVar[int]
    PGDEACTIVATE_FIELD_NUMBER: _ClassVar[int]
    PGLAZYFREE_FIELD_NUMBER: _ClassVar[int]
    PGLAZYFREED_FIELD_NUMBER: _ClassVar[int]
    THP_FAULT_ALLOC_FIELD_NUMBER: _ClassVar[int]
    THP_COLLAPSE_ALLOC_FIELD_NUMBER: _ClassVar[int]
    USAGE_FIELD_NUMBER: _ClassVar[int]
    USAGE_LIMIT_FIELD_NUMBER: _ClassVar[int]
    SWAP_USAGE_FIELD_NUMBER: _ClassVar[int]
    SWAP_LIMIT_FIELD_NUMBER: _ClassVar[int]
    anon: int
    file: int
    kernel_stack: int
    slab: int
    sock: int
    shmem: int
    file_mapped: int
    file_dirty: int
    file_writeback: int
    anon_thp: int
    inactive_anon: int
    active_anon: int
    inactive_file: int
    active_file: int
    unevictable: int
    slab_reclaimable: int
    slab_unreclaimable: int
    pgfault: int
    pgmajfault: int
    workingset_refault: int
    workingset_activate: int
    workingset_nodereclaim: int
    pgrefill: int
    pgscan: int
    pgsteal: int
    pgactivate: int
    pgdeactivate: int
    pglazyfree: int
    pglazyfreed: int
    thp_fault_alloc: int
    thp_collapse_alloc: int
    usage: int
    usage_limit: int
    swap_usage: int
    swap_limit: int
    def __init__(self, anon: _Optional[int] = ..., file: _Optional[int] = ..., kernel_stack: _Optional[int] = ..., slab: _Optional[int] = ..., sock: _Optional[int] = ..., shmem: _Optional[int] = ..., file_mapped: _Optional[int] = ..., file_dirty: _Optional[int] = ..., file_writeback: _Optional[int] = ..., anon_thp: _Optional[int] = ..., inactive_anon: _Optional[int] = ..., active_anon: _Optional[int] = ..., inactive_file: _Optional[int] = ..., active_file: _Optional[int] = ..., unevictable: _Optional[int] = ..., slab_reclaimable: _Optional[int] = ..., slab_unreclaimable: _Optional[int] = ..., pgfault: _Optional[int] = ..., pgmajfault: _Optional[int] = ..., workingset_refault: _Optional[int] = ..., workingset_activate: _Optional[int] = ..., workingset_nodereclaim: _Optional[int] = ..., pgrefill: _Optional[int] = ..., pgscan: _Optional[int] = ..., pgsteal: _Optional[int] = ..., pgactivate: _Optional[int] = ..., pgdeactivate: _Optional[int] = ..., pglazyfree: _Optional[int] = ..., pglazyfreed: _Optional[int] = ..., thp_fault_alloc: _Optional[int] = ..., thp_collapse_alloc: _Optional[int] = ..., usage: _Optional[int] = ..., usage_limit: _Optional[int] = ..., swap_usage: _Optional[int] = ..., swap_limit: _Optional[int] = ...) -> None: ...

class MemoryEvents(_message.Message):
    __slots__ = ("low", "high", "max", "oom", "oom_kill")
    LOW_FIELD_NUMBER: _ClassVar[int]
    HIGH_FIELD_NUMBER: _ClassVar[int]
    MAX_FIELD_NUMBER: _ClassVar[int]
    OOM_FIELD_NUMBER: _ClassVar[int]
    OOM_KILL_FIELD_NUMBER: _ClassVar[int]
    low: int
    high: int
    max: int
    oom: int
    oom_kill: int
    def __init__(self, low: _Optional[int] = ..., high: _Optional[int] = ..., max: _Optional[int] = ..., oom: _Optional[int] = ..., oom_kill: _Optional[int] = ...) -> None: ...

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

class IOStat(_message.Message):
    __slots__ = ("usage",)
    USAGE_FIELD_NUMBER: _ClassVar[int]
    usage: _containers.RepeatedCompositeFieldContainer[IOEntry]
    def __init__(self, usage: _Optional[_Iterable[_Union[IOEntry, _Mapping]]] = ...) -> None: ...

class IOEntry(_message.Message):
    __slots__ = ("major", "minor", "rbytes", "wbytes", "rios", "wios")
    MAJOR_FIELD_NUMBER: _ClassVar[int]
    MINOR_FIELD_NUMBER: _ClassVar[int]
    RBYTES_FIELD_NUMBER: _ClassVar[int]
    WBYTES_FIELD_NUMBER: _ClassVar[int]
    RIOS_FIELD_NUMBER: _ClassVar[int]
    WIOS_FIELD_NUMBER: _ClassVar[int]
    major: int
    minor: int
    rbytes: int
    wbytes: int
    rios: int
    wios: int
    def __init__(self, major: _Optional[int] = ..., minor: _Optional[int] = ..., rbytes: _Optional[int] = ..., wbytes: _Optional[int] = ..., rios: _Optional[int] = ..., wios: _Optional[int] = ...) -> None: ...

class HugeTlbStat(_message.Message):
    __slots__ = ("current", "max", "pagesize")
    CURRENT_FIELD_NUMBER: _ClassVar[int]
    MAX_FIELD_NUMBER: _ClassVar[int]
    PAGESIZE_FIELD_NUMBER: _ClassVar[int]
    current: int
    max: int
    pagesize: str
    def __init__(self, current: _Optional[int] = ..., max: _Optional[int] = ..., pagesize: _Optional[str] = ...) -> None: ...
