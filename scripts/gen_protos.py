#!/usr/bin/env python3
"""Generate cedana_shim.api from the upstream .proto files.

Sources are the official interface definitions shipped by Debian
(golang-github-containerd-containerd-dev 1.7 from trixie, whose protos are a
superset of 1.6's; golang-github-containerd-cgroups-dev; and
golang-github-kubernetes-cri-api-dev) plus the few schemas under protos/local
that no Debian package carries. Each file is staged under
cedana_shim/api/<name>.proto with two mechanical rewrites:

* import paths are mapped to their staged names, so the generated modules
  import each other as ``cedana_shim.api....`` (``github.com`` is not a Python
  package name);
* gogoproto / containerd fieldpath options are removed: they only steer Go code
  generation, and dropping them spares the shim importing descriptor.proto at
  start-up. The wire format (packages, messages, field numbers) is untouched.

Usage: gen_protos.py            regenerate shim/cedana_shim/api
       gen_protos.py --check    fail if the committed modules differ
"""

from __future__ import annotations

import argparse
import filecmp
import os
import re
import shutil
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
OUT_PACKAGE = REPO / "shim" / "cedana_shim" / "api"
DEPS_DIR = Path(os.environ.get("CEDANA_DEPS_DIR", "/opt/cedana-deps"))
GOCODE_ROOTS = [
    DEPS_DIR / "containerd-api/usr/share/gocode/src",
    DEPS_DIR / "cri-api/usr/share/gocode/src",
    Path("/usr/share/gocode/src"),
]
LOCAL = REPO / "protos" / "local"

CTRD = "github.com/containerd/containerd"
# upstream import path -> staged module path (under cedana_shim/api/)
SOURCES: dict[str, str] = {
    f"{CTRD}/api/types/mount.proto": "containerd/types/mount.proto",
    f"{CTRD}/api/types/task/task.proto": "containerd/types/task.proto",
    f"{CTRD}/api/runtime/task/v2/shim.proto": "containerd/task/v2/shim.proto",
    f"{CTRD}/api/events/task.proto": "containerd/events/task.proto",
    f"{CTRD}/api/services/ttrpc/events/v1/events.proto": "containerd/services/ttrpc_events.proto",
    f"{CTRD}/api/types/descriptor.proto": "containerd/types/descriptor.proto",
    f"{CTRD}/api/services/containers/v1/containers.proto": "containerd/services/containers.proto",
    f"{CTRD}/api/services/images/v1/images.proto": "containerd/services/images.proto",
    f"{CTRD}/runtime/v2/runc/options/oci.proto": "containerd/runc/options.proto",
    f"{CTRD}/pkg/runtimeoptions/v1/api.proto": "containerd/runtimeoptions.proto",
    "github.com/containerd/cgroups/stats/v1/metrics.proto": "cgroups/v1/metrics.proto",
    "github.com/containerd/cgroups/v2/stats/metrics.proto": "cgroups/v2/metrics.proto",
    "k8s.io/cri-api/pkg/apis/runtime/v1/api.proto": "cri/v1/api.proto",
    "local/ttrpc_request.proto": "ttrpc/request.proto",
    "local/google_rpc_status.proto": "google_rpc/status.proto",
    "local/bootstrap.proto": "containerd/bootstrap.proto",
    "local/runtime_info.proto": "containerd/types/introspection.proto",
    "local/cedana.proto": "cedana/v1/cedana.proto",
    "local/criu_stats.proto": "criu/stats.proto",
    "local/criu_pagemap.proto": "criu/pagemap.proto",
}
# import spellings used upstream that are not the canonical SOURCES keys
ALIASES = {"google/rpc/status.proto": "local/google_rpc_status.proto"}
# gRPC stubs only where we call gRPC: the CRI (tests, `cedana node`), containerd's
# containers and images (the image a remote checkpoint is checked against).
GRPC_SERVICES = {
    "cri/v1/api.proto",
    "containerd/services/containers.proto",
    "containerd/services/images.proto",
}
STAGE_PREFIX = "cedana_shim/api/"

