"""The CRI path, driven over gRPC as kubelet drives it, with `runtime_handler` set to the
runtime under test. Parametrized over containerd 1.6/1.7/2.1."""

from __future__ import annotations

import ipaddress
import json
import os
import re
import time
import uuid
from collections.abc import Iterator
from datetime import datetime
from pathlib import Path

import pytest
from cedana_shim.api.cri.v1 import api_pb2 as cri_pb

from .harness import procs
from .harness.config import CRI_NAMESPACE
from .harness.containerd import Containerd
from .harness.cri import CriClient, Pod
from .harness.util import wait_for

IDLE = ["sh", "-c", "while :; do sleep 0.1; done"]
# A shell that reacts to SIGTERM (pid 1 only receives signals it handles).
GRACEFUL = ["sh", "-c", 'trap "exit 0" TERM; while :; do sleep 0.1; done']
# Ignores SIGTERM explicitly: only the SIGKILL after the grace period stops it.
STUBBORN = ["sh", "-c", 'trap "" TERM; echo stubborn-ready; while :; do sleep 0.1; done']
CRI_LOG_LINE = re.compile(
    r"^(?P<ts>\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d(?:\.\d+)?(?:Z|[+-]\d\d:\d\d)) "
    r"(?P<stream>stdout|stderr) (?P<tag>[FP]) (?P<msg>.*)$"
)


@pytest.fixture
def pod_dir(containerd: Containerd) -> Path:
    return containerd.pod_logs / uuid.uuid4().hex[:12]


@pytest.fixture
def host_pod(cri: CriClient, pod_dir: Path) -> Iterator[Pod]:
    with cri.pod("hostnet", pod_dir, host_network=True) as pod:
        yield pod


def _netns(pid: int | str) -> str:
    return os.readlink(f"/proc/{pid}/ns/net")


def _sandbox_pid(cri: CriClient, pod_id: str) -> int:
    info = json.loads(cri.pod_status(pod_id, verbose=True).info["info"])
    return int(info["pid"])


def _read_cri_log(path: Path) -> list[dict[str, str]]:
    if not path.exists():
        return []
    text = path.read_text()
    # Only complete lines: the last one may still be being written.
    entries = []
    for line in text[: text.rfind("\n") + 1].splitlines():
        m = CRI_LOG_LINE.match(line)
        assert m, f"not a CRI log line: {line!r}"
        entries.append(m.groupdict())
    return entries


def _parse_ts(ts: str) -> datetime:
    # RFC 3339 with nanoseconds: Python keeps microseconds.
    head, _, frac = ts.partition(".")
    if frac:
        digits = re.match(r"\d+", frac)
        assert digits
        tz = frac[digits.end() :]
        ts = f"{head}.{digits.group()[:6]}{tz}"
    return datetime.fromisoformat(ts.replace("Z", "+00:00"))


def _pod_shim(containerd: Containerd, ids: list[str]) -> int:
    """The one process serving the shim sockets of all these tasks (pause + apps)."""
    addresses = {containerd.shim_address(CRI_NAMESPACE, i) for i in ids}
    assert len(addresses) == 1 and None not in addresses, (
        f"tasks of one pod must share one shim address, got {addresses}"
    )
    pids: set[int] = set()
    for i in ids:
        pids |= containerd.shim_pids(CRI_NAMESPACE, i)
    assert len(pids) == 1, f"expected one shim daemon for the pod, found {sorted(pids)}"
    return pids.pop()


def _wait_exit(pid: int, what: str) -> None:
    wait_for(lambda: not procs.pid_alive(pid), timeout=15, what=what)


