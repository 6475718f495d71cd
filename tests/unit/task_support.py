"""The task core on a fake runc, for root-free tests.

:class:`TaskWorld` (one per test, in ``tmp_path``) runs one test body in a fresh event
loop, with the test process a child subreaper for the duration (the fake's
detached inits are reparented to it and reaped by the loop's
:class:`~cedana_shim.runtime.reaper.Reaper`), and kills and reaps whatever the
body left behind. The body gets a :class:`TaskEnv`: a
:class:`~cedana_shim.task.service.TaskService` wired as the daemon wires it,
with the fake runc (:mod:`fakes.fake_runc`) as its runc, events collected into a
list, and a checkpoint :class:`~cedana_shim.checkpoint.pipeline.Pipeline` over a
real store in ``tmp_path``, :class:`ProbedHooks` and GPU steps.
"""

from __future__ import annotations

import asyncio
import contextlib
import ctypes
import gc
import json
import os
import signal
import sys
import time
from collections.abc import Awaitable, Callable, Iterator, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any, TypeVar

from cedana_shim.api.cedana.v1 import cedana_pb2 as cedana_pb
from cedana_shim.api.containerd.events import task_pb2 as ev
from cedana_shim.api.containerd.task.v2 import shim_pb2 as pb
from cedana_shim.checkpoint.dirty_tracking import DirtyTracking
from cedana_shim.checkpoint.gpu_steps import GpuSteps
from cedana_shim.checkpoint.pipeline import Pipeline
from cedana_shim.checkpoint.store import Store, StoreConfig
from cedana_shim.config import NodeConfig
from cedana_shim.hooks import HookReport, HookState, Stage
from cedana_shim.hooks.stub import StubHookRunner
from cedana_shim.lifecycle.checkpoint_manager import CheckpointManager
from cedana_shim.runtime.reaper import PR_SET_CHILD_SUBREAPER, Reaper, set_child_subreaper
from cedana_shim.runtime.runc import Runc
from cedana_shim.task.container import Container
from cedana_shim.task.events import TOPICS
from cedana_shim.task.options import RuntimeOptions
from cedana_shim.task.service import CEDANA_SERVICE_NAME, SERVICE_NAME, TaskService
from cedana_shim.ttrpc.server import CallContext
from fakes.fake_runc import FakeRunc, group_members
from google.protobuf.any_pb2 import Any as AnyProto
from google.protobuf.message import Message

T = TypeVar("T")
M = TypeVar("M", bound=Message)

SPEC_PROCESS_TYPE = "types.containerd.io/opencontainers/runtime-spec/1/Process"
NAMESPACE = "testns"
BODY_TIMEOUT = 10.0  # a test body that hangs fails instead
POLL = 0.005

# Container programs. Python ones run with -S: a fast start, stdlib only.
PYTHON = [sys.executable, "-S", "-c"]
# Reads the counter in its "memory" (the fake's memory file), stores it plus one,
# then sleeps: a restore from a checkpoint taken at N leaves N+1.
COUNTER = [
    *PYTHON,
    "import os, time\n"
    "path = os.environ['FAKE_RUNC_MEMORY']\n"
    "try:\n"
    "    n = int(open(path).read())\n"
    "except (OSError, ValueError):\n"
    "    n = 0\n"
    "open(path + '.tmp', 'w').write(str(n + 1))\n"
    "os.rename(path + '.tmp', path)\n"
    "time.sleep(60)\n",
]


def trap_term(exit_status: int, ready_file: str) -> list[str]:
    """A program that exits ``exit_status`` on SIGTERM; ``ready_file`` once it traps it."""
    return [
        *PYTHON,
        "import os, signal, time\n"
        f"signal.signal(signal.SIGTERM, lambda *_: os._exit({exit_status}))\n"
        f"open({ready_file!r}, 'w').close()\n"
        "while True:\n"
        "    time.sleep(60)\n",
    ]


SLEEP = ["sleep", "60"]


