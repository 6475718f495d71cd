"""One container: its init process, its execs, and the runc calls behind them.

Requests arrive here already turned into frozen configs (``CreateConfig``,
``ExecConfig``). Every operation checks the transition table, does the side
effect, and commits the transition once the side effect succeeded. Checkpoints
belong to :mod:`.checkpointing`, the choice of what to restore to
:class:`~cedana_shim.checkpoint.restore.RestoreSession` (this class is its
:class:`~cedana_shim.checkpoint.restore.RestoreHost`), events and exit
bookkeeping to the service.

About 570 lines: one class answers every Task verb for its container; the parts
with a job of their own live beside it (requests.py, execs.py, launch.py,
checkpointing.py, and checkpoint/restore.py for what to restore).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import signal
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from ..checkpoint import criu_config
from ..checkpoint.oplog import criu_logs_path
from ..checkpoint.pipeline import Target
from ..checkpoint.restore import RestoreRequest, RestoreSession
from ..checkpoint.rootfs_diff import reset_layer
from ..errors import (
    Aborted,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ShimError,
)
from ..lifecycle.checkpointing import Checkpointing
from ..lifecycle.process import ExitInfo, Process, State
from ..runtime.lazy_pages import PagesDaemon
from ..runtime.mount import mount_all, unmount_all
from ..runtime.reaper import Child, Reaper
from ..runtime.runc import (
    CheckpointOpts,
    CreateOpts,
    ExecOpts,
    RestoreOpts,
    Runc,
    Stdio,
    read_pid_file,
)
from .cgroups import Cgroup, load_cgroup, remove_cgroup
from .execs import IO_DRAIN_TIMEOUT, Execs
from .launch import RuncCall, run_with_stdio
from .requests import CheckpointConfig, CreateConfig, ExecConfig
from .stdio import LOGGER_STOP_GRACE, ProcessIO

log = logging.getLogger(__name__)

STOP_EXIT_WAIT = 10.0  # how long Delete waits for the exit of one killed after its checkpoint


# Reports an exit the container decided itself (a restore abandoned by a Kill).
ExitReporter = Callable[["Container"], None]


@dataclass(eq=False)
class Container:
    config: CreateConfig
    runc: Runc
    reaper: Reaper
    spec: dict[str, Any]
    init: Process
    io: ProcessIO
    report_exit: ExitReporter
    cgroup: Cgroup | None = None
    logger: Child | None = None
    rootfs_mounted: bool = False
    cr: Checkpointing | None = None  # the container opted in to checkpoints
    restore: RestoreSession | None = None  # what Start restores from (RESTORE_PENDING)
    _start: asyncio.Task[int] | None = None  # a Start restoring, for a Kill to abandon

    def __post_init__(self) -> None:
        self.execs = Execs(self.config.id)

    @property
    def id(self) -> str:
        return self.config.id

    @property
    def bundle(self) -> str:
        return self.config.bundle

    @property
    def rootfs(self) -> str:
        return os.path.join(self.bundle, "rootfs")

    # -- create / start --------------------------------------------------------------

    @classmethod
    async def create(
        cls,
        config: CreateConfig,
        *,
        runc: Runc,
        reaper: Reaper,
        spec: dict[str, Any],
        report_exit: ExitReporter,
        cr: Checkpointing | None = None,
        restore: RestoreSession | None = None,
    ) -> Container:
        opts = config.options
        container = cls(
            config=config,
            runc=runc,
            reaper=reaper,
            spec=spec,
            init=Process(config.id, ""),
            io=ProcessIO(config.id, config.stdio, opts.io_uid, opts.io_gid),
            report_exit=report_exit,
            cr=cr,
            restore=restore,
        )
        if cr is not None and not criu_config.annotate_spec(config.bundle, spec):
            log.warning(
                "the spec names its own CRIU config; cedana's CRIU options are not applied",
                extra={"container": config.id},
            )
        try:
            await container._create()
        except BaseException:
            await container._cleanup_failed_create()
            raise
        return container

    async def _create(self) -> None:
        if self.config.rootfs:
            os.makedirs(self.rootfs, mode=0o711, exist_ok=True)
            await asyncio.to_thread(mount_all, self.config.rootfs, self.rootfs)
            self.rootfs_mounted = True
        if self.config.checkpoint:
            # containerd's own restore (ctr restore): Start restores from these images.
            self.restore = None
            self.init.commit("plan-restore")
            return
        if self.restore is not None and await self.restore.prepare(self):
            self.init.commit("plan-restore")
            return
        self.restore = None
        await self._runc_create()

    async def _runc_create(self) -> None:
        await self._start_process(
            self.io,
            lambda console, stdio: self.runc.create(
                self.id,
                CreateOpts(
                    bundle=self.bundle,
                    pid_file=self._pid_file(),
                    console_socket=console,
                    no_pivot=self.config.options.no_pivot_root,
                    no_new_keyring=self.config.options.no_new_keyring,
                    stdio=stdio,
                ),
            ),
        )
        self.init.pid = read_pid_file(self._pid_file())
        self._load_cgroup()

    async def _start_process(self, io: ProcessIO, call: RuncCall) -> None:
        logger = await run_with_stdio(
            io, call, reaper=self.reaper, container_id=self.id, namespace=self.config.namespace
        )
        if io is self.io:
            self.logger = logger

    def _pid_file(self) -> str:
        return os.path.join(self.bundle, "init.pid")

    def _load_cgroup(self) -> None:
        try:
            self.cgroup = load_cgroup(self.init.pid)
        except (OSError, ValueError, NotFound) as err:
            log.warning("no cgroup for stats", extra={"container": self.id, "error": str(err)})

    async def start(self) -> int:
        async with self.init.lock:
            if self.init.exit is not None:
                raise FailedPrecondition(f"container {self.id} exited before it was started")
            if self.init.state is not State.RESTORE_PENDING:
                self.init.check("start")
                await self.runc.start(self.id)
                if self.init.exit is None:
                    self.init.commit("start")
            else:
                await self._start_restoring()
            if self.cr is not None:
                self.cr.started(self.init, self.target)
            return self.init.pid

    async def _start_restoring(self) -> None:
        self.init.commit("restore")
        # A task of its own, so that a Kill can abandon a long restore (kill()).
        self._start = asyncio.get_running_loop().create_task(self._restore_or_cold())
        try:
            await self._start
        except asyncio.CancelledError:
            if self.init.state is not State.STOPPED:
                raise  # the Start itself was cancelled, not abandoned by a Kill
            raise Aborted(
                f"restore of container {self.id} abandoned: a signal arrived before it finished"
            ) from None
        except BaseException:
            if self.init.state is State.RESTORING:
                self.init.commit("restore-failed")
            raise
        finally:
            self._start = None
        if self.init.exit is None:
            self.init.commit("restored")

    async def _restore_or_cold(self) -> int:
        if self.restore is not None:
            return await self.restore.run(self)
        # containerd's own restore (ctr restore): its images, no fallback of ours.
        cr = self.cr
        if cr is not None:
            netns_setup = criu_config.write_netns_setup(self.bundle, self.spec)
            options = criu_config.restore_options(cr.config, keep_tcp=True, netns_setup=netns_setup)
            criu_config.write(self.bundle, options)
        work = self.config.options.criu_work_path or os.path.join(self.bundle, "work")
        request = RestoreRequest(
            self.config.checkpoint,
            work,
            tcp_established=cr is not None and cr.config.tcp_established,
            file_locks=cr is not None and cr.config.file_locks,
            ext_unix_sk=cr is not None,
        )
        return await self.restore_images(request)

    # -- what the restore session drives (RestoreHost) --------------------------------

    async def network_facts(self) -> Any:
        """The pod network the new container joins (compared with the checkpoint's)."""
        from ..checkpoint.netinfo import joined_network_facts

        try:
            return await asyncio.to_thread(joined_network_facts, self.spec)
        except Exception as err:
            log.warning("no network facts", extra={"container": self.id, "error": str(err)})
            return {}

    async def restore_images(self, request: RestoreRequest) -> int:
        """``runc restore``; lazily (``request.lazy_pages``) it returns once every page is
        in, the tasks running (and their stdio copied) meanwhile."""
        self._fresh_io()
        pages: list[PagesDaemon] = []

        async def restore(console: str | None, stdio: Stdio | None) -> None:
            daemon = await self.runc.restore(
                self.id,
                RestoreOpts(
                    bundle=self.bundle,
                    image_path=request.image_dir,
                    work_path=request.work_dir,
                    pid_file=self._pid_file(),
                    console_socket=console,
                    no_pivot=self.config.options.no_pivot_root,
                    shell_job=self.io.config.terminal,
                    tcp_established=request.tcp_established,
                    ext_unix_sk=request.ext_unix_sk,
                    file_locks=request.file_locks,
                    lazy_pages=request.lazy_pages,
                    lazy_page_server=request.page_server,
                    stdio=stdio,
                ),
                keep_log_in=criu_logs_path(self.cr.pipeline.store.root) if self.cr else None,
            )
            pages.extend([daemon] if daemon is not None else [])

        try:
            await self._start_process(self.io, restore)
            self.init.pid = read_pid_file(self._pid_file())
            self._load_cgroup()
            for daemon in pages:
                request.resumed()
                await daemon.wait()  # cancelled (a Kill), it stops the tasks, then itself
        except BaseException:
            for daemon in pages:
                await asyncio.shield(daemon.abandon())
            raise
        return self.init.pid

    async def pids(self) -> Sequence[int]:
        if self.init.state in (State.STOPPED, State.DELETED, State.RESTORE_PENDING):
            return []
        return await self.runc.ps(self.id)

    async def discard_attempt(self) -> None:
        await self.runc.discard(self.id)
        # A runc restore killed before it wrote its state (a Kill, restore_timeout) left
        # the cgroups it made, unknown to runc delete.
        path = str((self.spec.get("linux") or {}).get("cgroupsPath") or "")
        with contextlib.suppress(OSError):
            if left := await asyncio.to_thread(remove_cgroup, path):
                log.warning("cgroups left in use", extra={"container": self.id, "left": left})

    async def reset_rootfs(self) -> None:
        if not self.rootfs_mounted:
            return
        self.rootfs_mounted = False  # until mounted again, should the reset fail
        await asyncio.to_thread(reset_layer, self.config.rootfs, self.rootfs)
        self.rootfs_mounted = True

    async def create_cold(self) -> int:
        self._fresh_io()
        await self._runc_create()
        await self.runc.start(self.id)
        return self.init.pid

    def _fresh_io(self) -> None:
        """New pipes for another attempt at starting the init: a failed one closed its own."""
        self.io.close()
        opts = self.config.options
        self.io = ProcessIO(self.id, self.config.stdio, opts.io_uid, opts.io_gid)

    def target(self) -> Target:
        """This container as the checkpoint pipeline sees it."""
        if self.cr is None:
            raise AssertionError(f"container {self.id} did not opt in to checkpoints")
        return Target(
            container_id=self.id,
            bundle=self.bundle,
            namespace=self.config.namespace,
            policy=self.cr.policy,
            spec=self.spec,
            rootfs=self.config.rootfs,
            pid=self.init.pid,
            terminal=self.io.config.terminal,
            runc=self.runc,
        )

    # -- execs -----------------------------------------------------------------------

    def add_exec(self, config: ExecConfig) -> None:
        if self.init.state is State.PAUSED:
            raise FailedPrecondition(f"cannot exec in paused container {self.id}")
        self.init.check("exec")
        self.execs.add(config)

    def process(self, exec_id: str) -> Process:
        return self.init if not exec_id else self.execs.get(exec_id).process

    async def start_exec(self, exec_id: str) -> int:
        ex = self.execs.get(exec_id)
        if self.cr is not None and self.init.state is State.CHECKPOINTING:
            # Frozen for the dump: runc cannot exec into it until it is thawed (a probe
            # waits a few hundred ms instead of failing).
            await self.cr.wait_thawed()
        async with ex.process.lock:
            ex.process.check("start")
            self.init.check("exec")  # a live container, not one being restored or gone
            ex.io = ProcessIO(
                f"{self.id}-{exec_id}",
                ex.config.stdio,
                self.config.options.io_uid,
                self.config.options.io_gid,
            )
            pid_file = os.path.join(self.bundle, f"{exec_id}.pid")
            process_json = ex.process_json()
            await self._start_process(
                ex.io,
                lambda console, stdio: self.runc.exec(
                    self.id,
                    ExecOpts(
                        process_spec_json=process_json,
                        pid_file=pid_file,
                        console_socket=console,
                        stdio=stdio,
                    ),
                ),
            )
            ex.process.pid = read_pid_file(pid_file)
            if ex.process.exit is None:
                ex.process.commit("start")
            return ex.process.pid

    # -- signals, pause, update ------------------------------------------------------------

    async def kill(self, exec_id: str, sig: int, all_processes: bool) -> None:
        if exec_id:
            proc = self.execs.get(exec_id).process
            proc.check("kill")
            if proc.pid == 0:
                raise FailedPrecondition(f"exec {exec_id} of container {self.id} is not started")
            try:
                os.kill(proc.pid, sig)
            except ProcessLookupError:
                raise NotFound(f"exec {exec_id} of container {self.id} already exited") from None
            return
        if self.init.state is State.RESTORING:
            await self._abandon_restore(sig)
            return
        cr = self.cr
        if cr is not None and sig == signal.SIGKILL:
            # SIGKILL wins over a dump in progress: it is abandoned (nothing of it
            # becomes visible) and what it froze is thawed, so the kill lands.
            await cr.abort(self.init)
        async with self.init.lock:
            self.init.check("kill")
            if (
                cr is not None
                and not all_processes
                and cr.request_stop(self.init, self.target, sig)
            ):
                return  # checkpointed first; the processes die once it is durable
            await self.runc.kill(self.id, sig, all=all_processes)

    async def _abandon_restore(self, sig: int) -> None:
        """A signal for a container still being restored: stop restoring, never run it.

        The Start in flight holds the process lock for the whole restore (which can
        take minutes), so waiting for the lock would keep a pod from being deleted.
        """
        starting = self._start
        assert starting is not None
        # Recorded first: the Start sees a STOPPED init and reports an abandoned restore
        # rather than a failed one. The runc driver kills runc, CRIU and whatever they
        # restored at once when the Start is cancelled.
        self.init.set_exited(128 + sig, time.time())
        starting.cancel()
        await asyncio.wait([starting])
        await self.discard_attempt()
        log.warning("restore abandoned", extra={"container": self.id, "signal": sig})
        self.report_exit(self)

    async def pause(self) -> None:
        async with self.init.lock:
            self.init.check("pause")
            await self.runc.pause(self.id)
            self.init.commit("pause")

    async def resume(self) -> None:
        async with self.init.lock:
            self.init.check("resume")
            await self.runc.resume(self.id)
            self.init.commit("resume")

    async def update(self, resources_json: bytes) -> None:
        async with self.init.lock:
            self.init.check("update")
            await self.runc.update(self.id, resources_json)

    def resize(self, exec_id: str, width: int, height: int) -> None:
        from .stdio import set_window_size

        proc = self.process(exec_id)
        proc.check("resize")
        io = self.io if not exec_id else self.execs.get(exec_id).io
        if io is not None and io.console is not None:
            set_window_size(io.console, width, height)

    def close_io(self, exec_id: str) -> None:
        io = self.io if not exec_id else self.execs.get(exec_id).io
        if io is not None:
            io.close_stdin()

    async def checkpoint(self, config: CheckpointConfig) -> None:
        """The Task API's Checkpoint: images into ``config.image_path`` for containerd.

        For an opted-in container it goes through the cedana pipeline, so the
        checkpoint also lands in the node's store.
        """
        if self.cr is not None:
            await self.cr.task_api_checkpoint(
                self.init, self.target, exit=config.exit, mirror_to=config.image_path
            )
            return
        async with self.init.lock:
            self.init.check("checkpoint")
            await self.runc.checkpoint(
                self.id,
                CheckpointOpts(
                    image_path=config.image_path,
                    work_path=config.work_path,
                    leave_running=not config.exit,
                    tcp_established=config.open_tcp,
                    ext_unix_sk=config.external_unix_sockets,
                    shell_job=self.io.config.terminal,
                    file_locks=config.file_locks,
                    empty_ns=config.empty_namespaces,
                ),
            )

    # -- exits -----------------------------------------------------------------------

    def needs_kill_all_on_exit(self) -> bool:
        """Without a private pid namespace the init's death does not end its children."""
        namespaces = (self.spec.get("linux") or {}).get("namespaces") or []
        for ns in namespaces:
            if isinstance(ns, dict) and ns.get("type") == "pid":
                return bool(ns.get("path"))
        return True

    async def kill_all(self) -> None:
        with contextlib.suppress(NotFound):
            await self.runc.kill(self.id, signal.SIGKILL, all=True)

    async def drain_output(self, process: Process) -> None:
        """Copy out what ``process`` wrote before its exit is known (bounded): a client
        closes its FIFOs once it learns of the exit (ctr's task Delete does), and
        output still in our pipes then is lost."""
        try:
            io = self.io if process.is_init else self.execs.get(process.exec_id).io
        except NotFound:
            return
        if io is not None and not await asyncio.to_thread(io.wait, IO_DRAIN_TIMEOUT):
            log.warning(
                "exit reported with output still being copied (the pipe is held open)",
                extra={"container": self.id, "exec": process.exec_id, "waited": IO_DRAIN_TIMEOUT},
            )

    # -- delete ----------------------------------------------------------------------

    async def delete(self) -> ExitInfo:
        if self.cr is not None:
            self.cr.stop_periodic()
            await self.cr.wait_stop()  # the rootfs diff is read before the unmount
            if self.init.state is State.STOPPING:
                # Killed after its checkpoint: its exit is on the way (kill --all of a
                # shared pid namespace, or slow-dying processes, can lag behind).
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(asyncio.shield(self.init.exited), STOP_EXIT_WAIT)
        async with self.init.lock:
            self.init.check("delete")
            if self.init.state is not State.RESTORE_PENDING:
                with contextlib.suppress(NotFound):
                    await self.runc.delete(self.id, force=self.init.state is State.CREATED)
            exit_info = self.init.exit or ExitInfo(0, 0.0)
            if self.restore is not None:
                # Deleted after its Create, never started: what was prepared for the
                # Start (a registry checkpoint's staging dir) would stay until the shim
                # exits. Left to the store's gc, rather than failing the Delete, if not.
                with contextlib.suppress(ShimError, OSError):
                    await self.restore.discard()
            await self._release()
            self.init.commit("delete")
            if not self.init.exited.done():
                # A Wait in flight on a container that never ran must not hang forever.
                self.init.exited.set_result(exit_info)
            return exit_info

    async def _release(self) -> None:
        await asyncio.to_thread(self.io.wait, IO_DRAIN_TIMEOUT)
        self.io.close()
        if self.logger is not None:
            await self.logger.terminate(LOGGER_STOP_GRACE)
            self.logger = None
        self.execs.close_io()
        if self.rootfs_mounted:
            await asyncio.to_thread(unmount_all, self.rootfs)
            self.rootfs_mounted = False
        if self.cr is not None:
            # A CRIU killed mid-restore leaves its cgroup yard mounted in the work dir,
            # and containerd cannot remove a bundle with mounts in it.
            with contextlib.suppress(OSError, ShimError):
                await asyncio.to_thread(
                    unmount_all, os.path.realpath(os.path.join(self.bundle, "work"))
                )

    async def _cleanup_failed_create(self) -> None:
        if self.restore is not None:
            with contextlib.suppress(Exception):
                await self.restore.discard()
        with contextlib.suppress(Exception):
            await self.runc.delete(self.id, force=True)
        with contextlib.suppress(Exception):
            await self._release()


def load_spec(bundle: str, container_id: str) -> dict[str, Any]:
    try:
        with open(os.path.join(bundle, "config.json"), "rb") as f:
            spec = json.load(f)
    except (OSError, ValueError) as err:
        raise InvalidArgument(f"read OCI spec of container {container_id}: {err}") from err
    if not isinstance(spec, dict):
        raise InvalidArgument(f"OCI spec of container {container_id} is not a JSON object")
    return spec


__all__ = ["Container", "load_spec"]
