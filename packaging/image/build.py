"""Build the cedana node image as an OCI layout, without a container daemon.

    sudo .venv/bin/python packaging/image/build.py --output /tmp/cedana-image \
        [--archive /tmp/cedana-image.tar] [--name REGISTRY/cedana/cedana-shim:TAG]
    skopeo copy oci:/tmp/cedana-image:0.1.0 docker://REGISTRY/cedana/cedana-shim:0.1.0

This script is the image's only definition (it replaced a Dockerfile that needed a
daemon and a CPython from GitHub, which CI cannot reach). Inputs are pinned:
Debian bookworm from --mirror (a snapshot.debian.org URL for a byte-exact rebuild),
the wheels of requirements.txt by hash, cedana-shim built from this checkout, and
every timestamp from SOURCE_DATE_EPOCH (default: the last commit's time): two builds
of one checkout against one mirror state give the same manifest digest.

1. wheels: cedana-shim from this checkout, its closure from requirements.txt;
2. a build root (mmdebstrap: Debian's python3.11, patchelf) runs ``assemble.py
   prefix``: Debian's interpreter made relocatable, then ``/opt/cedana`` assembled
   with ``cedana node bundle`` (why Debian's Python: assemble.py and the README);
3. the image root (mmdebstrap, Essential packages only: sh, coreutils, nsenter) gets
   ``/opt/cedana`` and runs ``assemble.py check``: a payload built by the image's
   interpreter runs in a root holding nothing but glibc;
4. umoci turns the root's tarball into one layer with the entrypoint and tags.

Needs root (mmdebstrap's root mode, chroot), mmdebstrap, umoci, and pip with
setuptools in the running Python. Prints a JSON summary (sizes, time, digest).
"""

from __future__ import annotations

import argparse
import datetime
import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
REPO = HERE.parents[1]
SUITE = "bookworm"
DEFAULT_MIRROR = "http://deb.debian.org/debian"
DEFAULT_REPOSITORY = "ghcr.io/cedana/cedana-shim"
BUILD_PACKAGES = ("python3.11-minimal", "libpython3.11-stdlib", "libstdc++6", "patchelf")
MERGED_USR_HOOKS = "/usr/share/mmdebstrap/hooks/merged-usr"
# Documentation a container never shows (copyright files stay).
SLIM = (
    *(f"--dpkgopt=path-exclude=/usr/share/{d}/*" for d in ("doc", "man", "info", "locale")),
    "--dpkgopt=path-include=/usr/share/doc/*/copyright",
)
ENTRYPOINT = "/opt/cedana/bin/cedana"
IMAGE_PATH = "PATH=/opt/cedana/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
# What pip may pick for the image's CPython 3.11 on glibc (requirements.txt's wheels).
WHEEL_TARGET = (
    "--only-binary=:all:", "--python-version", "3.11", "--implementation", "cp",
    "--abi", "cp311", "--platform", "manylinux2014_x86_64",
    "--platform", "manylinux_2_17_x86_64", "--platform", "manylinux_2_28_x86_64",
)  # fmt: skip


class BuildError(Exception):
    pass


def run(argv: list[str], *, what: str, env: dict[str, str] | None = None) -> str:
    proc = subprocess.run(
        argv,
        capture_output=True,
        text=True,
        check=False,
        env={**os.environ, **(env or {})},
    )
    if proc.returncode != 0:
        output = (proc.stdout + proc.stderr).strip()
        raise BuildError(f"{what}: `{' '.join(argv[:3])} ...` exited {proc.returncode}:\n"
                         f"{output[-4000:]}")  # fmt: skip
    return proc.stdout


def source_date_epoch() -> int:
    if os.environ.get("SOURCE_DATE_EPOCH"):
        return int(os.environ["SOURCE_DATE_EPOCH"])
    proc = subprocess.run(
        ["git", "-C", str(REPO), "log", "-1", "--format=%ct"], capture_output=True, text=True
    )
    return int(proc.stdout.strip()) if proc.returncode == 0 and proc.stdout.strip() else 0


def preflight(output: Path, archive: Path | None) -> None:
    if os.geteuid() != 0:
        raise BuildError("run as root: mmdebstrap's root mode and chroot need it")
    for tool in ("mmdebstrap", "umoci"):
        if shutil.which(tool) is None:
            raise BuildError(f"{tool} is not installed: apt-get install {tool}")
    if not os.path.isdir(MERGED_USR_HOOKS):
        raise BuildError(f"{MERGED_USR_HOOKS} is missing: mmdebstrap >= 1.0 has it")
    for path in (output, archive):
        if path is not None and os.path.lexists(path):
            raise BuildError(f"{path} already exists: remove it or pick another path")
    for path in (HERE, Path(tempfile.gettempdir())):
        if re.search(r"\s", str(path)):
            raise BuildError(f"{path} has white space, which mmdebstrap's hooks cannot quote")