class EventLog:
    """The service's event sender: every event, in order, and probes run at send time."""

    def __init__(self) -> None:
        self.events: list[Message] = []
        self._probes: list[Callable[[Message], None]] = []

    def send(self, event: Message) -> None:
        for probe in self._probes:
            probe(event)
        self.events.append(event)

    def probe(self, fn: Callable[[Message], None]) -> None:
        """Call ``fn`` with each event as it is sent, before it is recorded."""
        self._probes.append(fn)

    def of(self, kind: type[M]) -> list[M]:
        return [e for e in self.events if isinstance(e, kind)]

    def topics(self) -> list[str]:
        return [TOPICS[type(e)] for e in self.events]


class ProbedHooks(StubHookRunner):
    """The stub hook runner, plus probes called at each stage and a veto of
    chosen checkpoints at prerestore (the next candidate is then tried)."""

    def __init__(self) -> None:
        super().__init__()
        self.probes: list[Callable[[Stage, HookState], None]] = []
        self.vetoed: set[str] = set()  # checkpoint ids whose prerestore hook fails

    async def run(self, stage: Stage, state: HookState) -> HookReport:
        for probe in self.probes:
            probe(stage, state)
        veto = stage is Stage.PRERESTORE and state.checkpoint_id in self.vetoed
        if not veto:
            return await super().run(stage, state)
        self.fail(stage, f"checkpoint {state.checkpoint_id} vetoed by the test")
        try:
            return await super().run(stage, state)
        finally:
            del self.failing[stage]


class OnePipeline:
    """The pipeline source: the same pipeline for every node config path."""

    def __init__(self, pipeline: Pipeline) -> None:
        self.pipeline = pipeline

    def get(self, config_path: str) -> Pipeline:
        return self.pipeline


def ctx(method: str, service: str = SERVICE_NAME) -> CallContext:
    return CallContext(service=service, method=method)


