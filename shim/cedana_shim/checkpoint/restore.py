"""Restoring a container from its label's checkpoints: the one owner of that decision.

:class:`RestoreSession` reads top to bottom, and every way out of it is here:

1. ``prepare`` (at Create): wait, bounded, for checkpoints of the label still being
   written on this node; list the label's checkpoints newest first (a store that
   cannot be read means a cold start, said loudly); take the first candidate that
   is undamaged, fits this node and its GPUs, verifies, and unpacks: CRIU images
   (the raw images when the store has them, else extracted from the verified
   blob), the rootfs diff and /dev/shm applied to the new container's rootfs.
2. ``run`` (at Start): prerestore hooks (a failing one vetoes the candidate), CRIU
   restore through the container (raw images are checked while CRIU reads them;
   a gate holds the restored tasks until the verdict; not those this session's pull
   has just written, every byte checked as it was written), the GPU state back,
   postrestore hooks. With ``lazy_restore`` CRIU leaves the memory to its lazy-pages
   daemon: the tasks run before their pages are in, so the gate waits only for the
   other images, and the pages (``pages-*.img``) are checked while the daemon serves
   them; the restore is done once both are through, and given up (the tasks killed)
   the moment either fails. A registry candidate is then not pulled first but served
   (lazy_remote.py): its small blobs and the pages CRIU reads itself at Create, the
   rest fetched from the registry as the tasks touch it, checked before it is served,
   and committed to the store once all is in; a failure of the registry or of a
   chunk's check before then gives the restore up the same way.
3. Any failure: record why, undo the attempt, put the rootfs back, prepare the
   next candidate. Raw images that fail their check are discarded and the same
   checkpoint is tried again from its blob when it has one; a lazy attempt that
   fails otherwise is tried again at once, eagerly (a served one: pulled whole, if
   the registry still has it). A checkpoint that fails itself
   (damaged, its verification, its pull's checks, its restore) gets a failure record
   in the store (store/failures.py): later starts try it after every other candidate
   and retention never keeps it in place of a good one; one this session pulled from
   the registry is removed from the store again (the record keeps its tag last).
4. No candidate left: a cold start.

A restore by hand (``CEDANA_RESTORE``, see policy.py) has one candidate: the
checkpoint of the scope it names (here or in the registry), checked like any other
and also against the container's image. When it cannot be restored the Create (or
the Start, when CRIU fails) fails with an error naming it and why, unless the
policy's fallback is ``cold``. A successful restore is recorded in the store
(``restores/<id>.jsonl``) for `cedana checkpoints inspect`.

Each skipped candidate and the reason is recorded in the :class:`RestoreReport`
that the task layer logs and publishes (``/cedana/restore``). The session drives
the container only through :class:`RestoreHost`, so the same object serves any
caller that can restore from a directory of CRIU images.

About 930 lines: every way into and out of a restore is driven from here, on purpose
in one place (the candidates, by label or by hand, their checks, the fallback, the
report). Which candidate comes next and which are passed over is decided by the pure
functions of candidates.py, from what this session gathers; what is not a decision
lives beside it (compat.py, criu_config.py, gpu_steps.py, the store).
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import logging
import os
import platform
import shutil
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Protocol

from ..config import NodeConfig
from ..errors import (
    DataLoss,
    DeadlineExceeded,
    FailedPrecondition,
    NotFound,
    ShimError,
    Unavailable,
)
from ..hooks import HookFailed, HookRunner, HookState, Stage
from ..runtime.criu_stats import restore_stats
from ..runtime.runc import Runc
from . import cpu_fit, criu_config
from .candidates import (
    NodeFacts,
    Question,
    Refusal,
    RegistryFacts,
    entry_refusal,
    named,
    ranked,
    registry_verdict,
)
from .gpu_steps import GpuStepRunner
from .layers import CRIU_LAYER, ROOTFS_LAYER, SHM_LAYER, shm_source
from .netinfo import tcp_can_live
from .oplog import PhaseClock
from .policy import FALLBACK_COLD, Policy
from .rootfs_diff import apply, apply_dir
from .store import Entry, Store, priority
from .tool_versions import Versions

if TYPE_CHECKING:
    from .lazy_remote import ServedCheckpoint
    from .remote import RemoteCheckpoint, RemoteStore

log = logging.getLogger(__name__)

RESTORE_DIR = "cedana-restore"
IN_FLIGHT_POLL = 0.1  # seconds between looks at checkpoints still being written
REMOTE_IN_FLIGHT_POLL = 1.0  # the same, for pushes in flight in the registry
# RestoreReport.phases, always all present (seconds; 0.0 for a phase that did not run):
# waiting for checkpoints being written, listing candidates here and in the registry,
# pulling from the registry, verifying blobs, unpacking images and files, CRIU,
# the GPU state, pre/post-restore hooks.
PHASES = ("wait", "list", "pull", "verify", "unpack", "restore", "gpu", "hooks")
HOW_TO_FALL_BACK = "set CEDANA_RESTORE_FALLBACK=cold to start cold instead"


@dataclass(frozen=True, slots=True)
class RestoreRequest:
    """One CRIU restore attempt, as the container runs it."""

    image_dir: str
    work_dir: str
    tcp_established: bool
    file_locks: bool
    ext_unix_sk: bool = True
    # Memory through CRIU's lazy-pages daemon (node config lazy_restore): the tasks run
    # before all of it is in; restore_images returns once it is, and calls resumed()
    # as soon as they run.
    lazy_pages: bool = False
    resumed: Callable[[], None] = lambda: None
    # With lazy_pages, (the daemon's end, the server's end) of a connection to the
    # page server the daemon asks for the pages (a registry checkpoint,
    # lazy_remote.py); None: it reads them from image_dir.
    page_server: tuple[int, int] | None = None
    # The container the checkpoint was taken of (its metadata's containerId).
    checkpointed_container: str = ""


class RestoreHost(Protocol):
    """The container a session restores: the few things it needs done to it, each
    done its own way by a containerd task and by a Slurm job."""

    @property
    def bundle(self) -> str: ...
    @property
    def rootfs(self) -> str: ...
    @property
    def spec(self) -> Mapping[str, Any]: ...
    @property
    def runc(self) -> Runc:
        """The runc that restores it (the node's tool versions, its CPU check, are
        asked through it)."""
        ...

    async def network_facts(self) -> Any: ...
    async def restore_images(self, request: RestoreRequest) -> int:
        """``runc restore`` from the images; the new init's pid. With
        ``request.lazy_pages``, returned once the tasks have all their memory;
        cancelled, it kills them before anything else."""
        ...

    async def pids(self) -> Sequence[int]: ...
    async def discard_attempt(self) -> None:
        """Kill and forget whatever a failed attempt left running or half-created."""
        ...

    async def reset_rootfs(self) -> None:
        """The image's pristine rootfs again (a failed candidate's files gone)."""
        ...

    async def create_cold(self) -> int:
        """Create and start the container from its image, as if never checkpointed."""
        ...


@dataclass(frozen=True, slots=True)
class Plan:
    entry: Entry
    image_dir: str
    work_dir: str
    keep_tcp: bool  # the pod kept its addresses: established connections can live
    gpu_device_map: Mapping[str, str] | None = None  # recorded GPU UUID -> this node's
    raw: bool = False  # image_dir is the store's raw images: checked while CRIU reads
    # ... unless this session's pull has just written them, every byte checked as it was
    # written (each chunk's sha256, each file's CRC-32, the file list's digest in the
    # config): a second read beside CRIU's made B's `runc restore` 2-4x slower.
    pulled_raw: bool = False

    @property
    def recheck(self) -> bool:
        """Read the raw images a second time for their CRC-32s while CRIU reads them?"""
        return self.raw and not self.pulled_raw

    # A registry checkpoint restored lazily as it is pulled (lazy_remote.py): its
    # pages come from a page server fed by the registry; ``candidate`` is its tag.
    served: ServedCheckpoint | None = None
    candidate: RemoteCheckpoint | None = None

    @property
    def gpu(self) -> Mapping[str, Any]:
        """The checkpoint's GPU record; empty for a CPU-only checkpoint."""
        recorded = self.entry.metadata.get("gpu")
        return recorded if isinstance(recorded, Mapping) else {}


