"""The node's tool versions, recorded in every checkpoint and compared by a restore
(kernel, arch, the shim, runc, CRIU): asked once per daemon, by whichever comes first."""

from __future__ import annotations

import os
import platform
from dataclasses import dataclass, field

from .. import __version__
from ..runtime.reaper import Reaper
from ..runtime.runc import Runc


@dataclass
class Versions:
    """Tool versions recorded in every checkpoint; asked once per daemon."""

    values: dict[str, str] = field(default_factory=dict)

    async def get(self, runc: Runc) -> dict[str, str]:
        if not self.values:
            self.values = {
                "kernel": platform.release(),
                "arch": platform.machine(),
                "shim": __version__,
                "runc": await _first_line(runc.reaper, runc.binary, "--version"),
                "criu": await _first_line(runc.reaper, "criu", "--version"),
            }
        return self.values


async def _first_line(reaper: Reaper, *argv: str) -> str:
    """First line a tool prints about its version; never fails the checkpoint."""
    fd = os.memfd_create("version", os.MFD_CLOEXEC)
    try:
        await reaper.spawn(argv, stdout=fd).wait()
        out = os.pread(fd, 4096, 0).decode(errors="replace").strip()
        return out.splitlines()[0] if out else ""
    except OSError as err:
        return f"unknown ({err.strerror})"
    finally:
        os.close(fd)


__all__ = ["Versions"]
