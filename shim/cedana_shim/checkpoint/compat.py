"""Can this node (and this container) restore a checkpoint? The checks that need no images.

A checkpoint records the versions of the node that took it (``versions`` in its
metadata: kernel, arch, CRIU, runc). CRIU restores onto a kernel and a CRIU at least as
new as the dumping ones; an older one may lack what the images use (a syscall, a
socket option, an image field) and fail half-way, or worse. The architecture must be
the same. The CPU's features are CRIU's to judge (cpu_fit.py runs its cpuinfo check
before a pull; CRIU checks again when it restores); the GPU fit is the GPU steps'.
What is checked here runs before anything is downloaded.
"""

from __future__ import annotations

import platform
import re
from collections.abc import Mapping
from typing import Any

_NUMBERS = re.compile(r"(\d+)\.(\d+)(?:\.(\d+))?")


def version_tuple(text: str) -> tuple[int, ...] | None:
    """(major, minor, patch) of the first dotted version in ``text``: "6.18.44-fc",
    "Version: 4.2.1"; None when there is none."""
    m = _NUMBERS.search(text)
    if m is None:
        return None
    return tuple(int(g) for g in m.groups() if g is not None)


def incompatible(metadata: Mapping[str, Any], here: Mapping[str, str]) -> str:
    """Why a checkpoint with ``metadata`` cannot be restored on a node whose tool
    versions are ``here`` (the keys Versions records); empty when it may try. A version
    that cannot be read on either side is not held against the checkpoint."""
    versions = metadata.get("versions")
    if not isinstance(versions, Mapping):
        return "the checkpoint records no tool versions"
    arch = versions.get("arch")
    this_arch = here.get("arch") or platform.machine()
    if arch and arch != this_arch:
        return f"it was taken on {arch}, this node is {this_arch}"
    for tool, what in (("kernel", "kernel"), ("criu", "CRIU")):
        then = version_tuple(str(versions.get(tool) or ""))
        now = version_tuple(str(here.get(tool) or ""))
        if then is not None and now is not None and now < then:
            shown_then = ".".join(map(str, then))
            shown_now = ".".join(map(str, now))
            return (
                f"it was taken with {what} {shown_then}, this node has the older "
                f"{shown_now}: upgrade {what} here, or restore on a node like the one that "
                f"took it ({versions.get('node') or metadata.get('node') or 'unknown'})"
            )
    return ""


def image_mismatch(metadata: Mapping[str, Any], image: str, digest: str) -> str:
    """Why a checkpoint with ``metadata`` must not be restored into a container of
    ``image`` (pinned to ``digest``, or "" when it is a tag); empty when it may.

    The checkpoint's memory expects its own image's files underneath it. Digests
    are compared when both sides know theirs, else the image names when both are
    recorded (a tag moved to another digest cannot be told apart then); an image
    unknown on either side (a container made with ctr) is not held against it.
    """
    then = str(metadata.get("imageDigest") or "")
    then_name = str(metadata.get("image") or "")
    if then and digest:
        if then == digest:
            return ""
        return (
            f"it was taken from image {then_name or '?'} ({then}), this container's image is "
            f"{image or '?'} ({digest}): run the checkpointed image to restore it"
        )
    if then_name and image and then_name != image:
        return (
            f"it was taken from image {then_name}, this container's image is {image}: "
            "run the checkpointed image to restore it"
        )
    return ""