class TaskEnv:
    """One test's shim: the service, its events, the fake runc and the store."""

    def __init__(self, world: TaskWorld, reaper: Reaper) -> None:
        self.world = world
        self.fake = world.fake
        self.reaper = reaper
        self.hooks = world.hooks
        self.events = EventLog()
        self.config = world.node_config
        self.store = world.store_type(
            StoreConfig(root=self.config.store_path, retain=self.config.retain)
        )
        self.pipeline = Pipeline(self.store, self.config, self.hooks, GpuSteps(self.config, reaper))
        # Not this machine's kernel: a test that wants dirty tracking says so.
        self.pipeline.tracking = DirtyTracking(self.config.dirty_tracking, available=False)
        self.checkpoints = CheckpointManager(self.events, OnePipeline(self.pipeline))
        self.service = TaskService(
            NAMESPACE,
            self.events,
            reaper,
            checkpoints=self.checkpoints,
            runc_factory=self._runc,
            oom=None,
        )

    def reconfigure(self, **changes: Any) -> None:
        """A node config that changed (a daemon builds its pipeline again for it)."""
        config = replace(self.pipeline.config, **changes)
        self.pipeline.config = self.pipeline.delivery.config = config

    def _runc(self, options: RuntimeOptions, namespace: str, bundle: str) -> Runc:
        return Runc(
            reaper=self.reaper,
            root=self.fake.root,
            log_path=os.path.join(bundle, "log.json"),
            binary=self.fake.binary,
            criu=self.fake.criu if self.config.lazy_restore else None,
        )

    # -- bundles -----------------------------------------------------------------

    def bundle(
        self,
        container_id: str,
        args: Sequence[str],
        *,
        env: Sequence[str] = (),
        label: str | None = None,
        pid_namespace: bool = True,
    ) -> str:
        """A bundle whose config.json runs ``args``; ``label`` opts it in (auto).
        Without ``pid_namespace`` the container shares the host's (the shim then
        kills what the init leaves behind)."""
        path = self.world.tmp / "bundles" / container_id
        path.mkdir(parents=True, exist_ok=True)
        process_env = [f"PATH={os.environ.get('PATH', '/usr/bin:/bin')}", *env]
        if label is not None:
            process_env.append(f"CEDANA_CHECKPOINT={label}")
        namespaces = [{"type": "pid"}, {"type": "mount"}] if pid_namespace else [{"type": "mount"}]
        spec = {
            "ociVersion": "1.0.2",
            "process": {"args": list(args), "env": process_env, "cwd": str(path)},
            "root": {"path": "rootfs"},
            "annotations": {},
            "linux": {"namespaces": namespaces},
        }
        (path / "config.json").write_text(json.dumps(spec))
        return str(path)

    # -- the Task API, through its handlers ----------------------------------------

    async def create(
        self,
        container_id: str,
        args: Sequence[str] = SLEEP,
        *,
        env: Sequence[str] = (),
        label: str | None = None,
        stdout: str = "",
        pid_namespace: bool = True,
    ) -> int:
        bundle = self.bundle(container_id, args, env=env, label=label, pid_namespace=pid_namespace)
        req = pb.CreateTaskRequest(id=container_id, bundle=bundle, stdout=stdout, stderr=stdout)
        resp = await self.service.create(req, ctx("Create"))
        return int(resp.pid)

    async def start(self, container_id: str, exec_id: str = "") -> int:
        resp = await self.service.start(
            pb.StartRequest(id=container_id, exec_id=exec_id), ctx("Start")
        )
        return int(resp.pid)

    async def run(self, container_id: str, args: Sequence[str] = SLEEP, **kwargs: Any) -> int:
        """Create and start; the init's pid."""
        await self.create(container_id, args, **kwargs)
        return await self.start(container_id)

    async def pause(self, container_id: str) -> None:
        await self.service.pause(pb.PauseRequest(id=container_id), ctx("Pause"))

    async def resume(self, container_id: str) -> None:
        await self.service.resume(pb.ResumeRequest(id=container_id), ctx("Resume"))

    async def exec(
        self, container_id: str, exec_id: str, args: Sequence[str], *, stdout: str = ""
    ) -> None:
        process = {"args": list(args), "env": [f"PATH={os.environ.get('PATH', '')}"], "cwd": "/"}
        spec = AnyProto(type_url=SPEC_PROCESS_TYPE, value=json.dumps(process).encode())
        req = pb.ExecProcessRequest(
            id=container_id, exec_id=exec_id, spec=spec, stdout=stdout, stderr=stdout
        )
        await self.service.exec(req, ctx("Exec"))

    async def kill(
        self, container_id: str, sig: int, *, exec_id: str = "", all: bool = False
    ) -> None:
        req = pb.KillRequest(id=container_id, exec_id=exec_id, signal=sig, all=all)
        await self.service.kill(req, ctx("Kill"))

    async def wait(self, container_id: str, exec_id: str = "") -> pb.WaitResponse:
        req = pb.WaitRequest(id=container_id, exec_id=exec_id)
        return await asyncio.wait_for(self.service.wait(req, ctx("Wait")), 5.0)

    async def state(self, container_id: str, exec_id: str = "") -> pb.StateResponse:
        return await self.service.state(
            pb.StateRequest(id=container_id, exec_id=exec_id), ctx("State")
        )

    async def delete(self, container_id: str, exec_id: str = "") -> pb.DeleteResponse:
        return await self.service.delete(
            pb.DeleteRequest(id=container_id, exec_id=exec_id), ctx("Delete")
        )

    async def cedana_checkpoint(
        self, container_id: str, *, leave_running: bool
    ) -> cedana_pb.CheckpointResponse:
        req = cedana_pb.CheckpointRequest(container_id=container_id, leave_running=leave_running)
        return await self.service.cedana_checkpoint(req, ctx("Checkpoint", CEDANA_SERVICE_NAME))

    def container(self, container_id: str) -> Container:
        return self.service.container(container_id)

    # -- waiting -------------------------------------------------------------------

    async def until(self, done: Callable[[], object], what: str, timeout: float = 5.0) -> None:
        deadline = time.monotonic() + timeout
        while not done():
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout:g}s waiting for {what}")
            await asyncio.sleep(POLL)

    async def file_exists(self, path: str) -> None:
        await self.until(lambda: os.path.exists(path), f"{path} to exist")

    async def fake_called(self, verb: str) -> None:
        """Until the fake runc has been called for ``verb``."""
        await self.until(lambda: self.fake.calls(verb), f"runc {verb}")

    async def event(self, kind: type[M]) -> list[M]:
        """Until an event of ``kind`` was sent; all of them."""
        await self.until(lambda: self.events.of(kind), kind.__name__)
        return self.events.of(kind)

    async def exit_event(self, container_id: str, exec_id: str = "") -> ev.TaskExit:
        wanted = exec_id or container_id

        def found() -> list[ev.TaskExit]:
            return [e for e in self.events.of(ev.TaskExit) if e.container_id == container_id
                    and e.id == wanted]  # fmt: skip

        await self.until(found, f"TaskExit of {wanted}")
        return found()[0]

    def checkpoints_of(self, label: str) -> list[str]:
        """Ids of the label's published checkpoints, newest first."""
        return [e.id for e in self.store.catalog.list(scope=NAMESPACE, label=label)]


