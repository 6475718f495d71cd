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

from typing import TYPE_CHECKING

from cedana_shim.task.cgroups import Cgroup
from cedana_shim.task.stats_common import MAX_UINT32, MAX_UINT64
from cedana_shim.task.stats_v1 import metrics_v1
from cedana_shim.task.stats_v2 import metrics_v2

if TYPE_CHECKING:
    from google.protobuf.any_pb2 import Any

__all__ = [
    "MAX_UINT32",
    "MAX_UINT64",
    "V1_TYPE_URL",
    "V2_TYPE_URL",
    "collect_metrics",
    "metrics_v1",
    "metrics_v2",
]

V1_TYPE_URL = "io.containerd.cgroups.v1.Metrics"
V2_TYPE_URL = "io.containerd.cgroups.v2.Metrics"


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
