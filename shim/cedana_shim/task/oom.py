"""OOM-kill notifications for running containers, on the asyncio loop.

Both cgroup versions hand us a file descriptor that becomes readable when something
happened, so one ``loop.add_reader`` per container does all the waiting; no threads.

* cgroup v1: an eventfd registered through ``cgroup.event_control`` for
  ``memory.oom_control`` (containerd ``pkg/oom/v1``). Each read is one OOM event. The
  kernel also signals the eventfd once when the cgroup is removed, so a read after the
  directory is gone is the removal, not an OOM.
* cgroup v2: inotify on ``memory.events`` (containerd ``pkg/oom/v2``); we report when
  its ``oom_kill`` counter rises above the last value seen. kernfs sends no
  ``IN_DELETE_SELF``/``IN_IGNORED`` for a removed cgroup's files, so removal is
  noticed through an ``IN_DELETE`` watch on the parent directory.

An OOM kill that happened between the container's start and :meth:`OomWatcher.add`
is reported once, just after ``add`` (the ``oom_kill`` counter of memory.events or
memory.oom_control is non-zero then). containerd's v2 watcher gets the same effect by
counting from zero; its v1 watcher misses such kills.
"""

from __future__ import annotations

import asyncio
import errno
import functools
import logging
import os
import struct
from collections.abc import Callable
from dataclasses import dataclass
from types import TracebackType
from typing import TYPE_CHECKING, Literal

from cedana_shim.errors import FailedPrecondition, NotFound
from cedana_shim.task.cgroups import Cgroup

if TYPE_CHECKING:
    from typing import Self

__all__ = ["OomCallback", "OomWatcher"]

log = logging.getLogger(__name__)

OomCallback = Callable[[str], None]
"""Called with the container id on the event loop; must not block (enqueue the event)."""

# <sys/inotify.h>
_IN_MODIFY = 0x00000002
_IN_DELETE = 0x00000200
_IN_Q_OVERFLOW = 0x00004000
_IN_IGNORED = 0x00008000
_IN_ONLYDIR = 0x01000000
_INOTIFY_EVENT = struct.Struct("iIII")  # wd, mask, cookie, len; then len bytes of name

# A cgroup file of a cgroup being removed fails with ENODEV rather than ENOENT.
_GONE = frozenset((errno.ENOENT, errno.ENODEV, errno.ENOTDIR))


class _Inotify:
    """The two libc calls Python's os module lacks, loaded on first use."""

    def __init__(self) -> None:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        self._get_errno = ctypes.get_errno
        self._init1 = libc.inotify_init1
        self._init1.argtypes = [ctypes.c_int]
        self._init1.restype = ctypes.c_int
        self._add_watch = libc.inotify_add_watch
        self._add_watch.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32]
        self._add_watch.restype = ctypes.c_int

    def init(self) -> int:
        fd = int(self._init1(os.O_NONBLOCK | os.O_CLOEXEC))
        if fd < 0:
            code = self._get_errno()
            raise OSError(code, f"inotify_init1: {os.strerror(code)}")
        return fd

    def add_watch(self, fd: int, path: str, mask: int) -> int:
        wd = int(self._add_watch(fd, os.fsencode(path), mask))
        if wd < 0:
            code = self._get_errno()
            raise OSError(code, f"inotify_add_watch: {os.strerror(code)}", path)
        return wd


@functools.cache
def _inotify() -> _Inotify:
    return _Inotify()


def _read_oom_kill(path: str) -> int | None:
    """The ``oom_kill`` counter of a memory.events/memory.oom_control file; None if gone."""
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except OSError as err:
        if err.errno in _GONE:
            return None
        raise
    for line in text.splitlines():
        parts = line.split()
        if len(parts) == 2 and parts[0] == "oom_kill" and parts[1].isdigit():
            return int(parts[1])
    return 0


@dataclass(eq=False)
class _Watch:
    container_id: str
    version: Literal[1, 2]
    fd: int
    memory_dir: str
    events_wd: int = -1  # v2: the memory.events watch
    parent_wd: int = -1  # v2: the parent directory watch, -1 when it could not be set
    last_oom_kill: int = 0  # v2


