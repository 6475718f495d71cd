"""CRI workloads as kubelet runs them: the counter in a pod of its own, opted in by
label, stopped the way a pod deletion stops it; and the CRI log's stdout."""

from __future__ import annotations

import contextlib
import re
import uuid
from dataclasses import dataclass
from pathlib import Path

from cedana_shim.api.cri.v1 import api_pb2 as cri_pb

from .containerd import Containerd
from .cr_support import counter_script
from .cri import CriClient, Pod

ENV_LABEL = "CEDANA_CHECKPOINT"
_CRI_LOG_LINE = re.compile(r"^\S+ (stdout|stderr) [FP] (.*)$")


# -- reading the workload ------------------------------------------------------------------


def cri_stdout(path: Path) -> list[str]:
    """The stdout messages of a CRI container log (complete lines only)."""
    if not path.exists():
        return []
    text = path.read_text(errors="replace")
    out = []
    for line in text[: text.rfind("\n") + 1].splitlines():
        m = _CRI_LOG_LINE.match(line)
        assert m, f"not a CRI log line in {path}: {line!r}"
        if m.group(1) == "stdout":
            out.append(m.group(2))
    return out


@dataclass
class App:
    pod: Pod
    cid: str
    log: Path

    def stdout(self) -> list[str]:
        return cri_stdout(self.log)


def start_app(
    stack: contextlib.ExitStack,
    containerd: Containerd,
    cri: CriClient,
    *,
    label: str | None,
    namespace: str,
    host_network: bool = True,
    script: str | None = None,
    name: str = "app",
    pod_name: str = "counter",
) -> App:
    """A new pod `pod_name` (removed when `stack` closes) running the counter as
    container `name`, opted in with `label` (None: not opted in)."""
    log_dir = containerd.pod_logs / uuid.uuid4().hex[:12]
    pod = stack.enter_context(
        cri.pod(pod_name, log_dir, host_network=host_network, namespace=namespace)
    )
    envs = {ENV_LABEL: label} if label is not None else {}
    cid = cri.create_container(
        pod, name, containerd.images.busybox, ["sh", "-c", script or counter_script()], envs=envs
    )
    cri.start_container(cid)
    return App(pod, cid, log_dir / f"{name}.log")


def stop_app(cri: CriClient, app: App) -> cri_pb.ContainerStatus:
    """What kubelet does when the pod is deleted: StopContainer (SIGTERM, grace period),
    RemoveContainer, StopPodSandbox, RemovePodSandbox. The container must have been
    ended by its checkpoint (exit 143, and the workload never saw the SIGTERM)."""
    cri.stop_container(app.cid, timeout=30)
    status = cri.container_status(app.cid).status
    assert status.state == cri_pb.CONTAINER_EXITED, status
    assert status.exit_code == 143, status
    assert "got-TERM" not in app.stdout(), (
        "the shim delivered SIGTERM to the workload instead of checkpointing it"
    )
    cri.remove_container(app.cid)
    cri.stop_pod(app.pod.id)
    cri.remove_pod(app.pod.id)
    return status
