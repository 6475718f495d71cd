"""The OCI spec of a Slurm job: the host's mounts as external binds, the job's
identity and limits, the namespaces, and what the pipeline is shown of it."""

from __future__ import annotations

import pytest
from cedana_shim.errors import InvalidArgument
from cedana_shim.slurm.job_host import checkpoint_view
from cedana_shim.slurm.job_spec import (
    INIT_SCRIPT,
    HostMount,
    JobRequest,
    build_spec,
    capabilities,
    container_cgroup,
    host_mounts,
    job_cgroup,
)

MOUNTINFO = """\
22 1 8:1 / / rw,relatime shared:1 - ext4 /dev/sda1 rw
23 22 0:5 / /proc rw,nosuid,nodev,noexec shared:2 - proc proc rw
24 23 0:6 / /proc/sys/fs/binfmt_misc rw shared:3 - binfmt_misc binfmt_misc rw
25 22 0:7 / /sys rw,nosuid,nodev,noexec shared:4 - sysfs sysfs rw
26 22 0:8 / /dev rw,nosuid shared:5 - devtmpfs udev rw
27 26 0:9 / /dev/pts rw,nosuid,noexec shared:6 - devpts devpts rw
28 26 0:10 / /dev/shm rw,nosuid,nodev shared:7 - tmpfs tmpfs rw
29 22 0:11 / /home ro,nosuid shared:8 - nfs4 srv:/home rw
30 22 0:12 / /tmp rw,nosuid,nodev shared:9 - tmpfs tmpfs rw
31 30 0:13 / /tmp/job-42/rootfs rw shared:10 - overlay overlay rw
32 22 0:14 / /run/user/1000 rw,nosuid,nodev shared:11 - tmpfs tmpfs rw
33 22 0:15 / /scratch\\040space rw shared:12 - lustre lfs rw
34 22 0:16 / /mnt/fuse rw shared:13 - fuse.sshfs sshfs rw
35 27 0:9 / /dev/pts rw,nosuid,noexec shared:6 - devpts devpts rw
36 22 0:17 / /var/lib/docker/overlay2/x/merged rw shared:14 - overlay overlay rw
"""


def request(**changes: object) -> JobRequest:
    values: dict[str, object] = {
        "job_id": "42",
        "step_id": "batch",
        "uid": 1000,
        "gid": 1000,
        "gids": (1000, 27),
        "cwd": "/home/ada",
        "argv": ("/home/ada/victim.sh", "--fast"),
        "env": {"PATH": "/usr/bin:/bin", "CEDANA_CHECKPOINT": "victim"},
        "umask": 0o027,
    }
    values.update(changes)
    return JobRequest(**values)  # type: ignore[arg-type]


def test_host_mounts_are_the_stable_ones_parents_first_each_once() -> None:
    mounts = host_mounts(MOUNTINFO)
    assert [m.path for m in mounts] == [
        "/sys",
        "/dev",
        "/home",
        "/tmp",
        "/scratch space",
        "/dev/shm",
        "/dev/pts",
    ]
    by_path = {m.path: m for m in mounts}
    assert by_path["/home"].options == ("ro", "nosuid")
    assert by_path["/dev/pts"].options == ("nosuid", "noexec")


def test_job_cgroup_prefers_v2_else_the_memory_controller() -> None:
    assert job_cgroup("0::/system.slice/slurmstepd.scope/job_42/step_batch\n") == (
        "/system.slice/slurmstepd.scope/job_42/step_batch"
    )
    v1 = "12:cpu,cpuacct:/slurm/uid_1000/job_42\n4:memory:/slurm/uid_1000/job_42/step_batch\n"
    assert job_cgroup(v1) == "/slurm/uid_1000/job_42/step_batch"
    assert job_cgroup("1:name=systemd:/a\n") == "/"
    assert container_cgroup("/a/b", request()) == "/a/b/cedana-slurm-42.batch"


