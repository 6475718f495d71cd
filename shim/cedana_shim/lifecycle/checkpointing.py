"""One container's checkpoints: on stop, periodic, on demand, and the Task API's.

:class:`Checkpointing` drives the container's init process through the state table
(the daemon-wide part, :class:`~.checkpoint_manager.CheckpointManager`, builds it):

* a leave-running checkpoint (periodic, ``cedana checkpoint --leave-running``,
  the Task API) is RUNNING -> CHECKPOINTING -> RUNNING around the dump, and is
  durable (published) when it returns;
* a stop (SIGTERM/SIGINT for a container with a label) is RUNNING -> STOPPING:
  freeze, dump, publish, and only then kill, so the exit (128+signal) is reported
  after the checkpoint is durable. If it cannot be made durable the container is
  thawed, goes back to RUNNING and gets the signal, as it would without us.

The process's one lock guards its state: every change of state here is made under it,
and it is released for the dump and the publish. Checkpoints of one container run
one at a time (their turn, dump through publish); a SIGKILL abandons the one in progress
(nothing of it becomes visible). What follows durability (compaction, the push, the
wait for it before a stop's exit) belongs to the pipeline's
:class:`~cedana_shim.checkpoint.delivery.Delivery`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import AsyncIterator, Callable, Iterator
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any

from ..api.cedana.v1 import cedana_pb2 as cedana_ev
from ..api.containerd.events import task_pb2 as task_ev
from ..bundle_state import clear_stopping, mark_stopping
from ..checkpoint import op_records, oplog
from ..checkpoint.pipeline import Dump, DumpRequest, Pipeline, Target
from ..checkpoint.policy import Mode, Policy
from ..checkpoint.push_before_exit import wants_push_before_exit
from ..checkpoint.store import Entry
from ..config import NodeConfig
from ..errors import Aborted, DeadlineExceeded, FailedPrecondition, NotFound, ShimError
from .process import LIVE, Process, State

if TYPE_CHECKING:
    from .checkpoint_manager import CheckpointManager
    from .image_digest import ImageDigestLookup

log = logging.getLogger(__name__)

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
TargetFn = Callable[[], Target]


@dataclass(eq=False)
class Checkpointing:
    container_id: str
    policy: Policy
    pipeline: Pipeline
    manager: CheckpointManager
    # A checkpoint's turn, dump through publish: the next one waits for it (on the
    # process lock's condition; the process lock is the one lock of its states).
    _turns: asyncio.Condition | None = None
    _busy: bool = False
    _dumping: asyncio.Task[Dump] | None = None  # for a SIGKILL to abandon
    _stop: asyncio.Task[Any] | None = None
    _periodic: asyncio.Task[None] | None = None
    _after_commit: asyncio.Task[None] | None = None  # compaction, then the push
    _hurry: asyncio.Event = field(default_factory=asyncio.Event)  # SIGKILL after durable
    _warm_up: asyncio.Task[None] | None = None
    _pod_uid: str = ""  # from the spec's CRI annotations, when the CRI made the container
    # With a registry: the image's digest, recorded in each checkpoint (see image_digest).
    image: ImageDigestLookup | None = None

    @property
    def config(self) -> NodeConfig:
        return self.pipeline.config

    # -- leave-running checkpoints ----------------------------------------------

    async def checkpoint(self, init: Process, target: TargetFn, request: DumpRequest) -> Entry:
        """Dump and publish while the container keeps running (frozen for the dump; a
        paused one as it is, and it stays paused); durable on return."""
        async with self._turn(init):
            async with init.lock:
                init.commit("checkpoint")
                # A paused container is dumped as it is, and stays paused.
                request = replace(request, freeze=init.state is State.CHECKPOINTING)
            with self.manager.writing_label(self.policy):
                try:
                    dump = await self._dump(target(), request)
                finally:
                    async with init.lock:
                        if init.state in (State.CHECKPOINTING, State.CHECKPOINTING_PAUSED):
                            init.commit("checkpointed")
                return await self._publish(dump, request.reason)

    async def task_api_checkpoint(
        self, init: Process, target: TargetFn, *, exit: bool, mirror_to: str
    ) -> Entry:
        """``ctr task checkpoint``: into the store, and the images for containerd.

        With ``exit`` the container is killed once the checkpoint is durable, as
        runc's own checkpoint-and-exit would have killed it.
        """
        # containerd's client pauses the task for this itself; a running one is
        # frozen by us so that its memory and files are saved at the same instant.
        entry = await self.checkpoint(init, target, DumpRequest("task-api", mirror_to=mirror_to))
        if exit:
            with contextlib.suppress(NotFound):
                await target().runc.kill(self.container_id, signal.SIGKILL, all=True)
        return entry

    @contextlib.asynccontextmanager
    async def _turn(self, init: Process) -> AsyncIterator[None]:
        """One checkpoint of the container at a time, from its dump through its publish
        (the next dump's parent is the last one published). The process lock is held
        only to wait for the turn and, by the caller, for each change of state: never
        across the dump, so a Pause, a Kill or an exit is never kept waiting by one."""
        if self._turns is None:
            self._turns = asyncio.Condition(init.lock)
        turns = self._turns
        async with turns:
            await turns.wait_for(lambda: not self._busy)
            self._busy = True
        try:
            yield
        finally:
            async with turns:
                self._busy = False
                turns.notify_all()

    # -- checkpoint on stop ---------------------------------------------------------

    def request_stop(self, init: Process, target: TargetFn, sig: int) -> bool:
        """Turn a stop signal into checkpoint-then-kill; False: deliver it as usual."""
        if self.policy.mode is not Mode.AUTO or sig not in STOP_SIGNALS:
            return False
        if self._stop is not None and not self._stop.done():
            return True  # already stopping for an earlier signal
        if init.state not in (State.RUNNING, State.CHECKPOINTING):
            return False

        async def run() -> None:
            with contextlib.suppress(ShimError, OSError):  # logged; the signal was delivered
                await self.stop(init, target, sig, reason="stop")

        self._stop = asyncio.get_running_loop().create_task(run())
        return True

    async def stop(
        self,
        init: Process,
        target: TargetFn,
        sig: int,
        *,
        reason: str,
        signal_on_failure: bool = True,
    ) -> Entry:
        """Freeze, dump, publish, then kill; the exit reads 128+``sig``.

        On any failure before the checkpoint is durable the container is thawed
        and (``signal_on_failure``) gets ``sig``; the error is raised either way.
        """
        async with self._turn(init):
            async with init.lock:
                if init.state is not State.RUNNING:
                    if signal_on_failure and init.state in LIVE:
                        with contextlib.suppress(NotFound):  # paused meanwhile: as without us
                            await target().runc.kill(self.container_id, sig)
                    raise FailedPrecondition(
                        f"cannot checkpoint-and-stop container {self.container_id}: it is "
                        f"{init.state.value}"
                    )
                init.begin_stop(sig)
            current = target()
            dump: Dump | None = None
            with self.manager.writing_label(self.policy), _stopping_marked(current.bundle, sig):
                try:
                    dump = await self._dump(current, DumpRequest(reason, keep_frozen=True))
                    entry = await self._publish(dump, reason)
                except BaseException as err:
                    await asyncio.shield(self._undo_stop(init, current, dump))
                    killed = isinstance(err, (asyncio.CancelledError, Aborted))
                    if signal_on_failure and not killed:
                        log.warning(
                            "checkpoint on stop failed; stopping without it",
                            extra={"container": self.container_id, "error": str(err)},
                        )
                        with contextlib.suppress(NotFound):
                            await current.runc.kill(self.container_id, sig)
                    raise
            async with init.lock:
                if init.stop is None:  # no longer STOPPING: it died meanwhile (OOM, a kill
                    return entry  # from outside), nothing left to stop
                init.stop_durable()
        if self._push_before_exit():
            await self.pipeline.delivery.wait_pushed(
                entry, self._after_commit, self._hurry, self.container_id
            )
        if self.config.tcp_established and dump.tcp_streams:
            await self._silence_connections(current)
        with contextlib.suppress(NotFound):
            await current.runc.kill(self.container_id, signal.SIGKILL, all=True)
        return entry

    def _push_before_exit(self) -> bool:
        """Whether a stop waits for the push: ``registry_sync = before-exit``, or a
        namespace policy's ``beforeEviction`` for this label (the node agent's file,
        checkpoint/push_before_exit.py)."""
        if not self.config.registry:
            return False
        return self.config.registry_sync == "before-exit" or wants_push_before_exit(
            self.pipeline.store.root, self.policy.scope, self.policy.label
        )

    async def _silence_connections(self, current: Target) -> None:
        """The kill must not close the checkpointed TCP connections for their peers
        (see runtime.tcp_repair); a failure is logged, the kill goes on."""
        from ..runtime.tcp_repair import silence_connections

        try:
            pids = await current.runc.ps(self.container_id)
            count = await asyncio.to_thread(silence_connections, pids)
        except (ShimError, OSError) as err:
            log.warning(
                "cannot keep the checkpointed TCP connections open for their peers; "
                "the kill closes them",
                extra={"container": self.container_id, "error": str(err)},
            )
            return
        if count:
            log.info(
                "TCP connections left open for their peers until the restore",
                extra={"container": self.container_id, "connections": count},
            )

    async def _undo_stop(self, init: Process, current: Target, dump: Dump | None) -> None:
        """Not durable: the processes come back as they were (a failed dump has
        thawed them itself; a failed publish leaves that to us)."""
        if dump is not None:
            try:
                await self.pipeline.thaw(current, dump)
            except (ShimError, OSError) as thaw_err:
                log.error(
                    "cannot thaw the container after a failed checkpoint on stop",
                    extra={"container": self.container_id, "error": str(thaw_err)},
                )
        async with init.lock:
            if init.state is State.STOPPING:
                init.commit("stop-failed")

    async def abort(self, init: Process) -> None:
        """A SIGKILL arrived: give up a dump in progress; nothing of it becomes visible."""
        if init.stop is not None and init.stop.durable:
            self._hurry.set()  # no more waiting for the push: the kill goes first
            return  # the checkpoint is safe; the processes are being killed anyway
        task = self._dumping
        if task is not None and not task.done():
            task.cancel()
            await asyncio.wait([task])
        if self._stop is not None and not self._stop.done():
            await asyncio.wait([self._stop])  # its states rolled back, its freeze undone

    async def wait_thawed(self) -> None:
        """Until a dump in progress has let the container run again."""
        task = self._dumping
        if task is not None and not task.done():
            await asyncio.wait([task])

    async def wait_stop(self) -> None:
        """Delete must not unmount the rootfs while the diff is being captured."""
        if self._stop is not None:
            await asyncio.wait([self._stop])

    # -- once the container runs --------------------------------------------------

    def started(self, init: Process, target: TargetFn) -> None:
        """The container runs: its periodic checkpoints begin, and what every dump of
        it needs but that does not change is gathered now, off the stop's path."""
        self.start_periodic(init, target)
        if self._warm_up is None:
            self._warm_up = asyncio.get_running_loop().create_task(
                self.pipeline.warm_up(target().runc)
            )

    # -- periodic ---------------------------------------------------------------

    def start_periodic(self, init: Process, target: TargetFn) -> None:
        interval = self.policy.interval
        if interval is None or self._periodic is not None:
            return

        async def loop() -> None:
            while init.state not in (State.STOPPED, State.DELETED):
                await asyncio.sleep(interval)
                if init.state is not State.RUNNING:
                    continue
                with contextlib.suppress(ShimError, OSError):
                    await self.checkpoint(init, target, DumpRequest("periodic"))

        self._periodic = asyncio.get_running_loop().create_task(loop())

    def stop_periodic(self) -> None:
        if self._periodic is not None:
            self._periodic.cancel()
            self._periodic = None
        if self._warm_up is not None:
            self._warm_up.cancel()
        if self.image is not None:
            self.image.cancel()

    # -- the steps every checkpoint shares -----------------------------------------

    async def _dump(self, target: Target, request: DumpRequest) -> Dump:
        clock = oplog.PhaseClock()
        self._pod_uid = op_records.pod_uid(target.spec)
        image = self.image.for_dump() if self.image is not None else None
        self._dumping = asyncio.get_running_loop().create_task(self.pipeline.dump(target, request))
        try:
            try:
                async with asyncio.timeout(self.config.checkpoint_timeout):
                    dump = await self._dumping
                    # The operation began before the store staged the dump.
                    dump.clock.started = clock.started
                    if image and self.image and (digest := await self.image.settled(image)):
                        dump.ingest.set_metadata(imageDigest=digest)
                    return dump
            except TimeoutError:
                raise DeadlineExceeded(
                    f"checkpoint of container {self.container_id} took longer than "
                    f"checkpoint_timeout ({self.config.checkpoint_timeout:g}s) and was "
                    "abandoned; the container was thawed. Raise checkpoint_timeout in "
                    "the node config for larger containers"
                ) from None
            except asyncio.CancelledError:
                task = asyncio.current_task()
                if task is not None and task.cancelling():
                    raise  # our caller was cancelled, not the dump
                raise Aborted(
                    f"checkpoint of container {self.container_id} abandoned: the "
                    "container was killed while it was being dumped"
                ) from None
        except BaseException as err:
            if image is not None:
                image.cancel()
            self._failed(request.reason, err, clock)
            raise
        finally:
            self._dumping = None

    async def _publish(self, dump: Dump, reason: str) -> Entry:
        try:
            with dump.clock.phase("commit"):
                entry = await self.pipeline.publish(dump)
        except BaseException as err:
            self._failed(reason, err, dump.clock)
            raise
        total, phases = dump.clock.finish()
        log.info(
            "checkpoint committed",
            extra={
                "container": self.container_id,
                "checkpoint": entry.id,
                "reason": reason,
                "label": self.policy.label,
                "scope": self.policy.scope,
                "size": entry.size,
                "seconds": total,
                "phases": phases,
                "criu": dump.criu,
            },
        )
        await asyncio.to_thread(
            self._record, "committed", reason, total, phases, checkpoint_id=entry.id,
            size=entry.size,
        )  # fmt: skip
        self.manager.publish(
            cedana_ev.CheckpointCommitted(
                container_id=self.container_id,
                checkpoint_id=entry.id,
                scope=self.policy.scope,
                label=self.policy.label,
                reason=reason,
                size=entry.size,
            )
        )
        # containerd's own topic, as its runc shim publishes after a checkpoint.
        self.manager.publish(
            task_ev.TaskCheckpointed(container_id=self.container_id, checkpoint=entry.id)
        )
        # A stop that reports its exit after the push waits for this compaction too.
        urgent = reason == "stop" and self._push_before_exit()
        self._after_commit = await self.pipeline.delivery.committed(entry, urgent=urgent)
        return entry

    def _record(
        self,
        outcome: str,
        trigger: str,
        total: float,
        phases: dict[str, float],
        *,
        checkpoint_id: str = "",
        size: int = 0,
        detail: str = "",
    ) -> None:
        """The operation's record for the node agent (Events, metrics)."""
        record = op_records.checkpoint_record(
            self.container_id, self.policy, pod_uid=self._pod_uid, outcome=outcome,
            trigger=trigger, total=total, phases=phases, versions=self.pipeline.versions.values,
            checkpoint_id=checkpoint_id, size=size, detail=detail,
        )  # fmt: skip
        oplog.write(self.pipeline.store.root, record)

    def _failed(self, reason: str, err: BaseException, clock: oplog.PhaseClock) -> None:
        what = "cancelled" if isinstance(err, asyncio.CancelledError) else str(err)
        total, phases = clock.finish()
        log.error(
            "checkpoint failed",
            extra={
                "container": self.container_id,
                "reason": reason,
                "error": what,
                "label": self.policy.label,
                "seconds": total,
                "phases": phases,
            },
        )
        # Written here, synchronously: a failure may be the last thing this shim does.
        self._record("failed", reason, total, phases, detail=what)
        self.manager.publish(
            cedana_ev.CheckpointFailed(
                container_id=self.container_id,
                scope=self.policy.scope,
                label=self.policy.label,
                reason=reason,
                error=what,
            )
        )


@contextlib.contextmanager
def _stopping_marked(bundle: str, sig: int) -> Iterator[None]:
    """While a stop is frozen for its checkpoint, the bundle says so: a ``delete``
    after the daemon died then delivers the signal (cli/delete.py)."""
    try:
        mark_stopping(bundle, sig)
    except OSError as err:
        log.warning("cannot mark the stop in the bundle", extra={"error": str(err)})
    try:
        yield
    finally:
        clear_stopping(bundle)


def require_enabled(cr: Checkpointing | None, container_id: str) -> Checkpointing:
    if cr is None:
        raise FailedPrecondition(
            f"container {container_id} has not opted in to checkpoints: set "
            "CEDANA_ENABLE=1 or CEDANA_CHECKPOINT=<label> in its environment"
        )
    return cr


__all__ = ["STOP_SIGNALS", "Checkpointing", "require_enabled"]
