"""CRIU's lazy-pages daemon, serving one ``runc restore --lazy-pages`` its memory.

With ``--lazy-pages`` CRIU restores everything but the tasks' anonymous private
memory, registers that memory with userfaultfd and hands the descriptors to a
``criu lazy-pages`` daemon listening on ``lazy-pages.socket`` in the restore's work
dir. The tasks resume at once; the daemon answers their page faults from the images
dir and, once CRIU says the restore is finished, copies every page left in the
background. It exits 0 when all are in, or when the tasks are gone.

Until it exits the daemon *is* the tasks' memory. If it dies early the kernel drops
the registration and every page not copied yet reads as zeros, with no error (here: a
4 GiB workload whose daemon was SIGKILLed 0.3 s in resumed with its checksum wrong).
So:

- the daemon leads a process group of its own, which ``runc restore`` joins
  (:meth:`Runc.restore`); that group is what the bundle records while either lives,
  so the driver's cancellation and ``delete`` after a daemon crash stop both;
- the caller waits for :meth:`PagesDaemon.wait` before it calls the restore done: a
  daemon that exits non-zero gets the tasks killed at once and raises
  :class:`LazyPagesFailed` (the caller may then restore the same images eagerly);
- to stop a lazy restore (:meth:`PagesDaemon.abandon`) the daemon is frozen first
  (SIGSTOP: a faulting task then waits), the tasks are killed, then the daemon, so
  that no task ever reads a page the daemon did not fill.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import time
from collections.abc import Awaitable, Callable, Mapping
from typing import Any, Final

from cedana_shim import errors
from cedana_shim.bundle_state import clear_criu_group, mark_criu_group
from cedana_shim.runtime.pgroup import kill_criu_group, start_time
from cedana_shim.runtime.reaper import Child, Reaper

__all__ = ["LOG_NAME", "LazyPagesFailed", "PagesDaemon"]

logger = logging.getLogger(__name__)

LOG_NAME: Final = "lazy-pages.log"  # in the work dir, next to CRIU's restore.log
KEPT_LOG: Final = "criu-lazy-pages.log"  # the copy in the bundle, after a failure
# Listening takes milliseconds (it reads the process tree from the images first).
READY_TIMEOUT: Final = 30.0
STOP_TIMEOUT: Final = 5.0
_STDERR_LIMIT: Final = 4096


class LazyPagesFailed(errors.Unavailable):
    """The lazy path failed (the daemon did not start, or died before every page was
    in); the same images may still be restored eagerly."""


KillTasks = Callable[[], Awaitable[None]]


class PagesDaemon:
    """One ``criu lazy-pages`` for one restore; see the module docstring."""

    def __init__(
        self,
        child: Child,
        leader_start: int,
        *,
        container_id: str,
        bundle: str,
        work_dir: str,
        stderr_fd: int,
    ) -> None:
        self.child = child
        self.leader_start = leader_start
        self.container_id = container_id
        self.bundle = bundle
        self.work_dir = work_dir
        self._stderr_fd = stderr_fd
        self._kill_tasks: KillTasks | None = None
        self._started = time.monotonic()
        self._resumed: float | None = None
        self._done = False
        self._said = ""  # its stderr, kept when the memfd is closed

    @property
    def group(self) -> tuple[int, int]:
        """(pgid, leader start time): the group ``runc restore`` joins."""
        return self.child.pid, self.leader_start

    @classmethod
    async def start(
        cls,
        reaper: Reaper,
        *,
        criu: str,
        image_dir: str,
        work_dir: str,
        container_id: str,
        bundle: str,
        env: Mapping[str, str],
        page_server: tuple[int, int] | None = None,
    ) -> PagesDaemon:
        """The daemon, listening on its socket in ``work_dir`` (recorded in ``bundle``
        as the restore's process group); LazyPagesFailed when it cannot be. With
        ``page_server`` (the fds of both ends of a connection, inherited under their
        own numbers) it asks the page server at the other end of the first for the
        pages instead of reading ``pages-<n>.img`` (checkpoint/remote/page_server.py):
        the pagemaps stay in ``image_dir``, the pages come over the socket. The
        server's end is inherited too, never used: should this process die, the
        daemon's connection sees no EOF (which would end the daemon and leave every
        page not copied yet zero); it waits, a faulting task waits, and ``delete``
        kills them as after any shim's death."""
        argv = [
            criu,
            "lazy-pages",
            "--images-dir",
            os.path.abspath(image_dir),
            "--work-dir",
            os.path.abspath(work_dir),
            "--log-file",
            LOG_NAME,
        ]
        passed = [] if page_server is None else list(page_server)
        if page_server is not None:
            argv += ["--page-server", "--ps-socket", str(page_server[0])]
        os.makedirs(work_dir, mode=0o700, exist_ok=True)
        ready_r, ready_w = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
        stderr_fd = os.memfd_create("criu-lazy-pages-stderr", os.MFD_CLOEXEC)
        try:
            try:
                child = reaper.spawn(
                    [*argv, "--status-fd", str(ready_w)],
                    stdout=stderr_fd,
                    stderr=stderr_fd,
                    pass_fds=(ready_w, *passed),
                    env=env,
                    process_group=0,
                )
            except OSError as err:
                raise LazyPagesFailed(
                    f"container {container_id}: cannot run {criu} lazy-pages: {err}"
                ) from err
            finally:
                os.close(ready_w)
            leader_start = start_time(child.pid)
            daemon = cls(
                child,
                leader_start or 0,
                container_id=container_id,
                bundle=bundle,
                work_dir=work_dir,
                stderr_fd=stderr_fd,
            )
            stderr_fd = -1  # the daemon's now
            if leader_start is not None:
                try:
                    mark_criu_group(bundle, child.pid, leader_start, lazy=True)
                except OSError as err:
                    logger.warning(
                        "cannot record the lazy-pages daemon's process group in %s: %s",
                        bundle,
                        err,
                        extra={"container_id": container_id},
                    )
            try:
                await daemon._until_ready(ready_r)
            except BaseException:
                await _to_completion(daemon.abandon())
                raise
            return daemon
        finally:
            os.close(ready_r)
            if stderr_fd >= 0:
                os.close(stderr_fd)

    async def _until_ready(self, ready_fd: int) -> None:
        """CRIU writes one byte to --status-fd once it listens; EOF means it exited."""
        loop = asyncio.get_running_loop()
        ready: asyncio.Future[bool] = loop.create_future()

        def readable() -> None:
            try:
                data = os.read(ready_fd, 1)
            except BlockingIOError:
                return
            except OSError:
                data = b""
            if not ready.done():
                ready.set_result(bool(data))

        loop.add_reader(ready_fd, readable)
        exited = asyncio.ensure_future(self.child.wait())
        waiters: list[asyncio.Future[Any]] = [ready, exited]
        try:
            done, _ = await asyncio.wait(
                waiters, timeout=READY_TIMEOUT, return_when=asyncio.FIRST_COMPLETED
            )
        finally:
            loop.remove_reader(ready_fd)
            exited.cancel()
        if ready in done and ready.result():
            return
        if not done:
            raise LazyPagesFailed(self._failure(f"did not listen within {READY_TIMEOUT:g}s"))
        ex = await self.child.wait()
        raise LazyPagesFailed(self._failure(f"exited with status {ex.status} before listening"))

    def resumed(self, kill_tasks: KillTasks) -> None:
        """The restore is done and the tasks run: how to kill them should the daemon
        fail before all of their memory is in."""
        self._kill_tasks = kill_tasks
        self._resumed = time.monotonic()

    async def wait(self) -> None:
        """Until every page is in (the daemon exited 0). A daemon that failed has the
        tasks killed first, then LazyPagesFailed; a cancelled wait abandons the restore
        (see :meth:`abandon`)."""
        try:
            ex = await self.child.wait()
        except asyncio.CancelledError:
            await _to_completion(self.abandon())
            raise
        if ex.status != 0:
            await self._kill()
            why = self._failure(
                f"exited with status {ex.status} before all memory was in; "
                "the restored tasks were killed"
            )
            self._finish()
            raise LazyPagesFailed(why)
        self._finish()
        now = time.monotonic()
        logger.info(
            "lazy restore: all memory in",
            extra={
                "container_id": self.container_id,
                "seconds": round(now - self._started, 3),
                "after_resume_s": round(now - (self._resumed or now), 3),
            },
        )

    async def abandon(self) -> None:
        """Stop serving: freeze the daemon, kill the tasks (when known), kill the group,
        wait for the daemon's exit. Safe to call more than once."""
        if not self.child.exited.done():
            with contextlib.suppress(ProcessLookupError):
                os.killpg(self.child.pid, signal.SIGSTOP)  # faults now wait, never see zeros
            await self._kill()
            gone = await asyncio.to_thread(
                kill_criu_group, self.child.pid, self.leader_start, STOP_TIMEOUT
            )
            if not gone:
                logger.error(
                    "lazy-pages daemon group %d still alive %gs after SIGKILL",
                    self.child.pid,
                    STOP_TIMEOUT,
                    extra={"container_id": self.container_id},
                )
            await self.child.wait()
        self._finish()

    async def _kill(self) -> None:
        if self._kill_tasks is None:
            return
        try:
            await self._kill_tasks()
        except (errors.ShimError, OSError) as err:
            logger.warning(
                "killing the tasks of a failed lazy restore: %s",
                err,
                extra={"container_id": self.container_id},
            )

    def exit_status(self) -> int | None:
        """The daemon's exit status; None while it runs."""
        return self.child.exited.result().status if self.child.exited.done() else None

    def failed(self, what: str) -> LazyPagesFailed:
        return LazyPagesFailed(self._failure(what))

    def _finish(self) -> None:
        if self._done:
            return
        self._done = True
        clear_criu_group(self.bundle)
        self._said = self._stderr()
        os.close(self._stderr_fd)

    def _stderr(self) -> str:
        with contextlib.suppress(OSError, ValueError):
            size = os.fstat(self._stderr_fd).st_size
            text = os.pread(self._stderr_fd, _STDERR_LIMIT, max(0, size - _STDERR_LIMIT))
            return " ".join(text.decode(errors="replace").split())
        return ""

    def _failure(self, what: str) -> str:
        """What went wrong, with the daemon's words and where its log is kept."""
        said = self._said if self._done else self._stderr()
        import shutil  # only on this failure path

        source = os.path.join(self.work_dir, LOG_NAME)
        kept = os.path.join(self.bundle, KEPT_LOG)
        where = ""
        try:
            shutil.copyfile(source, kept)
            where = f"; log: {kept}"
        except OSError:
            if os.path.exists(source):
                where = f"; log: {source}"
        detail = f": {said}" if said else ""
        return f"container {self.container_id}: criu lazy-pages {what}{detail}{where}"


async def _to_completion(work: Awaitable[None]) -> None:
    """Await ``work`` to its end even if cancelled meanwhile."""
    done = asyncio.ensure_future(work)
    while not done.done():
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.shield(done)
    with contextlib.suppress(Exception):
        done.result()
