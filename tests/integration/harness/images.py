"""Local test images: no registry is reachable, so images are built from Debian's
busybox-static with umoci and loaded with `ctr images import`."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tarfile
from dataclasses import dataclass
from pathlib import Path

BUSYBOX_IMAGE = "docker.io/cedana-test/busybox:latest"
PAUSE_IMAGE = "docker.io/cedana-test/pause:latest"
_BUSYBOX = Path("/bin/busybox")
_ENV_PATH = "PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# 2^31-1 seconds: busybox `sleep` has no "infinity", and the pause process is only ever
# SIGKILLed by CRI.
_PAUSE_SECONDS = "2147483647"


@dataclass(frozen=True)
class TestImages:
    archive: Path  # OCI layout tarball holding both images
    busybox: str
    pause: str


def _run(*argv: str | Path) -> None:
    proc = subprocess.run(
        [str(a) for a in argv], capture_output=True, text=True, timeout=120, check=False
    )
    if proc.returncode != 0:
        raise RuntimeError(
            f"{' '.join(map(str, argv))} failed ({proc.returncode}):\n{proc.stdout}{proc.stderr}"
        )


def _populate_rootfs(rootfs: Path) -> None:
    for d in ("bin", "dev", "etc", "proc", "root", "sys", "var", "run"):
        (rootfs / d).mkdir(exist_ok=True)
    tmp = rootfs / "tmp"
    tmp.mkdir(exist_ok=True)
    os.chmod(tmp, 0o1777)
    shutil.copy2(_BUSYBOX, rootfs / "bin" / "busybox")
    applets = subprocess.run(
        [str(_BUSYBOX), "--list"], capture_output=True, text=True, check=True
    ).stdout.split()
    for applet in applets:
        link = rootfs / "bin" / applet
        if applet != "busybox" and not link.exists():
            link.symlink_to("busybox")
    (rootfs / "etc" / "passwd").write_text("root:x:0:0:root:/root:/bin/sh\n")
    (rootfs / "etc" / "group").write_text("root:x:0:\n")


def build_test_images(workdir: Path) -> TestImages:
    """Build the busybox and pause images into one OCI archive under `workdir`."""
    if not _BUSYBOX.is_file():
        raise RuntimeError(f"{_BUSYBOX} missing: install busybox-static (make setup)")
    layout = workdir / "layout"
    bundle = workdir / "bundle"
    for p in (layout, bundle):
        if p.exists():
            shutil.rmtree(p)
    _run("umoci", "init", "--layout", layout)
    _run("umoci", "new", "--image", f"{layout}:busybox")
    _run("umoci", "unpack", "--image", f"{layout}:busybox", bundle)
    _populate_rootfs(bundle / "rootfs")
    _run("umoci", "repack", "--image", f"{layout}:busybox", bundle)
    _run(
        "umoci",
        "config",
        "--image",
        f"{layout}:busybox",
        "--config.env",
        _ENV_PATH,
        "--config.cmd",
        "/bin/sh",
        "--config.workingdir",
        "/",
    )
    _run(
        "umoci",
        "config",
        "--image",
        f"{layout}:busybox",
        "--tag",
        "pause",
        "--config.entrypoint",
        "/bin/sleep",
        "--config.cmd",
        _PAUSE_SECONDS,
    )
    _run("umoci", "gc", "--layout", layout)
    shutil.rmtree(bundle)

    # containerd names imported OCI images after this annotation; the bare umoci tag
    # ("busybox") would otherwise need --base-name, which differs between ctr versions.
    names = {"busybox": BUSYBOX_IMAGE, "pause": PAUSE_IMAGE}
    index_path = layout / "index.json"
    index = json.loads(index_path.read_text())
    for desc in index["manifests"]:
        ann = desc.setdefault("annotations", {})
        tag = ann.get("org.opencontainers.image.ref.name")
        if tag in names:
            ann["io.containerd.image.name"] = names[tag]
    index_path.write_text(json.dumps(index))

    archive = workdir / "images.tar"
    with tarfile.open(archive, "w") as tar:
        for entry in sorted(layout.iterdir()):
            tar.add(entry, arcname=entry.name)
    return TestImages(archive=archive, busybox=BUSYBOX_IMAGE, pause=PAUSE_IMAGE)
