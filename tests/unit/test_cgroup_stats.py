"""Metrics from fixture cgroup trees, checked value by value against what
containerd's cgroups library reports for the same files.

The expected numbers were cross-checked by running github.com/containerd/cgroups
(v1 controllers' ``Stat`` with ``IgnoreNotExist``, v2 ``Manager.Stat``) on these
exact trees.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest
from cedana_shim.api.cgroups.v1 import metrics_pb2 as v1pb
from cedana_shim.api.cgroups.v2 import metrics_pb2 as v2pb
from cedana_shim.errors import NotFound
from cedana_shim.task.cgroups import Cgroup, parse_mountinfo, resolve_cgroup
from cedana_shim.task.stats import (
    MAX_UINT32,
    MAX_UINT64,
    V1_TYPE_URL,
    V2_TYPE_URL,
    collect_metrics,
    metrics_v1,
    metrics_v2,
)

V1_UNLIMITED = 9223372036854771712  # PAGE_COUNTER_MAX * 4 KiB, what v1 shows for "no limit"

# -- fixture trees ------------------------------------------------------------------

V1_MEMORY_STAT = """\
cache 9076736
rss 1961984
rss_huge 2097152
shmem 4096
mapped_file 8192
dirty 90112
writeback 4096
workingset_refault_anon 0
workingset_refault_file 2336
swap 0
swapcached 0
pgpgin 33186
pgpgout 30495
pgfault 72218
pgmajfault 18
inactive_anon 1728512
active_anon 8192
inactive_file 6725632
active_file 2351104
unevictable 12288
hierarchical_memory_limit 16777216
hierarchical_memsw_limit 9223372036854771712
total_cache 9076737
total_rss 1961985
total_rss_huge 2097153
total_shmem 4096
total_mapped_file 8193
total_dirty 90113
total_writeback 4097
total_workingset_refault_anon 0
total_workingset_refault_file 2336
total_swap 0
total_swapcached 0
total_pgpgin 33187
total_pgpgout 30496
total_pgfault 72219
total_pgmajfault 19
total_inactive_anon 1728513
total_active_anon 8193
total_inactive_file 6725633
total_active_file 2351105
total_unevictable 12289
"""

V1_THROTTLE_BYTES = """\
8:0 Read 4096
8:0 Write 8192
8:0 Sync 12288
8:0 Async 0
8:0 Discard 0
8:0 Total 12288
253:1 Read 100
253:1 Write 0
253:1 Sync 0
253:1 Async 100
253:1 Discard 0
253:1 Total 100
Total 12388
"""

V1_THROTTLE_SERVICED = """\
8:0 Read 1
8:0 Write 2
8:0 Sync 3
8:0 Async 0
8:0 Discard 0
8:0 Total 3
Total 3
"""

PARTITIONS = """\
major minor  #blocks  name

   8        0  104857600 sda
   8        1  104856576 sda1
 253        1    1048576 dm-1
   8        0  104857600 sda-duplicate
