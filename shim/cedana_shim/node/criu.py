"""Is a CRIU >= 4.1 where runc will look for it on the host?"""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from typing import Final

from .criu_probe import probe_inet_dump
from .hostfs import HostRoot
from .report import NodeError

MINIMUM: Final = (4, 1)
# containerd (and so runc, which runs `criu` from PATH) gets systemd's default PATH;
# the first criu on it is the one that checkpoints.
SEARCH_PATH: Final = ("/usr/local/sbin", "/usr/local/bin", "/usr/sbin", "/usr/bin", "/sbin", "/bin")
INSTALL_PATH: Final = "/usr/local/sbin/criu"
HOW_TO_GET: Final = (
    "CRIU >= 4.1 is needed for checkpoint/restore (older releases fail on current "
    "kernels). Get one onto the node as /usr/local/sbin/criu: the `criu` package of "
    "Debian 13 or another distribution that ships >= 4.1, or a build from the CRIU "
    "source release (`make criu`, then `install -m 0755 criu/criu "
    "/usr/local/sbin/criu`), or pass `--criu-source FILE` to have the installer copy "
    "one there. `--skip-criu-check` installs anyway (containers run, checkpoints fail)."
)
NO_PROBE: Final = (
    "socket dump not probed (the host root is not this process's /: run `cedana doctor` "
    "on the node)"
)
_VERSION_RE = re.compile(r"Version:\s*(\d+)\.(\d+)(?:\.(\d+))?")


@dataclass(frozen=True)
class CriuCheck:
    path: str | None  # host path of the criu runc will run; None: none on PATH
    version: tuple[int, ...] | None
    problem: str | None  # None: good enough

    @property
    def ok(self) -> bool:
        return self.problem is None

    def describe(self) -> str:
        if self.path is None:
            return "no criu on containerd's PATH"
        shown = ".".join(map(str, self.version)) if self.version else "unknown version"
        return f"{self.path} ({shown})"


def parse_version(text: str) -> tuple[int, ...] | None:
    m = _VERSION_RE.search(text)
    if not m:
        return None
    return tuple(int(g) for g in m.groups() if g is not None)


def check(host: HostRoot) -> CriuCheck:
    for directory in SEARCH_PATH:
        path = f"{directory}/criu"
        real = host.path(path)
        if not (os.path.isfile(real) and os.access(real, os.X_OK)):
            continue
        try:
            proc = host.run([path, "--version"], timeout=30)
            output = (proc.stdout + proc.stderr).decode(errors="replace")
        except OSError as err:
            output = str(err)
        version = parse_version(output)
        if version is None:
            return CriuCheck(path, None, f"{path} does not run here: {output.strip()[:300]}")
        if version[:2] < MINIMUM:
            shown = ".".join(map(str, version))
            return CriuCheck(path, version, f"{path} is CRIU {shown}, older than 4.1")
        return CriuCheck(path, version, None)
    return CriuCheck(None, None, "no criu on containerd's PATH")


def probe_sockets(host: HostRoot, found: CriuCheck) -> str:
    """Whether ``found`` dumps a process holding a TCP socket on this kernel (see
    criu_probe): a NodeError saying why not, else what was checked. Only where the
    host root is this process's own: CRIU must see the probe's process."""
    if not host.is_real or found.path is None:
        return f"{found.describe()}; {NO_PROBE}"
    problem = probe_inet_dump(found.path)
    if problem is not None:
        raise NodeError(f"{problem}. {HOW_TO_GET}")
    return f"{found.describe()}; dumps TCP sockets on this kernel"
