"""Does this node's CPU fit a checkpoint taken on another? CRIU's own cpuinfo check,
asked before a checkpoint is downloaded from the registry.

Every x86 dump holds ``cpuinfo.img`` (~130 bytes: vendor, family, model, the CPUID
capability words, the FPU's xsave features), and CRIU compares it with the CPU it
restores on: images that may use an instruction or a register file this CPU lacks
fail there. The pipeline records the dump's copy in the checkpoint's metadata
(``cpuinfo``, base64), so that another node can run the same comparison, ``criu
cpuinfo check``, on a registry's candidate before it pulls gigabytes it could not
restore. A dump without the file (architectures whose CRIU writes none) records
nothing, and CRIU's check at restore is then the only one.

The comparison is the restore's: with the ``cpu-cap`` an operator put in
``criu_config_extra``, or CRIU's default; ``cpu-cap none`` (CRIU checks nothing at
restore) skips it.
"""

from __future__ import annotations

import base64
import binascii
import os
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING

from ..config import NodeConfig

if TYPE_CHECKING:
    from ..runtime.runc import Runc

CPUINFO_IMAGE = "cpuinfo.img"
METADATA_KEY = "cpuinfo"
MAX_CPUINFO_BYTES = 4096  # x86's is ~130; what is larger is not CRIU's
_MAX_DETAIL = 300


def record(criu_dir: str) -> str:
    """The dump's cpuinfo.img, base64, for the metadata; "" when there is none."""
    try:
        fd = os.open(
            os.path.join(criu_dir, CPUINFO_IMAGE), os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC
        )
    except FileNotFoundError:
        return ""
    with os.fdopen(fd, "rb") as f:
        image = f.read(MAX_CPUINFO_BYTES + 1)
    if not image or len(image) > MAX_CPUINFO_BYTES:
        return ""  # not CRIU's: its restore judges the images alone
    return base64.b64encode(image).decode("ascii")


def decode(recorded: object) -> bytes | None:
    """The image recorded in a checkpoint's metadata; None when it is not one (a
    registry's metadata is checked like anything else it sends)."""
    if not isinstance(recorded, str) or len(recorded) > (MAX_CPUINFO_BYTES + 2) // 3 * 4:
        return None
    try:
        image = base64.b64decode(recorded, validate=True)
    except (binascii.Error, ValueError):
        return None
    return image or None


def cpu_cap(config: NodeConfig) -> str:
    """The ``cpu-cap`` of the node's extra CRIU options (the last one wins, as in
    CRIU's config file); "" for CRIU's default."""
    cap = ""
    for line in config.criu_config_extra.splitlines():
        words = line.replace("=", " ").split()
        if len(words) == 2 and words[0].lstrip("-") == "cpu-cap":
            cap = words[1]
    return cap


async def misfit(
    recorded: object, config: NodeConfig, check: Callable[[bytes, str], Awaitable[str]]
) -> str:
    """Why this node's CPU cannot restore a checkpoint whose metadata recorded
    ``recorded`` as its ``cpuinfo``; "" when it fits, or when nothing was recorded.
    ``check`` is :func:`check` with the restoring runc (CRIU runs through its reaper)."""
    if recorded is None or recorded == "":
        return ""
    image = decode(recorded)
    if image is None:
        return "its recorded CPU description (cpuinfo) is malformed"
    cap = cpu_cap(config)
    if cap == "none":
        return ""
    return await check(image, cap)


async def check(runc: Runc, image: bytes, cap: str) -> str:
    """``criu cpuinfo check`` of ``image`` (with ``--cpu-cap cap`` unless "") on this
    node; why it failed, or "" when this CPU fits."""
    import tempfile  # only where a remote candidate is weighed

    with tempfile.TemporaryDirectory(prefix="cedana-cpuinfo-") as images:  # 0700
        fd = os.open(
            os.path.join(images, CPUINFO_IMAGE),
            os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC,
            0o600,
        )
        with os.fdopen(fd, "wb") as f:
            f.write(image)
        out = os.memfd_create("criu-cpuinfo", os.MFD_CLOEXEC)
        try:
            argv = [runc.criu or "criu", "cpuinfo", "check", "--images-dir", images]
            if cap:
                argv.append(f"--cpu-cap={cap}")  # an optional argument: one word
            ended = await runc.reaper.spawn(argv, stdout=out, stderr=out).wait()
            said = os.pread(out, 64 * 1024, 0).decode(errors="replace")
        finally:
            os.close(out)
    if ended.status == 0:
        return ""
    lines = [line.strip() for line in said.splitlines() if line.strip()]
    detail = lines[-1][:_MAX_DETAIL] if lines else f"exit status {ended.status}"
    return (
        f"this node's CPU lacks what the dumping node's had (criu cpuinfo check: {detail}): "
        "restore it on a node with the same CPU features"
    )