"""


def _write(directory: Path, files: dict[str, str]) -> None:
    directory.mkdir(parents=True, exist_ok=True)
    for name, content in files.items():
        (directory / name).write_text(content)


def write_v1_tree(root: Path) -> Cgroup:
    """A container cgroup in every v1 controller, cpu and cpuacct mounted together."""
    mem = root / "memory" / "ctr"
    _write(
        mem,
        {
            "memory.stat": V1_MEMORY_STAT,
            "memory.oom_control": "oom_kill_disable 0\nunder_oom 1\noom_kill 3\n",
            "memory.usage_in_bytes": "11038720\n",
            "memory.max_usage_in_bytes": "16777216\n",
            "memory.failcnt": "42\n",
            "memory.limit_in_bytes": "16777216\n",
            "memory.memsw.usage_in_bytes": "11038721\n",
            "memory.memsw.max_usage_in_bytes": "16777217\n",
            "memory.memsw.failcnt": "7\n",
            "memory.memsw.limit_in_bytes": f"{V1_UNLIMITED}\n",
            "memory.kmem.usage_in_bytes": "1234944\n",
            "memory.kmem.max_usage_in_bytes": "2097152\n",
            "memory.kmem.failcnt": "0\n",
            "memory.kmem.limit_in_bytes": f"{V1_UNLIMITED}\n",
            "memory.kmem.tcp.usage_in_bytes": "0\n",
            "memory.kmem.tcp.max_usage_in_bytes": "4096\n",
            "memory.kmem.tcp.failcnt": "0\n",
            "memory.kmem.tcp.limit_in_bytes": f"{V1_UNLIMITED}\n",
            "memory.soft_limit_in_bytes": "-1\n",
            "cgroup.procs": "",
        },
    )
    cpu = root / "cpu,cpuacct" / "ctr"
    _write(
        cpu,
        {
            "cpu.stat": (
                "nr_periods 120\nnr_throttled 7\nthrottled_time 35000000\nnr_bursts 0\n"
                "burst_time 0\n"
            ),
            "cpu.cfs_quota_us": "-1\n",
            "cpuacct.stat": "user 150\nsystem 25\n",
            "cpuacct.usage": "1800000000\n",
            "cpuacct.usage_percpu": "900000000 600000000 300000000 0 \n",
        },
    )
    pids = root / "pids" / "ctr"
    _write(pids, {"pids.current": "5\n", "pids.max": "max\n"})
    blkio = root / "blkio" / "ctr"
    _write(
        blkio,
        {
            "blkio.throttle.io_service_bytes": V1_THROTTLE_BYTES,
            "blkio.throttle.io_serviced": V1_THROTTLE_SERVICED,
            "blkio.throttle.io_service_bytes_recursive": V1_THROTTLE_BYTES,
            "blkio.bfq.io_serviced_recursive": "Total 0\n",
        },
    )
    hugetlb = root / "hugetlb" / "ctr"
    _write(
        hugetlb,
        {
            "hugetlb.2MB.usage_in_bytes": "4194304\n",
            "hugetlb.2MB.max_usage_in_bytes": "6291456\n",
            "hugetlb.2MB.failcnt": "1\n",
            "hugetlb.2MB.limit_in_bytes": f"{V1_UNLIMITED}\n",
            "hugetlb.2MB.rsvd.usage_in_bytes": "0\n",
            "hugetlb.1GB.usage_in_bytes": "0\n",
            "hugetlb.1GB.max_usage_in_bytes": "1073741824\n",
            "hugetlb.1GB.failcnt": "0\n",
            "hugetlb.1GB.limit_in_bytes": f"{V1_UNLIMITED}\n",
        },
    )
    rdma = root / "rdma" / "ctr"
    _write(
        rdma,
        {
            "rdma.current": (
                "mlx5_0 hca_handle=2 hca_object=20\nmlx5_1 hca_handle=0 hca_object=0\n"
            ),
            "rdma.max": (
                "mlx5_0 hca_handle=max hca_object=1000\nmlx5_1 hca_handle=5 hca_object=max\n"
            ),
        },
    )
    proc = root / "proc"
    _write(proc, {"partitions": PARTITIONS})
    return Cgroup.v1(
        {
            "memory": str(mem),
            "cpu": str(cpu),
            "cpuacct": str(cpu),
            "pids": str(pids),
            "blkio": str(blkio),
            "hugetlb": str(hugetlb),
            "rdma": str(rdma),
            "name=systemd": str(root / "systemd" / "ctr"),
        }
    )


V2_MEMORY_STAT = """\
anon 1589248
file 7520256
kernel 1662976
kernel_stack 65536
pagetables 106496
sec_pagetables 0
percpu 5424
sock 4096
vmalloc 8192
shmem 12288
zswap 0
zswapped 0
file_mapped 1339392
file_dirty 24576
file_writeback 8192
swapcached 0
anon_thp 2097152
file_thp 0
shmem_thp 0
inactive_anon 1581056
active_anon 20480
inactive_file 5017600
active_file 2490368
unevictable 16384
slab_reclaimable 1104552
slab_unreclaimable 350872
slab 1455424
workingset_refault_anon 0
workingset_refault_file 11
workingset_activate_anon 0
workingset_activate_file 3
workingset_restore_anon 0
workingset_restore_file 0
workingset_nodereclaim 7
pgdemote_kswapd 0
pgscan 123
pgsteal 120
pgscan_kswapd 0
pgscan_direct 123
pgsteal_kswapd 0
pgsteal_direct 120
pgfault 6021
pgmajfault 14
pgrefill 9
pgactivate 310
pgdeactivate 8
pglazyfree 2
pglazyfreed 1
zswpin 0
zswpout 0
thp_fault_alloc 4
thp_collapse_alloc 1
"""


def write_v2_tree(root: Path) -> Cgroup:
    path = root / "kubepods" / "ctr"
    _write(
        path,
        {
            "cgroup.controllers": "cpuset cpu io memory hugetlb pids rdma misc\n",
            "cgroup.events": "populated 1\nfrozen 0\n",
            "cpu.stat": (
                "usage_usec 2500000\nuser_usec 2000000\nsystem_usec 500000\n"
                "core_sched.force_idle_usec 0\nnr_periods 50\nnr_throttled 3\n"
                "throttled_usec 12000\nnr_bursts 0\nburst_usec 0\n"
            ),
            "cpu.max": "max 100000\n",
            "memory.stat": V2_MEMORY_STAT,
            "memory.current": "52428800\n",
            "memory.max": "max\n",
            "memory.swap.current": "4096\n",
            "memory.swap.max": "max\n",
            "memory.events": "low 0\nhigh 5\nmax 12\noom 2\noom_kill 1\noom_group_kill 0\n",
            "pids.current": "7\n",
            "pids.max": "100\n",
            "io.stat": (
                "8:0 rbytes=4096 wbytes=8192 rios=1 wios=2 dbytes=0 dios=0\n"
                "253:1 rbytes=10 wbytes=20 rios=3 wios=4 dbytes=0 dios=0\n"
            ),
            "rdma.current": "mlx5_0 hca_handle=2 hca_object=20\n",
            "rdma.max": "mlx5_0 hca_handle=max hca_object=1000\n",
            "hugetlb.2MB.current": "2097152\n",
            "hugetlb.2MB.max": "max\n",
            "hugetlb.2MB.rsvd.current": "0\n",
            "hugetlb.2MB.rsvd.max": "max\n",
            "hugetlb.2MB.events": "max 0\n",
            "hugetlb.1GB.current": "0\n",
            "hugetlb.1GB.max": "1073741824\n",
        },
    )
    return Cgroup.v2(str(path))


# -- cgroup v1 ----------------------------------------------------------------------


def test_v1_any_type_url_is_bare_and_value_decodes(tmp_path: Path) -> None:
    cg = write_v1_tree(tmp_path)
    any_msg = collect_metrics(cg, proc=str(tmp_path / "proc"))
    assert any_msg.type_url == "io.containerd.cgroups.v1.Metrics" == V1_TYPE_URL
    decoded = v1pb.Metrics.FromString(any_msg.value)
    assert decoded == metrics_v1(cg, proc=str(tmp_path / "proc"))
    assert decoded.memory.usage.usage == 11038720


def test_v1_pids_and_cpu(tmp_path: Path) -> None:
    m = metrics_v1(write_v1_tree(tmp_path), proc=str(tmp_path / "proc"))
    assert m.HasField("pids")
    assert (m.pids.current, m.pids.limit) == (5, 0)  # v1 reports "max" as 0
    assert m.cpu.usage.total == 1800000000
    assert m.cpu.usage.user == 1_500_000_000  # 150 ticks of 1/100 s
    assert m.cpu.usage.kernel == 250_000_000
    assert list(m.cpu.usage.per_cpu) == [900000000, 600000000, 300000000, 0]
    assert (m.cpu.throttling.periods, m.cpu.throttling.throttled_periods) == (120, 7)
    assert m.cpu.throttling.throttled_time == 35000000


def test_v1_memory(tmp_path: Path) -> None:
    mem = metrics_v1(write_v1_tree(tmp_path), proc=str(tmp_path / "proc")).memory
    expected_stat = {
        "cache": 9076736,
        "rss": 1961984,
        "rss_huge": 2097152,
        "mapped_file": 8192,
        "dirty": 90112,
        "writeback": 4096,
        "pg_pg_in": 33186,
        "pg_pg_out": 30495,
        "pg_fault": 72218,
        "pg_maj_fault": 18,
        "inactive_anon": 1728512,
        "active_anon": 8192,
        "inactive_file": 6725632,
        "active_file": 2351104,
        "unevictable": 12288,
        "hierarchical_memory_limit": 16777216,
        "hierarchical_swap_limit": V1_UNLIMITED,
        "total_cache": 9076737,
        "total_rss": 1961985,
        "total_rss_huge": 2097153,
        "total_mapped_file": 8193,
        "total_dirty": 90113,
        "total_writeback": 4097,
        "total_pg_pg_in": 33187,
        "total_pg_pg_out": 30496,
        "total_pg_fault": 72219,
        "total_pg_maj_fault": 19,
        "total_inactive_anon": 1728513,
        "total_active_anon": 8193,
        "total_inactive_file": 6725633,
        "total_active_file": 2351105,
        "total_unevictable": 12289,
    }
    assert {k: getattr(mem, k) for k in expected_stat} == expected_stat

    def entry(e: v1pb.MemoryEntry) -> tuple[int, int, int, int]:
        return (e.usage, e.max, e.failcnt, e.limit)

    assert entry(mem.usage) == (11038720, 16777216, 42, 16777216)
    assert entry(mem.swap) == (11038721, 16777217, 7, V1_UNLIMITED)
    assert entry(mem.kernel) == (1234944, 2097152, 0, V1_UNLIMITED)
    assert entry(mem.kernel_tcp) == (0, 4096, 0, V1_UNLIMITED)


def test_v1_oom_control(tmp_path: Path) -> None:
    m = metrics_v1(write_v1_tree(tmp_path), proc=str(tmp_path / "proc"))
    assert m.HasField("memory_oom_control")
    oom = m.memory_oom_control
    assert (oom.oom_kill_disable, oom.under_oom, oom.oom_kill) == (0, 1, 3)


def _blkio(entries: object) -> list[tuple[str, int, int, str, int]]:
    return [(e.device, e.major, e.minor, e.op, e.value) for e in entries]  # type: ignore[attr-defined]


def test_v1_blkio_throttle_fallback(tmp_path: Path) -> None:
    m = metrics_v1(write_v1_tree(tmp_path), proc=str(tmp_path / "proc"))
    # No blkio.io_serviced_recursive (no CFQ): only the two throttle files, and the
    # first /proc/partitions name wins for a device number.
    assert _blkio(m.blkio.io_service_bytes_recursive) == [
        ("/dev/sda", 8, 0, "Read", 4096),
        ("/dev/sda", 8, 0, "Write", 8192),
        ("/dev/sda", 8, 0, "Sync", 12288),
        ("/dev/sda", 8, 0, "Async", 0),
        ("/dev/sda", 8, 0, "Discard", 0),
        ("/dev/sda", 8, 0, "Total", 12288),
        ("/dev/dm-1", 253, 1, "Read", 100),
        ("/dev/dm-1", 253, 1, "Write", 0),
        ("/dev/dm-1", 253, 1, "Sync", 0),
        ("/dev/dm-1", 253, 1, "Async", 100),
        ("/dev/dm-1", 253, 1, "Discard", 0),
        ("/dev/dm-1", 253, 1, "Total", 100),
    ]
    assert _blkio(m.blkio.io_serviced_recursive) == [
        ("/dev/sda", 8, 0, "Read", 1),
        ("/dev/sda", 8, 0, "Write", 2),
        ("/dev/sda", 8, 0, "Sync", 3),
        ("/dev/sda", 8, 0, "Async", 0),
        ("/dev/sda", 8, 0, "Discard", 0),
        ("/dev/sda", 8, 0, "Total", 3),
    ]
    assert len(m.blkio.io_queued_recursive) == 0
    assert len(m.blkio.sectors_recursive) == 0


def test_v1_blkio_cfq_files_win_when_they_have_data(tmp_path: Path) -> None:
    cg = write_v1_tree(tmp_path)
    blkio = Path(cg.controllers["blkio"])
    _write(
        blkio,
        {
            "blkio.io_serviced_recursive": "8:0 Read 11\n8:0 Write 12\nTotal 23\n",
            "blkio.io_service_bytes_recursive": "8:0 Read 4096\nTotal 4096\n",
            "blkio.sectors_recursive": "8:0 80\n",
            "blkio.time_recursive": "8:0 1234\n",
            "blkio.io_queued_recursive": "Total 0\n",
            "blkio.io_service_time_recursive": "",
            "blkio.io_wait_time_recursive": "",
            "blkio.io_merged_recursive": "",
        },
    )
    m = metrics_v1(cg, proc=str(tmp_path / "proc"))
    assert _blkio(m.blkio.io_serviced_recursive) == [
        ("/dev/sda", 8, 0, "Read", 11),
        ("/dev/sda", 8, 0, "Write", 12),
    ]
    assert _blkio(m.blkio.io_service_bytes_recursive) == [("/dev/sda", 8, 0, "Read", 4096)]
    assert _blkio(m.blkio.sectors_recursive) == [("/dev/sda", 8, 0, "", 80)]
    assert _blkio(m.blkio.io_time_recursive) == [("/dev/sda", 8, 0, "", 1234)]


def test_v1_hugetlb_in_upstream_order(tmp_path: Path) -> None:
    m = metrics_v1(write_v1_tree(tmp_path), proc=str(tmp_path / "proc"))
    # upstream walks /sys/kernel/mm/hugepages: hugepages-1048576kB sorts first
    assert [(h.pagesize, h.usage, h.max, h.failcnt) for h in m.hugetlb] == [
        ("1GB", 0, 1073741824, 0),
        ("2MB", 4194304, 6291456, 1),
    ]


def test_v1_rdma(tmp_path: Path) -> None:
    rdma = metrics_v1(write_v1_tree(tmp_path), proc=str(tmp_path / "proc")).rdma
    assert [(e.device, e.hca_handles, e.hca_objects) for e in rdma.current] == [
        ("mlx5_0", 2, 20),
        ("mlx5_1", 0, 0),
    ]
    assert [(e.device, e.hca_handles, e.hca_objects) for e in rdma.limit] == [
        ("mlx5_0", MAX_UINT32, 1000),
        ("mlx5_1", 5, MAX_UINT32),
    ]


def test_v1_missing_controllers_are_skipped(tmp_path: Path) -> None:
    cg = write_v1_tree(tmp_path)
    for name in ("pids", "blkio", "hugetlb", "rdma"):
        shutil.rmtree(cg.controllers[name])
    m = metrics_v1(cg, proc=str(tmp_path / "proc"))
    assert not m.HasField("pids")
    assert not m.HasField("blkio")
    assert not m.HasField("rdma")
    assert len(m.hugetlb) == 0
    assert m.memory.usage.usage == 11038720
    assert m.cpu.usage.total == 1800000000


def test_v1_cgroup_without_controllers_mapped(tmp_path: Path) -> None:
    cg = write_v1_tree(tmp_path)
    only_memory = Cgroup.v1({"memory": cg.controllers["memory"]})
    m = metrics_v1(only_memory, proc=str(tmp_path / "proc"))
    # The CPU sub-messages are always present, as upstream pre-creates them.
    assert m.HasField("cpu") and m.cpu.HasField("usage") and m.cpu.usage.total == 0
    assert not m.HasField("pids")
    assert m.memory.usage.usage == 11038720


def test_v1_missing_files_inside_a_controller(tmp_path: Path) -> None:
    cg = write_v1_tree(tmp_path)
    mem = Path(cg.controllers["memory"])
    for name in mem.glob("memory.memsw.*"):  # no swap accounting on this kernel
        name.unlink()
    (mem / "memory.oom_control").unlink()
    (Path(cg.controllers["cpuacct"]) / "cpuacct.usage_percpu").unlink()
    m = metrics_v1(cg, proc=str(tmp_path / "proc"))
    assert m.memory.HasField("swap")  # always sent, zero here
    assert (m.memory.swap.usage, m.memory.swap.limit) == (0, 0)
    # Unlike upstream, a missing memsw does not also lose the kmem values.
    assert m.memory.kernel.usage == 1234944
    assert not m.HasField("memory_oom_control")
    assert m.cpu.usage.total == 1800000000 and list(m.cpu.usage.per_cpu) == []


def test_v1_negative_and_malformed_values(tmp_path: Path) -> None:
    cg = write_v1_tree(tmp_path)
    mem = Path(cg.controllers["memory"])
    (mem / "memory.failcnt").write_text("-1\n")  # upstream's parseUint: negative is 0
    (mem / "memory.stat").write_text("cache 5\nbroken line here\nrss x\nrss_huge 7\n")
    m = metrics_v1(cg, proc=str(tmp_path / "proc"))
    assert m.memory.usage.failcnt == 0
    assert (m.memory.cache, m.memory.rss, m.memory.rss_huge) == (5, 0, 7)


def test_v1_vanished_cgroup_is_not_found(tmp_path: Path) -> None:
    cg = write_v1_tree(tmp_path)
    for directory in cg.dirs:
        shutil.rmtree(directory, ignore_errors=True)
    with pytest.raises(NotFound):
        collect_metrics(cg, proc=str(tmp_path / "proc"))


def test_v1_vanished_memory_cgroup_is_not_found(tmp_path: Path) -> None:
    # The container may share e.g. its blkio cgroup with its parent, which stays.
    cg = write_v1_tree(tmp_path)
    shutil.rmtree(cg.controllers["memory"])
    with pytest.raises(NotFound):
        collect_metrics(cg, proc=str(tmp_path / "proc"))
    no_memory = Cgroup.v1({k: v for k, v in cg.controllers.items() if k != "memory"})
    assert metrics_v1(no_memory, proc=str(tmp_path / "proc")).pids.current == 5


# -- cgroup v2 ----------------------------------------------------------------------


def test_v2_any_type_url_is_bare_and_value_decodes(tmp_path: Path) -> None:
    cg = write_v2_tree(tmp_path)
    any_msg = collect_metrics(cg)
    assert any_msg.type_url == "io.containerd.cgroups.v2.Metrics" == V2_TYPE_URL
    assert v2pb.Metrics.FromString(any_msg.value) == metrics_v2(cg)


def test_v2_values(tmp_path: Path) -> None:
    m = metrics_v2(write_v2_tree(tmp_path))
    assert (m.pids.current, m.pids.limit) == (7, 100)
    cpu = m.cpu
    assert (cpu.usage_usec, cpu.user_usec, cpu.system_usec) == (2500000, 2000000, 500000)
    assert (cpu.nr_periods, cpu.nr_throttled, cpu.throttled_usec) == (50, 3, 12000)
    mem = m.memory
    expected = {
        "anon": 1589248,
        "file": 7520256,
        "kernel_stack": 65536,
        "slab": 1455424,
        "sock": 4096,
        "shmem": 12288,
        "file_mapped": 1339392,
        "file_dirty": 24576,
        "file_writeback": 8192,
        "anon_thp": 2097152,
        "inactive_anon": 1581056,
        "active_anon": 20480,
        "inactive_file": 5017600,
        "active_file": 2490368,
        "unevictable": 16384,
        "slab_reclaimable": 1104552,
        "slab_unreclaimable": 350872,
        "pgfault": 6021,
        "pgmajfault": 14,
        # these three were renamed *_anon/*_file in Linux 5.9; upstream reads the old names
        "workingset_refault": 0,
        "workingset_activate": 0,
        "workingset_nodereclaim": 7,
        "pgrefill": 9,
        "pgscan": 123,
        "pgsteal": 120,
        "pgactivate": 310,
        "pgdeactivate": 8,
        "pglazyfree": 2,
        "pglazyfreed": 1,
        "thp_fault_alloc": 4,
        "thp_collapse_alloc": 1,
        "usage": 52428800,
        "usage_limit": MAX_UINT64,
        "swap_usage": 4096,
        "swap_limit": MAX_UINT64,
    }
    assert {k: getattr(mem, k) for k in expected} == expected
    ev = m.memory_events
    assert (ev.low, ev.high, ev.max, ev.oom, ev.oom_kill) == (0, 5, 12, 2, 1)
    assert [(e.major, e.minor, e.rbytes, e.wbytes, e.rios, e.wios) for e in m.io.usage] == [
        (8, 0, 4096, 8192, 1, 2),
        (253, 1, 10, 20, 3, 4),
    ]
    assert [(e.device, e.hca_handles, e.hca_objects) for e in m.rdma.current] == [("mlx5_0", 2, 20)]
    assert [(e.device, e.hca_handles, e.hca_objects) for e in m.rdma.limit] == [
        ("mlx5_0", MAX_UINT32, 1000)
    ]
    assert [(h.pagesize, h.current, h.max) for h in m.hugetlb] == [
        ("2MB", 2097152, MAX_UINT64),
        ("1GB", 0, 1073741824),
    ]


def test_v2_unlimited_pids_is_max_uint64(tmp_path: Path) -> None:
    cg = write_v2_tree(tmp_path)
    (Path(cg.path) / "pids.max").write_text("max\n")
    assert metrics_v2(cg).pids.limit == MAX_UINT64 == 2**64 - 1


def test_v2_stat_files_of_disabled_controllers_are_not_read(tmp_path: Path) -> None:
    cg = write_v2_tree(tmp_path)
    (Path(cg.path) / "cgroup.controllers").write_text("pids\n")
    m = metrics_v2(cg)
    # As upstream: cpu.stat/memory.stat count only when their controller is enabled.
    assert m.cpu.usage_usec == 0 and m.memory.anon == 0
    assert m.memory.usage == 52428800  # single-value files are read regardless
    assert m.pids.current == 7


def test_v2_missing_controllers_are_skipped(tmp_path: Path) -> None:
    path = tmp_path / "bare"
    _write(path, {"cgroup.controllers": "\n", "cpu.stat": "usage_usec 10\n"})
    m = metrics_v2(Cgroup.v2(str(path)))
    # upstream always sends these, zero-filled
    for name in ("pids", "cpu", "memory", "io", "rdma"):
        assert m.HasField(name), name
    assert (m.pids.current, m.pids.limit, m.memory.usage, m.memory.usage_limit) == (0, 0, 0, 0)
    assert not m.HasField("memory_events")
    assert len(m.hugetlb) == 0 and len(m.io.usage) == 0


def test_v2_vanished_cgroup_is_not_found(tmp_path: Path) -> None:
    cg = write_v2_tree(tmp_path)
    shutil.rmtree(cg.path)
    with pytest.raises(NotFound):
        collect_metrics(cg)


# -- locating a cgroup --------------------------------------------------------------

HYBRID_MOUNTINFO = """\
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
32 31 0:29 / /sys/fs/cgroup/cpu,cpuacct rw,relatime shared:9 - cgroup cgroup rw,cpu,cpuacct
35 31 0:32 / /sys/fs/cgroup/memory rw,relatime shared:12 - cgroup cgroup rw,memory
39 31 0:36 / /sys/fs/cgroup/pids rw,relatime - cgroup cgroup rw,pids
40 31 0:37 / /sys/fs/cgroup/systemd rw,relatime - cgroup cgroup rw,xattr,name=systemd
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw,nsdelegate
60 22 0:50 / /proc rw,nosuid - proc proc rw
"""

HYBRID_PROC_CGROUP = """\
12:pids:/kubepods/pod1/ctr
9:name=systemd:/kubepods/pod1/ctr
4:memory:/kubepods/pod1/ctr
2:cpu,cpuacct:/kubepods/pod1/ctr
1:net_cls:/
0::/kubepods/pod1/ctr
"""


def test_resolve_v1_hybrid_with_combined_mount() -> None:
    cg = resolve_cgroup(HYBRID_PROC_CGROUP, HYBRID_MOUNTINFO)
    assert cg.version == 1
    assert dict(cg.controllers) == {
        "pids": "/sys/fs/cgroup/pids/kubepods/pod1/ctr",
        "name=systemd": "/sys/fs/cgroup/systemd/kubepods/pod1/ctr",
        "memory": "/sys/fs/cgroup/memory/kubepods/pod1/ctr",
        "cpu": "/sys/fs/cgroup/cpu,cpuacct/kubepods/pod1/ctr",
        "cpuacct": "/sys/fs/cgroup/cpu,cpuacct/kubepods/pod1/ctr",
    }  # net_cls is not mounted, so it is left out
    assert cg.memory_dir == "/sys/fs/cgroup/memory/kubepods/pod1/ctr"
    assert cg.controller_dir("blkio") is None


def test_resolve_nested_mount_root_and_unusual_mount_point() -> None:
    # Inside a container: each hierarchy is mounted at its sub-cgroup, and here at a
    # mount point with a space (written \040 by the kernel).
    mountinfo = (
        "100 99 0:32 /docker/abc /cg\\040root/mem rw - cgroup cgroup rw,memory\n"
        "101 99 0:29 /docker/abc /cg\\040root/cpu rw - cgroup cgroup rw,cpuacct,cpu\n"
        "102 99 0:29 / /host/cpu rw - cgroup cgroup rw,cpuacct,cpu\n"
    )
    proc_cgroup = "4:memory:/docker/abc/inner\n2:cpu,cpuacct:/docker/abc\n"
    cg = resolve_cgroup(proc_cgroup, mountinfo)
    assert cg.controllers["memory"] == "/cg root/mem/inner"
    # Both mounts show the cgroup; the one rooted deeper wins.
    assert cg.controllers["cpu"] == "/cg root/cpu"


def test_resolve_v2_unified() -> None:
    mountinfo = "29 23 0:26 / /sys/fs/cgroup rw,nosuid - cgroup2 cgroup2 rw,nsdelegate\n"
    cg = resolve_cgroup("0::/system.slice/containerd.service\n", mountinfo)
    assert cg == Cgroup.v2("/sys/fs/cgroup/system.slice/containerd.service")
    nested = resolve_cgroup(
        "0::/kubepods/pod1/ctr\n",
        "29 23 0:26 /kubepods /mnt/cg rw - cgroup2 cgroup2 rw\n",
    )
    assert nested.path == "/mnt/cg/pod1/ctr"


def test_resolve_outside_every_mount_is_not_found() -> None:
    with pytest.raises(NotFound):
        resolve_cgroup("0::/a\n", "29 23 0:26 /b /sys/fs/cgroup rw - cgroup2 cgroup2 rw\n")
    with pytest.raises(NotFound):
        resolve_cgroup("4:memory:/a\n", "60 22 0:50 / /proc rw,nosuid - proc proc rw\n")


def test_mountinfo_optional_fields_and_bad_lines() -> None:
    mounts = parse_mountinfo(
        "garbage\n"
        "35 31 0:32 / /sys/fs/cgroup/memory rw shared:12 master:3 - cgroup cgroup rw,memory\n"
    )
    assert len(mounts) == 1
    assert mounts[0].mount_point == "/sys/fs/cgroup/memory"
    assert "memory" in mounts[0].super_options


def test_cgroup_value_checks() -> None:
    with pytest.raises(ValueError):
        Cgroup(version=2)
    with pytest.raises(ValueError):
        Cgroup(version=1, path="/x")
    source = {"memory": "/a"}
    cg = Cgroup.v1(source)
    source["memory"] = "/b"
    assert cg.controllers["memory"] == "/a"
    assert cg == Cgroup.v1({"memory": "/a"}) and hash(cg) == hash(Cgroup.v1({"memory": "/a"}))
