"""The checkpoint pipeline: dump a container into the store.

Three steps, so that nothing a stop waits for is slower than it must be:

* :meth:`Pipeline.dump` freezes the container, runs CRIU (through runc, always
  leave-running) straight into a staging area on the store's filesystem and
  captures the rootfs diff and the pod's /dev/shm while it is frozen. A
  periodic or on-demand dump thaws it again; a stop keeps it frozen
  (``keep_frozen``) for the caller, who kills it once the checkpoint is durable
  or thaws it (:meth:`Pipeline.thaw`) and delivers the signal if it cannot be.
* :meth:`Pipeline.publish` makes the checkpoint durable and visible: the raw
  files fsynced and checksummed where CRIU wrote them, no compression.
* :meth:`Pipeline.compact` compresses it later, in the background, niced.

Anything that fails or is cancelled before publish leaves nothing a restore
could pick.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import platform
import shutil
import sys
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from typing import Any

from ..config import NodeConfig
from ..errors import DataLoss, ResourceExhausted, ShimError
from ..hooks import HookRunner, HookState, Stage
from ..runtime.criu_stats import dump_stats
from ..runtime.mount import Mount
from ..runtime.runc import CheckpointOpts, Runc
from ..runtime.tcp_repair import tcp_summary
from . import cpu_fit, criu_config, preflight
from .delivery import Delivery
from .dirty_tracking import DirtyTracking
from .gpu_steps import GpuDump, GpuStepRunner
from .layers import (
    CRIU_LAYER,
    MEDIA_TYPES,
    ROOTFS_LAYER,
    SHM_LAYER,
    mount_destinations,
    shm_source,
    spec_mounts,
)
from .netinfo import network_facts, preload_network_facts
from .oplog import PhaseClock, criu_logs_path
from .policy import Policy
from .rootfs_diff import capture, capture_dir, upperdir_of
from .store import Entry, Ingest, Store, priority
from .tool_versions import Versions

log = logging.getLogger(__name__)

METADATA_VERSION = 1
STORE_FULL_BYTES = 16 << 20
WARM_UP_DELAY = 1.0  # seconds after the container started


@dataclass(frozen=True, slots=True)
class Target:
    """What the pipeline needs to know about the container it checkpoints."""

    container_id: str
    bundle: str
    namespace: str  # containerd's
    policy: Policy
    spec: Mapping[str, Any]
    rootfs: tuple[Mount, ...]
    pid: int
    terminal: bool
    runc: Runc


@dataclass(frozen=True, slots=True)
class DumpRequest:
    """One checkpoint: why, and what becomes of the container around the dump."""

    reason: str  # stop | periodic | manual | task-api
    # Pause the container for the dump and the file capture, so memory and files are
    # saved at the same instant (containerd's own checkpoint client pauses it itself).
    freeze: bool = True
    # Leave it frozen afterwards: a stop kills it once the checkpoint is durable.
    keep_frozen: bool = False
    # Also leave a copy of the CRIU images here (the Task API's checkpoint path, which
    # containerd archives itself).
    mirror_to: str = ""


@dataclass(eq=False)
class Dump:
    """A dump staged in the store, not yet durable."""

    ingest: Ingest
    frozen: bool = False  # the container is still paused by us (keep_frozen)
    gpu: GpuDump | None = None  # GPU state still in host memory (keep_frozen)
    # Seconds per phase (gpu, freeze, dump, rootfs), for the operation's log line,
    # record and metrics.
    clock: PhaseClock = field(default_factory=PhaseClock)
    # CRIU's own figures for its part (runtime.criu_stats), for the same log line.
    criu: dict[str, float | int] = field(default_factory=dict)
    # Established TCP connections CRIU saved (its tcp-stream images): only those
    # need keeping open for their peers across a stop's kill.
    tcp_streams: int = 0
    # (container id, init pid) of a dump that tracked dirty pages: once committed, it
    # is the parent of that container's next dump (dirty_tracking.py).
    tracked: tuple[str, int] | None = None


@dataclass(frozen=True, slots=True)
class _Parent:
    """The checkpoint a dump tracking dirty pages is taken against."""

    id: str
    relative: str  # its raw CRIU images, relative to the dump's images dir
    checked: asyncio.Future[None]  # their CRC-32s, checked beside the dump


class Pipeline:
    def __init__(
        self, store: Store, config: NodeConfig, hooks: HookRunner, gpu: GpuStepRunner
    ) -> None:
        self.store = store
        self.config = config
        self.hooks = hooks
        self.gpu = gpu
        self.versions = Versions()
        self.tracking = DirtyTracking(config.dirty_tracking)
        # What follows durability: compaction, the push, the before-exit wait.
        self.delivery = Delivery(store, config)

    async def warm_up(self, runc: Runc) -> None:
        """Pay now for what the first dump of this daemon would otherwise pay beside
        CRIU, on a busy node taking CPU from it: the tool versions (two processes) and
        pyroute2's import (~0.2 s of CPU here), after a pause so that a container's
        own start-up comes first. Never fails."""
        await asyncio.sleep(WARM_UP_DELAY)
        with contextlib.suppress(Exception):
            await self.versions.get(runc)
            await self.tracking.available(runc)
            await asyncio.to_thread(preload_network_facts)

    async def dump(self, target: Target, request: DumpRequest) -> Dump:
        """CRIU dump + rootfs diff into a staging area; the caller publishes or aborts."""
        started = time.monotonic()
        # What CRIU is known to refuse fails the checkpoint before the freeze or the hooks.
        await asyncio.to_thread(preflight.check, target.container_id, target.pid)
        # Network facts and tool versions are gathered while CRIU dumps, not before:
        # pyroute2's import and two `--version` runs would otherwise delay the stop.
        context = asyncio.get_running_loop().create_task(self._context(target))
        try:
            ingest = await asyncio.to_thread(
                self.store.writer.begin,
                scope=target.policy.scope,
                label=target.policy.label,
                metadata=self._metadata(target, request.reason),
            )
        except BaseException:
            await _settle(context)
            raise
        dump = Dump(ingest)
        criu_dir = ingest.dir(CRIU_LAYER)
        # CRIU's work dir (its log) off the store's disk: when the store fills up, the
        # log must still say so.
        work_dir = os.path.join(target.bundle, "work", f"criu-dump-{ingest.id}")
        state: HookState | None = None
        try:
            # An operator's precheckpoint hook may veto: the container keeps running.
            state = HookState(
                target.container_id, target.bundle, "running", target.pid, target.spec,
                ingest.id, criu_dir,
            )  # fmt: skip
            await self.hooks.run(Stage.PRECHECKPOINT, state)
            # GPU state into host memory first: a cgroup-frozen process cannot be locked.
            with dump.clock.phase("gpu"):
                dump.gpu = await self.gpu.before_dump(target.container_id, target.spec, target.runc)
            if dump.gpu is None:
                del dump.clock.phases["gpu"]  # no GPU: no phase (its instant goes to other)
            tracking = await self.tracking.available(target.runc)
            if tracking:
                dump.tracked = (target.container_id, target.pid)
                parent = self.tracking.take_parent(target.container_id, target.pid)
            else:
                parent = None
            criu_config.write(
                target.bundle, criu_config.dump_options(self.config, track_mem=tracking)
            )
            if request.freeze:
                with dump.clock.phase("freeze"):
                    await target.runc.pause(target.container_id)
                dump.frozen = True
            found = await self._criu_dump(target, dump, criu_dir, work_dir, parent)
            dumped = time.monotonic()
            with dump.clock.phase("rootfs"):
                await asyncio.to_thread(self._capture_files, target, ingest)
            if not request.keep_frozen:
                await self.thaw(target, dump)
            if found is not None:
                await self._flatten(target, dump, criu_dir, work_dir, found)
            dump.criu = dump_stats(work_dir)
            dump.tcp_streams = _count_tcp_streams(criu_dir)
            ingest.set_metadata(**await context)
            cpuinfo = cpu_fit.record(criu_dir)
            if cpuinfo:  # another node checks its CPU against it before a pull
                ingest.set_metadata(**{cpu_fit.METADATA_KEY: cpuinfo})
            if dump.gpu is not None:
                ingest.set_metadata(gpu=dump.gpu.metadata)
            if request.mirror_to:
                await asyncio.to_thread(_mirror, criu_dir, request.mirror_to)
            status = "paused" if dump.frozen else "running"
            await self.hooks.run(Stage.POSTCHECKPOINT, replace(state, status=status, outcome="ok"))
            ingest.add_dir_layer(CRIU_LAYER, criu_dir, MEDIA_TYPES[CRIU_LAYER])
            ingest.keep_raw(CRIU_LAYER)
            ingest.set_metadata(
                timings={
                    "dump_s": round(dumped - started, 3),
                    "files_s": round(time.monotonic() - dumped, 3),
                    "criu": dump.criu,
                },
            )
            return dump
        except BaseException:
            await _settle(context)
            with contextlib.suppress(Exception):  # the dump failed: the processes live on
                await asyncio.shield(self.thaw(target, dump))
            if state is not None:  # a started pre stage always gets its post stage
                with contextlib.suppress(Exception):
                    await asyncio.shield(
                        self.hooks.run(Stage.POSTCHECKPOINT, replace(state, outcome="failed"))
                    )
            # Measured before the abort frees the staged images.
            error = sys.exc_info()[1]
            full = "" if isinstance(error, asyncio.CancelledError) else _store_full(self.store.root)
            await asyncio.shield(asyncio.to_thread(self.store.writer.abort, ingest))
            if full:
                raise ResourceExhausted(
                    f"checkpoint of container {target.container_id} failed: the checkpoint "
                    f"store {self.store.root} is full ({full}); free space there or point "
                    "store_path at a larger disk"
                ) from error
            raise
        finally:
            shutil.rmtree(work_dir, ignore_errors=True)

    async def _criu_dump(
        self, target: Target, dump: Dump, criu_dir: str, work_dir: str, parent: str | None
    ) -> _Parent | None:
        """``runc checkpoint`` into ``criu_dir``. With ``parent`` (a checkpoint id, dirty
        tracking) only the pages written since that checkpoint are dumped; the caller
        then copies the rest in (:meth:`_flatten`). A dump against the parent that
        fails is done again in full."""
        found = self._parent_images(parent, criu_dir) if parent else None
        if found is None:
            await self._run_criu(target, dump, criu_dir, work_dir, None)
            return None
        try:
            await self._run_criu(target, dump, criu_dir, work_dir, found.relative)
        except (ShimError, OSError) as err:
            await _settle(found.checked)
            await self._dump_in_full(target, dump, criu_dir, work_dir, found, err)
            return None
        return found

    async def _flatten(
        self, target: Target, dump: Dump, criu_dir: str, work_dir: str, found: _Parent
    ) -> None:
        """Copy the parent's pages into a dump against it (pagemap.flatten): every
        stored checkpoint stands alone. Runs after the thaw: the freeze is the dump of
        what changed. When it fails, a container still frozen (a stop) is dumped again
        in full; otherwise this checkpoint fails and the next one is full."""
        from . import pagemap  # only on nodes that track dirty pages

        try:
            await found.checked
            with dump.clock.phase("flatten"):
                flat = await asyncio.to_thread(pagemap.flatten, criu_dir)
        except (ShimError, OSError) as err:
            if not dump.frozen:
                raise DataLoss(
                    f"checkpoint of container {target.container_id}: its pages written "
                    f"since checkpoint {found.id} were dumped, but the rest could not be "
                    f"copied in from that checkpoint ({err}); the next checkpoint is a "
                    "full one"
                ) from err
            await self._dump_in_full(target, dump, criu_dir, work_dir, found, err)
            return
        log.info(
            "dumped the pages written since the parent checkpoint",
            extra={
                "container": target.container_id,
                "parent": found.id,
                "flatten": asdict(flat) if flat else None,
            },
        )

    async def _dump_in_full(
        self,
        target: Target,
        dump: Dump,
        criu_dir: str,
        work_dir: str,
        found: _Parent,
        err: BaseException,
    ) -> None:
        log.warning(
            "dump against the parent checkpoint failed, dumping in full",
            extra={"container": target.container_id, "parent": found.id, "error": str(err)},
        )
        await asyncio.to_thread(_empty_dir, criu_dir)
        await self._run_criu(target, dump, criu_dir, work_dir, None)

    def _parent_images(self, parent: str, criu_dir: str) -> _Parent | None:
        """Checkpoint ``parent``'s raw CRIU images, their CRC-32 check started now to
        run beside the dump; None when they are gone."""
        try:
            entry = self.store.catalog.get(parent)
            images = self.store.raw.raw_images(entry, CRIU_LAYER)
        except ShimError as err:
            images, why = None, str(err)
        else:
            why = "its raw images are gone"
        if images is None:
            log.info(
                "dumping in full: the parent checkpoint cannot be used",
                extra={"parent": parent, "why": why},
            )
            return None

        def check() -> None:
            try:
                self.store.raw.verify_raw(entry, CRIU_LAYER)
            except DataLoss:
                self.store.raw.discard_raw(entry)
                raise

        checked = asyncio.ensure_future(asyncio.to_thread(check))
        checked.add_done_callback(lambda f: f.cancelled() or f.exception())  # a cancelled dump
        # Relative: CRIU links it as the images dir's `parent`.
        return _Parent(parent, os.path.relpath(images, criu_dir), checked)

    async def _run_criu(
        self, target: Target, dump: Dump, criu_dir: str, work_dir: str, parent: str | None
    ) -> None:
        # The page images' fsync and CRC run beside the dump, not after it.
        early_seal = dump.ingest.seal_early(criu_dir)
        try:
            with dump.clock.phase("dump"), priority.foreground():
                await target.runc.checkpoint(
                    target.container_id,
                    CheckpointOpts(
                        image_path=criu_dir,
                        work_path=work_dir,
                        parent_path=parent,
                        leave_running=True,  # CRIU leaves a frozen container frozen
                        tcp_established=self.config.tcp_established,
                        ext_unix_sk=True,
                        file_locks=self.config.file_locks,
                        shell_job=target.terminal,
                    ),
                    keep_log_in=criu_logs_path(self.store.root),
                )
        finally:
            await asyncio.shield(asyncio.to_thread(early_seal.stop))

    async def thaw(self, target: Target, dump: Dump) -> None:
        """Undo a dump's freeze: the cgroup first, then the GPU (CUDA needs the
        process running to take its state back). Idempotent."""
        if dump.frozen:
            await target.runc.resume(target.container_id)
            dump.frozen = False
        if dump.gpu is not None and dump.gpu.frozen is not None:
            await self.gpu.after_dump(dump.gpu, thaw_processes=True)
            dump.gpu.frozen = None

    def _capture_files(self, target: Target, ingest: Ingest) -> None:
        upper = upperdir_of(target.rootfs)
        if upper is not None:
            path = os.path.join(ingest.path, "rootfs-diff.tar")
            stats = capture(upper, path, exclude=mount_destinations(target.spec))
            ingest.add_file_layer(ROOTFS_LAYER, path, MEDIA_TYPES[ROOTFS_LAYER])
            ingest.set_metadata(
                rootfs_diff={
                    "files": stats.files,
                    "deletions": stats.deletions,
                    "bytes": stats.bytes,
                }
            )
        else:
            log.warning(
                "rootfs is not an overlay: its changes are not saved",
                extra={"container": target.container_id},
            )
        shm = shm_source(target.spec)
        if shm is not None:
            path = os.path.join(ingest.path, "shm.tar")
            capture_dir(shm, path)
            ingest.add_file_layer(SHM_LAYER, path, MEDIA_TYPES[SHM_LAYER])

    async def publish(self, dump: Dump) -> Entry:
        """Make the dump durable and visible (raw, fsynced, checksummed)."""
        try:
            with priority.foreground():
                entry = await asyncio.shield(
                    asyncio.to_thread(self.store.writer.publish, dump.ingest)
                )
            if dump.tracked is not None:
                self.tracking.remember(*dump.tracked, entry.id)
            return entry
        except BaseException:
            with contextlib.suppress(Exception):
                await asyncio.shield(asyncio.to_thread(self.store.writer.abort, dump.ingest))
            raise

    def _metadata(self, target: Target, reason: str) -> dict[str, Any]:
        policy = target.policy
        return {
            "metadataVersion": METADATA_VERSION,
            "reason": reason,
            "namespace": policy.scope,
            "containerdNamespace": target.namespace,
            "containerId": target.container_id,
            "pod": policy.pod,
            "container": policy.container,
            "image": policy.image,
            "imageDigest": policy.image_digest,
            "node": platform.node(),
            "terminal": target.terminal,
            "mounts": [str(m.get("destination")) for m in spec_mounts(target.spec)],
        }

    async def _context(self, target: Target) -> dict[str, Any]:
        """The pod's network facts and the tool versions; never fails a checkpoint."""
        # Started before the dump: the thread pins the namespace (it opens
        # /proc/PID/ns/net first) before CRIU ends the process.
        facts = asyncio.ensure_future(
            asyncio.to_thread(network_facts, f"/proc/{target.pid}/ns/net")
        )
        # Read while the container is frozen for the dump: the connections CRIU saves.
        tcp = asyncio.ensure_future(asyncio.to_thread(tcp_summary, target.pid))
        versions = await self.versions.get(target.runc)
        try:
            network: Any = await facts
        except Exception as err:
            log.warning(
                "no network facts", extra={"container": target.container_id, "error": str(err)}
            )
            network = {}
        # Unreadable: the restore then takes every connection as leaving the container.
        with contextlib.suppress(OSError):
            network = {**network, "tcp": await tcp}
        return {"versions": versions, "network": network}