def _restore_clock() -> PhaseClock:
    clock = PhaseClock()
    clock.phases.update(dict.fromkeys(PHASES, 0.0))
    return clock


@dataclass
class RestoreReport:
    """How a restore ended, for the log and the ``/cedana/restore`` event."""

    container_id: str
    scope: str
    label: str
    checkpoint_id: str = ""  # empty for a cold start
    skipped: list[str] = field(default_factory=list)  # "<id>: why", in order
    store_problem: str = ""  # the store could not be read: started cold because of it
    requested: str = ""  # restore by hand: the id or prefix asked for
    failed: str = ""  # restore by hand refused: the error the Create or Start failed with
    memory: str = ""  # how the restored memory came back: "lazy" or "eager" ("" for cold)
    criu: dict[str, float | int] = field(default_factory=dict)  # CRIU's restore statistics
    clock: PhaseClock = field(default_factory=_restore_clock, repr=False)
    total: float = 0.0  # seconds spent restoring (at Create and at Start), phases and all

    @property
    def outcome(self) -> str:
        if self.failed:
            return "failed"
        return "restored" if self.checkpoint_id else "cold"

    @property
    def detail(self) -> str:
        if self.failed:
            return self.failed
        reasons = [self.store_problem] if self.store_problem else []
        reasons += self.skipped
        if not reasons and not self.checkpoint_id:
            return "no checkpoint for this label"
        return "; ".join(reasons)

    @property
    def alarming(self) -> bool:
        """Something was passed over or broken: worth a warning, not an info line."""
        return bool(self.skipped or self.store_problem or self.failed)

    @property
    def phases(self) -> dict[str, float]:
        """Seconds per phase (every key of PHASES; 0.0 for one that did not run)."""
        return self.clock.phases

    def timing(self, phase: str) -> contextlib.AbstractContextManager[None]:
        """Add the time spent in the block to ``phase``."""
        return self.clock.phase(phase)


class RawImagesBad(DataLoss):
    """The raw images CRIU read are not what was checkpointed."""


