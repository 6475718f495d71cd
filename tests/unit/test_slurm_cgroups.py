"""Where a protected job's cgroups are, and what is removed after it: the mounted
hierarchies, the directories runc will create, and Slurm's own of the job."""

from __future__ import annotations

from pathlib import Path

from cedana_shim.slurm.cgroups import CreatedDirs, Hierarchy, hierarchies, slurm_dirs_of_job
from cedana_shim.slurm.job_spec import checkpoint_obstacle

MOUNTINFO = """\
31 23 0:28 / /sys/fs/cgroup rw,relatime - tmpfs tmpfs rw,mode=755
32 31 0:29 / /sys/fs/cgroup/cpu,cpuacct rw,nosuid,relatime - cgroup cgroup rw,cpu,cpuacct
35 31 0:32 / /sys/fs/cgroup/memory rw,relatime - cgroup cgroup rw,memory
40 31 0:37 / /sys/fs/cgroup/systemd rw,relatime - cgroup cgroup rw,xattr,name=systemd
41 31 0:38 / /sys/fs/cgroup/unified rw,relatime - cgroup2 cgroup2 rw,nsdelegate
50 31 0:32 /ns /mnt/other-memory rw,relatime - cgroup cgroup rw,memory
"""


def test_hierarchies_are_the_whole_cgroup_mounts_keyed_as_proc_cgroup_names_them() -> None:
    assert hierarchies(MOUNTINFO) == [
        Hierarchy("cpu,cpuacct", "/sys/fs/cgroup/cpu,cpuacct"),
        Hierarchy("memory", "/sys/fs/cgroup/memory"),
        Hierarchy("name=systemd", "/sys/fs/cgroup/systemd"),
        Hierarchy("", "/sys/fs/cgroup/unified"),
    ]
    assert Hierarchy("", "/sys/fs/cgroup").path("/a/b") == "/sys/fs/cgroup/a/b"


def test_slurm_dirs_of_a_job_are_those_below_and_at_its_job_cgroup_and_its_uid() -> None:
    v1 = "/slurm_node1/uid_1000/job_42/step_batch/task_0"
    assert slurm_dirs_of_job(v1, "42", 1000) == [
        v1,
        "/slurm_node1/uid_1000/job_42/step_batch",
        "/slurm_node1/uid_1000/job_42",
        "/slurm_node1/uid_1000",
    ]
    v2 = "/system.slice/slurmstepd.scope/job_42/step_batch/user/task_0"
    assert slurm_dirs_of_job(v2, "42", 1000)[-1] == "/system.slice/slurmstepd.scope/job_42"
    # Not this job's, not a job's at all, or something of ours below it: nothing.
    assert slurm_dirs_of_job("/slurm/uid_1000/job_43/step_batch", "42", 1000) == []
    assert slurm_dirs_of_job("/process_api/abc", "42", 0) == []
    assert slurm_dirs_of_job("/slurm/uid_0/job_42/step_batch/mine", "42", 0) == []


def test_created_dirs_are_the_missing_ancestors_and_go_once_empty(tmp_path: Path) -> None:
    pids, memory = tmp_path / "pids", tmp_path / "memory"
    (memory / "slurm" / "job_1").mkdir(parents=True)
    pids.mkdir()
    found = [Hierarchy("pids", str(pids)), Hierarchy("memory", str(memory))]
    created = CreatedDirs("/slurm/job_1/cedana-slurm-1.batch", found)
    assert sorted(created.missing) == [str(pids / "slurm"), str(pids / "slurm" / "job_1")]
    (pids / "slurm" / "job_1" / "cedana-slurm-1.batch").mkdir(parents=True)  # runc's mkdir -p
    (pids / "slurm" / "job_1" / "cedana-slurm-1.batch").rmdir()  # runc delete: the leaf
    (memory / "slurm" / "job_1" / "other").mkdir()
    created.remove()
    assert list(pids.iterdir()) == []
    assert (memory / "slurm" / "job_1" / "other").is_dir()  # never ours: stays


def test_a_checkpoint_obstacle_is_named_for_non_root_jobs_without_cap_sys_resource() -> None:
    full, without = "CapEff:\t000001ffffffffff\n", "CapEff:\t000001fffeffffff\n"
    assert checkpoint_obstacle(0, without) is None
    assert checkpoint_obstacle(1000, full) is None
    reason = checkpoint_obstacle(1000, without)
    assert reason is not None and "uid 1000" in reason and "CAP_SYS_RESOURCE" in reason