class OomWatcher:
    """Calls ``callback(container_id)`` for every OOM kill in a watched cgroup.

    Use as ``async with OomWatcher(callback) as watcher:``; :meth:`add` and
    :meth:`remove` are plain methods to call on the loop. A watch ends by itself when
    its cgroup is removed; leaving the ``async with`` ends them all.
    """

    def __init__(self, callback: OomCallback) -> None:
        self._callback = callback
        self._loop: asyncio.AbstractEventLoop | None = None
        self._closed = False
        self._watches: dict[str, _Watch] = {}

    async def __aenter__(self) -> Self:
        if self._closed:
            raise RuntimeError("OomWatcher is closed")
        self._loop = asyncio.get_running_loop()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()

    def __contains__(self, container_id: object) -> bool:
        return container_id in self._watches

    @property
    def watching(self) -> frozenset[str]:
        """The ids of the containers being watched now."""
        return frozenset(self._watches)

    def add(self, container_id: str, cgroup: Cgroup) -> None:
        """Start watching ``cgroup`` for ``container_id``, replacing any earlier watch.

        Raises :class:`~cedana_shim.errors.NotFound` if the cgroup does not exist and
        :class:`~cedana_shim.errors.FailedPrecondition` if it has no memory controller.
        """
        if self._loop is None or self._closed:
            raise RuntimeError("OomWatcher.add needs an entered, open watcher")
        memory_dir = cgroup.memory_dir
        if memory_dir is None:
            raise FailedPrecondition(f"cgroup of {container_id} has no memory controller")
        if not os.path.isdir(memory_dir):
            raise NotFound(f"cgroup {memory_dir} does not exist")
        if container_id in self._watches:
            self.remove(container_id)
        if cgroup.version == 1:
            watch = self._open_v1(container_id, memory_dir)
        else:
            watch = self._open_v2(container_id, memory_dir)
        self._watches[container_id] = watch
        self._loop.add_reader(watch.fd, self._on_readable, watch)
        log.debug(
            "watching for OOM kills",
            extra={"container_id": container_id, "cgroup": memory_dir, "version": watch.version},
        )

    def remove(self, container_id: str) -> None:
        """Stop watching ``container_id``; a no-op if it is not watched."""
        watch = self._watches.get(container_id)
        if watch is not None:
            self._stop(watch)

    def close(self) -> None:
        """Stop every watch. Idempotent."""
        self._closed = True
        for watch in list(self._watches.values()):
            self._stop(watch)

    # -- opening ---------------------------------------------------------------------

    def _open_v1(self, container_id: str, memory_dir: str) -> _Watch:
        oom_control = os.path.join(memory_dir, "memory.oom_control")
        efd = os.eventfd(0, os.EFD_CLOEXEC | os.EFD_NONBLOCK)
        try:
            ofd = os.open(oom_control, os.O_RDONLY | os.O_CLOEXEC)
            try:
                # The kernel keeps its own reference to memory.oom_control, so our fd
                # can go as soon as the registration is written.
                control = os.open(
                    os.path.join(memory_dir, "cgroup.event_control"), os.O_WRONLY | os.O_CLOEXEC
                )
                try:
                    os.write(control, f"{efd} {ofd}".encode())
                finally:
                    os.close(control)
            finally:
                os.close(ofd)
        except OSError as err:
            os.close(efd)
            if err.errno in _GONE:
                raise NotFound(f"cgroup {memory_dir} does not exist") from err
            raise
        # Registered first, read second: an OOM in between is reported twice, not lost.
        try:
            before = _read_oom_kill(oom_control)
        except BaseException:
            os.close(efd)
            raise
        if before:
            self._report_later(container_id)
        return _Watch(container_id, 1, efd, memory_dir)

    def _open_v2(self, container_id: str, memory_dir: str) -> _Watch:
        inotify = _inotify()
        fd = inotify.init()
        watch = _Watch(container_id, 2, fd, memory_dir)
        events_path = os.path.join(memory_dir, "memory.events")
        try:
            watch.events_wd = inotify.add_watch(fd, events_path, _IN_MODIFY)
        except OSError as err:
            os.close(fd)
            if err.errno in _GONE and not os.path.isdir(memory_dir):
                raise NotFound(f"cgroup {memory_dir} does not exist") from err
            if err.errno in _GONE:
                raise FailedPrecondition(
                    f"cgroup {memory_dir} has no memory.events (memory controller not enabled)"
                ) from err
            raise
        try:
            watch.parent_wd = inotify.add_watch(
                fd, os.path.dirname(memory_dir), _IN_DELETE | _IN_ONLYDIR
            )
        except OSError as err:
            # Still useful without it: the watch then ends at remove() or close().
            log.warning(
                "cannot watch for cgroup removal",
                extra={"container_id": container_id, "cgroup": memory_dir, "error": str(err)},
            )
        try:
            before = _read_oom_kill(events_path)
        except BaseException:
            os.close(fd)
            raise
        if before:
            watch.last_oom_kill = before
            self._report_later(container_id)
        return watch

    # -- events ----------------------------------------------------------------------

    def _on_readable(self, watch: _Watch) -> None:
        if self._watches.get(watch.container_id) is not watch:
            return  # replaced or removed while this callback was queued
        try:
            if watch.version == 1:
                self._on_v1(watch)
            else:
                self._on_v2(watch)
        except OSError:
            log.exception(
                "OOM watch failed; no longer watching",
                extra={"container_id": watch.container_id, "cgroup": watch.memory_dir},
            )
            self._stop(watch)

    def _on_v1(self, watch: _Watch) -> None:
        try:
            count = os.eventfd_read(watch.fd)
        except BlockingIOError:
            return
        if os.path.isdir(watch.memory_dir):
            self._report(watch.container_id)
            return
        # The removal itself adds exactly one to the counter; anything above it was
        # an OOM that raced with the rmdir.
        if count > 1:
            self._report(watch.container_id)
        self._stop(watch, reason="cgroup removed")

    def _on_v2(self, watch: _Watch) -> None:
        removed = False
        name = os.path.basename(watch.memory_dir)
        for wd, mask, event_name in self._drain_inotify(watch.fd):
            if wd == watch.parent_wd and mask & _IN_DELETE and event_name == name:
                removed = True
            elif wd == watch.events_wd and mask & _IN_IGNORED:
                removed = True  # the file (or its filesystem) went away
            elif mask & _IN_Q_OVERFLOW:
                log.debug("inotify queue overflow", extra={"container_id": watch.container_id})
        count = _read_oom_kill(os.path.join(watch.memory_dir, "memory.events"))
        if count is not None and count > watch.last_oom_kill:
            watch.last_oom_kill = count
            self._report(watch.container_id)
        if removed or count is None:
            self._stop(watch, reason="cgroup removed")

    @staticmethod
    def _drain_inotify(fd: int) -> list[tuple[int, int, str]]:
        events: list[tuple[int, int, str]] = []
        while True:
            try:
                data = os.read(fd, 65536)
            except BlockingIOError:
                return events
            if not data:
                return events
            offset = 0
            while offset + _INOTIFY_EVENT.size <= len(data):
                wd, mask, _cookie, length = _INOTIFY_EVENT.unpack_from(data, offset)
                start = offset + _INOTIFY_EVENT.size
                raw_name = data[start : start + length].split(b"\0", 1)[0]
                events.append((wd, mask, os.fsdecode(raw_name)))
                offset = start + length

    # -- helpers -----------------------------------------------------------------------

    def _report(self, container_id: str) -> None:
        log.info("OOM kill in container", extra={"container_id": container_id})
        try:
            self._callback(container_id)
        except Exception:
            log.exception("OOM callback failed", extra={"container_id": container_id})

    def _report_later(self, container_id: str) -> None:
        # Never call back from inside add(): the caller may hold state it is updating.
        assert self._loop is not None
        self._loop.call_soon(self._report_if_watched, container_id)

    def _report_if_watched(self, container_id: str) -> None:
        if container_id in self._watches:
            self._report(container_id)

    def _stop(self, watch: _Watch, reason: str = "removed") -> None:
        if self._watches.get(watch.container_id) is watch:
            del self._watches[watch.container_id]
        if self._loop is not None:
            self._loop.remove_reader(watch.fd)
        os.close(watch.fd)
        log.debug(
            "stopped watching for OOM kills",
            extra={"container_id": watch.container_id, "cgroup": watch.memory_dir, "why": reason},
        )