def test_capabilities_bounding_from_the_task_others_only_for_root() -> None:
    status = "Name:\tx\nCapEff:\t0000000000000041\nCapBnd:\t0000000000000043\n"
    user = capabilities(1000, status)
    assert user["bounding"] == ["CAP_CHOWN", "CAP_DAC_OVERRIDE", "CAP_SETGID"]
    assert user["effective"] == user["permitted"] == user["ambient"] == []
    root = capabilities(0, status)
    assert root["effective"] == root["permitted"] == ["CAP_CHOWN", "CAP_SETGID"]


def test_spec_runs_the_job_as_its_user_in_new_pid_and_mount_namespaces_only() -> None:
    rlimits = [{"type": "RLIMIT_NOFILE", "soft": 1024, "hard": 4096}]
    spec = build_spec(
        request(),
        rootfs="/run/cedana/slurm/roots/42.batch",
        mounts=[HostMount("/home", ("ro",)), HostMount("/dev/shm", ())],
        cgroup="/slurm/job_42/cedana-slurm-42.batch",
        rlimits=rlimits,
        proc_status="CapEff:\t0\nCapBnd:\t1\n",
    )
    process = spec["process"]
    assert process["user"] == {
        "uid": 1000,
        "gid": 1000,
        "umask": 0o027,
        "additionalGids": [1000, 27],
    }
    assert process["args"] == [
        "/bin/sh", "-c", INIT_SCRIPT, "cedana-job-init", "/home/ada/victim.sh", "--fast"
    ]  # fmt: skip
    assert process["env"] == ["PATH=/usr/bin:/bin", "CEDANA_CHECKPOINT=victim"]
    assert process["cwd"] == "/home/ada"
    assert process["rlimits"] == rlimits
    assert process["terminal"] is False
    assert spec["root"] == {"path": "/run/cedana/slurm/roots/42.batch", "readonly": False}
    assert spec["linux"]["namespaces"] == [{"type": "pid"}, {"type": "mount"}]
    assert spec["linux"]["cgroupsPath"] == "/slurm/job_42/cedana-slurm-42.batch"
    assert spec["mounts"] == [
        {"destination": "/proc", "type": "proc", "source": "proc", "options": []},
        {"destination": "/home", "type": "bind", "source": "/home", "options": ["bind", "ro"]},
        {"destination": "/dev/shm", "type": "bind", "source": "/dev/shm", "options": ["bind"]},
    ]
    # The pipeline never sees the node's /dev/shm (it would save and restore it).
    view = checkpoint_view(spec)
    assert [m["destination"] for m in view["mounts"]] == ["/proc", "/home"]
    assert len(spec["mounts"]) == 3


@pytest.mark.parametrize(
    ("changes", "message"),
    [({"argv": ()}, "no command"), ({"cwd": "relative"}, "not absolute")],
)
def test_spec_refuses_what_cannot_run(changes: dict[str, object], message: str) -> None:
    with pytest.raises(InvalidArgument, match=message):
        build_spec(request(**changes), rootfs="/r", mounts=[], cgroup="/c", rlimits=[])


def test_the_pipeline_sees_the_gpus_slurm_gave_the_job() -> None:
    from cedana_shim.checkpoint.gpu_steps import gpu_requested, visible_devices

    env = {"PATH": "/bin", "SLURM_JOB_GPUS": "0,2"}
    spec = build_spec(request(env=env), rootfs="/r", mounts=[], cgroup="/c", rlimits=[])
    view = checkpoint_view(spec)
    assert gpu_requested(view) and visible_devices(view) == "0,2"
    assert "NVIDIA_VISIBLE_DEVICES=0,2" not in spec["process"]["env"]  # the job's own env
    cpu = build_spec(request(), rootfs="/r", mounts=[], cgroup="/c", rlimits=[])
    assert not gpu_requested(checkpoint_view(cpu))
