"""Checkpoint/restore for opted-in containers, on top of the plain runc shim.

:class:`CheckpointManager` is the daemon-wide part: node config, stores,
events, and the commits still running at shutdown. :class:`Checkpointing` is
one opted-in container's part: its policy, the restore candidates chosen at
Create, checkpoint-on-stop, periodic and on-demand checkpoints. Every path
goes through the same :class:`~cedana_shim.checkpoint.pipeline.Pipeline`.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from google.protobuf.message import Message

from ..api.cedana.v1 import cedana_pb2 as cedana_ev
from ..checkpoint.gpu_steps import GpuSteps
from ..checkpoint.pipeline import Pipeline, Target
from ..checkpoint.policy import Mode, Policy, parse_duration
from ..checkpoint.restore import Attempts, Planner, RestorePlan
from ..checkpoint.store import Entry, Store, StoreConfig
from ..config import NodeConfig, load_node_config
from ..errors import DataLoss, FailedPrecondition, ShimError
from ..hooks import HookState, ProcessHookRunner, Stage, reaper_spawn
from ..runtime.reaper import Reaper
from .events import EventSender

log = logging.getLogger(__name__)

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)


class CheckpointManager:
    def __init__(self, events: EventSender, reaper: Reaper) -> None:
        self.events = events
        self.reaper = reaper
        self._pipelines: dict[str, Pipeline] = {}
        self._commits: set[asyncio.Task[Any]] = set()

    def for_container(self, container_id: str, policy: Policy, config_path: str) -> Checkpointing:
        config = load_node_config(config_path or None)
        if policy.interval is None and config.checkpoint_interval:
            interval = parse_duration(config.checkpoint_interval, "node config checkpoint_interval")
            policy = replace(policy, interval=interval)
        pipeline = self._pipelines.get(config.store_path)
        if pipeline is None or pipeline.config != config:
            store = Store(
                StoreConfig(
                    root=config.store_path,
                    compression_level=config.compression_level,
                    threads=config.compression_threads,
                    retain=config.retain,
                    cache_raw=config.cache_raw,
                )
            )
            hooks = ProcessHookRunner(
                tuple(d for d in config.hooks_dirs.split(":") if d),
                spawn=reaper_spawn(self.reaper),
            )
            gpu = GpuSteps(config, self.reaper)
            pipeline = Pipeline(store, config, hooks, gpu)
            self._pipelines[config.store_path] = pipeline
        return Checkpointing(container_id, policy, pipeline, self)

    def publish(self, event: Message) -> None:
        self.events.send(event)

    def track(self, task: asyncio.Task[Any]) -> None:
        self._commits.add(task)
        task.add_done_callback(self._commits.discard)

    async def drain(self, timeout: float) -> None:
        """Let commits still compressing finish before the daemon exits."""
        if not self._commits:
            return
        log.info("waiting for checkpoint commits", extra={"pending": len(self._commits)})
        await asyncio.wait(set(self._commits), timeout=timeout)


@dataclass
class Checkpointing:
    container_id: str
    policy: Policy
    pipeline: Pipeline
    manager: CheckpointManager
    attempts: Attempts = field(default_factory=Attempts)
    remaining: list[Entry] = field(default_factory=list)
    plan: RestorePlan | None = None
    stop_signal: int | None = None  # set once a checkpoint-on-stop dumped successfully
    stop_task: asyncio.Task[None] | None = None
    periodic_task: asyncio.Task[None] | None = None
    dump_lock: asyncio.Lock = field(default_factory=asyncio.Lock)

    @property
    def config(self) -> NodeConfig:
        return self.pipeline.config

    @property
    def store(self) -> Store:
        return self.pipeline.store

    # -- restore -----------------------------------------------------------------

    async def first_plan(
        self, *, bundle: str, rootfs: str, spec: Any, network: Any, reset: Callable[[], None]
    ) -> RestorePlan | None:
        if self.policy.mode is not Mode.AUTO:
            return None
        self.remaining = await asyncio.to_thread(
            self.store.candidates, self.policy.scope, self.policy.label
        )
        return await self.next_plan(
            bundle=bundle, rootfs=rootfs, spec=spec, network=network, reset=reset
        )

    async def next_plan(
        self, *, bundle: str, rootfs: str, spec: Any, network: Any, reset: Callable[[], None]
    ) -> RestorePlan | None:
        planner = Planner(self.store, self.pipeline.gpu, self.container_id)
        self.plan, self.remaining = await asyncio.to_thread(
            planner.prepare,
            self.remaining,
            bundle=bundle,
            rootfs=rootfs,
            spec=spec,
            network=network,
            reset_rootfs=reset,
            attempts=self.attempts,
        )
        return self.plan

    def restore_hook_state(self, bundle: str, spec: Any, images: str) -> HookState:
        entry_id = self.plan.entry.id if self.plan is not None else ""
        return HookState(self.container_id, bundle, "creating", 0, spec, entry_id, images)

    async def run_hooks(self, stage: Stage, state: HookState) -> None:
        await self.pipeline.hooks.run(stage, state)

    def restore_failed(self, error: BaseException) -> None:
        if self.plan is None:
            return
        if self.plan.cached and isinstance(error, DataLoss):
            # Only the cached copy was bad (and is gone now): the verified blob of the
            # same checkpoint is tried next.
            self.attempts.add(self.plan.entry, f"cached images discarded: {error}")
            self.remaining.insert(0, self.plan.entry)
        else:
            self.attempts.add(self.plan.entry, f"restore failed: {error}")
        Planner.discard(self.plan)
        self.plan = None

    def report_restore(self, restored: bool) -> None:
        if self.policy.mode is not Mode.AUTO:
            return
        entry_id = self.plan.entry.id if restored and self.plan is not None else ""
        detail = str(self.attempts) if self.attempts.skipped or not restored else ""
        outcome = "restored" if restored else "cold"
        # A first start with no checkpoint yet is normal; anything skipped is not.
        log_fn = log.warning if self.attempts.skipped else log.info
        log_fn(
            "restored from checkpoint" if restored else "starting cold",
            extra={
                "container": self.container_id,
                "label": self.policy.label,
                "scope": self.policy.scope,
                "checkpoint": entry_id,
                "why": detail,
            },
        )
        self.manager.publish(
            cedana_ev.RestoreOutcome(
                container_id=self.container_id,
                scope=self.policy.scope,
                label=self.policy.label,
                checkpoint_id=entry_id,
                outcome=outcome,
                detail=detail,
            )
        )
        if self.plan is not None:
            Planner.discard(self.plan)

    # -- checkpoint --------------------------------------------------------------

    async def checkpoint(
        self,
        target: Target,
        *,
        reason: str,
        leave_running: bool,
        freeze: bool = True,
        mirror_to: str = "",
    ) -> Entry:
        """Dump and commit, waiting for both (on-demand and periodic checkpoints)."""
        async with self.dump_lock:
            if not leave_running:
                self.stop_signal = signal.SIGTERM  # the exit reads as a polite stop
            try:
                ingest = await self._dump(target, reason, leave_running, freeze, mirror_to)
            except BaseException:
                self.stop_signal = None
                raise
        return await self._commit(ingest, reason)

    async def _dump(
        self,
        target: Target,
        reason: str,
        leave_running: bool,
        freeze: bool = False,
        mirror_to: str = "",
    ) -> Any:
        try:
            async with asyncio.timeout(self.config.checkpoint_timeout):
                return await self.pipeline.dump(
                    target,
                    reason=reason,
                    leave_running=leave_running,
                    freeze=freeze,
                    mirror_to=mirror_to,
                )
        except BaseException as err:
            self._failed(reason, err)
            raise

    async def _commit(self, ingest: Any, reason: str) -> Entry:
        try:
            entry = await self.pipeline.commit(ingest)
        except BaseException as err:
            self._failed(reason, err)
            raise
        log.info(
            "checkpoint committed",
            extra={
                "container": self.container_id,
                "checkpoint": entry.id,
                "reason": reason,
                "label": self.policy.label,
                "scope": self.policy.scope,
                "size": entry.size,
            },
        )
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
        return entry

    def _failed(self, reason: str, err: BaseException) -> None:
        what = "cancelled" if isinstance(err, asyncio.CancelledError) else str(err)
        log.error(
            "checkpoint failed",
            extra={
                "container": self.container_id,
                "reason": reason,
                "error": what,
                "label": self.policy.label,
            },
        )
        self.manager.publish(
            cedana_ev.CheckpointFailed(
                container_id=self.container_id,
                scope=self.policy.scope,
                label=self.policy.label,
                reason=reason,
                error=what,
            )
        )

    # -- checkpoint on stop ----------------------------------------------------------

    def wants_stop_checkpoint(self, sig: int) -> bool:
        return self.policy.mode is Mode.AUTO and sig in STOP_SIGNALS

    def stopping(self) -> bool:
        return self.stop_task is not None and not self.stop_task.done()

    def begin_stop(self, target: Target, sig: int, fallback: Callable[[int], Any]) -> None:
        """Dump the container as it stops; if the dump fails, deliver ``sig`` after all.

        The container's processes exit when CRIU has written the images (no
        leave-running); the exit is reported as 128+``sig``. Compression and the
        commit continue in the background.
        """
        if self.stopping():
            return

        # Set before the dump: CRIU kills the processes the moment the images are
        # written, and their exit must already read as 128+sig.
        self.stop_signal = sig

        async def run() -> None:
            try:
                async with self.dump_lock:
                    ingest = await self._dump(target, "stop", leave_running=False)
            except asyncio.CancelledError:
                self.stop_signal = None
                raise
            except (ShimError, OSError) as err:
                self.stop_signal = None
                log.warning(
                    "checkpoint on stop failed; stopping without it",
                    extra={"container": self.container_id, "error": str(err)},
                )
                await fallback(sig)
                return
            commit = asyncio.get_running_loop().create_task(self._commit(ingest, "stop"))
            commit.add_done_callback(_log_unexpected)
            self.manager.track(commit)

        self.stop_task = asyncio.get_running_loop().create_task(run())
        self.stop_task.add_done_callback(_log_unexpected)

    async def abort_stop(self) -> None:
        """A SIGKILL arrived: give up the dump; nothing of it becomes visible."""
        task = self.stop_task
        if task is not None and not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, ShimError, OSError):
                await task

    async def wait_stop(self) -> None:
        """Delete must not unmount the rootfs while the diff is being captured."""
        if self.stop_task is not None:
            with contextlib.suppress(asyncio.CancelledError, ShimError, OSError):
                await asyncio.shield(self.stop_task)

    # -- periodic ---------------------------------------------------------------

    def start_periodic(self, target: Callable[[], Target | None]) -> None:
        interval = self.policy.interval
        if interval is None or self.periodic_task is not None:
            return

        async def loop() -> None:
            while True:
                await asyncio.sleep(interval)
                current = target()
                if current is None:
                    return
                with contextlib.suppress(ShimError, OSError):
                    await self.checkpoint(current, reason="periodic", leave_running=True)

        self.periodic_task = asyncio.get_running_loop().create_task(loop())

    def stop_periodic(self) -> None:
        if self.periodic_task is not None:
            self.periodic_task.cancel()
            self.periodic_task = None


def _log_unexpected(task: asyncio.Task[Any]) -> None:
    if not task.cancelled() and (exc := task.exception()) is not None:
        log.error("checkpoint task crashed", exc_info=exc)


def require_enabled(cr: Checkpointing | None, container_id: str) -> Checkpointing:
    if cr is None:
        raise FailedPrecondition(
            f"container {container_id} has not opted in to checkpoints: set "
            "CEDANA_ENABLE=1 or CEDANA_CHECKPOINT=<label> in its environment"
        )
    return cr