class RestoreSession:
    def __init__(
        self,
        *,
        store: Store,
        hooks: HookRunner,
        gpu: GpuStepRunner,
        config: NodeConfig,
        policy: Policy,
        container_id: str,
        report: Callable[[RestoreReport], None],
        writing_here: Callable[[str, str], bool] = lambda scope, label: False,
        remote: Callable[[], RemoteStore] | None = None,
        image_digest: Callable[[], Awaitable[str]] | None = None,
        versions: Versions | None = None,
    ) -> None:
        self.store = store
        self.hooks = hooks
        self.gpu = gpu
        self.config = config
        self.policy = policy
        self._report = report
        self._writing_here = writing_here  # this daemon's own stops still dumping
        self.result = RestoreReport(
            container_id, policy.scope, policy.label, requested=policy.restore
        )
        self._remote = remote  # the node's registry, when it has one
        # This node's tool versions: the pipeline's (asked once per daemon) when given.
        self._versions = versions or Versions()
        # This container's image digest, asked of containerd (blocking) only when a
        # checkpoint from another node is considered; policy.image_digest when pinned.
        self._image_digest = image_digest
        self._digest: str | None = policy.image_digest or None
        self._remaining: list[Entry | RemoteCheckpoint] = []
        self._pulled: dict[str, RemoteCheckpoint] = {}  # entry id -> the tag it came from
        self._raw_refused: set[str] = set()  # ids whose raw images failed their check
        self._eager_only: set[str] = set()  # ids whose lazy restore failed
        self._refusal: type[ShimError] | None = None  # a restore by hand's error class
        self._refused: tuple[str, str] | None = None  # and its (checkpoint, why)
        self._since = time.monotonic()  # when prepare or run began (RestoreReport.total)
        self.plan: Plan | None = None
        self._ran = False  # run() took the plan: its attempts drop what they hold

    @property
    def container_id(self) -> str:
        return self.result.container_id

    # -- Create: choose and unpack -------------------------------------------------

    async def prepare(self, host: RestoreHost) -> bool:
        """Unpack the first usable candidate into ``host``; False means start cold
        (already reported: the caller just creates the container as usual).

        A restore by hand that cannot be restored raises (NotFound, InvalidArgument,
        DataLoss, FailedPrecondition, ...) naming the checkpoint and why, unless its
        fallback is cold."""
        self._since = time.monotonic()
        if self.policy.restore:
            self._remaining = await self._chosen()
        else:
            self._remaining = await self._candidates()
        self.plan = await self._prepare_next(host)
        if self.plan is None:
            self._finish_or_refuse()
        else:
            self._lap()
        return self.plan is not None

    async def discard(self) -> None:
        """The container goes without its Start (a Delete after the Create): drop what
        the prepared plan holds, which only an attempt would have (a served checkpoint's
        staging dir in the store, the attempt's work dir). Nothing once :meth:`run`
        began: each of its attempts drops its own."""
        plan, self.plan = self.plan, None
        if plan is None or self._ran:
            return
        if plan.served is not None:
            await asyncio.to_thread(plan.served.close)
        await asyncio.to_thread(_discard_work, plan)

    @property
    def _by_hand(self) -> bool:
        """A restore by hand that must not start cold."""
        return bool(self.policy.restore) and self.policy.restore_fallback != FALLBACK_COLD

    def _finish_or_refuse(self) -> None:
        """No candidate was restored: reported, and for a restore by hand that must
        not start cold, raised as the error that fails the container (naming the
        checkpoint and the last reason recorded)."""
        if not self._by_hand:
            self._finish()
            return
        which, why = self._refused or ("", "it could not be restored")
        ref = self.policy.restore
        named = f"{ref!r}" if which in ("", ref) else f"{ref!r} ({which})"
        self.result.failed = (
            f"container {self.container_id}: cannot restore checkpoint {named} "
            f"(CEDANA_RESTORE) in namespace {self.policy.scope!r}: {why}; {HOW_TO_FALL_BACK}"
        )
        self._finish()
        raise (self._refusal or FailedPrecondition)(self.result.failed)

    async def _chosen(self) -> list[Entry | RemoteCheckpoint]:
        """The one checkpoint a restore by hand names, here or in the registry; an
        unknown or ambiguous name is recorded (and refused by :meth:`_finish_or_refuse`)."""
        scope, ref = self.policy.scope, self.policy.restore
        with self.result.timing("list"):
            try:
                local = await asyncio.to_thread(self.store.reader.matching, scope, ref)
            except (ShimError, OSError) as err:
                self.result.store_problem = f"checkpoint store unusable: {err}"
                local = []
            listed = await self._registry_listing(lambda remote: remote.list(scope))
        chosen = named(ref, scope, local, listed)
        if isinstance(chosen, Refusal):
            self._refuse(chosen.kind, ref, chosen.why)
            return []
        return [chosen]

    async def _registry_listing(
        self, listing: Callable[[RemoteStore], list[RemoteCheckpoint]]
    ) -> list[RemoteCheckpoint]:
        """What ``listing`` finds in the node's registry (none without one); a registry
        that cannot be listed is noted in the report."""
        if self._remote is None:
            return []
        try:
            remote = self._remote()
            return await asyncio.to_thread(listing, remote)
        except (ShimError, OSError) as err:
            self.result.skipped.append(f"registry: cannot list checkpoints ({err})")
            return []

    def _refuse(self, kind: type[ShimError], checkpoint: str, why: str) -> None:
        """Record why a restore by hand cannot use ``checkpoint`` and the error class
        that says so."""
        self._refusal = kind
        self._refused = (checkpoint, why)
        self._skip(checkpoint, why)

    async def _candidates(self) -> list[Entry | RemoteCheckpoint]:
        """The label's checkpoints here and in the registry, in the order they are
        tried (:func:`.candidates.ranked`)."""
        scope, label = self.policy.scope, self.policy.label
        with self.result.timing("wait"):
            await self._wait_for_writers(scope, label)
        local: list[Entry] = []
        with self.result.timing("list"):
            try:
                local = await asyncio.to_thread(self.store.reader.candidates, scope, label)
            except (ShimError, OSError) as err:
                # A damaged store must never keep a container from running.
                self.result.store_problem = f"checkpoint store unusable: {err}"
            listed = await self._registry_listing(lambda remote: remote.candidates(scope, label))
        failures = await asyncio.to_thread(self.store.failure_records.failures)
        return ranked(local, listed, failures)

    async def _wait_for_writers(self, scope: str, label: str) -> None:
        """A checkpoint of this label still being written is the one to restore:
        wait for it (bounded) rather than start from an older one, or cold."""
        deadline = time.monotonic() + self.config.label_wait_timeout
        started = time.monotonic()
        announced = False
        next_remote = started
        remote_writers: list[str] = []
        while True:
            try:
                writers = await asyncio.to_thread(self.store.reader.in_flight, scope, label)
            except (ShimError, OSError):
                writers = []
            here = self._writing_here(scope, label)
            if not writers and not here and time.monotonic() >= next_remote:
                # The registry is asked once a second, the local store every poll.
                remote_writers = await self._pushes_in_flight(scope, label)
                next_remote = time.monotonic() + REMOTE_IN_FLIGHT_POLL
            writers = writers or remote_writers
            if not writers and not here:
                break
            if not announced:
                # The Create is held up to label_wait_timeout: say so when it begins.
                log.info(
                    "waiting for a checkpoint of the label being written",
                    extra={
                        "container": self.container_id,
                        "label": label,
                        "writers": writers or ["this node's stop"],
                        "timeout_s": self.config.label_wait_timeout,
                    },
                )
                announced = True
            if time.monotonic() >= deadline:
                pending = ", ".join(writers) or "this node's stop"
                self.result.skipped.append(
                    f"{pending}: still being written after "
                    f"{self.config.label_wait_timeout:g}s, not waited for"
                )
                return
            await asyncio.sleep(IN_FLIGHT_POLL)
        waited = time.monotonic() - started
        if announced:
            log.info(
                "waited for a checkpoint of the label being written",
                extra={"container": self.container_id, "label": label, "waited_s": waited},
            )

    async def _pushes_in_flight(self, scope: str, label: str) -> list[str]:
        """Checkpoints of the label another node is really still pushing: newer than any
        complete one, their marker refreshed lately by its pusher and not from the
        future (a failed push removes its marker, a dead pusher stops refreshing it)."""
        if self._remote is None:
            return []
        try:
            remote = self._remote()
            pushing = await asyncio.to_thread(remote.in_flight, scope, label)
        except (ShimError, OSError):
            return []  # an unreachable registry is reported by the listing
        return [f"{p.checkpoint_id} (being pushed by {p.node})" for p in pushing]

    async def _prepare_next(self, host: RestoreHost) -> Plan | None:
        network: Any = None
        here: NodeFacts | None = None
        while self._remaining:
            if here is None:
                here = NodeFacts(
                    versions=await self._versions.get(host.runc),
                    image=self.policy.image,
                    pinned_digest=self.policy.image_digest,
                    by_hand=bool(self.policy.restore),
                )
            candidate = self._remaining.pop(0)
            if isinstance(candidate, Entry):
                entry = candidate
            else:
                if self._lazy_remote(candidate):
                    plan = await self._prepare_served(candidate, here, host)
                    if plan is not None:
                        return plan
                    if candidate.checkpoint_id not in self._eager_only:
                        continue  # refused (recorded)
                pulled = await self._pull(candidate, here, host)
                if pulled is None:
                    continue
                entry = pulled
            refusal = entry_refusal(entry, here)
            if refusal is not None:
                self._refuse(refusal.kind, entry.id, refusal.why)
                if refusal.failed:
                    await asyncio.to_thread(self._failed, entry.id, refusal.why)
                continue
            if network is None:
                network = await host.network_facts()
            try:
                return await asyncio.to_thread(self._unpack, entry, host, network)
            except (ShimError, OSError) as err:
                self._refuse(_kind(err, DataLoss), entry.id, str(err))
                if isinstance(err, DataLoss):  # its verification: not this node's doing
                    await asyncio.to_thread(self._failed, entry.id, str(err))
                await host.reset_rootfs()
        return None

    async def _pull(
        self, candidate: RemoteCheckpoint, here: NodeFacts, host: RestoreHost
    ) -> Entry | None:
        """A checkpoint from the registry into this node's store, if this node can take
        it (checked on its metadata before anything large is downloaded: versions, the
        image, the CPU's features, the GPUs); None when it was skipped (recorded)."""
        assert self._remote is not None
        node = candidate.node or f"#{candidate.node_hash}"
        what = f"{candidate.checkpoint_id} (registry, from node {node})"
        try:
            with self.result.timing("pull"):
                remote = self._remote()
                if not await self._admitted(remote, candidate, what, here, host):
                    return None
                started = time.monotonic()
                entry = await asyncio.to_thread(remote.pull, candidate)
        except (ShimError, OSError) as err:
            self._refuse(_kind(err, DataLoss), what, f"cannot pull it: {err}")
            if isinstance(err, DataLoss):  # what the registry holds is bad, not the link
                await asyncio.to_thread(
                    self._failed, candidate.checkpoint_id, str(err), tag=candidate.tag
                )
            return None
        self._pulled[entry.id] = candidate
        log.info(
            "pulled checkpoint from the registry",
            extra={
                "container": self.container_id,
                "checkpoint": entry.id,
                "node": entry.metadata.get("node") or node,
                "size": entry.size,
                "seconds": round(time.monotonic() - started, 3),
            },
        )
        return entry

    async def _admitted(
        self,
        remote: RemoteStore,
        candidate: RemoteCheckpoint,
        what: str,
        here: NodeFacts,
        host: RestoreHost,
    ) -> bool:
        """Can this node take ``candidate``, judged on its metadata before anything
        large is downloaded (versions, the image, the CPU's features, the GPUs)? A
        refusal is recorded."""
        facts = RegistryFacts(await asyncio.to_thread(remote.fetch_metadata, candidate))
        while isinstance(verdict := registry_verdict(facts, here), Question):
            facts = await self._answer(verdict, facts, host)
        if verdict is not None:
            self._refuse(verdict.kind, what, verdict.why)
            return False
        return True

    def _lazy_remote(self, candidate: RemoteCheckpoint) -> bool:
        """Restore ``candidate`` lazily while it is pulled (lazy_remote.py)?"""
        return self.config.lazy_restore and candidate.checkpoint_id not in self._eager_only

    async def _prepare_served(
        self, candidate: RemoteCheckpoint, here: NodeFacts, host: RestoreHost
    ) -> Plan | None:
        """``candidate`` ready for a lazy restore from the registry: checked as
        :meth:`_pull` checks it, its small blobs staged and unpacked, the pages CRIU
        reads itself in (lazy_remote.py). None when refused (recorded), or when only a
        full pull can restore it (in ``_eager_only`` then: its pages are not chunks, or
        the bundle's filesystem has no room for them raw)."""
        from .lazy_remote import NoRoomForPages, ServedCheckpoint  # the lazy restore's only

        assert self._remote is not None
        node = candidate.node or f"#{candidate.node_hash}"
        what = f"{candidate.checkpoint_id} (registry, from node {node})"
        served: ServedCheckpoint | None = None
        work = os.path.join(host.bundle, "work", RESTORE_DIR, candidate.checkpoint_id)
        try:
            with self.result.timing("pull"):
                remote = self._remote()
                if not await self._admitted(remote, candidate, what, here, host):
                    return None
                await asyncio.to_thread(shutil.rmtree, work, True)
                served = ServedCheckpoint(remote.lazy_pull(candidate), os.path.join(work, "images"))
                await asyncio.to_thread(served.prepare)
            if not served.chunked():
                served.close()
                self._eager_only.add(candidate.checkpoint_id)  # one blob: pulled whole
                return None
            entry = served.entry()
            refusal = entry_refusal(entry, here)
            if refusal is not None:
                served.close()
                self._refuse(refusal.kind, what, refusal.why)
                return None
            network = await host.network_facts()
            with self.result.timing("unpack"):
                device_map = await asyncio.to_thread(self._gpu_mapping, entry.metadata, host.spec)
                await asyncio.to_thread(self._apply_served_files, served, host)
        except (ShimError, OSError) as err:
            if served is not None:
                await asyncio.to_thread(served.close)
            await asyncio.to_thread(shutil.rmtree, work, True)
            await host.reset_rootfs()
            if isinstance(err, NoRoomForPages):
                # Nothing wrong with the checkpoint: a full pull puts its blobs in the
                # store (and checks the room there itself).
                self._skip(what, f"lazy restore impossible, pulling it whole: {err}")
                self._eager_only.add(candidate.checkpoint_id)
                return None
            self._refuse(_kind(err, DataLoss), what, f"cannot pull it: {err}")
            if isinstance(err, DataLoss):  # what the registry holds is bad, not the link
                await asyncio.to_thread(
                    self._failed, candidate.checkpoint_id, str(err), tag=candidate.tag
                )
            return None
        return Plan(
            entry,
            served.image_dir,
            os.path.join(work, "criu-work"),
            keep_tcp=tcp_can_live(entry.metadata.get("network"), network),
            gpu_device_map=device_map,
            served=served,
            candidate=candidate,
        )

    def _apply_served_files(self, served: ServedCheckpoint, host: RestoreHost) -> None:
        """The rootfs diff and /dev/shm of a served checkpoint, from its staged blobs."""
        names = {layer.name for layer in served.entry().layers}
        targets = [(ROOTFS_LAYER, host.rootfs, apply)]
        shm = shm_source(host.spec)
        if shm is not None:
            targets.append((SHM_LAYER, shm, apply_dir))
        for name, dest, apply_layer in targets:
            if name in names:
                with served.pull.open_layer(name) as stream:
                    apply_layer(
                        stream,  # type: ignore[arg-type]
                        dest,
                        spool_dir=self.store.reader.spool_dir(),
                        expected_bytes=served.pull.layer(name).raw_size,
                    )

    def _commit_served(self, plan: Plan) -> Entry:
        """A served checkpoint restored: into the store as a pull would have put it
        (logged when it cannot be: the restore stands). Blocking."""
        assert plan.served is not None and plan.candidate is not None
        try:
            entry = plan.served.commit()
        except (ShimError, OSError) as err:
            log.warning(
                "restored lazily from the registry, but cannot keep the checkpoint in the store",
                extra={
                    "container": self.container_id,
                    "checkpoint": plan.entry.id,
                    "error": str(err),
                },
            )
            return plan.entry
        self._pulled[entry.id] = plan.candidate
        return entry

    async def _answer(
        self, question: Question, facts: RegistryFacts, host: RestoreHost
    ) -> RegistryFacts:
        """``facts`` with the answer to ``question`` about a registry's candidate."""
        metadata = facts.metadata
        if question is Question.IMAGE_DIGEST:
            return replace(facts, image_digest=await self._container_image_digest())
        if question is Question.CPU_FIT:
            check = functools.partial(cpu_fit.check, host.runc)
            misfit = await cpu_fit.misfit(metadata.get(cpu_fit.METADATA_KEY), self.config, check)
            return replace(facts, cpu_misfit=misfit)
        misfit = await asyncio.to_thread(self._gpu_misfit, metadata, host.spec)
        return replace(facts, gpu_misfit=misfit)

    async def _container_image_digest(self) -> str:
        """The digest of this container's image; "" when containerd cannot say (logged
        once: the check falls back to the image names)."""
        if self._digest is None:
            self._digest = ""
            if self._image_digest is not None:
                try:
                    self._digest = await self._image_digest()
                except (ShimError, OSError) as err:
                    log.warning(
                        "cannot tell this container's image digest; remote checkpoints are "
                        "checked by image name only",
                        extra={"container": self.container_id, "error": str(err)},
                    )
        return self._digest

    def _unpack(self, entry: Entry, host: RestoreHost, network: Any) -> Plan:
        """Verify ``entry`` and lay it out for CRIU and the new rootfs. Blocking."""
        work = os.path.join(host.bundle, "work", RESTORE_DIR, entry.id)
        try:
            device_map = self._gpu_mapping(entry.metadata, host.spec)
            shutil.rmtree(work, ignore_errors=True)
            os.makedirs(work, mode=0o700)
            raw = None
            if entry.id not in self._raw_refused:
                raw = self.store.raw.raw_images(entry, CRIU_LAYER)
            if raw is not None:
                # Blobs present with their sizes now; the raw images' checksums are
                # checked while CRIU restores (the restored tasks wait for both).
                with self.result.timing("verify"):
                    self.store.reader.verify(entry, deep=False)
                image_dir = raw
            else:
                with self.result.timing("verify"):
                    self.store.reader.verify(entry)
                image_dir = os.path.join(work, "images")
                with self.result.timing("unpack"):
                    self.store.reader.extract_layer(entry, CRIU_LAYER, image_dir)
            with self.result.timing("unpack"):
                self._apply_files(entry, host)
        except BaseException:
            shutil.rmtree(work, ignore_errors=True)
            raise
        return Plan(
            entry,
            image_dir,
            os.path.join(work, "criu-work"),
            keep_tcp=tcp_can_live(entry.metadata.get("network"), network),
            gpu_device_map=device_map,
            raw=raw is not None,
            pulled_raw=raw is not None
            and entry.id in self._pulled
            and self.store.adopter.take_fresh_cache(entry.id),
        )

    def _apply_files(self, entry: Entry, host: RestoreHost) -> None:
        """The rootfs diff and /dev/shm, straight from the raw tar when the store
        has one, else from the blob through a spool on the store's own disk."""
        names = {layer.name for layer in entry.layers}
        targets = [(ROOTFS_LAYER, host.rootfs, apply)]
        shm = shm_source(host.spec)
        if shm is not None:
            targets.append((SHM_LAYER, shm, apply_dir))
        for name, dest, apply_layer in targets:
            if name not in names:
                continue
            raw_tar = self.store.reader.layer_source(entry, name)
            if raw_tar is not None:
                with raw_tar:  # seekable: applied in place, no spool
                    apply_layer(raw_tar, dest)
                continue
            with self.store.reader.open_layer(entry, name) as stream:
                apply_layer(
                    stream,
                    dest,
                    spool_dir=self.store.reader.spool_dir(),
                    expected_bytes=entry.layer(name).raw_size,
                )

    def _gpu_mapping(
        self, metadata: Mapping[str, Any], spec: Mapping[str, Any]
    ) -> dict[str, str] | None:
        recorded = metadata.get("gpu")
        if not isinstance(recorded, Mapping) or not recorded.get("processes"):
            return None
        return self.gpu.restore_mapping(recorded, spec, self.container_id)

    def _gpu_misfit(self, metadata: Mapping[str, Any], spec: Mapping[str, Any]) -> str:
        """Why this node's GPUs cannot take a checkpoint with ``metadata``; "". Blocking."""
        try:
            self._gpu_mapping(metadata, spec)
        except ShimError as err:
            return str(err)
        return ""

    # -- Start: restore, fall back, or start cold ------------------------------------

    async def run(self, host: RestoreHost) -> int:
        """Restore the prepared candidate, then the next ones; cold when none is left.

        Returns the init's pid. A cancellation (a Kill during the restore) passes
        through after the attempt's gate was told to let nothing run. A restore by
        hand that fails (and may not start cold) raises, the attempt undone.
        """
        self._since = time.monotonic()
        self._ran = True
        plan = self.plan
        while plan is not None:
            try:
                pid = await self._attempt(host, plan)
            except RawImagesBad as bad:
                self._skip(plan.entry.id, f"raw images discarded: {bad}")
                await host.discard_attempt()
                retry = await asyncio.to_thread(self._discard_raw, plan.entry)
                if retry is not None:
                    # Only the raw copy was bad: the blob of the same checkpoint is next.
                    self._raw_refused.add(retry.id)
                    self._remaining.insert(0, retry)
            except (ShimError, OSError) as err:
                if self._lazy(plan):
                    # The lazy path (the daemon, userfaultfd, the registry feeding it)
                    # may be all that failed: the same checkpoint eagerly (a served
                    # one pulled whole first, if the registry still has it).
                    self._skip(plan.entry.id, f"lazy restore failed, restoring eagerly: {err}")
                    self._eager_only.add(plan.entry.id)
                    self._remaining.insert(0, plan.candidate or plan.entry)
                else:
                    kind = _kind(err, FailedPrecondition)
                    self._refuse(kind, plan.entry.id, f"restore failed: {err}")
                    if not isinstance(err, HookFailed):  # a veto judges the restore, not it
                        await asyncio.to_thread(self._failed, plan.entry.id, str(err))
                await host.discard_attempt()
            else:
                self.result.checkpoint_id = plan.entry.id
                self.result.memory = "lazy" if self._lazy(plan) else "eager"
                entry = plan.entry
                if plan.served is not None:
                    entry = await asyncio.to_thread(self._commit_served, plan)
                await asyncio.to_thread(self._record, entry)
                self._finish()
                return pid
            finally:
                if plan.served is not None:  # the daemon is done or gone by now
                    await asyncio.to_thread(plan.served.close)
                _discard_work(plan)
            await host.reset_rootfs()
            plan = self.plan = await self._prepare_next(host)
        self._finish_or_refuse()
        return await host.create_cold()

    def _record(self, entry: Entry) -> None:
        """What was restored from ``entry`` and when, in the store; a record that
        cannot be written is logged, never a reason to fail the restore."""
        policy = self.policy
        record = {
            "restoredAt": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "containerId": self.container_id,
            "namespace": policy.scope,
            "pod": policy.pod,
            "container": policy.container,
            "label": policy.label,
            "node": platform.node(),
            "byHand": bool(policy.restore),
        }
        try:
            self.store.restore_records.record_restore(entry.id, record)
            self.store.failure_records.clear_failure(entry.id)
        except (ShimError, OSError) as err:
            log.warning(
                "cannot record the restore in the store",
                extra={"container": self.container_id, "checkpoint": entry.id, "error": str(err)},
            )

    def _failed(self, checkpoint_id: str, why: str, *, tag: str = "") -> None:
        """``checkpoint_id`` itself failed: recorded (see the module doc), and removed
        from the store when this session pulled it. Blocking; logs, never raises."""
        pulled = self._pulled.pop(checkpoint_id, None)
        try:
            self.store.failure_records.record_failure(
                checkpoint_id, why, tag=pulled.tag if pulled else tag
            )
            if pulled is not None:
                self.store.maintenance.remove(checkpoint_id)
                log.info(
                    "removed a pulled checkpoint that failed; the registry's copy is tried "
                    "last from now on",
                    extra={"container": self.container_id, "checkpoint": checkpoint_id},
                )
        except NotFound:
            pass  # removed meanwhile (retention, prune)
        except (ShimError, OSError) as err:
            log.warning(
                "cannot record a failed checkpoint in the store",
                extra={
                    "container": self.container_id,
                    "checkpoint": checkpoint_id,
                    "error": str(err),
                },
            )

    def _discard_raw(self, entry: Entry) -> Entry | None:
        """Drop bad raw images; the checkpoint again if it has a blob to try instead
        (it may have been compacted since it was planned)."""
        self.store.raw.discard_raw(entry)
        try:
            current = self.store.catalog.get(entry.id)
        except (ShimError, OSError):
            return None
        return current if current.state == "compacted" else None

    async def _attempt(self, host: RestoreHost, plan: Plan) -> int:
        state = HookState(
            self.container_id,
            host.bundle,
            "creating",
            0,
            host.spec,
            plan.entry.id,
            plan.image_dir,
        )
        timing = self.result.timing
        with timing("hooks"):
            await self.hooks.run(Stage.PRERESTORE, state)  # an operator's veto raises
        try:
            with timing("restore"), priority.foreground():
                pid = await self._restore(host, plan)
            if plan.gpu:
                # Processes without their GPU state cannot run: the attempt failed.
                with timing("gpu"):
                    await self.gpu.after_restore(
                        self.container_id, await host.pids(), plan.gpu, plan.gpu_device_map
                    )
        except BaseException:
            with contextlib.suppress(Exception), timing("hooks"):  # post hooks never undo
                await asyncio.shield(
                    self.hooks.run(Stage.POSTRESTORE, replace(state, outcome="failed"))
                )
            raise
        with contextlib.suppress(ShimError, OSError), timing("hooks"):
            await self.hooks.run(
                Stage.POSTRESTORE, replace(state, status="running", pid=pid, outcome="ok")
            )
        return pid

    def _lazy(self, plan: Plan) -> bool:
        """Restore ``plan`` through CRIU's lazy-pages daemon?"""
        return self.config.lazy_restore and plan.entry.id not in self._eager_only

    async def _restore(self, host: RestoreHost, plan: Plan) -> int:
        gate = verdict = ""
        if plan.recheck:
            gate, verdict = criu_config.write_gate(
                os.path.dirname(plan.work_dir), self.config.restore_timeout
            )
        netns_setup = criu_config.write_netns_setup(host.bundle, host.spec)
        criu_config.write(
            host.bundle,
            criu_config.restore_options(
                self.config, keep_tcp=plan.keep_tcp, gate=gate, netns_setup=netns_setup
            ),
        )
        lazy = self._lazy(plan)
        resumed = asyncio.Event()
        checking = None
        if plan.pulled_raw:
            log.info(
                "restoring from raw images checked as they were pulled",
                extra={"container": self.container_id, "checkpoint": plan.entry.id},
            )
        if plan.recheck:
            checking = asyncio.get_running_loop().create_task(
                self._check_raw(plan, verdict, resumed if lazy else None)
            )
        page_server = None if plan.served is None else plan.served.serve()
        request = RestoreRequest(
            image_dir=plan.image_dir,
            work_dir=plan.work_dir,
            tcp_established=plan.keep_tcp and self.config.tcp_established,
            file_locks=self.config.file_locks,
            lazy_pages=lazy,
            resumed=resumed.set if plan.served is None else _both(resumed.set, plan.served.resumed),
            checkpointed_container=str(plan.entry.metadata.get("containerId") or ""),
            page_server=page_server,
        )
        try:
            try:
                async with asyncio.timeout(self.config.restore_timeout):
                    if plan.served is not None:
                        pid = await _restore_served(host, request, plan.served)
                    else:
                        pid = await _restore_checked(host, request, checking)
            except TimeoutError:
                raise DeadlineExceeded(
                    f"CRIU did not finish within restore_timeout ({self.config.restore_timeout:g}s)"
                ) from None
        except asyncio.CancelledError:
            if checking is not None:  # its verdict lets nothing of the attempt run
                checking.cancel()
                with contextlib.suppress(BaseException):
                    await checking
            raise
        except BaseException as failure:
            if checking is not None:
                # CRIU failing at the gate is the check's doing: say so (the blob is next).
                resumed.set()  # a lazy attempt's pages are checked all the same
                try:
                    await checking
                except RawImagesBad as bad:
                    raise bad from failure
                except BaseException:
                    pass
            raise
        if checking is not None:
            await checking  # RawImagesBad: whatever CRIU made of them must not run
        self.result.criu = restore_stats(plan.work_dir)
        return pid

    async def _check_raw(self, plan: Plan, verdict: str, resumed: asyncio.Event | None) -> None:
        """The raw images' checksums, and the gate's verdict on them. Lazily restored
        (``resumed`` given), the tasks resume before the daemon reads their memory pages:
        the verdict is on the other images, and the pages are checked once the tasks
        run (the restore is not done until they pass; :func:`_restore_checked`), so
        that the check's CPU and reads stay off the way to the tasks' first
        instruction."""
        try:
            if resumed is not None:
                await asyncio.to_thread(
                    self.store.raw.verify_raw, plan.entry, CRIU_LAYER, only=_not_pages
                )
                criu_config.give_verdict(verdict, ok=True)
                await resumed.wait()
                await asyncio.to_thread(
                    self.store.raw.verify_raw, plan.entry, CRIU_LAYER, only=_pages
                )
                return
            await asyncio.to_thread(self.store.raw.verify_raw, plan.entry, CRIU_LAYER)
        except BaseException as err:
            with contextlib.suppress(OSError):
                criu_config.give_verdict(verdict, ok=False)
            if isinstance(err, DataLoss):
                raise RawImagesBad(str(err)) from err
            raise
        criu_config.give_verdict(verdict, ok=True)

    # -- bookkeeping --------------------------------------------------------------

    def _skip(self, checkpoint: str, why: str) -> None:
        self.result.skipped.append(f"{checkpoint}: {why}")
        log.warning(
            "skipping checkpoint",
            extra={"container": self.container_id, "checkpoint": checkpoint, "error": why},
        )

    def _lap(self) -> None:
        """Count the time since the session last began working in ``total``."""
        now = time.monotonic()
        self.result.total += now - self._since
        self._since = now

    def _finish(self) -> None:
        self._lap()
        self._report(self.result)


