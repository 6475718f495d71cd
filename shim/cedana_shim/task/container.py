"""One container: its init process, its execs, and the runc calls behind them.

Requests arrive here already turned into frozen configs (``CreateConfig``,
``ExecConfig``). Every operation takes the process's lock, checks the
transition table, does the side effect, and commits the transition only once
the side effect succeeded. Events and exit bookkeeping belong to the service.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import signal
import time
from dataclasses import dataclass, field, replace
from typing import Any

from ..bundle_state import BundleState
from ..checkpoint import criu_config
from ..checkpoint.pipeline import CRIU_LAYER, Target
from ..checkpoint.rootfs_diff import upperdir_of
from ..errors import (
    Aborted,
    AlreadyExists,
    DataLoss,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ShimError,
)
from ..hooks import Stage
from ..runtime.console import ConsoleSocket
from ..runtime.mount import Mount, mount_all, unmount_all
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
from .cgroups import Cgroup, load_cgroup
from .checkpointing import Checkpointing
from .options import RuntimeOptions
from .process import ExitInfo, Process, State
from .stdio import LOGGER_READY_TIMEOUT, LOGGER_STOP_GRACE, ProcessIO, StdioConfig

log = logging.getLogger(__name__)

IO_DRAIN_TIMEOUT = 2.0  # how long Delete waits for output still in flight


@dataclass(frozen=True, slots=True)
class CreateConfig:
    id: str
    bundle: str
    namespace: str
    rootfs: tuple[Mount, ...]
    stdio: StdioConfig
    checkpoint: str  # a directory of CRIU images to restore at Start, or ""
    options: RuntimeOptions


@dataclass(frozen=True, slots=True)
class ExecConfig:
    exec_id: str
    stdio: StdioConfig
    process_json: bytes  # an OCI specs.Process


@dataclass(frozen=True, slots=True)
class CheckpointConfig:
    image_path: str
    work_path: str
    exit: bool
    open_tcp: bool = False
    external_unix_sockets: bool = False
    file_locks: bool = False
    empty_namespaces: tuple[str, ...] = ()


@dataclass(eq=False)
class ExecProcess:
    config: ExecConfig
    process: Process
    io: ProcessIO | None = None
    logger: Child | None = None


@dataclass(eq=False)
class Container:
    config: CreateConfig
    runc: Runc
    reaper: Reaper
    spec: dict[str, Any]
    init: Process
    io: ProcessIO
    execs: dict[str, ExecProcess] = field(default_factory=dict)
    cgroup: Cgroup | None = None
    logger: Child | None = None
    rootfs_mounted: bool = False
    pending_init_exit: tuple[ExitInfo, int] | None = None  # (exit, pid) held for execs
    cr: Checkpointing | None = None  # set when the container opted in to checkpoints
    restoring: asyncio.Task[None] | None = None  # a Start restoring the init
    restore_killed: int | None = None  # the signal that abandoned that restore
    abandoned_exit: ExitInfo | None = None  # the exit to report for it
    restore_images: str = ""  # CRIU images Start restores from (restore pending)

    @property
    def id(self) -> str:
        return self.config.id

    @property
    def bundle(self) -> str:
        return self.config.bundle

    # -- create / start --------------------------------------------------------------

    @classmethod
    async def create(
        cls,
        config: CreateConfig,
        reaper: Reaper,
        *,
        debug: bool,
        spec: dict[str, Any],
        cr: Checkpointing | None = None,
    ) -> Container:
        opts = config.options
        state = BundleState(
            opts.binary_name, os.path.join(opts.root, config.namespace), opts.systemd_cgroup
        )
        state.save(config.bundle)
        runc = Runc(
            reaper=reaper,
            root=state.runc_root,
            log_path=os.path.join(config.bundle, "log.json"),
            binary=state.runc_binary,
            systemd_cgroup=state.systemd_cgroup,
            debug=debug,
        )
        container = cls(
            config=config,
            runc=runc,
            reaper=reaper,
            spec=spec,
            init=Process(config.id, ""),
            io=ProcessIO(config.id, config.stdio, opts.io_uid, opts.io_gid),
            cr=cr,
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
            self.restore_images = self.config.checkpoint
            self.init.state = State.RESTORE_PENDING
            return
        if self.cr is not None:
            plan = await self.cr.first_plan(
                bundle=self.bundle,
                rootfs=self.rootfs,
                spec=self.spec,
                network=await self._network_facts(),
                reset=self._reset_rootfs,
            )
            if plan is not None:
                self.restore_images = plan.image_dir
                self.init.state = State.RESTORE_PENDING
                return
            self.cr.report_restore(restored=False)
        await self._runc_create()

    @property
    def rootfs(self) -> str:
        return os.path.join(self.bundle, "rootfs")

    async def _runc_create(self) -> None:
        await self._run_with_stdio(
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

    async def _network_facts(self) -> Any:
        """The pod network the new container joins (compared with the checkpoint's)."""
        from ..checkpoint.netinfo import network_facts

        for ns in (self.spec.get("linux") or {}).get("namespaces") or []:
            if isinstance(ns, dict) and ns.get("type") == "network" and ns.get("path"):
                try:
                    return await asyncio.to_thread(network_facts, str(ns["path"]))
                except Exception as err:
                    log.warning("no network facts", extra={"container": self.id, "error": str(err)})
        return {}

    def _reset_rootfs(self) -> None:
        """Back to the image's pristine rootfs: a restore that failed half-way
        must not leave its files behind for the next candidate or a cold start."""
        upper = upperdir_of(self.config.rootfs)
        if upper is None or not self.rootfs_mounted:
            return
        unmount_all(self.rootfs)
        self.rootfs_mounted = False
        for name in os.listdir(upper):
            path = os.path.join(upper, name)
            if os.path.isdir(path) and not os.path.islink(path):
                shutil.rmtree(path)
            else:
                os.unlink(path)
        mount_all(self.config.rootfs, self.rootfs)
        self.rootfs_mounted = True

    def _pid_file(self) -> str:
        return os.path.join(self.bundle, "init.pid")

    def _load_cgroup(self) -> None:
        try:
            self.cgroup = load_cgroup(self.init.pid)
        except (OSError, ValueError, NotFound) as err:
            log.warning("no cgroup for stats", extra={"container": self.id, "error": str(err)})

    async def _run_with_stdio(self, io: ProcessIO, call: Any) -> None:
        """Run a runc verb that starts a process with ``io`` as its stdio."""
        if io.config.terminal:
            try:
                async with ConsoleSocket() as console:
                    await call(console.path, None)
                    master = await console.receive_master()
            except BaseException:
                io.close()  # the client waits for EOF on its FIFOs
                raise
            io.start(master)
            return
        logger: Child | None = None
        try:
            stdin, stdout, stderr = io.prepare()
            logger = await self._start_logger(io)
            await call(None, Stdio(stdin, stdout, stderr))
        except BaseException:
            io.close()
            if logger is not None:
                await logger.terminate(LOGGER_STOP_GRACE)
            raise
        if io is self.io:
            self.logger = logger
        io.start()

    async def _start_logger(self, io: ProcessIO) -> Child | None:
        plan = io.logger
        if plan is None:
            return None
        import fcntl

        devnull = os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC)
        # The logger wants its pipes at fds 3, 4, 5. Copies above those numbers
        # first, so no dup2 overwrites a source another one still needs.
        sources = (plan.stdout_r, plan.stderr_r, plan.ready_w)
        high = [fcntl.fcntl(fd, fcntl.F_DUPFD_CLOEXEC, 10) for fd in sources]
        try:
            pid = os.posix_spawn(
                plan.argv[0],
                list(plan.argv),
                {"CONTAINER_ID": self.id, "CONTAINER_NAMESPACE": self.config.namespace},
                file_actions=[
                    *((os.POSIX_SPAWN_DUP2, devnull, fd) for fd in (0, 1, 2)),
                    *((os.POSIX_SPAWN_DUP2, fd, 3 + i) for i, fd in enumerate(high)),
                ],
            )
        except OSError as err:
            raise InvalidArgument(f"start logging binary {plan.argv[0]}: {err}") from err
        finally:
            for fd in (devnull, *high):
                os.close(fd)
        child = self.reaper.track(pid)
        io.logger_spawned()
        loop = asyncio.get_running_loop()
        ready = loop.run_in_executor(None, os.read, plan.ready_r, 1)
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(ready, LOGGER_READY_TIMEOUT)
        return child

    async def start(self) -> int:
        async with self.init.lock:
            if self.init.exit is not None:
                raise FailedPrecondition(f"container {self.id} exited before it was started")
            self.init.check("start")
            if self.init.state is State.RESTORE_PENDING:
                # A task of its own, so that a Kill can abandon a long restore (kill()).
                self.restoring = asyncio.get_running_loop().create_task(self._start_restoring())
                try:
                    await self.restoring
                except asyncio.CancelledError:
                    if self.restore_killed is None:
                        raise
                    raise Aborted(
                        f"restore of container {self.id} abandoned: signal "
                        f"{self.restore_killed} arrived before it finished"
                    ) from None
                finally:
                    self.restoring = None
            else:
                await self.runc.start(self.id)
            if self.init.exit is None:
                self.init.commit("start")
            if self.cr is not None:
                self.cr.start_periodic(self.target_if_running)
            return self.init.pid

    async def _start_restoring(self) -> None:
        if self.cr is None or self.config.checkpoint:
            # containerd's own restore (ctr restore): its images, no fallback of ours.
            await self._restore(self.restore_images, keep_tcp=True)
            return
        while self.cr.plan is not None:
            hook_state = self.cr.restore_hook_state(self.bundle, self.spec, self.restore_images)
            try:
                # An operator's prerestore hook may veto this candidate.
                await self.cr.run_hooks(Stage.PRERESTORE, hook_state)
                await self._restore(self.restore_images, keep_tcp=self.cr.plan.keep_tcp)
            except (ShimError, OSError) as err:
                with contextlib.suppress(ShimError, OSError):
                    await self.cr.run_hooks(
                        Stage.POSTRESTORE, replace(hook_state, status="stopped", outcome="failed")
                    )
                log.warning("restore failed", extra={"container": self.id, "error": str(err)})
                self.cr.restore_failed(err)
                with contextlib.suppress(ShimError, OSError):
                    await self.runc.delete(self.id, force=True)
                await asyncio.to_thread(self._reset_rootfs)
                plan = await self.cr.next_plan(
                    bundle=self.bundle,
                    rootfs=self.rootfs,
                    spec=self.spec,
                    network=await self._network_facts(),
                    reset=self._reset_rootfs,
                )
                self.restore_images = plan.image_dir if plan is not None else ""
                continue
            with contextlib.suppress(ShimError, OSError):  # post hooks report, never undo
                await self.cr.run_hooks(
                    Stage.POSTRESTORE,
                    replace(hook_state, status="running", pid=self.init.pid, outcome="ok"),
                )
            self.cr.report_restore(restored=True)
            return
        self.cr.report_restore(restored=False)
        self._fresh_io()
        await self._runc_create()
        await self.runc.start(self.id)

    async def _restore(self, images: str, *, keep_tcp: bool) -> None:
        work = self.config.options.criu_work_path or os.path.join(self.bundle, "work")
        timeout: float | None = None
        plan = self.cr.plan if self.cr is not None and not self.config.checkpoint else None
        gate = verdict = ""
        if plan is not None:
            work = plan.work_dir
            if plan.cached and self.cr is not None:
                gate, verdict = criu_config.write_gate(
                    os.path.dirname(plan.work_dir), self.cr.config.restore_timeout
                )
        if self.cr is not None:
            criu_config.write(
                self.bundle,
                criu_config.restore_options(self.cr.config, keep_tcp=keep_tcp, gate=gate),
            )
            timeout = self.cr.config.restore_timeout
        self._fresh_io()
        verifying: asyncio.Task[None] | None = None
        if self.cr is not None and plan is not None and plan.cached:
            # CRIU restores from the cache while its digests are checked; the gate
            # holds the restored tasks stopped until the verdict.
            verifying = asyncio.get_running_loop().create_task(
                self._verify_cache(plan.entry.id, verdict)
            )
        failure: BaseException | None = None
        try:
            await self._restore_images(images, work, keep_tcp, timeout)
        except BaseException as err:
            failure = err
        if verifying is not None and plan is not None and self.cr is not None:
            try:
                await verifying
            except DataLoss as bad:
                # The cached images were not what was committed: whatever CRIU made of
                # them must not run. The caller retries from the verified blob.
                if failure is None:
                    with contextlib.suppress(ShimError):
                        await self.runc.kill(self.id, signal.SIGKILL, all=True)
                self.cr.store.raw_cache.drop(plan.entry.id)
                raise bad from failure
        if failure is not None:
            raise failure
        if self.cr is not None and plan is not None and plan.gpu:
            try:
                await self.cr.pipeline.gpu.after_restore(
                    self.id, self.runc, plan.gpu, plan.gpu_device_map
                )
            except BaseException:
                # Processes without their GPU state cannot run: this attempt failed.
                with contextlib.suppress(ShimError):
                    await self.runc.kill(self.id, signal.SIGKILL, all=True)
                raise

    async def _verify_cache(self, entry_id: str, verdict: str) -> None:
        assert self.cr is not None
        try:
            await asyncio.to_thread(self.cr.store.raw_cache.verify, entry_id, CRIU_LAYER)
        except BaseException:
            criu_config.give_verdict(verdict, ok=False)
            raise
        criu_config.give_verdict(verdict, ok=True)

    async def _restore_images(
        self, images: str, work: str, keep_tcp: bool, timeout: float | None
    ) -> None:
        async with asyncio.timeout(timeout):
            await self._run_with_stdio(
                self.io,
                lambda console, stdio: self.runc.restore(
                    self.id,
                    RestoreOpts(
                        bundle=self.bundle,
                        image_path=images,
                        work_path=work,
                        pid_file=self._pid_file(),
                        console_socket=console,
                        no_pivot=self.config.options.no_pivot_root,
                        shell_job=self.io.config.terminal,
                        tcp_established=self.cr is not None
                        and keep_tcp
                        and self.cr.config.tcp_established,
                        ext_unix_sk=self.cr is not None,
                        file_locks=self.cr is not None and self.cr.config.file_locks,
                        stdio=stdio,
                    ),
                ),
            )
        self.init.pid = read_pid_file(self._pid_file())
        self._load_cgroup()

    def _fresh_io(self) -> None:
        """New pipes for another attempt at starting the init: a failed one closed its own."""
        self.io.close()
        opts = self.config.options
        self.io = ProcessIO(self.id, self.config.stdio, opts.io_uid, opts.io_gid)

    def target(self) -> Target:
        """This container as the checkpoint pipeline sees it."""
        assert self.cr is not None
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

    def target_if_running(self) -> Target | None:
        return self.target() if self.init.state is State.RUNNING else None

    # -- execs -----------------------------------------------------------------------

    def add_exec(self, config: ExecConfig) -> None:
        if config.exec_id in self.execs:
            raise AlreadyExists(f"exec {config.exec_id} already exists in container {self.id}")
        if self.init.state is State.PAUSED:
            raise FailedPrecondition(f"cannot exec in paused container {self.id}")
        self.init.check("exec")
        try:
            json.loads(config.process_json)
        except ValueError as err:
            raise InvalidArgument(f"exec {config.exec_id}: process spec is not JSON") from err
        self.execs[config.exec_id] = ExecProcess(config, Process(self.id, config.exec_id))

    def get_exec(self, exec_id: str) -> ExecProcess:
        try:
            return self.execs[exec_id]
        except KeyError:
            raise NotFound(f"exec {exec_id} not found in container {self.id}") from None

    def process(self, exec_id: str) -> Process:
        return self.init if not exec_id else self.get_exec(exec_id).process

    async def start_exec(self, exec_id: str) -> int:
        ex = self.get_exec(exec_id)
        async with ex.process.lock:
            ex.process.check("start")
            if self.init.state is not State.RUNNING:
                raise FailedPrecondition(
                    f"cannot start exec {exec_id}: container {self.id} is {self.init.state.value}"
                )
            ex.io = ProcessIO(
                f"{self.id}-{exec_id}",
                ex.config.stdio,
                self.config.options.io_uid,
                self.config.options.io_gid,
            )
            pid_file = os.path.join(self.bundle, f"{exec_id}.pid")
            process_json = _with_terminal(ex.config.process_json, ex.config.stdio.terminal)
            await self._run_with_stdio(
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

    def running_execs(self) -> list[ExecProcess]:
        return [e for e in self.execs.values() if e.process.state is State.RUNNING]

    # -- signals, pause, update ------------------------------------------------------------

    async def kill(self, exec_id: str, sig: int, all_processes: bool) -> None:
        if exec_id:
            proc = self.get_exec(exec_id).process
            proc.check("kill")
            if proc.pid == 0:
                raise FailedPrecondition(f"exec {exec_id} of container {self.id} is not started")
            try:
                os.kill(proc.pid, sig)
            except ProcessLookupError:
                raise NotFound(f"exec {exec_id} of container {self.id} already exited") from None
            return
        if self.restoring is not None and not self.restoring.done():
            await self._abandon_restore(sig)
            return
        cr = self.cr
        if cr is not None and sig == signal.SIGKILL and cr.stopping() and self.init.exit is None:
            # SIGKILL wins over a checkpoint still dumping: abort it (nothing of it is
            # ever committed), thaw what CRIU froze, then kill. Once CRIU has written
            # the images the process is gone and the rest of the checkpoint (its files,
            # the commit) goes on: a kill then has nothing left to stop.
            await cr.abort_stop()
            with contextlib.suppress(ShimError):
                await self.runc.resume(self.id)
        async with self.init.lock:
            self.init.check("kill")
            running = self.init.state in (State.RUNNING, State.PAUSED)
            if cr is not None and running and not all_processes and cr.wants_stop_checkpoint(sig):
                cr.begin_stop(self.target(), sig, self._kill_after_failed_checkpoint)
                return
            await self.runc.kill(self.id, sig, all=all_processes)

    async def _abandon_restore(self, sig: int) -> None:
        """A signal for a container still being restored: stop restoring, never run it.

        The Start in flight holds the process lock for the whole restore (which can
        take minutes), so waiting for the lock would keep a pod from being deleted.
        """
        restoring = self.restoring
        assert restoring is not None
        self.restore_killed = sig
        # The runc driver terminates runc (and with it CRIU) and reaps them; no grace
        # period: the container is being killed, not asked to stop.
        grace, self.runc.kill_grace = self.runc.kill_grace, 0.0
        try:
            restoring.cancel()
            await asyncio.wait([restoring])
        finally:
            self.runc.kill_grace = grace
        with contextlib.suppress(ShimError):
            await self.runc.delete(self.id, force=True)
        log.warning("restore abandoned", extra={"container": self.id, "signal": sig})
        self.abandoned_exit = ExitInfo(128 + sig, time.time())

    async def _kill_after_failed_checkpoint(self, sig: int) -> None:
        with contextlib.suppress(NotFound):
            await self.runc.kill(self.id, sig)

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

    async def pids(self) -> list[int]:
        if self.init.state in (State.STOPPED, State.DELETED):
            return []
        return await self.runc.ps(self.id)

    def resize(self, exec_id: str, width: int, height: int) -> None:
        from .stdio import set_window_size

        proc = self.process(exec_id)
        proc.check("resize")
        io = self.io if not exec_id else self.get_exec(exec_id).io
        if io is not None and io.console is not None:
            set_window_size(io.console, width, height)

    def close_io(self, exec_id: str) -> None:
        io = self.io if not exec_id else self.get_exec(exec_id).io
        if io is not None:
            io.close_stdin()

    async def checkpoint(self, config: CheckpointConfig) -> None:
        """The Task API's Checkpoint: images into ``config.image_path`` for containerd.

        For an opted-in container it goes through the cedana pipeline, so the
        checkpoint also lands in the node's store.
        """
        if self.cr is not None:
            self.init.check("checkpoint")
            await self.cr.checkpoint(
                self.target(),
                reason="task-api",
                leave_running=not config.exit,
                freeze=False,  # containerd's client pauses the task itself
                mirror_to=config.image_path,
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

    # -- delete ----------------------------------------------------------------------

    async def delete(self) -> ExitInfo:
        if self.cr is not None:
            self.cr.stop_periodic()
            await self.cr.wait_stop()  # the rootfs diff is read before the unmount
        async with self.init.lock:
            self.init.check("delete")
            if self.init.state is not State.RESTORE_PENDING:
                await self.runc.delete(self.id, force=self.init.state is State.CREATED)
            exit_info = self.init.exit or ExitInfo(0, 0.0)
            await self._release()
            self.init.commit("delete")
            return exit_info

    def delete_exec(self, exec_id: str) -> ExecProcess:
        ex = self.get_exec(exec_id)
        ex.process.check("delete")
        if ex.io is not None:
            ex.io.wait(IO_DRAIN_TIMEOUT)
            ex.io.close()
        ex.process.commit("delete")
        del self.execs[exec_id]
        return ex

    async def _release(self) -> None:
        await asyncio.to_thread(self.io.wait, IO_DRAIN_TIMEOUT)
        self.io.close()
        if self.logger is not None:
            await self.logger.terminate(LOGGER_STOP_GRACE)
            self.logger = None
        for ex in self.execs.values():
            if ex.io is not None:
                ex.io.close()
        if self.rootfs_mounted:
            await asyncio.to_thread(unmount_all, os.path.join(self.bundle, "rootfs"))
            self.rootfs_mounted = False
        if self.cr is not None:
            # A CRIU killed mid-restore leaves its cgroup yard mounted in the work dir,
            # and containerd cannot remove a bundle with mounts in it.
            with contextlib.suppress(OSError, ShimError):
                await asyncio.to_thread(
                    unmount_all, os.path.realpath(os.path.join(self.bundle, "work"))
                )

    async def _cleanup_failed_create(self) -> None:
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


def _with_terminal(process_json: bytes, terminal: bool) -> bytes:
    """containerd overrides the exec spec's ``terminal`` with the request's."""
    spec = json.loads(process_json)
    spec["terminal"] = terminal
    return json.dumps(spec).encode()
