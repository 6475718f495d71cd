"""containerd.task.v2.Task: thin ttrpc handlers over the containers.

Each handler decodes its request into a frozen config, calls a ``task_*``
coroutine (no ttrpc context, so tests call them directly), and encodes the
answer. This module also owns exit bookkeeping: the reaper reports every exit
here, once; once the process's output is copied out (bounded, see
``Container.drain_output``) the matching process records it and the exit is
published, an init's only after every exec of its container has been published
(containerd ``handleInitExit``).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from collections.abc import Callable, Mapping
from typing import Any

from google.protobuf.any_pb2 import Any as AnyProto
from google.protobuf.empty_pb2 import Empty
from google.protobuf.message import Message

from .. import __version__
from ..api.cedana.v1 import cedana_pb2 as cedana_pb
from ..api.containerd.events import task_pb2 as ev
from ..api.containerd.runc import options_pb2 as runc_pb
from ..api.containerd.task.v2 import shim_pb2 as pb
from ..api.containerd.types import task_pb2 as types
from ..bundle_state import mark_deleted
from ..checkpoint.pipeline import DumpRequest
from ..checkpoint.policy import policy_for
from ..errors import FailedPrecondition, InvalidArgument, NotFound, ShimError
from ..lifecycle.checkpoint_manager import CheckpointManager
from ..lifecycle.checkpointing import require_enabled
from ..lifecycle.events import EventSender
from ..lifecycle.process import NOT_EXITED, ExitInfo, Process, State
from ..runtime.mount import Mount
from ..runtime.reaper import Exit, Reaper
from ..ttrpc.server import CallContext, Method
from .container import Container, load_spec
from .oom import OomWatcher
from .options import parse_runtime_options, type_name
from .requests import CheckpointConfig, CreateConfig, ExecConfig
from .runc_factory import RuncFactory
from .stats import collect_metrics
from .stdio import StdioConfig

log = logging.getLogger(__name__)

SERVICE_NAME = "containerd.task.v2.Task"
CEDANA_SERVICE_NAME = "cedana.shim.v1.Checkpoint"
STATUS = {
    State.CREATED: types.CREATED,
    State.RESTORE_PENDING: types.CREATED,
    State.RESTORING: types.CREATED,
    State.RUNNING: types.RUNNING,
    State.PAUSED: types.PAUSED,
    State.CHECKPOINTING: types.RUNNING,
    State.CHECKPOINTING_PAUSED: types.PAUSED,
    State.STOPPING: types.RUNNING,
    State.STOPPED: types.STOPPED,
    State.DELETED: types.STOPPED,
}
SPEC_TYPE_PREFIX = "types.containerd.io/opencontainers/runtime-spec/1/"


def _timestamp(message: Any, when: float) -> None:
    message.FromNanoseconds(int(when * 1e9))


def _exited_at(process: Process) -> float:
    return process.exit.timestamp if process.exit else NOT_EXITED


class TaskService:
    def __init__(
        self,
        namespace: str,
        events: EventSender,
        reaper: Reaper,
        *,
        checkpoints: CheckpointManager,
        runc_factory: RuncFactory,
        oom: OomWatcher | None = None,
        on_shutdown: Callable[[], None] = lambda: None,
    ) -> None:
        self.namespace = namespace
        self.events = events
        self.reaper = reaper
        self.oom = oom
        self.checkpoints = checkpoints
        self.runc_factory = runc_factory
        self.containers: dict[str, Container] = {}
        self._on_shutdown = on_shutdown
        self._exit_tasks: set[asyncio.Task[None]] = set()
        # An init's exit waits here until every exec of its container has exited
        # (containerd's handleInitExit): container id -> (exit, pid).
        self._held_init_exits: dict[str, tuple[ExitInfo, int]] = {}
        # (id(process), pid) of exits being handled: one exit seen twice is handled once.
        self._exiting: set[tuple[int, int]] = set()
        reaper.subscribe(self._on_exit)

    def cedana_methods(self) -> Mapping[str, Method[Any]]:
        return {"Checkpoint": Method(cedana_pb.CheckpointRequest, self.cedana_checkpoint)}

    async def cedana_checkpoint(
        self, req: cedana_pb.CheckpointRequest, _: CallContext
    ) -> cedana_pb.CheckpointResponse:
        container = self.container(req.container_id)
        cr = require_enabled(container.cr, req.container_id)
        if req.leave_running:
            request = DumpRequest("manual")
            entry = await cr.checkpoint(container.init, container.target, request)
        else:
            entry = await cr.stop(
                container.init,
                container.target,
                signal.SIGTERM,
                reason="manual",
                signal_on_failure=False,
            )
        return cedana_pb.CheckpointResponse(
            checkpoint_id=entry.id, label=entry.label, scope=entry.scope, size=entry.size
        )

    def methods(self) -> Mapping[str, Method[Any]]:
        def m(request_type: type[Message], handler: Any) -> Method[Any]:
            return Method(request_type, handler)

        return {
            "State": m(pb.StateRequest, self.state),
            "Create": m(pb.CreateTaskRequest, self.create),
            "Start": m(pb.StartRequest, self.start),
            "Delete": m(pb.DeleteRequest, self.delete),
            "Pids": m(pb.PidsRequest, self.pids),
            "Pause": m(pb.PauseRequest, self.pause),
            "Resume": m(pb.ResumeRequest, self.resume),
            "Checkpoint": m(pb.CheckpointTaskRequest, self.checkpoint),
            "Kill": m(pb.KillRequest, self.kill),
            "Exec": m(pb.ExecProcessRequest, self.exec),
            "ResizePty": m(pb.ResizePtyRequest, self.resize_pty),
            "CloseIO": m(pb.CloseIORequest, self.close_io),
            "Update": m(pb.UpdateTaskRequest, self.update),
            "Wait": m(pb.WaitRequest, self.wait),
            "Stats": m(pb.StatsRequest, self.stats),
            "Connect": m(pb.ConnectRequest, self.connect),
            "Shutdown": m(pb.ShutdownRequest, self.shutdown),
        }

    def container(self, container_id: str) -> Container:
        try:
            return self.containers[container_id]
        except KeyError:
            raise NotFound(f"container {container_id} not created in this shim") from None

    # -- handlers --------------------------------------------------------------------

    async def create(self, req: pb.CreateTaskRequest, _: CallContext) -> pb.CreateTaskResponse:
        if req.id in self.containers:
            raise InvalidArgument(f"container {req.id} already exists in this shim")
        if req.parent_checkpoint:
            raise InvalidArgument(f"container {req.id}: parent checkpoints are not supported")
        config = CreateConfig(
            id=req.id,
            bundle=req.bundle,
            namespace=self.namespace,
            rootfs=tuple(Mount(m.type, m.source, m.target, tuple(m.options)) for m in req.rootfs),
            stdio=StdioConfig(req.stdin, req.stdout, req.stderr, req.terminal),
            checkpoint=req.checkpoint,
            options=parse_runtime_options(req.options if req.HasField("options") else None),
        )
        pid = await self.task_create(config)
        self.events.send(
            ev.TaskCreate(
                container_id=req.id,
                bundle=req.bundle,
                rootfs=req.rootfs,
                io=ev.TaskIO(
                    stdin=req.stdin, stdout=req.stdout, stderr=req.stderr, terminal=req.terminal
                ),
                checkpoint=req.checkpoint,
                pid=pid,
            )
        )
        return pb.CreateTaskResponse(pid=pid)

    async def task_create(self, config: CreateConfig) -> int:
        spec = load_spec(config.bundle, config.id)
        policy = policy_for(spec, config.id, self.namespace)
        cr = restore = None
        if policy.enabled:
            cr, restore = self.checkpoints.for_container(
                config.id, policy, config.options.config_path
            )
        runc = self.runc_factory(config.options, self.namespace, config.bundle)
        with self.reaper.collect() as early:
            container = await Container.create(
                config,
                runc=runc,
                reaper=self.reaper,
                spec=spec,
                report_exit=self._report_decided_exit,
                cr=cr,
                restore=restore,
            )
        self.containers[config.id] = container
        self._replay(early, container.init)
        self._watch_oom(container)
        log.info("created", extra={"container": config.id, "pid": container.init.pid})
        return container.init.pid

    async def start(self, req: pb.StartRequest, _: CallContext) -> pb.StartResponse:
        container = self.container(req.id)
        if req.exec_id:
            with self.reaper.collect() as early:
                pid = await container.start_exec(req.exec_id)
            self.events.send(ev.TaskExecStarted(container_id=req.id, exec_id=req.exec_id, pid=pid))
            self._replay(early, container.execs.get(req.exec_id).process)
            return pb.StartResponse(pid=pid)
        with self.reaper.collect() as early:
            pid = await container.start()
        self.events.send(ev.TaskStart(container_id=req.id, pid=pid))
        self._replay(early, container.init)
        if self.oom is not None and req.id not in self.oom:
            self._watch_oom(container)  # a restored container has its cgroup only now
        return pb.StartResponse(pid=pid)

    async def delete(self, req: pb.DeleteRequest, _: CallContext) -> pb.DeleteResponse:
        container = self.container(req.id)
        if req.exec_id:
            ex = container.execs.delete(req.exec_id)
            info = ex.process.exit or ExitInfo(0, 0.0)
            pid = ex.process.pid
        else:
            info = await container.delete()
            pid = container.init.pid
            del self.containers[req.id]
            try:
                mark_deleted(container.bundle, pid, info.status, info.timestamp)
            except OSError as err:  # the delete command then simply does the full cleanup
                log.warning(
                    "cannot mark bundle deleted", extra={"container": req.id, "error": str(err)}
                )
            if self.oom is not None:
                self.oom.remove(req.id)
            event = ev.TaskDelete(container_id=req.id, pid=pid, exit_status=info.status)
            _timestamp(event.exited_at, info.timestamp)
            self.events.send(event)
        resp = pb.DeleteResponse(pid=pid, exit_status=info.status)
        _timestamp(resp.exited_at, info.timestamp)
        return resp

    async def pids(self, req: pb.PidsRequest, _: CallContext) -> pb.PidsResponse:
        container = self.container(req.id)
        by_pid = {e.process.pid: e.config.exec_id for e in container.execs}
        resp = pb.PidsResponse()
        for pid in await container.pids():
            info = resp.processes.add(pid=pid)
            if pid in by_pid:
                details = runc_pb.ProcessDetails(exec_id=by_pid[pid])
                info.info.CopyFrom(
                    AnyProto(
                        type_url=details.DESCRIPTOR.full_name, value=details.SerializeToString()
                    )
                )
        return resp

    async def pause(self, req: pb.PauseRequest, _: CallContext) -> Empty:
        await self.container(req.id).pause()
        self.events.send(ev.TaskPaused(container_id=req.id))
        return Empty()

    async def resume(self, req: pb.ResumeRequest, _: CallContext) -> Empty:
        await self.container(req.id).resume()
        self.events.send(ev.TaskResumed(container_id=req.id))
        return Empty()

    async def checkpoint(self, req: pb.CheckpointTaskRequest, _: CallContext) -> Empty:
        container = self.container(req.id)
        opts = runc_pb.CheckpointOptions()
        if req.HasField("options") and req.options.type_url:
            if type_name(req.options.type_url) != "containerd.runc.v1.CheckpointOptions":
                raise InvalidArgument(
                    f"unsupported checkpoint options type {req.options.type_url!r}"
                )
            opts = runc_pb.CheckpointOptions.FromString(req.options.value)
        image_path = req.path or opts.image_path
        if not image_path:
            raise InvalidArgument(f"checkpoint of container {req.id} needs an image path")
        work_path = opts.work_path or os.path.join(container.bundle, "work", "criu-work")
        await container.checkpoint(
            CheckpointConfig(
                image_path=image_path,
                work_path=work_path,
                exit=opts.exit,
                open_tcp=opts.open_tcp,
                external_unix_sockets=opts.external_unix_sockets,
                file_locks=opts.file_locks,
                empty_namespaces=tuple(opts.empty_namespaces),
            )
        )
        return Empty()

    async def kill(self, req: pb.KillRequest, _: CallContext) -> Empty:
        await self.container(req.id).kill(req.exec_id, req.signal, req.all)
        return Empty()

    async def exec(self, req: pb.ExecProcessRequest, _: CallContext) -> Empty:
        container = self.container(req.id)
        spec = req.spec
        if spec.type_url and not spec.type_url.startswith(SPEC_TYPE_PREFIX):
            raise InvalidArgument(f"exec {req.exec_id}: unsupported spec type {spec.type_url!r}")
        container.add_exec(
            ExecConfig(
                exec_id=req.exec_id,
                stdio=StdioConfig(req.stdin, req.stdout, req.stderr, req.terminal),
                process_json=spec.value,
            )
        )
        self.events.send(ev.TaskExecAdded(container_id=req.id, exec_id=req.exec_id))
        return Empty()

    async def resize_pty(self, req: pb.ResizePtyRequest, _: CallContext) -> Empty:
        self.container(req.id).resize(req.exec_id, req.width, req.height)
        return Empty()

    async def close_io(self, req: pb.CloseIORequest, _: CallContext) -> Empty:
        if req.stdin:
            self.container(req.id).close_io(req.exec_id)
        return Empty()

    async def update(self, req: pb.UpdateTaskRequest, _: CallContext) -> Empty:
        await self.container(req.id).update(req.resources.value)
        return Empty()

    async def wait(self, req: pb.WaitRequest, _: CallContext) -> pb.WaitResponse:
        process = self.container(req.id).process(req.exec_id)
        info = await asyncio.shield(process.exited)
        resp = pb.WaitResponse(exit_status=info.status)
        _timestamp(resp.exited_at, info.timestamp)
        return resp

    async def stats(self, req: pb.StatsRequest, _: CallContext) -> pb.StatsResponse:
        container = self.container(req.id)
        if container.cgroup is None:
            raise NotFound(f"container {req.id} has no cgroup to read stats from")
        stats = await asyncio.to_thread(collect_metrics, container.cgroup)
        return pb.StatsResponse(stats=stats)

    async def connect(self, req: pb.ConnectRequest, _: CallContext) -> pb.ConnectResponse:
        container = self.containers.get(req.id)
        return pb.ConnectResponse(
            shim_pid=os.getpid(),
            task_pid=container.init.pid if container else 0,
            version=__version__,
        )

    async def shutdown(self, req: pb.ShutdownRequest, _: CallContext) -> Empty:
        # containerd sends this after every Delete; a pod's shim stays for the rest.
        if not self.containers:
            self._on_shutdown()
        return Empty()

    async def state(self, req: pb.StateRequest, _: CallContext) -> pb.StateResponse:
        container = self.container(req.id)
        if req.exec_id:
            ex = container.execs.get(req.exec_id)
            process, stdio = ex.process, ex.config.stdio
        else:
            process, stdio = container.init, container.config.stdio
        resp = pb.StateResponse(
            id=req.id,
            bundle=container.bundle,
            pid=process.pid,
            status=STATUS[process.state],
            stdin=stdio.stdin,
            stdout=stdio.stdout,
            stderr=stdio.stderr,
            terminal=stdio.terminal,
            exit_status=process.exit.status if process.exit else 0,
            exec_id=req.exec_id,
        )
        _timestamp(resp.exited_at, _exited_at(process))
        return resp

    def _watch_oom(self, container: Container) -> None:
        if self.oom is None or container.cgroup is None:
            return
        try:
            self.oom.add(container.id, container.cgroup)
        except (NotFound, FailedPrecondition, OSError) as err:
            log.warning("no OOM events", extra={"container": container.id, "error": str(err)})

    def publish_oom(self, container_id: str) -> None:
        log.warning("OOM kill", extra={"container": container_id})
        self.events.send(ev.TaskOOM(container_id=container_id))

    # -- exits -----------------------------------------------------------------------

    def _on_exit(self, ex: Exit) -> None:
        for container in self.containers.values():
            for process in (container.init, *(e.process for e in container.execs)):
                if process.pid == ex.pid and process.exit is None:
                    self._schedule_exit(container, process, ex)
                    return

    def _replay(self, early: Mapping[int, Exit], process: Process) -> None:
        """Handle an exit reaped before the process's pid was known."""
        ex = early.get(process.pid) if process.pid else None
        if ex is not None and process.exit is None:
            self._schedule_exit(self.container(process.container_id), process, ex)

    def _schedule_exit(self, container: Container, process: Process, ex: Exit) -> None:
        # An exit seen both live and in a start window is handled once.
        key = (id(process), ex.pid)
        if key in self._exiting:
            return
        self._exiting.add(key)
        task = asyncio.get_running_loop().create_task(self._handle_exit(container, process, ex))
        self._exit_tasks.add(task)
        task.add_done_callback(self._exit_tasks.discard)
        task.add_done_callback(lambda _: self._exiting.discard(key))

    async def _handle_exit(self, container: Container, process: Process, ex: Exit) -> None:
        if not process.is_init:
            await container.drain_output(process)
            if process.set_exited(ex.status, ex.timestamp):
                self._publish_exit(process)
            held = self._held_init_exits.get(container.id)
            if held is not None and not container.execs.running():
                del self._held_init_exits[container.id]
                await self._finish_init_exit(container, *held)
            return
        if container.needs_kill_all_on_exit():
            try:
                await container.kill_all()
            except ShimError as err:
                # Never let this stop the exit from being reported.
                log.warning(
                    "kill --all after init exit failed",
                    extra={"container": container.id, "error": str(err)},
                )
        info = ExitInfo(ex.status, ex.timestamp)
        if container.execs.running():
            self._held_init_exits[container.id] = (info, ex.pid)  # after the last exec's
            return
        await self._finish_init_exit(container, info, ex.pid)

    async def _finish_init_exit(self, container: Container, info: ExitInfo, pid: int) -> None:
        if container.init.pid == pid:
            await container.drain_output(container.init)
        # The lock orders the exit after a Start still in flight (its TaskStart first).
        async with container.init.lock:
            if container.init.pid != pid:
                # A process of a restore attempt that failed (and was killed): the
                # container's init is another process by now.
                log.debug(
                    "exit of a replaced process", extra={"container": container.id, "pid": pid}
                )
                return
            if container.init.set_exited(info.status, info.timestamp):
                self._publish_exit(container.init)
        reported = container.init.exit
        log.info(
            "exited",
            extra={
                "container": container.id,
                "exit_status": reported.status if reported else info.status,
            },
        )

    def _report_decided_exit(self, container: Container) -> None:
        """An exit the container recorded itself (a Kill abandoned its restore)."""
        if container.init.exit is not None:
            self._publish_exit(container.init)

    def _publish_exit(self, process: Process) -> None:
        assert process.exit is not None
        event = ev.TaskExit(
            container_id=process.container_id,
            id=process.exec_id or process.container_id,
            pid=process.pid,
            exit_status=process.exit.status,
        )
        _timestamp(event.exited_at, process.exit.timestamp)
        self.events.send(event)
