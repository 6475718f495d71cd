"""The node image (packaging/image/build.py) as the chart runs it, on REAL containerd.

The image is built once per session (no Docker daemon: mmdebstrap and umoci) and
imported with `ctr images import` into a private containerd, the "kubelet's" one.
`ctr run` runs `cedana node install --host-root /host` from it with a fake host root
bind-mounted, as the DaemonSet helper does. The "host" is a second private containerd
whose config is the fake host root's (test_node_install's `make_node`): after the
install it must run a CRI pod with the `cedana` handler through the payload the image
put there, whose interpreter finds every library but glibc inside the payload. The
uninstall, from the image too, gives the host its config back byte for byte.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from .harness import images as harness_images
from .harness.config import CTR_NAMESPACE, RUNC, selected_versions
from .harness.containerd import Containerd, make_containerd
from .test_node_install import Node, _run_cri_pod, make_node

REPO = Path(__file__).resolve().parents[2]
BUILD = REPO / "packaging" / "image" / "build.py"
IMAGE_PREFIX = "/opt/cedana"
IMAGE_PYTHON = f"{IMAGE_PREFIX}/bin/python3"
# The C library's own sonames: the only libraries a payload may take from the host.
GLIBC = re.compile(r"^(libc|libm|libdl|libpthread|librt|libutil|libresolv|ld-linux-x86-64)\.so")


@dataclass(frozen=True)
class NodeImage:
    archive: Path
    name: str
    summary: dict[str, object]


@pytest.fixture(scope="session")
def node_image(itest_root: Path) -> NodeImage:
    """packaging/image/build.py, once per session (downloads are cached in its default
    cache directory between sessions)."""
    out = itest_root / "node-image"
    proc = subprocess.run(
        [sys.executable, str(BUILD), "--output", str(out), "--archive", f"{out}.tar"],
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    assert proc.returncode == 0, f"build.py exited {proc.returncode}:\n{proc.stderr}"
    summary = json.loads(proc.stdout)
    print(f"node image: {json.dumps(summary)}")
    return NodeImage(Path(f"{out}.tar"), str(summary["name"]), summary)


@pytest.fixture
def runner(test_images: harness_images.TestImages, itest_root: Path) -> Iterator[Containerd]:
    """The containerd that runs the image (the kubelet's, on a real node)."""
    version = selected_versions()[-1]
    instance = make_containerd(version, RUNC, test_images, itest_root / "runner", ())
    try:
        yield instance
    finally:
        instance.cleanup()


def _run_from_image(
    runner: Containerd, image: NodeImage, node: Node, *args: str
) -> subprocess.CompletedProcess[str]:
    """`cedana node ARGS` in a privileged container of the image, the host root at /host
    and the node's directory (containerd's and the restart helper's sockets) at its own
    path, as the DaemonSet mounts the node's / and containerd's socket. The fake host
    root gets this machine's libraries (read-only, in the container only), so that the
    host binaries the installer runs through chroot (criu, containerd, the payload's
    interpreter) find a loader and libraries, as on a node."""
    base = node.host_root.parent
    for name in ("lib", "lib64"):
        if not (node.host_root / name).is_symlink():
            (node.host_root / name).symlink_to(f"usr/{name}")
    restart = node.restarter.command.replace(sys.executable, IMAGE_PYTHON, 1)
    return runner.ctr(CTR_NAMESPACE)(
        "run", "--rm", "--privileged", "--net-host", "--runtime", RUNC.runtime_type,
        "--mount", f"type=bind,src={node.host_root},dst=/host,options=rbind:rw",
        "--mount", f"type=bind,src={base},dst={base},options=rbind:rw",
        "--mount", "type=bind,src=/usr/lib,dst=/host/usr/lib,options=rbind:ro",
        "--mount", "type=bind,src=/usr/lib64,dst=/host/usr/lib64,options=rbind:ro",
        image.name, f"node-{uuid.uuid4().hex[:8]}",
        f"{IMAGE_PREFIX}/bin/cedana", "node", *args, "--host-root", "/host",
        "--containerd-socket", str(node.containerd.socket), "--restart-command", restart,
        "--json",
        timeout=300, check=False,
    )  # fmt: skip


def _foreign_libraries(payload: Path) -> dict[str, str]:
    """What the payload's interpreter and extension modules load from outside it, other
    than glibc (ldd resolves through the RUNPATHs the image build set)."""
    foreign = {}
    elves = [payload / "bin/python3", *sorted(payload.glob("lib/python3.*/**/*.so"))]
    for path in elves:
        out = subprocess.run(["ldd", str(path)], capture_output=True, text=True).stdout
        for soname, target in re.findall(r"^\s*(\S+) => (\S+)", out, re.MULTILINE):
            inside = os.path.realpath(target).startswith(str(payload) + "/")
            if not inside and not GLIBC.match(soname):
                foreign[f"{path.relative_to(payload)}: {soname}"] = target
    return foreign


def test_install_from_the_image_under_containerd(
    node_image: NodeImage,
    runner: Containerd,
    test_images: harness_images.TestImages,
    itest_root: Path,
) -> None:
    runner.ctr(CTR_NAMESPACE)("images", "import", str(node_image.archive), timeout=180)
    version = selected_versions()[-1]
    # The payload comes from the image: the installer builds it from the image's Python.
    with make_node(version, "plain", test_images, itest_root, Path(IMAGE_PREFIX)) as node:
        original = node.config.read_bytes()

        proc = _run_from_image(runner, node_image, node, "install")
        assert proc.returncode == 0, f"install from the image: {proc.stdout}\n{proc.stderr}"
        result = json.loads(proc.stdout)
        assert result["ok"] and result["restarted"], result
        assert node.restarter.restarts == 1
        steps = {s["name"]: s for s in result["steps"]}
        assert steps["probe pod"]["outcome"] == "ok", steps["probe pod"]

        payload = node.host_root / "opt/cedana"
        manifest = json.loads((payload / "cedana-bundle.json").read_text())
        assert manifest["portable"] and manifest["python"] == node_image.summary["python"]
        assert not (payload / "lib/python3.11/site-packages/kubernetes").exists(), (
            "the Kubernetes client serves the helper only: the payload leaves it out"
        )
        assert _foreign_libraries(payload) == {}
        _run_cri_pod(node, test_images)

        proc = _run_from_image(runner, node_image, node, "uninstall")
        assert proc.returncode == 0, f"uninstall from the image: {proc.stdout}\n{proc.stderr}"
        assert json.loads(proc.stdout)["ok"]
        assert node.config.read_bytes() == original
        assert not payload.exists()
