"""The nodes of the VM tier: containerd registered as on a kubeadm node with cgroup v2.

The `cedana` handler is registered as `cedana node install` registers it on containerd
>= 1.7 (a runc-type runtime whose runtime_path is the shim), with `SystemdCgroup = true`
as kubeadm sets it for runc: the CRI's containers run in systemd scopes under the pod's
slice (`kubepods-besteffort-pod<uid>.slice/cri-containerd-<id>.scope`), as kubelet's
systemd cgroup driver names them. `ctr run --runtime io.containerd.cedana.v2` passes no
runc options, so ctr's containers use runc's cgroupfs driver on the same unified
hierarchy (`/<namespace>/<id>`).
"""

from __future__ import annotations

from pathlib import Path

from cedana_shim.api.cri.v1 import api_pb2 as cri
from cedana_shim.node import registration
from integration.harness import procs
from integration.harness.containerd import Containerd
from integration.harness.cri import CriClient

CGROUP_ROOT = Path("/sys/fs/cgroup")
# What a test waits at most for one step (a checkpoint, a restore, some output), in the
# host's terms: the harness stretches every bound by CEDANA_TEST_SLOWER (conftest).
TIMEOUT = 30
MiB = 1 << 20
# Once /hog exists the counter (each tick) reads 128 MiB into a shell variable: beyond
# any memory limit the tests set.
HOG = "[ -e /hog ] && hog=$(head -c 134217728 /dev/zero | tr '\\000' x)\n"


class SystemdCri(CriClient):
    """Pods whose cgroup parent is a systemd slice, as kubelet's systemd driver makes."""

    def pod_config(
        self, name: str, log_dir: Path, *, host_network: bool, namespace: str = "itest"
    ) -> cri.PodSandboxConfig:
        config = super().pod_config(name, log_dir, host_network=host_network, namespace=namespace)
        config.linux.cgroup_parent = f"kubepods-besteffort-pod{config.metadata.uid}.slice"
        return config


class SystemdNode(Containerd):
    def _cedana_tables(self) -> str:
        return "\n" + registration.render_tables(
            self.version.config_version,
            self.cedana_runtime_path(),
            str(self.node_config),
            runc_options={"SystemdCgroup": True},
        )

    def cri(self) -> CriClient:
        client = SystemdCri(self.socket, self.runtime.handler)
        client.wait_ready()
        return client


def cgroup_of(pid: int) -> str:
    """The unified-hierarchy path of a process (its `0::` line)."""
    for line in Path(f"/proc/{pid}/cgroup").read_text().splitlines():
        if line.startswith("0::"):
            return line[3:]
    raise AssertionError(f"pid {pid} is in no cgroup v2 cgroup")


def cgroup_dir(path: str) -> Path:
    return CGROUP_ROOT / path.lstrip("/")


def cgroup_pids(path: str) -> set[int]:
    """Every process in the cgroup and below it."""
    found: set[int] = set()
    for members in cgroup_dir(path).rglob("cgroup.procs"):
        found |= {int(p) for p in members.read_text().split()}
    return found


class Figures:
    """What the tests measured, printed at the end of the run (the tier's figures)."""

    def __init__(self) -> None:
        self.lines: list[str] = []

    def add(self, line: str) -> None:
        self.lines.append(line)


def assert_cgroup_holds(path: str, tree: set[int]) -> None:
    """`tree` is in the cgroup at `path`, and nothing else lives there but their
    children (or processes that are gone by now)."""
    where = {pid: cgroup_of(pid) for pid in tree}
    assert set(where.values()) == {path}, f"processes outside the cgroup {path}: {where}"
    members = cgroup_pids(path)
    strangers = members - tree - procs.descendants(tree)
    assert not {p for p in strangers if procs.pid_alive(p)}, (path, members, tree)