GOGO_IMPORT = re.compile(
    r'^\s*import\s+(weak\s+)?"[^"]*(gogo\.proto|fieldpath\.proto)";\s*\n', re.M
)
GOGO_FILE_OPTION = re.compile(
    r"^\s*option\s+\((gogoproto|containerd\.plugin|containerd\.types)\.[^;]*;\s*\n", re.M
)
FIELD_OPTIONS = re.compile(r"\s*\[([^\[\]]*)\]")
IMPORT = re.compile(r'^(\s*import\s+(?:public\s+)?)"([^"]+)";', re.M)


def find_source(name: str) -> Path:
    if name.startswith("local/"):
        return LOCAL / name.removeprefix("local/")
    for root in GOCODE_ROOTS:
        if (root / name).is_file():
            return root / name
    sys.exit(f"gen_protos: {name} not found under {GOCODE_ROOTS}; run scripts/setup-node-deps.sh")


def strip_field_options(match: re.Match[str]) -> str:
    kept = [o.strip() for o in match.group(1).split(",") if not o.strip().startswith("(gogoproto.")]
    kept = [o for o in kept if o]
    return f" [{', '.join(kept)}]" if kept else ""


def rewrite(text: str) -> str:
    text = GOGO_IMPORT.sub("", text)
    text = GOGO_FILE_OPTION.sub("", text)
    text = FIELD_OPTIONS.sub(strip_field_options, text)

    def fix_import(m: re.Match[str]) -> str:
        target = ALIASES.get(m.group(2), m.group(2))
        if target in SOURCES:
            return f'{m.group(1)}"{STAGE_PREFIX}{SOURCES[target]}";'
        if target.startswith("google/protobuf/"):
            return m.group(0)
        raise SystemExit(f"gen_protos: unmapped import {m.group(2)}")

    return IMPORT.sub(fix_import, text)


def generate(out_root: Path) -> None:
    import grpc_tools
    from grpc_tools import protoc  # type: ignore[import-untyped]

    stage = Path(tempfile.mkdtemp(prefix="cedana-protos-"))
    try:
        staged: list[str] = []
        for upstream, target in SOURCES.items():
            dest = stage / STAGE_PREFIX / target
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_text(rewrite(find_source(upstream).read_text()))
            staged.append(STAGE_PREFIX + target)
        include = Path(grpc_tools.__file__).parent / "_proto"
        for name in staged:
            args = [
                "protoc",
                f"-I{stage}",
                f"-I{include}",
                f"--python_out={out_root}",
                f"--pyi_out={out_root}",
            ]
            if name.removeprefix(STAGE_PREFIX) in GRPC_SERVICES:
                args.append(f"--grpc_python_out={out_root}")
            if protoc.main([*args, name]) != 0:
                raise SystemExit(f"gen_protos: protoc failed on {name}")
    finally:
        shutil.rmtree(stage)
    for d in [out_root / "cedana_shim" / "api", *(out_root / "cedana_shim" / "api").rglob("*")]:
        if d.is_dir() and not (d / "__init__.py").exists():
            (d / "__init__.py").write_text("")


def tree(root: Path) -> dict[str, Path]:
    return {
        str(p.relative_to(root)): p
        for p in root.rglob("*")
        if p.is_file() and "__pycache__" not in p.parts
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--check", action="store_true", help="compare instead of writing")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="cedana-gen-") as tmp:
        out = Path(tmp)
        generate(out)
        fresh = tree(out / "cedana_shim" / "api")
        if args.check:
            current = tree(OUT_PACKAGE)
            current.pop("README.md", None)
            drift = sorted(set(fresh) ^ set(current)) + sorted(
                n for n in set(fresh) & set(current) if not filecmp.cmp(fresh[n], current[n], False)
            )
            if drift:
                print(
                    "generated protobuf modules are out of date; run scripts/gen_protos.py:",
                    *drift,
                    sep="\n  ",
                )
                return 1
            print(f"generated protobuf modules up to date ({len(fresh)} files)")
            return 0
        readme = OUT_PACKAGE / "README.md"
        keep = readme.read_text() if readme.exists() else None
        shutil.rmtree(OUT_PACKAGE, ignore_errors=True)
        shutil.copytree(out / "cedana_shim" / "api", OUT_PACKAGE)
        if keep is not None:
            readme.write_text(keep)
        print(f"wrote {len(fresh)} files under {OUT_PACKAGE.relative_to(REPO)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
