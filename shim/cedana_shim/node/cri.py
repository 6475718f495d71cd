"""The CRI calls that prove the ``cedana`` handler answers, made over gRPC on
containerd's socket exactly as kubelet makes them.

grpcio is imported only here and only when a check runs; a missing grpcio is
reported as such (it ships in the DaemonSet image and in the node payload).
"""

# grpcio ships no type stubs and the generated *_pb2_grpc stubs are untyped; the typed
# surface of this module is its own signatures.
# mypy: disable-error-code="import-untyped,no-untyped-call"

from __future__ import annotations

import contextlib
import json
import time
import uuid
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from . import registration as reg

RPC_TIMEOUT = 30.0


class CriError(Exception):
    pass


@dataclass(frozen=True)
class CriRuntimes:
    """What the CRI plugin reports (Status verbose ``config``, 1.6 through 2.1) about
    the cedana handler and the default runtime."""

    runtime_type: str | None  # containerd.runtimes.cedana.runtimeType
    runtime_path: str | None  # containerd.runtimes.cedana.runtimePath
    default_runtime: str | None  # containerd.defaultRuntimeName


def runtimes_in_cri_config(cri_config: Mapping[str, Any]) -> CriRuntimes:
    containerd = cri_config.get("containerd")
    if not isinstance(containerd, Mapping):
        return CriRuntimes(None, None, None)
    default = containerd.get("defaultRuntimeName")
    runtimes = containerd.get("runtimes")
    entry = runtimes.get(reg.HANDLER) if isinstance(runtimes, Mapping) else None
    if not isinstance(entry, Mapping):
        entry = {}
    kind, path = entry.get("runtimeType"), entry.get("runtimePath")
    return CriRuntimes(
        str(kind) if kind is not None else None,
        str(path) if path else None,
        str(default) if default else None,
    )


@dataclass(frozen=True)
class HandlerStatus:
    answering: bool  # the CRI service answered Status
    runtime_type: str | None  # what CRI has registered for the cedana handler
    runtime_path: str | None  # the shim binary it names
    handlers: tuple[str, ...]  # CRI's runtime_handlers (containerd >= 2.0 fills it)
    sandbox_image: str | None
    default_runtime: str | None  # the CRI's default runtime (pods without a handler)
    detail: str

    @property
    def registered(self) -> bool:
        if self.runtime_type == reg.RUNC_TYPE:
            return reg.is_shim_path(self.runtime_path)
        return self.runtime_type == reg.RUNTIME_TYPE  # containerd 1.6's form


def _modules() -> tuple[Any, Any, Any]:
    try:
        import grpc
    except ImportError as err:
        raise CriError(
            "the CRI check needs grpcio, which this Python does not have "
            "(`pip install grpcio`, or use `--verify none`)"
        ) from err
    from cedana_shim.api.cri.v1 import api_pb2, api_pb2_grpc

    return grpc, api_pb2, api_pb2_grpc