async def _cancel_the_rest() -> None:
    """Cancel what the body left running (periodic loops); it must end."""
    rest = asyncio.all_tasks() - {asyncio.current_task()}
    for task in rest:
        task.cancel()
    if rest:
        _, pending = await asyncio.wait(rest, timeout=5.0)
        assert not pending, f"tasks that ignore cancellation: {pending}"


class TaskWorld:
    """What outlives one event loop: tmp dirs, the fake runc, hooks, the store's config."""

    def __init__(self, tmp: Path) -> None:
        self.tmp = tmp
        self.fake = FakeRunc.install(str(tmp / "fake-runc"))
        self.hooks = ProbedHooks()
        self.store_type: Callable[[StoreConfig], Store] = Store
        self.node_config = NodeConfig(
            store_path=str(tmp / "store"),
            hooks_dirs="",
            checkpoint_timeout=10.0,
            restore_timeout=10.0,
            label_wait_timeout=5.0,
            log_file=str(tmp / "shim.log"),
        )

    def run(self, body: Callable[[TaskEnv], Awaitable[T]], timeout: float = BODY_TIMEOUT) -> T:
        """Run ``body`` in a fresh loop; a task that died of an exception nobody
        retrieved (a bug in the code under test) fails the test too."""
        unhandled: list[dict[str, Any]] = []

        async def main() -> T:
            asyncio.get_running_loop().set_exception_handler(lambda _, c: unhandled.append(c))
            reaper = Reaper()
            reaper.install()
            env = TaskEnv(self, reaper)
            try:
                return await asyncio.wait_for(body(env), timeout)
            finally:
                for container in list(env.service.containers.values()):
                    if container.cr is not None:  # a stop's last runc kill may be running
                        await asyncio.wait_for(container.cr.wait_stop(), timeout)
                await env.checkpoints.drain(timeout)
                await _cancel_the_rest()  # while the reaper still reaps their runc calls
                for container in env.service.containers.values():
                    container.io.close()
                reaper.close()

        with self._subreaper():
            result = asyncio.run(main())
        gc.collect()  # a task's unretrieved exception is reported when it is freed
        assert not unhandled, "unhandled in the event loop: " + "; ".join(
            f"{c.get('message')}: {c.get('exception')!r}" for c in unhandled
        )
        return result

    @contextlib.contextmanager
    def _subreaper(self) -> Iterator[None]:
        set_child_subreaper()
        try:
            yield
        finally:
            self.kill_leftovers()
            libc = ctypes.CDLL(None, use_errno=True)
            libc.prctl(PR_SET_CHILD_SUBREAPER, 0, 0, 0, 0)

    def kill_leftovers(self) -> None:
        """SIGKILL every process group the fake started; reap what was reparented here."""
        groups = self.fake.process_groups()
        for pgid in groups:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(pgid, signal.SIGKILL)
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline:
            try:
                pid, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0 and not group_members(groups):
                return
            if pid == 0:
                time.sleep(POLL)
