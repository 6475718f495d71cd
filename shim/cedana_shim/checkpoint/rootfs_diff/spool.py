"""A seekable view of the archive an apply reads, spooled only where it must be.

Validation reads every header before the first write, so the archive is read
twice. A path or a seekable file is read in place. A stream (a decompressor)
is kept in a spool file first, and only in the caller's ``spool_dir`` (a
private directory on the checkpoint store's filesystem), never in $TMPDIR: a
small checkpoint expands to gigabytes, and /tmp is RAM on tmpfs nodes that
nobody charges to the container. The spool is created unlinked (O_TMPFILE,
mode 0600) so not even a crash leaves it behind; a stream is refused before
its first byte when its expected size is over the limit or the free space,
and it is cut off as soon as it delivers more than it was expected to.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from typing import BinaryIO, Final

from cedana_shim import errors

from .types import Limits, os_error

__all__ = ["open_archive"]

_CHUNK: Final = 1 << 20


def _free_bytes(path: str) -> int:
    """Bytes an unprivileged writer may still use on the filesystem of ``path``.

    The root reserve is left alone on purpose: a restore must not eat the
    margin the node keeps for itself.
    """
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


@contextmanager
def open_archive(
    src: BinaryIO | str,
    limits: Limits,
    *,
    spool_dir: str | None,
    expected_bytes: int | None,
) -> Iterator[BinaryIO]:
    """``src`` as a seekable file, spooled into ``spool_dir`` if it is a stream."""
    if isinstance(src, str):
        with _open_path(src, limits) as f:
            yield f
        return
    if _seekable(src):
        yield src
        return
    if spool_dir is None:
        raise errors.InvalidArgument(
            "rootfs diff: the archive is a stream that cannot seek, and validating it before "
            "the first write reads it twice; pass spool_dir= (a private directory on the "
            "checkpoint store's filesystem) to keep it there, or the path of the raw tar"
        )
    cap = limits.max_archive_bytes
    if expected_bytes is not None:
        _check_room(expected_bytes, limits, spool_dir)
        cap = min(cap, expected_bytes)
    try:
        spool = tempfile.TemporaryFile(prefix="rootfs-diff-", dir=spool_dir)  # noqa: SIM115
    except FileNotFoundError as err:
        raise errors.NotFound(
            f"rootfs diff spool directory {spool_dir} does not exist; the checkpoint store "
            "creates it: check the store's path in the shim configuration"
        ) from err
    except OSError as err:
        raise os_error(err, f"creating a spool file in {spool_dir}") from err
    with spool:
        _fill(spool, src, cap, limits, expected_bytes, spool_dir)
        spool.seek(0)
        yield spool


@contextmanager
def _open_path(path: str, limits: Limits) -> Iterator[BinaryIO]:
    try:
        f = open(path, "rb")  # noqa: SIM115 - closed by the with below
    except OSError as err:
        raise os_error(err, "opening the diff archive") from err
    with f:
        size = os.fstat(f.fileno()).st_size
        if size > limits.max_archive_bytes:
            raise errors.InvalidArgument(
                f"rootfs diff {path} is {size} bytes, over the {limits.max_archive_bytes} limit"
            )
        yield f


def _check_room(expected: int, limits: Limits, spool_dir: str) -> None:
    if expected > limits.max_archive_bytes:
        raise errors.InvalidArgument(
            f"rootfs diff is {expected} bytes uncompressed, over the "
            f"{limits.max_archive_bytes}-byte limit; nothing was spooled or applied"
        )
    try:
        free = _free_bytes(spool_dir)
    except OSError as err:
        raise os_error(err, f"checking the free space of spool directory {spool_dir}") from err
    if expected > free:
        raise errors.ResourceExhausted(
            f"rootfs diff of {expected} bytes (uncompressed) does not fit in spool directory "
            f"{spool_dir}: its filesystem has {free} bytes free; nothing was spooled or "
            "applied. Free space there (e.g. `cedana checkpoints prune`) and restore again"
        )


def _fill(
    spool: BinaryIO,
    src: BinaryIO,
    cap: int,
    limits: Limits,
    expected: int | None,
    spool_dir: str,
) -> None:
    total = 0
    # Never ask for more than one byte past the cap: a stream that lies about
    # its size is cut off there, not after another chunk.
    while chunk := src.read(min(_CHUNK, cap + 1 - total)):
        total += len(chunk)
        if total > cap:
            if expected is not None:  # then the cap is what the checkpoint recorded
                raise errors.DataLoss(
                    f"rootfs diff stream is longer than the {expected} bytes the checkpoint "
                    "recorded for it: the layer is damaged; nothing was applied. Remove this "
                    "checkpoint (`cedana checkpoints rm`) or restore from another one"
                )
            raise errors.InvalidArgument(
                f"rootfs diff stream is over the {limits.max_archive_bytes}-byte limit"
            )
        try:
            spool.write(chunk)
        except OSError as err:
            raise os_error(err, f"spooling the diff into {spool_dir}") from err
    try:
        spool.flush()  # a full disk shows here at the latest, not in a later seek
    except OSError as err:
        raise os_error(err, f"spooling the diff into {spool_dir}") from err


def _seekable(f: BinaryIO) -> bool:
    try:
        return f.seekable() and f.tell() >= 0
    except (OSError, ValueError, AttributeError):
        return False