class CriClient:
    def __init__(self, socket_path: str) -> None:
        self.grpc, self.pb, pb_grpc = _modules()
        self.socket_path = socket_path
        self.channel = self.grpc.insecure_channel(f"unix://{socket_path}")
        self.runtime = pb_grpc.RuntimeServiceStub(self.channel)

    def close(self) -> None:
        self.channel.close()

    def __enter__(self) -> CriClient:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _describe(self, err: Exception) -> str:
        code = getattr(err, "code", None)
        details = getattr(err, "details", None)
        if callable(code) and callable(details):
            return f"{code().name}: {details()}"
        return str(err)

    def status(self) -> HandlerStatus:
        try:
            resp = self.runtime.Status(self.pb.StatusRequest(verbose=True), timeout=5)
        except self.grpc.RpcError as err:
            return HandlerStatus(False, None, None, (), None, None, self._describe(err))
        try:
            config = json.loads(resp.info.get("config", "{}"))
        except ValueError:
            config = {}
        handlers = tuple(h.name for h in resp.runtime_handlers)
        cri = runtimes_in_cri_config(config)
        runtime_type = cri.runtime_type
        image = config.get("sandboxImage") or None
        if runtime_type is None and reg.HANDLER in handlers:
            runtime_type = "(listed, type not reported)"
        if runtime_type is None:
            detail = f"CRI answers but has no {reg.HANDLER!r} handler"
        elif runtime_type == reg.RUNC_TYPE and not reg.is_shim_path(cri.runtime_path):
            detail = (
                f"CRI's {reg.HANDLER!r} handler is a {runtime_type} runtime that runs "
                f"{cri.runtime_path or 'containerd-shim-runc-v2'}, not {reg.SHIM_BINARY}"
            )
        else:
            shim = f", {cri.runtime_path}" if cri.runtime_path else ""
            detail = f"CRI lists handler {reg.HANDLER!r} ({runtime_type}{shim})"
        return HandlerStatus(
            True, runtime_type, cri.runtime_path, handlers, image, cri.default_runtime, detail
        )

    def wait_registered(self, timeout: float) -> HandlerStatus:
        """containerd's CRI plugin answers a little after its socket appears."""
        deadline = time.monotonic() + timeout
        while True:
            status = self.status()
            if status.registered or time.monotonic() > deadline:
                return status
            time.sleep(0.2)

    def cedana_pods(self) -> list[str]:
        """Names of the pods that run now with the cedana handler: named, or (no
        handler) by being the CRI's default runtime."""
        pb = self.pb
        ours = {reg.HANDLER}
        if self.status().default_runtime == reg.HANDLER:
            ours.add("")
        resp = self.runtime.ListPodSandbox(pb.ListPodSandboxRequest(), timeout=RPC_TIMEOUT)
        return [
            f"{p.metadata.namespace}/{p.metadata.name}"
            for p in resp.items
            if p.runtime_handler in ours and p.state == pb.SANDBOX_READY
        ]

    def find_container(self, namespace: str, pod: str, container: str) -> str:
        """The id of the running container ``container`` (any, when "") of the ready
        pod ``namespace/pod``, as kubelet named them in the CRI metadata."""
        pb = self.pb
        try:
            pods = self.runtime.ListPodSandbox(
                pb.ListPodSandboxRequest(
                    filter=pb.PodSandboxFilter(
                        state=pb.PodSandboxStateValue(state=pb.SANDBOX_READY)
                    )
                ),
                timeout=RPC_TIMEOUT,
            ).items
            for sandbox in pods:
                if (sandbox.metadata.namespace, sandbox.metadata.name) != (namespace, pod):
                    continue
                running = pb.ContainerStateValue(state=pb.CONTAINER_RUNNING)
                found = self.runtime.ListContainers(
                    pb.ListContainersRequest(
                        filter=pb.ContainerFilter(pod_sandbox_id=sandbox.id, state=running)
                    ),
                    timeout=RPC_TIMEOUT,
                ).containers
                names = sorted(c.metadata.name for c in found)
                for c in found:
                    if not container or c.metadata.name == container:
                        return str(c.id)
                raise CriError(
                    f"pod {namespace}/{pod} has no running container {container!r} on this "
                    f"node (running: {', '.join(names) or 'none'})"
                )
        except self.grpc.RpcError as err:
            raise CriError(f"listing pods and containers: {self._describe(err)}") from None
        raise CriError(f"pod {namespace}/{pod} is not running on this node")

    def probe_pod(self, image: str | None) -> str:
        """Run a pod sandbox with the cedana handler and, given an image that is on
        the node, a container in it; then remove both. Returns what ran."""
        pb = self.pb
        uid = uuid.uuid4().hex
        config = pb.PodSandboxConfig(
            metadata=pb.PodSandboxMetadata(
                name=f"cedana-install-probe-{uid[:8]}", uid=uid, namespace="cedana-system"
            ),
            labels={"cedana.ai/probe": "true"},
            linux=pb.LinuxPodSandboxConfig(
                security_context=pb.LinuxSandboxSecurityContext(
                    # The host's network: the probe must not depend on CNI being ready.
                    namespace_options=pb.NamespaceOption(network=pb.NODE, pid=pb.CONTAINER)
                )
            ),
        )
        try:
            pod = self.runtime.RunPodSandbox(
                pb.RunPodSandboxRequest(config=config, runtime_handler=reg.HANDLER),
                timeout=RPC_TIMEOUT,
            ).pod_sandbox_id
        except self.grpc.RpcError as err:
            raise CriError(
                f"RunPodSandbox with handler {reg.HANDLER!r}: {self._describe(err)}"
            ) from None
        try:
            if not image:
                return f"pod sandbox {pod[:12]} ran with handler {reg.HANDLER!r}"
            try:
                cid = self.runtime.CreateContainer(
                    pb.CreateContainerRequest(
                        pod_sandbox_id=pod,
                        config=pb.ContainerConfig(
                            metadata=pb.ContainerMetadata(name="probe"),
                            image=pb.ImageSpec(image=image),
                            linux=pb.LinuxContainerConfig(),
                        ),
                        sandbox_config=config,
                    ),
                    timeout=RPC_TIMEOUT,
                ).container_id
                self.runtime.StartContainer(
                    pb.StartContainerRequest(container_id=cid), timeout=RPC_TIMEOUT
                )
                state = self.runtime.ContainerStatus(
                    pb.ContainerStatusRequest(container_id=cid), timeout=RPC_TIMEOUT
                ).status.state
            except self.grpc.RpcError as err:
                raise CriError(
                    f"container ({image}) in a {reg.HANDLER!r} pod: {self._describe(err)}"
                ) from None
            if state not in (pb.CONTAINER_RUNNING, pb.CONTAINER_EXITED):
                raise CriError(f"probe container {cid[:12]} is {pb.ContainerState.Name(state)}")
            return (
                f"pod sandbox {pod[:12]} and container {cid[:12]} ({image}) ran with "
                f"handler {reg.HANDLER!r}"
            )
        finally:
            with contextlib.suppress(self.grpc.RpcError):
                self.runtime.StopPodSandbox(
                    pb.StopPodSandboxRequest(pod_sandbox_id=pod), timeout=RPC_TIMEOUT
                )
            with contextlib.suppress(self.grpc.RpcError):
                self.runtime.RemovePodSandbox(
                    pb.RemovePodSandboxRequest(pod_sandbox_id=pod), timeout=RPC_TIMEOUT
                )