def _kind(err: BaseException, otherwise: type[ShimError]) -> type[ShimError]:
    """The errors.py class of ``err`` (its status code) for a restore by hand's own
    error; ``otherwise`` for an OSError."""
    for cls in type(err).__mro__:
        if issubclass(cls, ShimError) and cls.__module__ == ShimError.__module__:
            return cls
    return otherwise


async def _restore_checked(
    host: RestoreHost, request: RestoreRequest, checking: asyncio.Task[None] | None
) -> int:
    """``host.restore_images``; a lazy one given up (its tasks killed) as soon as the
    raw images' check fails, since the tasks run by then. The check's own outcome is
    the caller's to await."""
    if checking is None or not request.lazy_pages:
        return await host.restore_images(request)
    restoring = asyncio.ensure_future(host.restore_images(request))
    try:
        await asyncio.wait([restoring, checking], return_when=asyncio.FIRST_EXCEPTION)
    except BaseException:  # cancelled (a Kill, the deadline): the restore goes too
        await _cancel(restoring)
        raise
    if not restoring.done():  # the check failed while the tasks run: kill them now
        if await _cancel(restoring):
            raise asyncio.CancelledError
        checking.result()
    return restoring.result()


async def _restore_served(
    host: RestoreHost, request: RestoreRequest, served: ServedCheckpoint
) -> int:
    """``host.restore_images`` fed by ``served``'s page server; given up (its tasks
    killed, the daemon frozen first) as soon as the server fails: a chunk the registry
    cannot give, or that does not verify, is never a page a task reads."""
    assert served.failed is not None
    restoring = asyncio.ensure_future(host.restore_images(request))
    waiting: list[asyncio.Future[Any]] = [restoring, served.failed]
    try:
        await asyncio.wait(waiting, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # cancelled (a Kill, the deadline): the restore goes too
        await _cancel(restoring)
        raise
    if not restoring.done():
        if await _cancel(restoring):
            raise asyncio.CancelledError
        err = served.failed.result()
        kind = _kind(err, Unavailable) if isinstance(err, ShimError | OSError) else DataLoss
        raise kind(f"the registry's pages failed while the tasks ran (they were killed): {err}")
    return restoring.result()


def _both(first: Callable[[], None], then: Callable[[], None]) -> Callable[[], None]:
    def call() -> None:
        first()
        then()

    return call


async def _cancel(task: asyncio.Future[Any]) -> bool:
    """Cancel ``task`` and wait for its end (it kills what it started); True when the
    caller was cancelled meanwhile."""
    task.cancel()
    cancelled = False
    while not task.done():
        try:
            await asyncio.wait([task])
        except asyncio.CancelledError:
            cancelled = True
    if not task.cancelled():
        task.exception()  # retrieved: its failure is not news
    return cancelled


def _pages(path: str) -> bool:
    """CRIU's memory pages (``pages-<n>.img``), which its lazy-pages daemon reads."""
    return path.startswith("pages-") and path.endswith(".img") and "/" not in path


def _not_pages(path: str) -> bool:
    return not _pages(path)


def _discard_work(plan: Plan) -> None:
    # The work dir only: raw images belong to the store.
    shutil.rmtree(os.path.dirname(plan.work_dir), ignore_errors=True)