def build_wheels(work: Path, cache: Path, epoch: int) -> tuple[Path, str]:
    """cedana-shim's wheel from this checkout, and its pinned closure, in one
    hash-checked install under work/site; returns that dir and the shim's version."""
    src = work / "src"
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy2(REPO / name, src / name)
    shutil.copytree(
        REPO / "shim", src / "shim", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info")
    )
    wheels = cache / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    built = work / "built"
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check"]
    env = {"SOURCE_DATE_EPOCH": str(epoch)}
    run([*pip, "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(built), str(src)],
        what="building the cedana-shim wheel (needs pip and setuptools here)", env=env)  # fmt: skip
    (wheel,) = built.glob("cedana_shim-*.whl")
    version = wheel.name.split("-")[1]
    run([*pip, "download", "-q", "--no-deps", "--require-hashes", *WHEEL_TARGET, "-d", str(wheels),
         "-r", str(HERE / "requirements.txt")], what="downloading the pinned wheels")  # fmt: skip
    requirements = work / "requirements.txt"
    digest = hashlib.sha256(wheel.read_bytes()).hexdigest()
    requirements.write_text(
        (HERE / "requirements.txt").read_text() + f"cedana-shim=={version} --hash=sha256:{digest}\n"
    )
    site = work / "site"
    # From an index (find-links), not a path: no direct_url.json naming this temp dir.
    # No bytecode here: the image root compiles it once, reproducibly.
    run([*pip, "install", "-q", "--no-index", "--find-links", str(wheels), "--find-links",
         str(built), "--no-deps", "--no-compile", "--require-hashes", *WHEEL_TARGET,
         "--target", str(site), "-r", str(requirements)],
        what="installing the wheels for the image")  # fmt: skip
    return site, version


def mmdebstrap(cache: Path, mirror: str, target: str, packages: tuple[str, ...],
               hooks: list[str], extra: tuple[str, ...] = ()) -> None:  # fmt: skip
    debs = cache / "debs"
    debs.mkdir(parents=True, exist_ok=True)
    argv = [
        "mmdebstrap", "--mode=root", "--variant=essential", *extra,
        # merged /usr through mmdebstrap's hook rather than the usrmerge package (and the
        # 50 MB of perl it pulls in)
        f"--hook-dir={MERGED_USR_HOOKS}",
        *([f"--include={','.join(packages)}"] if packages else []),
        '--setup-hook=mkdir -p "$1"/var/cache/apt/archives/',
        f"--setup-hook=sync-in {debs} /var/cache/apt/archives/",
        *[f"--customize-hook={hook}" for hook in hooks],
        f"--customize-hook=sync-out /var/cache/apt/archives {debs}",
        SUITE, target, mirror,
    ]  # fmt: skip
    run(argv, what=f"mmdebstrap {target}")


def glibc_floor(root: Path) -> str:
    """The newest GLIBC_x.y symbol version any ELF file under root asks for."""
    newest = (2, 0)
    for dirpath, _dirs, files in os.walk(root):
        for name in files:
            path = os.path.join(dirpath, name)
            if os.path.islink(path) or not (".so" in name or "/bin/" in path):
                continue
            proc = subprocess.run(["readelf", "-V", path], capture_output=True, text=True)
            for major, minor in re.findall(r"Name: GLIBC_(\d+)\.(\d+)", proc.stdout):
                newest = max(newest, (int(major), int(minor)))
    return f"{newest[0]}.{newest[1]}"


def tree_size(root: Path) -> int:
    return sum(
        os.lstat(os.path.join(d, f)).st_size for d, _dirs, files in os.walk(root) for f in files
    )


def make_layout(work: Path, rootfs: Path, tag: str, name: str, epoch: int) -> Path:
    layout = work / "layout"
    image = f"{layout}:{tag}"
    created = datetime.datetime.fromtimestamp(epoch, datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    run(["umoci", "init", "--layout", str(layout)], what="umoci init")
    run(["umoci", "new", "--image", image], what="umoci new")
    run(["umoci", "raw", "add-layer", "--image", image, "--history.created", created,
         "--history.created_by", "packaging/image/build.py", str(rootfs)],
        what="umoci raw add-layer")  # fmt: skip
    run(["umoci", "config", "--image", image, "--created", created, "--history.created", created,
         "--config.entrypoint", ENTRYPOINT, "--config.cmd", "node", "--config.cmd", "--help",
         "--config.env", IMAGE_PATH, "--config.workingdir", "/",
         "--config.label", f"org.opencontainers.image.version={tag}",
         "--config.label", "org.opencontainers.image.title=cedana-shim node image"],
        what="umoci config")  # fmt: skip
    run(["umoci", "gc", "--layout", str(layout)], what="umoci gc")
    # containerd names an imported OCI image after this annotation (the bare tag would
    # need --base-name, which differs between ctr versions).
    index_path = layout / "index.json"
    index = json.loads(index_path.read_text())
    for desc in index["manifests"]:
        desc.setdefault("annotations", {})["io.containerd.image.name"] = name
    index_path.write_text(json.dumps(index))
    return layout


def write_archive(layout: Path, archive: Path, epoch: int) -> None:
    def clamp(info: tarfile.TarInfo) -> tarfile.TarInfo:
        info.mtime = min(info.mtime, epoch)
        info.uid = info.gid = 0
        info.uname = info.gname = ""
        return info

    with tarfile.open(archive, "w") as tar:
        for dirpath, dirnames, files in os.walk(layout):
            dirnames.sort()
            for f in sorted(files):
                path = Path(dirpath) / f
                tar.add(path, arcname=str(path.relative_to(layout)), filter=clamp)


def build(args: argparse.Namespace) -> dict[str, object]:
    started = time.monotonic()
    preflight(args.output, args.archive)
    epoch = source_date_epoch()
    os.environ["SOURCE_DATE_EPOCH"] = str(epoch)  # mmdebstrap: reproducible roots
    cache = args.cache.resolve()
    with tempfile.TemporaryDirectory(prefix="cedana-image-") as tmp:
        work = Path(tmp)
        site, version = build_wheels(work, cache, epoch)
        phases = {"wheels": time.monotonic() - started}
        prefix = work / "prefix"
        prefix.mkdir()
        mmdebstrap(cache, args.mirror, "/dev/null", BUILD_PACKAGES, [
            'mkdir -p "$1/usr/lib/python3.11/site-packages" "$1/tmp/assemble"',
            f"sync-in {site} /usr/lib/python3.11/site-packages",
            f"copy-in {HERE / 'assemble.py'} {HERE / 'sitecustomize.py'} /tmp/assemble",
            'chroot "$1" python3.11 /tmp/assemble/assemble.py prefix',
            f"sync-out /opt/cedana {prefix}",
        ])  # fmt: skip
        phases["build root"] = time.monotonic() - started - sum(phases.values())
        rootfs = work / "rootfs.tar"
        check = work / "check.json"
        mmdebstrap(cache, args.mirror, str(rootfs), (), [
            'mkdir -p "$1/opt/cedana"',
            f"sync-in {prefix} /opt/cedana",
            f"copy-in {HERE / 'assemble.py'} /tmp",
            f'chroot "$1" /opt/cedana/bin/python3 -I /tmp/assemble.py check > {check}',
            'rm -f "$1/tmp/assemble.py"',
            # Bytecode that does not depend on when it was written (the checks above
            # wrote some): hash-based, and unchecked, since /opt/cedana is only ever
            # replaced whole, here and on nodes.
            'find "$1/opt/cedana" -name __pycache__ -prune -exec rm -rf {} +',
            'chroot "$1" /opt/cedana/bin/python3 -I -m compileall -q -j 0 '
            "--invalidation-mode unchecked-hash /opt/cedana/lib",
        ], extra=("--skip=output/dev", *SLIM))  # fmt: skip
        phases["image root"] = time.monotonic() - started - sum(phases.values())
        tag = args.tag or version
        name = args.name or f"{DEFAULT_REPOSITORY}:{tag}"
        layout = make_layout(work, rootfs, tag, name, epoch)
        manifest_desc = json.loads((layout / "index.json").read_text())["manifests"][0]
        payload = json.loads(check.read_text())["payload"]
        summary: dict[str, object] = {
            "layout": str(args.output),
            "tag": tag,
            "name": name,
            "manifest_digest": manifest_desc["digest"],
            "image_bytes_compressed": tree_size(layout / "blobs"),
            "rootfs_bytes": rootfs.stat().st_size,
            "prefix_bytes": tree_size(prefix),
            "python": payload["python"],
            "payload_portable": payload["portable"],
            "needs_glibc": glibc_floor(prefix),
            "source_date_epoch": epoch,
            "phase_seconds": {k: round(v, 1) for k, v in phases.items()},
        }
        shutil.move(str(layout), args.output)
    if args.archive is not None:
        write_archive(args.output, args.archive, epoch)
        summary["archive"] = str(args.archive)
    summary["build_seconds"] = round(time.monotonic() - started, 1)
    return summary


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--output", type=Path, required=True, help="a new OCI layout directory")
    p.add_argument("--archive", type=Path, help="also write the layout as a tar (ctr import)")
    p.add_argument("--tag", help="the layout's tag (default: cedana-shim's version)")
    p.add_argument(
        "--name", help=f"the image name for `ctr import` (default {DEFAULT_REPOSITORY}:TAG)"
    )
    p.add_argument("--mirror", default=DEFAULT_MIRROR, help="Debian mirror (default %(default)s)")
    p.add_argument(
        "--cache",
        type=Path,
        default=Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "cedana-image",
        help="downloaded .debs and wheels, kept between builds (default %(default)s)",
    )
    args = p.parse_args(argv)
    try:
        summary = build(args)
    except BuildError as err:
        print(f"build.py: {err}", file=sys.stderr)
        return 1
    print(json.dumps(summary, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
