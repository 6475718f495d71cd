"""`containerd-shim-cedana-v2 -info` on real containerd 2.1: the RuntimeInfo containerd
reads, and what the CRI makes of its features (recursive read-only mounts).

containerd 2.x asks a runtime for its features through the task plugin's PluginInfo,
which runs `<shim> -info` with the runtime options on stdin. The first test makes that
call through containerd's introspection API for the `cedana` and the `runc` runtime
types and compares the answers. The CRI (2.0 up to 2.3.3) introspects only runtimes
of type io.containerd.runc.v2, which is how `cedana node install` registers the
`cedana` handler on containerd >= 1.7 (`runtime_path` naming our shim), and how the
harness registers it too: that handler must give a container with a CRI
`recursive_read_only` mount exactly what the runc handler gives it.

critest (cri-tools' CRI validation suite) was run by hand against both handlers (README,
"CRI parity with the runc shim"): every spec had the same outcome. critest is not
available in CI (no Debian package, no Go module proxy), so these CRI calls keep the
properties its runtime-feature specs depend on.
"""

# grpcio ships no type stubs.
# mypy: disable-error-code="import-untyped,no-untyped-call"

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from cedana_shim.api.containerd.runc import options_pb2
from cedana_shim.api.containerd.types import introspection_pb2
from cedana_shim.api.cri.v1 import api_pb2 as cri_pb
from google.protobuf.any_pb2 import Any

from .harness import images as harness_images
from .harness.config import CEDANA, CONTAINERD_VERSIONS, CRI_NAMESPACE
from .harness.containerd import Containerd
from .harness.cri import CriClient, Pod

V21 = next(v for v in CONTAINERD_VERSIONS if v.short == "2.1")
PLUGIN_INFO = "/containerd.services.introspection.v1.Introspection/PluginInfo"
FEATURES_TYPE_URL = "types.containerd.io/opencontainers/runtime-spec/1/features/Features"


