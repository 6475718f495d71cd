"""A CRI client that makes the calls kubelet makes, over gRPC on containerd's socket."""

# grpcio ships no type stubs and the generated *_pb2_grpc stubs are untyped; the typed
# surface of this module is its own signatures.
# mypy: disable-error-code="import-untyped,no-untyped-call"

from __future__ import annotations

import contextlib
import json
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import grpc
from cedana_shim.api.cri.v1 import api_pb2 as cri
from cedana_shim.api.cri.v1 import api_pb2_grpc as cri_grpc

from .util import slower, wait_for

# Kubelet puts every pod under a cgroup parent it owns; the tests do the same so that
# nothing lands at the root of the cgroup hierarchies.
CGROUP_PARENT_ROOT = "/cedana-itest-pods"
RPC_TIMEOUT = 30.0 * slower()  # tests/vm sets CEDANA_TEST_SLOWER before it imports us


@dataclass
class Pod:
    id: str
    config: cri.PodSandboxConfig
    log_dir: Path


class CriClient:
    def __init__(self, socket: Path, handler: str) -> None:
        self.handler = handler
        self.channel = grpc.insecure_channel(f"unix://{socket}")
        self.runtime = cri_grpc.RuntimeServiceStub(self.channel)
        self.images = cri_grpc.ImageServiceStub(self.channel)

    def close(self) -> None:
        self.channel.close()

    def wait_ready(self, timeout: float = 15) -> cri.VersionResponse:
        """The CRI plugin starts serving a little after containerd's socket appears."""
        resp: cri.VersionResponse = wait_for(
            lambda: self.runtime.Version(cri.VersionRequest(), timeout=2),
            timeout=timeout,
            what="CRI Version to answer",
        )
        return resp

    # -- pods -------------------------------------------------------------------------

    def pod_config(
        self, name: str, log_dir: Path, *, host_network: bool, namespace: str = "itest"
    ) -> cri.PodSandboxConfig:
        uid = uuid.uuid4().hex
        ns = cri.NamespaceOption(
            network=cri.NODE if host_network else cri.POD,
            pid=cri.CONTAINER,
            ipc=cri.POD,
        )
        return cri.PodSandboxConfig(
            metadata=cri.PodSandboxMetadata(name=name, uid=uid, namespace=namespace, attempt=0),
            # kubelet leaves hostname empty for host-network pods: they share the
            # node's UTS namespace and runc refuses to set a hostname there.
            hostname="" if host_network else name,
            log_directory=str(log_dir),
            labels={"cedana-itest": "1"},
            linux=cri.LinuxPodSandboxConfig(
                cgroup_parent=f"{CGROUP_PARENT_ROOT}/pod{uid}",
                security_context=cri.LinuxSandboxSecurityContext(namespace_options=ns),
            ),
        )

    def run_pod(
        self, name: str, log_dir: Path, *, host_network: bool, namespace: str = "itest"
    ) -> Pod:
        """`namespace` is the pod's Kubernetes namespace (metadata.namespace)."""
        log_dir.mkdir(parents=True, exist_ok=True)
        config = self.pod_config(name, log_dir, host_network=host_network, namespace=namespace)
        resp = self.runtime.RunPodSandbox(
            cri.RunPodSandboxRequest(config=config, runtime_handler=self.handler),
            timeout=RPC_TIMEOUT,
        )
        return Pod(id=resp.pod_sandbox_id, config=config, log_dir=log_dir)

    def pod_status(self, pod_id: str, verbose: bool = False) -> cri.PodSandboxStatusResponse:
        resp: cri.PodSandboxStatusResponse = self.runtime.PodSandboxStatus(
            cri.PodSandboxStatusRequest(pod_sandbox_id=pod_id, verbose=verbose),
            timeout=RPC_TIMEOUT,
        )
        return resp

    def stop_pod(self, pod_id: str) -> None:
        self.runtime.StopPodSandbox(
            cri.StopPodSandboxRequest(pod_sandbox_id=pod_id), timeout=RPC_TIMEOUT
        )

    def remove_pod(self, pod_id: str) -> None:
        self.runtime.RemovePodSandbox(
            cri.RemovePodSandboxRequest(pod_sandbox_id=pod_id), timeout=RPC_TIMEOUT
        )

    def pod_ids(self) -> list[str]:
        resp = self.runtime.ListPodSandbox(cri.ListPodSandboxRequest(), timeout=RPC_TIMEOUT)
        return [p.id for p in resp.items]

    @contextlib.contextmanager
    def pod(
        self, name: str, log_dir: Path, *, host_network: bool, namespace: str = "itest"
    ) -> Iterator[Pod]:
        """A pod that is stopped and removed (with its containers) however the test ends."""
        pod = self.run_pod(name, log_dir, host_network=host_network, namespace=namespace)
        try:
            yield pod
        finally:
            with contextlib.suppress(grpc.RpcError):
                self.stop_pod(pod.id)
            with contextlib.suppress(grpc.RpcError):
                self.remove_pod(pod.id)

    # -- containers -------------------------------------------------------------------

    def create_container(
        self,
        pod: Pod,
        name: str,
        image: str,
        command: Sequence[str],
        args: Sequence[str] = (),
        envs: dict[str, str] | None = None,
        mounts: Sequence[tuple[str, str]] = (),
        memory_limit: int = 0,
    ) -> str:
        """`mounts`: (host path, container path) read-only binds; `memory_limit`: the
        container's, in bytes (0: none), as kubelet passes a pod's limit."""
        config = cri.ContainerConfig(
            metadata=cri.ContainerMetadata(name=name, attempt=0),
            image=cri.ImageSpec(image=image),
            command=list(command),
            args=list(args),
            envs=[cri.KeyValue(key=k, value=v) for k, v in (envs or {}).items()],
            mounts=[
                cri.Mount(host_path=host, container_path=inside, readonly=True)
                for host, inside in mounts
            ],
            log_path=f"{name}.log",
            # As kubelet does: the pod's namespace options (a pid namespace of the
            # container's own unless the pod shares one).
            linux=cri.LinuxContainerConfig(
                security_context=cri.LinuxContainerSecurityContext(
                    namespace_options=pod.config.linux.security_context.namespace_options
                ),
                resources=cri.LinuxContainerResources(memory_limit_in_bytes=memory_limit)
                if memory_limit
                else None,
            ),
        )
        resp = self.runtime.CreateContainer(
            cri.CreateContainerRequest(
                pod_sandbox_id=pod.id, config=config, sandbox_config=pod.config
            ),
            timeout=RPC_TIMEOUT,
        )
        return str(resp.container_id)

    def start_container(self, cid: str) -> None:
        self.runtime.StartContainer(
            cri.StartContainerRequest(container_id=cid), timeout=RPC_TIMEOUT
        )

    def run_container(self, pod: Pod, name: str, image: str, command: Sequence[str]) -> str:
        cid = self.create_container(pod, name, image, command)
        self.start_container(cid)
        return cid

    def container_status(self, cid: str, verbose: bool = False) -> cri.ContainerStatusResponse:
        resp: cri.ContainerStatusResponse = self.runtime.ContainerStatus(
            cri.ContainerStatusRequest(container_id=cid, verbose=verbose),
            timeout=RPC_TIMEOUT,
        )
        return resp

    def container_info(self, cid: str) -> dict[str, Any]:
        """containerd's verbose status: a JSON document with the task pid and spec."""
        info = self.container_status(cid, verbose=True).info
        return dict(json.loads(info["info"]))

    def container_pid(self, cid: str) -> int:
        return int(self.container_info(cid)["pid"])

    def wait_container_state(
        self, cid: str, state: int, timeout: float = 15
    ) -> cri.ContainerStatus:
        return wait_for(
            lambda: s if (s := self.container_status(cid).status).state == state else None,
            timeout=timeout,
            what=f"container {cid[:12]} in state {cri.ContainerState.Name(state)}",
        )

    def exec_sync(self, cid: str, cmd: Sequence[str], timeout: int = 10) -> cri.ExecSyncResponse:
        resp: cri.ExecSyncResponse = self.runtime.ExecSync(
            cri.ExecSyncRequest(container_id=cid, cmd=list(cmd), timeout=timeout),
            timeout=timeout + RPC_TIMEOUT,
        )
        return resp

    def container_stats(self, cid: str) -> cri.ContainerStats:
        resp: cri.ContainerStatsResponse = self.runtime.ContainerStats(
            cri.ContainerStatsRequest(container_id=cid), timeout=RPC_TIMEOUT
        )
        return resp.stats

    def stop_container(self, cid: str, timeout: int) -> None:
        self.runtime.StopContainer(
            cri.StopContainerRequest(container_id=cid, timeout=timeout),
            timeout=timeout + RPC_TIMEOUT,
        )

    def remove_container(self, cid: str) -> None:
        self.runtime.RemoveContainer(
            cri.RemoveContainerRequest(container_id=cid), timeout=RPC_TIMEOUT
        )

    def container_ids(self, pod_id: str | None = None) -> list[str]:
        flt = cri.ContainerFilter(pod_sandbox_id=pod_id) if pod_id else None
        resp = self.runtime.ListContainers(
            cri.ListContainersRequest(filter=flt), timeout=RPC_TIMEOUT
        )
        return [c.id for c in resp.containers]

    def image_present(self, ref: str) -> bool:
        resp: cri.ImageStatusResponse = self.images.ImageStatus(
            cri.ImageStatusRequest(image=cri.ImageSpec(image=ref)), timeout=RPC_TIMEOUT
        )
        return resp.HasField("image")

    def remove_all_pods(self) -> None:
        """Teardown: what kubelet does when a node is drained."""
        for pod_id in self.pod_ids():
            with contextlib.suppress(grpc.RpcError):
                self.stop_pod(pod_id)
            with contextlib.suppress(grpc.RpcError):
                self.remove_pod(pod_id)