async def _settle(task: asyncio.Future[Any]) -> None:
    """Let a helper task finish (or fail) before its caller unwinds."""
    with contextlib.suppress(BaseException):
        await asyncio.shield(task)


def _store_full(root: str) -> str:
    """A description of how full the store's disk is, or "" if it is not."""
    try:
        usage = shutil.disk_usage(root)
    except OSError:
        return ""
    if usage.free < max(STORE_FULL_BYTES, usage.total // 100):
        return f"{usage.free} bytes free of {usage.total}"
    return ""


def _empty_dir(path: str) -> None:
    """Remove what a failed CRIU run left in its images dir (symlinks not followed)."""
    with os.scandir(path) as entries:
        for entry in entries:
            if entry.is_dir(follow_symlinks=False):
                shutil.rmtree(entry.path)
            else:
                os.unlink(entry.path)


def _mirror(src: str, dest: str) -> None:
    """Hard-link (or copy, across filesystems) the CRIU images into ``dest``."""
    os.makedirs(dest, exist_ok=True)
    for name in os.listdir(src):
        source, target = os.path.join(src, name), os.path.join(dest, name)
        try:
            os.link(source, target)
        except OSError:
            shutil.copy2(source, target)


def _count_tcp_streams(criu_dir: str) -> int:
    with os.scandir(criu_dir) as it:
        return sum(1 for e in it if e.name.startswith("tcp-stream-"))