@pytest.fixture(scope="module")
def node(test_images: harness_images.TestImages, itest_root: Path) -> Iterator[Containerd]:
    itest_root.mkdir(parents=True, exist_ok=True)
    base = Path(
        subprocess.run(
            ["mktemp", "-d", "-p", str(itest_root), f"{V21.id}-info-XXXX"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    )
    instance = Containerd(V21, CEDANA, base, test_images)
    try:
        instance.start()
        instance.import_images(CRI_NAMESPACE)
        yield instance
    finally:
        instance.cleanup(check=False)


# -- the introspection API, as the CRI calls it ---------------------------------------


def _field(number: int, payload: bytes) -> bytes:
    """A length-delimited protobuf field (the introspection service's request is three
    of them; its messages are not among our generated modules)."""
    length, out = len(payload), bytearray()
    while True:
        byte, length = length & 0x7F, length >> 7
        out.append(byte | (0x80 if length else 0))
        if not length:
            break
    return bytes([number << 3 | 2]) + bytes(out) + payload


def _fields(data: bytes) -> dict[int, bytes]:
    """The length-delimited fields of a message (last one wins)."""
    out, i = {}, 0
    while i < len(data):
        key, i = data[i], i + 1
        length = shift = 0
        while True:
            byte, i = data[i], i + 1
            length |= (byte & 0x7F) << shift
            shift += 7
            if not byte & 0x80:
                break
        assert key & 7 == 2, f"unexpected wire type in {data!r}"
        out[key >> 3] = data[i : i + length]
        i += length
    return out


def plugin_info(
    node: Containerd, runtime: str, options: Any | None
) -> introspection_pb2.RuntimeInfo:
    request = introspection_pb2.RuntimeRequest(runtime_path=runtime)
    if options is not None:
        request.options.CopyFrom(options)
    packed = Any(type_url="containerd.types.RuntimeRequest", value=request.SerializeToString())
    body = (
        _field(1, b"io.containerd.runtime.v2")
        + _field(2, b"task")
        + _field(3, packed.SerializeToString())
    )
    with grpc.insecure_channel(f"unix://{node.socket}") as channel:
        call = channel.unary_unary(
            PLUGIN_INFO, request_serializer=lambda b: b, response_deserializer=lambda b: b
        )
        response = call(body, timeout=30, metadata=[("containerd-namespace", CRI_NAMESPACE)])
    extra = Any.FromString(_fields(response)[2])
    assert extra.type_url.endswith("containerd.types.RuntimeInfo"), extra.type_url
    return introspection_pb2.RuntimeInfo.FromString(extra.value)


def test_plugin_info_gives_runcs_features(node: Containerd) -> None:
    runc_opts = options_pb2.Options(binary_name="runc")
    packed = Any(type_url="containerd.runc.v1.Options", value=runc_opts.SerializeToString())
    ours = plugin_info(node, "io.containerd.cedana.v2", packed)
    theirs = plugin_info(node, "io.containerd.runc.v2", packed)
    assert ours.name == "io.containerd.cedana.v2" and ours.version.version
    assert ours.features.type_url == theirs.features.type_url == FEATURES_TYPE_URL
    assert json.loads(ours.features.value) == json.loads(theirs.features.value)
    assert "rro" in json.loads(ours.features.value)["mountOptions"]
    assert ours.options == theirs.options == packed
    # Without options (a runtime with no `options` table): runc from PATH all the same.
    bare = plugin_info(node, "io.containerd.cedana.v2", None)
    assert json.loads(bare.features.value) == json.loads(theirs.features.value)


# -- the CRI: recursive read-only mounts -------------------------------------------------


def _handler_features(client: CriClient) -> dict[str, dict[str, bool]]:
    """Each CRI runtime handler's features as the CRI's Status reports them, every field
    (defaults included): critest skips its recursive read-only and user-namespace specs
    on what a handler reports."""
    status = client.runtime.Status(cri_pb.StatusRequest(verbose=True))
    return {
        h.name: {
            field.name: bool(getattr(h.features, field.name))
            for field in h.features.DESCRIPTOR.fields
        }
        for h in status.runtime_handlers
    }


@pytest.fixture(scope="module")
def nested_dir(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """A directory with a writable tmpfs mounted inside it: what a recursive
    read-only bind must make read-only too."""
    top = tmp_path_factory.mktemp("rro")
    (top / "sub").mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "rro-sub", top / "sub"], check=True)
    try:
        os.chmod(top, 0o755)
        yield top
    finally:
        subprocess.run(["umount", "-l", top / "sub"], check=False)


def _rro_container(client: CriClient, pod: Pod, image: str, host: Path, propagation: int) -> str:
    config = cri_pb.ContainerConfig(
        metadata=cri_pb.ContainerMetadata(name="rro", attempt=0),
        image=cri_pb.ImageSpec(image=image),
        command=["sh", "-c", "sleep 600"],
        mounts=[
            cri_pb.Mount(
                host_path=str(host),
                container_path="/data",
                readonly=True,
                recursive_read_only=True,
                propagation=propagation,  # type: ignore[arg-type]
            )
        ],
        log_path="rro.log",
        linux=cri_pb.LinuxContainerConfig(
            security_context=cri_pb.LinuxContainerSecurityContext(
                namespace_options=pod.config.linux.security_context.namespace_options
            )
        ),
    )
    resp = client.runtime.CreateContainer(
        cri_pb.CreateContainerRequest(
            pod_sandbox_id=pod.id, config=config, sandbox_config=pod.config
        ),
        timeout=60,
    )
    return str(resp.container_id)


def _try_rro(
    node: Containerd, handler: str, host: Path, propagation: int = cri_pb.PROPAGATION_PRIVATE
) -> tuple[str, str]:
    """("ok", what writing under the mount did) or ("refused", the CRI's words)."""
    client = CriClient(node.socket, handler)
    try:
        client.wait_ready()
        log_dir = node.pod_logs / uuid.uuid4().hex[:8]
        with client.pod(f"rro-{handler}", log_dir, host_network=True) as pod:
            try:
                cid = _rro_container(client, pod, node.images.busybox, host, propagation)
            except grpc.RpcError as err:
                return "refused", str(err.details())
            client.start_container(cid)
            top = client.exec_sync(cid, ["sh", "-c", "touch /data/x 2>&1; echo $?"])
            sub = client.exec_sync(cid, ["sh", "-c", "touch /data/sub/x 2>&1; echo $?"])
            client.stop_container(cid, timeout=1)
            return "ok", f"top: {top.stdout.decode().strip()}; sub: {sub.stdout.decode().strip()}"
    finally:
        client.close()


def test_recursive_read_only_mount_as_with_runc(node: Containerd, nested_dir: Path) -> None:
    with contextlib.closing(CriClient(node.socket, "runc")) as client:
        client.wait_ready()
        features = _handler_features(client)
    # "" is the default runtime (runc here).
    assert set(features) == {"", "runc", "cedana"}, features
    assert features["runc"]["recursive_read_only_mounts"], features
    assert features["cedana"] == features["runc"] == features[""], features
    runc = _try_rro(node, "runc", nested_dir)
    ours = _try_rro(node, "cedana", nested_dir)
    assert runc[0] == "ok" and "Read-only file system" in runc[1].split("sub:")[1], runc
    assert ours == runc
    # Refused the same way where runc's is (host-to-container propagation from a
    # private mount), the container id aside.
    slave = cri_pb.PROPAGATION_HOST_TO_CONTAINER
    runc = _try_rro(node, "runc", nested_dir, slave)
    ours = _try_rro(node, "cedana", nested_dir, slave)
    assert runc[0] == "refused" and "not a shared or slave mount" in runc[1], runc
    assert (ours[0], _no_ids(ours[1])) == (runc[0], _no_ids(runc[1]))


def _no_ids(text: str) -> str:
    return re.sub(r"\b[0-9a-f]{64}\b", "<id>", text)
