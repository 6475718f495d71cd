"""The life of one protected job step, in the runner's keeper process (see runner.py).

Start (restore the label's latest checkpoint, or cold), forward the signals the
task process passes on, checkpoint on SIGTERM/SIGINT before the job sees them,
serve the control socket, and report the job's exit status. Everything about
checkpoints goes through the shim's own layers: the CheckpointManager and
Checkpointing of the task layer, the pipeline, RestoreSession and the store.

The job never outlives its Slurm job, whatever else fails: Slurm's signals come on
the task process's socketpair, never through the control socket; the stop's
signal and kill reach the job without runc when runc cannot run, and a reserve of
descriptors is given back for the stop's checkpoint (job_signals.py); and once the
task process is gone (KillWait's SIGKILL), or this keeper fails, the job is killed
through a pidfd opened when it started, which needs no free descriptor.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import shutil
import signal
import socket
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Final

from google.protobuf.message import Message

from .. import log as shim_log
from ..api.cedana.v1 import cedana_pb2 as cedana_ev
from ..checkpoint import criu_config
from ..checkpoint.pipeline import DumpRequest
from ..checkpoint.policy import Policy
from ..errors import FailedPrecondition, InvalidArgument, NotFound, ShimError
from ..lifecycle.checkpoint_manager import CheckpointManager, PipelineSource
from ..lifecycle.checkpointing import STOP_SIGNALS, Checkpointing
from ..lifecycle.process import Process, State
from ..runtime.reaper import Exit, Reaper, set_child_subreaper
from ..runtime.runc import Runc
from ..runtime.unmount import unmount_all
from . import cgroups, job_spec, leftovers
from .batch_script import BatchScript
from .control import RUN_DIR, SOCKET_DIR, ControlServer, socket_path
from .job_host import JobHost
from .job_signals import FD_FOR_STOP, FdReserve, InitHandle, JobRunc

log = logging.getLogger(__name__)

# The node's checkpoint pipelines, built by the composition root (cli/): the node
# config the way the shim's daemon reads it (cli.wiring.NodePipelines).
PipelinesFactory = Callable[[Reaper], PipelineSource]

EXIT_RUNNER_FAILED: Final = 125  # the runner could not run the job at all
KILLED_EXIT_WAIT: Final = 10.0
COMPACT_DRAIN_TIMEOUT: Final = 600.0
# Signals whose default action would end the keeper (see run()).
_IGNORED: Final = (
    signal.SIGTERM,
    signal.SIGINT,
    signal.SIGHUP,
    signal.SIGQUIT,
    signal.SIGUSR1,
    signal.SIGUSR2,
    signal.SIGALRM,
)


@dataclass(frozen=True, slots=True)
class JobPaths:
    """Where one job step's runner keeps its state (root's, under /run) and its
    control socket (the job's owner may reach it, control.py)."""

    base: str
    name: str
    sockets: str = SOCKET_DIR

    @property
    def socket(self) -> str:
        return socket_path(self.name, self.sockets)

    @property
    def bundle(self) -> str:
        return os.path.join(self.base, "bundles", self.name)

    @property
    def rootfs(self) -> str:
        # Outside the bundle on purpose: the bundle is removed with rmtree, and this
        # is the host's root bound in the runner's mount namespace.
        return os.path.join(self.base, "roots", self.name)

    @property
    def runc_root(self) -> str:
        return os.path.join(self.base, "runc")


class JobEvents:
    """The shim's checkpoint events, as the few lines the job's stderr gets."""

    def __init__(self, err: int = 2) -> None:
        self._err = err
        # What is known to stop every checkpoint of this job (job_spec.checkpoint_obstacle).
        self.obstacle: str | None = None

    def send(self, event: Message) -> None:
        if isinstance(event, cedana_ev.RestoreOutcome):
            if event.checkpoint_id:
                detail = f"label {event.label}" + (f"; {event.detail}" if event.detail else "")
                self.say(f"restored from {event.checkpoint_id} ({detail})")
            else:
                self.say(f"starting cold: {event.detail}")
        elif isinstance(event, cedana_ev.CheckpointCommitted):
            self.say(
                f"checkpoint {event.checkpoint_id} committed ({event.reason}, label {event.label})"
            )
        elif isinstance(event, cedana_ev.CheckpointFailed):
            if self.obstacle:
                self.say(f"checkpoint failed ({event.reason}): {self.obstacle} ({event.error})")
            else:
                self.say(f"checkpoint failed ({event.reason}): {event.error}")

    def say(self, text: str) -> None:
        with contextlib.suppress(OSError):
            os.write(self._err, f"cedana: {text}\n".encode(errors="replace"))


class JobRun:
    def __init__(
        self,
        request: job_spec.JobRequest,
        policy: Policy,
        front: socket.socket,
        pipelines: PipelinesFactory,
        *,
        config_path: str = "",
        base: str = RUN_DIR,
        sockets: str = SOCKET_DIR,
    ) -> None:
        self.request = request
        self._pipelines = pipelines
        self.policy = policy
        self.front = front
        self.config_path = config_path
        self.paths = JobPaths(base, request.name, sockets)
        self.events = JobEvents()
        self._exits: dict[int, Exit] = {}
        self._pending: list[int] = []  # signals that came while the job was starting
        self.init: Process | None = None
        self.cr: Checkpointing | None = None
        self.host: JobHost | None = None
        self._cgroup = ""  # the container's cgroup path
        self._created: cgroups.CreatedDirs | None = None
        self._task_gone = False
        self._reserve = FdReserve()
        self._runc: JobRunc | None = None

    async def run(self) -> int:
        loop = asyncio.get_running_loop()
        for sig in _IGNORED:
            # Slurm's own signals reach the task process, which forwards them; one that
            # reaches this process too (proctrack/cgroup) must not end it.
            loop.add_signal_handler(sig, lambda: None)
        set_child_subreaper()
        reaper = Reaper(loop)
        reaper.install()
        unsubscribe = reaper.subscribe(self._on_exit)
        pipelines = self._pipelines(reaper)
        # Signals that arrive while the job is being started wait for it (_signal).
        front_gone = loop.create_task(self._forward_signals())
        try:
            shim_log.add_node_log(pipelines.get(self.config_path).config.log_file)
            self.events.obstacle = job_spec.checkpoint_obstacle(self.request.uid)
            if self.events.obstacle:
                self.events.say(f"warning: {self.events.obstacle}")
            manager = CheckpointManager(self.events, pipelines)
            cr, restore = manager.for_container(
                self.request.container_id, self.policy, self.config_path
            )
            self.cr = cr
            self.host = host = await self._prepare(reaper, cr)
            if restore is not None and await restore.prepare(host):
                pid = await restore.run(host)
            else:
                pid = await host.create_cold()
        except Exception as err:  # whatever it was, nothing of the job may stay running
            self.events.say(f"cannot run job {self.request.name}: {err}")
            front_gone.cancel()
            await self._cleanup()
            self._report(EXIT_RUNNER_FAILED)
            unsubscribe()
            return EXIT_RUNNER_FAILED
        try:
            status = await self._supervise(pid, cr, host, front_gone)
        except BaseException:
            self._kill_now()  # whatever went wrong, the job must not outlive its keeper
            raise
        self._reserve.release()  # the rest: for the cleanup
        cr.stop_periodic()
        await cr.wait_stop()
        if self.init is None or self.init.exit is None:
            await self._kill_all()
        # else the container's pid 1 is gone, and with it, by the kernel, every other
        # process of its PID namespace: nothing to kill.
        await host.drain_output()
        # Cleaned up before the step ends: a requeued job (same id, maybe this node)
        # finds the step's names free.
        front_gone.cancel()
        await self._cleanup()
        self._report(status)
        _let_go_of_stdio()  # the step's output is complete: nothing may hold it open
        if self._runc is not None and self._runc.init is not None:
            self._runc.init.close()  # the job is gone: nothing left to signal
            self._runc.init = None
        unsubscribe()
        await manager.drain(COMPACT_DRAIN_TIMEOUT)
        reaper.close()
        return status

    async def _supervise(
        self, pid: int, cr: Checkpointing, host: JobHost, front_gone: asyncio.Task[None]
    ) -> int:
        """From the job's start to its exit: its status."""
        init = self.init = Process(self.request.container_id, "", State.RUNNING, pid)
        self._hold_init(pid)
        if pid in self._exits:
            init.set_exited(self._exits[pid].status, self._exits[pid].timestamp)
        cr.started(init, host.target)
        control = ControlServer(self.paths.socket, frozenset({0, self.request.uid}), self._control)
        try:
            await control.start()
        except OSError as err:
            log.warning("no control socket", extra={"path": control.path, "error": str(err)})
        for sig in self._pending:
            await self._signal(sig)
        ends: set[asyncio.Future[Any]] = {front_gone, init.exited}
        await asyncio.wait(ends, return_when=asyncio.FIRST_COMPLETED)
        if not init.exited.done():  # the task process was killed (KillWait's SIGKILL)
            self._task_gone = True
            # The step is over for Slurm: the job goes now, before anything that needs
            # a descriptor or runc; a checkpoint in progress is abandoned below.
            self._kill_now()
            self._reserve.release()
            # Its output file may already be the requeued job's (truncated); nothing
            # of this run may land in it.
            _let_go_of_stdio()
            await cr.abort(init)  # nothing of an abandoned checkpoint stays
            await self._kill_all()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(init.exited), KILLED_EXIT_WAIT)
        await control.close()
        return init.exit.status if init.exit is not None else 128 + signal.SIGKILL

    async def _prepare(self, reaper: Reaper, cr: Checkpointing) -> JobHost:
        """A fresh bundle (what a killed runner of the same step left is removed
        first), the host's root bound for it, and its spec."""
        paths = self.paths
        if not os.path.isdir(self.request.cwd):
            # runc would create it, as root, on the host (the container's root).
            raise InvalidArgument(f"the job's working directory {self.request.cwd} does not exist")
        runc = self._runc = JobRunc(
            reaper=reaper,
            root=paths.runc_root,
            log_path=os.path.join(paths.bundle, "log.json"),
        )
        # Without a log: the bundle that would hold it is not there yet.
        janitor = Runc(reaper=reaper, root=paths.runc_root)
        await leftovers.sweep(
            os.path.dirname(paths.bundle), os.path.dirname(paths.rootfs), paths.sockets, janitor
        )
        if os.path.exists(os.path.join(paths.runc_root, self.request.container_id)):
            with contextlib.suppress(ShimError, OSError):
                await janitor.delete(self.request.container_id, force=True)
        shutil.rmtree(paths.bundle, ignore_errors=True)
        for private in (
            os.path.dirname(paths.base),  # /run/cedana (the shim keeps it 0700 too)
            paths.base,
            os.path.dirname(paths.bundle),
            os.path.dirname(paths.rootfs),
        ):
            # The bundle's spec holds the job's environment: root's eyes only.
            os.makedirs(private, mode=0o700, exist_ok=True)
            os.chmod(private, 0o700)
        os.makedirs(os.path.join(paths.bundle, "work"), mode=0o700)  # CRIU's work dirs
        leftovers.mark_keeper(paths.bundle)
        mounts = job_spec.host_mounts()
        job_spec.bind_host_root(paths.rootfs)
        # The task process's, not this process's: a keeper from the warm template has
        # the template's rlimits, cgroups and OOM score.
        facts = job_spec.task_facts(self.request.task_pid)
        self._cgroup = job_spec.container_cgroup(job_spec.job_cgroup(facts.cgroup), self.request)
        self._created = cgroups.CreatedDirs(self._cgroup)
        spec = job_spec.build_spec(
            self.request,
            rootfs=paths.rootfs,
            mounts=mounts,
            cgroup=self._cgroup,
            rlimits=facts.rlimits,
            proc_status=facts.status,
            oom_score_adj=facts.oom_score_adj,
        )
        spec["annotations"] = {criu_config.ANNOTATION: criu_config.config_path(paths.bundle)}
        with open(os.path.join(paths.bundle, "config.json"), "w") as f:
            json.dump(spec, f)
        return JobHost(
            container_id=self.request.container_id,
            bundle=paths.bundle,
            rootfs=paths.rootfs,
            spec=spec,
            runc=runc,
            policy=cr.policy,
            script=BatchScript(self.request.job_id, self.request.step_id, self.request.argv),
        )

    def _on_exit(self, ex: Exit) -> None:
        self._exits[ex.pid] = ex
        init = self.init
        if init is not None and ex.pid == init.pid and init.exit is None:
            init.set_exited(ex.status, ex.timestamp)

    async def _forward_signals(self) -> None:
        """Each byte from the task process is a signal it caught; returns at EOF."""
        loop = asyncio.get_running_loop()
        self.front.setblocking(False)
        while True:
            try:
                data = await loop.sock_recv(self.front, 64)
            except OSError:
                return
            if not data:
                return
            for sig in data:
                await self._signal(sig)

    async def _signal(self, sig: int) -> None:
        init, cr, host = self.init, self.cr, self.host
        if init is None or cr is None or host is None:
            self._pending.append(sig)  # still starting: delivered once it runs
            return
        if init.exit is not None:
            return
        if sig in STOP_SIGNALS and cr.request_stop(init, host.target, sig):
            # Checkpointed first; the job dies once the checkpoint is durable. Most
            # of the reserve is for this checkpoint; the job's end needs none.
            self._reserve.release(FD_FOR_STOP)
            return
        with contextlib.suppress(ShimError, OSError):  # OSError: not even the fallback
            await host.runc.kill(self.request.container_id, sig)

    async def _control(self, request: dict[str, Any]) -> dict[str, Any]:
        op = request.get("op")
        init, cr, host = self.init, self.cr, self.host
        assert init is not None and cr is not None and host is not None
        if op == "status":
            return {
                "job": self.request.job_id,
                "step": self.request.step_id,
                "uid": self.request.uid,
                "scope": cr.policy.scope,
                "label": cr.policy.label,
                "mode": cr.policy.mode.value,
                "state": init.state.value,
                "pid": init.pid,
                "runner_pid": os.getpid(),
            }
        if op == "checkpoint":
            try:
                entry = await cr.checkpoint(init, host.target, DumpRequest("manual"))
            except ShimError as err:
                if not self.events.obstacle:
                    raise
                raise FailedPrecondition(
                    f"cannot checkpoint job {self.request.name}: {self.events.obstacle} ({err})"
                ) from None
            return {
                "checkpoint": entry.id,
                "label": entry.label,
                "scope": entry.scope,
                "size": entry.size,
                "job": self.request.job_id,
            }
        raise InvalidArgument(f"unknown control request {op!r}: use checkpoint or status")

    def _hold_init(self, pid: int) -> None:
        """A pidfd of the job's init from now on, for the stop without runc."""
        try:
            handle: InitHandle | None = InitHandle.open(pid, self._cgroup)
        except OSError as err:
            log.warning(
                "cannot hold the job's init: stopping it needs runc",
                extra={"container": self.request.container_id, "pid": pid, "error": str(err)},
            )
            handle = None
        if handle is not None and pid in self._exits:
            handle.close()  # reaped before the pidfd was opened: it may name another
            handle = None
        if self._runc is not None:
            self._runc.init = handle

    def _kill_now(self) -> None:
        """SIGKILL the job without runc or a new descriptor (its init's pidfd)."""
        handle = self._runc.init if self._runc is not None else None
        if handle is None or (self.init is not None and self.init.exit is not None):
            return
        try:
            handle.kill()
        except NotFound:
            pass  # dead already, not reaped yet
        except (ShimError, OSError) as err:
            log.error(
                "cannot kill the job through its init's pidfd",
                extra={"container": self.request.container_id, "error": str(err)},
            )

    async def _kill_all(self) -> None:
        if self.host is not None:
            with contextlib.suppress(NotFound, ShimError, OSError):
                await self.host.runc.kill(self.request.container_id, signal.SIGKILL, all=True)

    def _report(self, status: int) -> None:
        with contextlib.suppress(OSError):
            self.front.setblocking(True)
            self.front.sendall(f"{status}\n".encode())

    async def _cleanup(self) -> None:
        if self.host is not None:
            with contextlib.suppress(ShimError, OSError):
                await self.host.runc.delete(self.request.container_id, force=True)
            if self.host.script is not None:
                self.host.script.remove_staged()
        if self._created is not None:
            self._created.remove()
        if self._task_gone and self._cgroup:
            # slurmstepd removed the step's cgroups while ours were still in them.
            removed = cgroups.finish_slurm_removal(
                self._cgroup, self.request.job_id, self.request.uid
            )
            if removed:
                log.info("removed the job's cgroups Slurm left", extra={"paths": removed})
        with contextlib.suppress(ShimError, OSError):
            await asyncio.to_thread(unmount_all, self.paths.rootfs)
        with contextlib.suppress(OSError):
            os.rmdir(self.paths.rootfs)  # never rmtree: it may still be the host's root
        with contextlib.suppress(ShimError, OSError):
            await asyncio.to_thread(unmount_all, self.paths.bundle)
        shutil.rmtree(self.paths.bundle, ignore_errors=True)


def _let_go_of_stdio() -> None:
    """Once the step is over, the step's stdio is not ours to hold or write to."""
    try:
        devnull = os.open(os.devnull, os.O_RDWR)
    except OSError as err:  # no descriptor left: the job's end must not fail on this
        log.warning("cannot let go of the step's stdio", extra={"error": str(err)})
        return
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    os.close(devnull)


__all__ = ["EXIT_RUNNER_FAILED", "JobEvents", "JobPaths", "JobRun", "PipelinesFactory"]