def test_host_network_pod_lifecycle(containerd: Containerd, cri: CriClient, pod_dir: Path) -> None:
    pod = cri.run_pod("lifecycle", pod_dir, host_network=True)
    status = cri.pod_status(pod.id).status
    assert status.state == cri_pb.SANDBOX_READY
    assert status.runtime_handler == containerd.runtime.handler
    sandbox_pid = _sandbox_pid(cri, pod.id)
    # `runc start` returns once the init was released; its execve follows a moment later.
    wait_for(
        lambda: procs.read_argv(sandbox_pid) == ("/bin/sleep", "2147483647"),
        timeout=5,
        what="the pause process to exec",
    )
    assert _netns(sandbox_pid) == _netns("self"), "host network pod must share our netns"

    cid = cri.create_container(
        pod,
        "app",
        containerd.images.busybox,
        [
            "sh",
            "-c",
            "echo hello-stdout; echo hello-stderr >&2; "
            'trap "exit 0" TERM; while :; do sleep 0.1; done',
        ],
    )
    assert cri.container_status(cid).status.state == cri_pb.CONTAINER_CREATED
    cri.start_container(cid)
    cri.wait_container_state(cid, cri_pb.CONTAINER_RUNNING)
    pid = cri.container_pid(cid)
    assert procs.pid_alive(pid)
    assert _netns(pid) == _netns("self")
    shim_pid = _pod_shim(containerd, [pod.id, cid])

    log_path = pod_dir / "app.log"
    assert cri.container_status(cid).status.log_path == str(log_path)
    entries = wait_for(
        lambda: e if len(e := _read_cri_log(log_path)) >= 2 else None,
        timeout=10,
        what="two lines in the CRI log",
    )
    by_stream = {e["stream"]: e for e in entries}
    assert by_stream["stdout"]["msg"] == "hello-stdout"
    assert by_stream["stderr"]["msg"] == "hello-stderr"
    for e in entries:
        assert e["tag"] == "F"
        assert abs(time.time() - _parse_ts(e["ts"]).timestamp()) < 120

    res = cri.exec_sync(cid, ["sh", "-c", "echo exec-out; echo exec-err >&2; exit 3"])
    assert (res.stdout, res.stderr, res.exit_code) == (b"exec-out\n", b"exec-err\n", 3)
    res = cri.exec_sync(cid, ["cat", "/etc/hostname"])
    assert res.exit_code == 0 and res.stdout.strip() != b""

    stats = cri.container_stats(cid)
    assert stats.attributes.id == cid
    assert stats.memory.working_set_bytes.value > 0, stats
    assert stats.cpu.usage_core_nano_seconds.value > 0, stats

    started = time.monotonic()
    cri.stop_container(cid, timeout=30)
    assert time.monotonic() - started < 10, "a container that exits on SIGTERM stops promptly"
    st = cri.container_status(cid).status
    assert st.state == cri_pb.CONTAINER_EXITED
    assert st.exit_code == 0
    assert not procs.pid_alive(pid)

    cri.remove_container(cid)
    assert cid not in cri.container_ids()
    cri.stop_pod(pod.id)
    assert cri.pod_status(pod.id).status.state == cri_pb.SANDBOX_NOTREADY
    wait_for(lambda: not procs.pid_alive(sandbox_pid), timeout=10, what="pause to exit")
    cri.remove_pod(pod.id)
    assert pod.id not in cri.pod_ids()
    _wait_exit(shim_pid, "the pod's shim to exit after RemovePodSandbox")


def test_cni_pod_gets_ip_in_own_netns(
    containerd: Containerd, cri: CriClient, pod_dir: Path
) -> None:
    with cri.pod("cni", pod_dir, host_network=False) as pod:
        status = cri.pod_status(pod.id).status
        assert status.state == cri_pb.SANDBOX_READY
        ip = ipaddress.ip_address(status.network.ip)
        assert ip in ipaddress.ip_network(containerd.subnet), (ip, containerd.subnet)
        sandbox_pid = _sandbox_pid(cri, pod.id)
        assert _netns(sandbox_pid) != _netns("self")

        cid = cri.run_container(pod, "net", containerd.images.busybox, IDLE)
        cri.wait_container_state(cid, cri_pb.CONTAINER_RUNNING)
        shim_pid = _pod_shim(containerd, [pod.id, cid])
        pid = cri.container_pid(cid)
        assert _netns(pid) == _netns(sandbox_pid), "containers join the pod's netns"
        res = cri.exec_sync(cid, ["ip", "-4", "addr", "show", "eth0"])
        assert res.exit_code == 0, res.stderr
        assert f"inet {ip}/24".encode() in res.stdout, res.stdout
        cri.stop_container(cid, timeout=2)
        cri.remove_container(cid)
    assert pod.id not in cri.pod_ids()
    _wait_exit(shim_pid, "the pod's shim to exit after RemovePodSandbox")


