"""What is under test: the containerd versions and the runtime (cedana or runc)."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parents[3]
DEPS_DIR = Path(os.environ.get("CEDANA_DEPS_DIR", "/opt/cedana-deps"))
# Where the cedana shim is: the CRI handler's runtime_path from containerd 1.7 (as
# `cedana node install` registers it), and the directory put on the test containerd's
# PATH, where containerd 1.6's CRI and `ctr run --runtime io.containerd.cedana.v2` find it.
SHIM_BIN_DIR = Path(os.environ.get("CEDANA_SHIM_BIN_DIR", str(REPO_ROOT / ".venv" / "bin")))
CRIU = Path("/usr/local/sbin/criu")
CNI_BIN_DIR = Path("/usr/lib/cni")

# Namespace used by the ctr tests. Distinct from any namespace a node would use because
# the runc shim keeps its state under /run/containerd/runc/<ns>, shared by every
# containerd on the host.
CTR_NAMESPACE = "cedana-itest"
CRI_NAMESPACE = "k8s.io"


@dataclass(frozen=True)
class ContainerdVersion:
    short: str
    full: str
    bin_dir: Path
    config_version: int

    @property
    def id(self) -> str:
        return f"ctrd-{self.short}"

    @property
    def containerd(self) -> Path:
        return self.bin_dir / "containerd"

    @property
    def ctr(self) -> Path:
        return self.bin_dir / "ctr"

    @property
    def runc_shim(self) -> Path:
        return self.bin_dir / "containerd-shim-runc-v2"

    @property
    def major_minor(self) -> tuple[int, int]:
        major, minor = self.short.split(".")
        return int(major), int(minor)


CONTAINERD_VERSIONS: tuple[ContainerdVersion, ...] = (
    ContainerdVersion("1.6", "1.6.20", Path("/usr/bin"), 2),
    ContainerdVersion("1.7", "1.7.24", DEPS_DIR / "containerd-1.7" / "usr" / "bin", 2),
    ContainerdVersion("2.1", "2.1.9", DEPS_DIR / "containerd-2.1" / "usr" / "bin", 3),
)


@dataclass(frozen=True)
class Runtime:
    """A containerd runtime as registered in the test containerd's config."""

    handler: str  # CRI runtime handler / config table name
    runtime_type: str  # what `ctr run --runtime` and the CRI runtime_type name
    shim_binary: str  # basename containerd derives from runtime_type

    def shim_path(self, version: ContainerdVersion) -> Path:
        if self.handler == "runc":
            return version.runc_shim
        return SHIM_BIN_DIR / self.shim_binary


CEDANA = Runtime("cedana", "io.containerd.cedana.v2", "containerd-shim-cedana-v2")
RUNC = Runtime("runc", "io.containerd.runc.v2", "containerd-shim-runc-v2")
RUNTIMES = {r.handler: r for r in (CEDANA, RUNC)}


def runtime_under_test() -> Runtime:
    """The runtime the suite drives: cedana by default, `CEDANA_TEST_RUNTIME=runc` to run
    the very same tests against containerd's own runc shim for comparison."""
    name = os.environ.get("CEDANA_TEST_RUNTIME", "cedana").strip().lower()
    try:
        return RUNTIMES[name]
    except KeyError:
        raise ValueError(
            f"CEDANA_TEST_RUNTIME={name!r}: expected one of {sorted(RUNTIMES)}"
        ) from None


def selected_versions() -> tuple[ContainerdVersion, ...]:
    """`CEDANA_TEST_CONTAINERD=1.6,2.1` narrows the matrix while iterating locally."""
    raw = os.environ.get("CEDANA_TEST_CONTAINERD", "").strip()
    if not raw:
        return CONTAINERD_VERSIONS
    wanted = {v.strip() for v in raw.split(",") if v.strip()}
    picked = tuple(v for v in CONTAINERD_VERSIONS if v.short in wanted or v.full in wanted)
    unknown = wanted - {v.short for v in picked} - {v.full for v in picked}
    if unknown:
        raise ValueError(f"CEDANA_TEST_CONTAINERD: unknown versions {sorted(unknown)}")
    return picked
