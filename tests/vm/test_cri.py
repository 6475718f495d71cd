"""Stop and resume through the CRI as kubelet drives it on a kubeadm node: cgroup v2,
runc's systemd cgroup driver (`SystemdCgroup = true`), each container in a systemd scope
under its pod's slice.

The restored container must be the new pod's: its processes in the new pod's
`cri-containerd-<id>.scope` under the new container's memory limit (an OOM kill there is
reported as `OOMKilled`), its cgroup namespace rooted there, and the pod's removal
(kill-all, the scope's end) finishing.
"""

from __future__ import annotations

import contextlib
import uuid
from pathlib import Path

import pytest
from cedana_shim.api.cri.v1 import api_pb2 as cri_pb
from integration.harness.containerd import Containerd
from integration.harness.cr_events import TOPIC_RESTORE, EventStream
from integration.harness.cr_support import assert_continues, counter_script, wait_ticks
from integration.harness.cri import CriClient, Pod
from integration.harness.cri_apps import ENV_LABEL, cri_stdout
from integration.harness.util import wait_for

from .nodes import HOG, TIMEOUT, MiB, assert_cgroup_holds, cgroup_dir, cgroup_of

# Kubelet's grace period: the checkpoint of a stop must fit in it (the guest is slow).
GRACE = 240


def _scope(pod: Pod, cid: str) -> str:
    """Where kubelet's systemd driver and runc put a BestEffort pod's container."""
    uid = pod.config.metadata.uid
    return (
        "/kubepods.slice/kubepods-besteffort.slice/"
        f"kubepods-besteffort-pod{uid}.slice/cri-containerd-{cid}.scope"
    )


def _start(
    stack: contextlib.ExitStack, c: Containerd, cri: CriClient, label: str, limit: int
) -> tuple[Pod, str, Path]:
    log_dir = c.pod_logs / uuid.uuid4().hex[:12]
    pod = stack.enter_context(cri.pod("counter", log_dir, host_network=True, namespace="vm"))
    script = counter_script(tick=0.5, each_tick=HOG)
    cid = cri.create_container(
        pod, "app", c.images.busybox, ["sh", "-c", script], envs={ENV_LABEL: label},
        memory_limit=limit,
    )  # fmt: skip
    cri.start_container(cid)
    return pod, cid, log_dir / "app.log"


def _inside_view(cri: CriClient, cid: str) -> bytes:
    res = cri.exec_sync(cid, ["cat", "/proc/1/cgroup"], timeout=60)
    assert res.exit_code == 0, res
    return bytes(res.stdout)


@pytest.mark.vm_containerd("1.7", "2.1")
def test_a_pod_resumes_in_its_own_scope_under_its_limit(
    containerd: Containerd, cri: CriClient
) -> None:
    label = f"cri-{uuid.uuid4().hex[:8]}"
    with EventStream(containerd.socket) as events, contextlib.ExitStack() as stack:
        pod1, cid1, log1 = _start(stack, containerd, cri, label, 64 * MiB)
        before = wait_ticks(lambda: cri_stdout(log1), count=3, timeout=TIMEOUT)
        pid1 = cri.container_pid(cid1)
        assert cgroup_of(pid1) == _scope(pod1, cid1)
        view = _inside_view(cri, cid1)
        assert view == b"0::/\n", view  # the CRI's cgroup namespace on cgroup v2
        cri.stop_container(cid1, timeout=GRACE)
        status = cri.container_status(cid1).status
        assert status.exit_code == 143, status
        before = wait_ticks(lambda: cri_stdout(log1), count=3, timeout=TIMEOUT)
        cri.remove_container(cid1)
        cri.stop_pod(pod1.id)
        cri.remove_pod(pod1.id)

        pod2, cid2, log2 = _start(stack, containerd, cri, label, 48 * MiB)
        outcome = events.wait_topic(TOPIC_RESTORE, cid2, timeout=TIMEOUT)
        assert outcome.field("outcome") == "restored", outcome
        after = wait_ticks(lambda: cri_stdout(log2), count=2, timeout=TIMEOUT)
        assert_continues(before, after, "restore into a new pod's scope")
        scope = _scope(pod2, cid2)
        assert_cgroup_holds(scope, {cri.container_pid(cid2)})
        assert not cgroup_dir(_scope(pod1, cid1)).exists(), "the old pod's scope was recreated"
        assert (cgroup_dir(scope) / "memory.max").read_text().strip() == str(48 * MiB)
        assert _inside_view(cri, cid2) == view
        stats = cri.container_stats(cid2)
        assert stats.memory.working_set_bytes.value > 0, stats

        assert cri.exec_sync(cid2, ["touch", "/hog"], timeout=60).exit_code == 0
        exited = cri.wait_container_state(cid2, cri_pb.CONTAINER_EXITED, timeout=TIMEOUT)
        assert exited.reason == "OOMKilled", exited
        cri.remove_container(cid2)
        cri.stop_pod(pod2.id)
        cri.remove_pod(pod2.id)
        wait_for(
            lambda: not cgroup_dir(scope).exists(),
            timeout=60,
            what=f"systemd to remove {scope} once the pod is gone",
        )