def test_stop_container_sigkills_after_grace_period(
    containerd: Containerd, cri: CriClient, host_pod: Pod
) -> None:
    cid = cri.run_container(host_pod, "stubborn", containerd.images.busybox, STUBBORN)
    wait_for(
        lambda: any(
            e["msg"] == "stubborn-ready" for e in _read_cri_log(host_pod.log_dir / "stubborn.log")
        ),
        timeout=10,
        what="the trap to be installed",
    )
    pid = cri.container_pid(cid)
    started = time.monotonic()
    cri.stop_container(cid, timeout=2)
    elapsed = time.monotonic() - started
    assert 1.5 <= elapsed < 8, f"StopContainer(timeout=2) took {elapsed:.2f}s"
    st = cri.container_status(cid).status
    assert st.state == cri_pb.CONTAINER_EXITED
    assert st.exit_code == 137, st
    assert not procs.pid_alive(pid)
    cri.remove_container(cid)


def test_stop_container_honours_sigterm(
    containerd: Containerd, cri: CriClient, host_pod: Pod
) -> None:
    cid = cri.run_container(host_pod, "graceful", containerd.images.busybox, GRACEFUL)
    cri.wait_container_state(cid, cri_pb.CONTAINER_RUNNING)
    time.sleep(0.2)  # the shell installs its trap right after exec
    started = time.monotonic()
    cri.stop_container(cid, timeout=30)
    elapsed = time.monotonic() - started
    assert elapsed < 5, f"a SIGTERM-handling container took {elapsed:.2f}s to stop"
    st = cri.container_status(cid).status
    assert st.state == cri_pb.CONTAINER_EXITED
    assert st.exit_code == 0, st
    cri.remove_container(cid)


@pytest.mark.cgroup_v1  # memory.limit_in_bytes
def test_update_container_resources(containerd: Containerd, cri: CriClient, host_pod: Pod) -> None:
    cid = cri.run_container(host_pod, "resize", containerd.images.busybox, IDLE)
    pid = cri.container_pid(cid)
    limit = 96 * 1024 * 1024
    cri.runtime.UpdateContainerResources(
        cri_pb.UpdateContainerResourcesRequest(
            container_id=cid, linux=cri_pb.LinuxContainerResources(memory_limit_in_bytes=limit)
        ),
        timeout=30,
    )
    memory_cg = procs.cgroup_dir(pid, "memory")
    assert procs.read_int(memory_cg / "memory.limit_in_bytes") == limit
    assert cri.exec_sync(cid, ["echo", "ok"]).stdout == b"ok\n"
    cri.stop_container(cid, timeout=1)
    cri.remove_container(cid)


def test_pod_containers_share_one_shim(
    containerd: Containerd, cri: CriClient, pod_dir: Path
) -> None:
    with cri.pod("shared", pod_dir, host_network=True) as pod:
        cids = [cri.run_container(pod, f"c{i}", containerd.images.busybox, IDLE) for i in range(3)]
        for cid in cids:
            cri.wait_container_state(cid, cri_pb.CONTAINER_RUNNING)
        shim_pid = _pod_shim(containerd, [pod.id, *cids])
        served = containerd.shim_daemons()[shim_pid]
        assert served == {(CRI_NAMESPACE, i) for i in (pod.id, *cids)}
        pids = [_sandbox_pid(cri, pod.id)] + [cri.container_pid(c) for c in cids]
        assert len(set(pids)) == 4
        for pid in pids:
            assert procs.read_ppid(pid) == shim_pid, f"pid {pid} is not a child of the shim"
        # Where the shim's command line is its own (the runc shim), it is keyed on the
        # sandbox id, as containerd groups a pod by io.kubernetes.cri.sandbox-id.
        named = [s for s in containerd.shims() if s.pid == shim_pid]
        if named:
            assert named[0].id == pod.id
            assert named[0].binary == containerd.runtime.shim_binary

        # Removing one container must leave the shared shim serving the others.
        cri.stop_container(cids[0], timeout=1)
        cri.remove_container(cids[0])
        assert procs.pid_alive(shim_pid)
        res = cri.exec_sync(cids[1], ["echo", "still-here"])
        assert res.stdout == b"still-here\n"
    assert pod.id not in cri.pod_ids()
    _wait_exit(shim_pid, f"shim {shim_pid} to exit after the pod was removed")
    for pid in pids:
        assert not procs.pid_alive(pid)
