"""Freeze and thaw the CUDA state of every process of a container, in parallel.

``freeze`` runs before CRIU dumps the process tree: lock every process, then
checkpoint every process, so that all of them stop at one instant and none holds
the GPU when CRIU looks. ``thaw`` runs after a leave-running dump, or after a
CRIU restore (with a device map when the GPUs changed): restore every process,
then unlock every process, so none resumes before all of its peers' memory is
back (tensor-parallel workers wait on each other).

Driver calls block (a checkpoint copies the process's GPU memory), so each runs
in a worker thread; ``parallelism`` bounds how many at once.

The driver has no rollback. When any step fails for any process, every process
touched so far is walked back to RUNNING (restore if checkpointed, unlock if
locked, each retried once) so the workload keeps running, and the error lists
what happened to each pid. A caller that is cancelled still waits for the
threads and for that walk back: nothing is left locked behind its back.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections import Counter
from collections.abc import Callable, Coroutine, Iterable, Mapping
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any, Final, Generic, TypeVar

from .driver import (
    TOWARDS_RUNNING,
    CudaCheckpointDriver,
    GpuError,
    GpuFailedPrecondition,
    GpuInternal,
    GpuNotFound,
    GpuProcessExited,
    GpuRecoveryFailed,
    ProcessState,
    Step,
)
from .inventory import GpuProcess
from .records import Frozen, Thawed

log = logging.getLogger(__name__)

T = TypeVar("T")

# CRIU's CUDA plugin uses CRIU's --timeout (10 s by default) for the lock.
DEFAULT_LOCK_TIMEOUT_MS: Final = 10_000
DEFAULT_PARALLELISM: Final = 8
# Recovery tries each of restore/unlock at most this often per process.
RECOVERY_TRIES: Final = 2

EXITED: Final = "exited"
UNKNOWN: Final = "unknown"


async def freeze(
    driver: CudaCheckpointDriver,
    processes: Iterable[GpuProcess | int],
    *,
    lock_timeout_ms: int = DEFAULT_LOCK_TIMEOUT_MS,
    parallelism: int = DEFAULT_PARALLELISM,
    container_id: str = "",
) -> Frozen:
    """Lock, then checkpoint, every CUDA process among ``processes``.

    Pids that are not CUDA processes, or exit meanwhile, are skipped. A process that
    is not RUNNING to begin with fails the freeze before anything is touched (another
    tool holds its GPU state). On any failure every process is returned to RUNNING
    and the error, of the first failure's class, lists each pid's fate; when a
    process cannot be returned it is :class:`GpuRecoveryFailed`.
    """
    procs = _by_pid(processes)
    run = _Run(driver, parallelism, container_id)
    try:
        frozen = await _outlive_cancellation(_freeze(run, procs, lock_timeout_ms), run)
        if run.cancelled:
            # Cancelled as the last checkpoint finished: put everything back.
            await _outlive_cancellation(_thaw(run, _targets(frozen), None, None), run)
            raise asyncio.CancelledError
        return frozen
    finally:
        run.close()


async def thaw(
    driver: CudaCheckpointDriver,
    target: Frozen | Iterable[GpuProcess | int],
    device_map: Mapping[str, str] | None = None,
    *,
    parallelism: int = DEFAULT_PARALLELISM,
    container_id: str = "",
    total_bytes: int | None = None,
) -> Thawed:
    """Restore (with ``device_map``, old GPU UUID -> new), then unlock, every process.

    Takes a :class:`Frozen` (after a leave-running dump) or the pids of a restored
    container (after CRIU restore; the host pids differ from the dumped ones, so
    pass ``total_bytes`` from the checkpoint metadata to get a GB/s figure). Each
    process is taken from whatever state it is in: a CHECKPOINTED one is restored and
    unlocked, a LOCKED one unlocked, a RUNNING one left alone, a pid without CUDA
    skipped. A failed step is retried once (noted in ``Thawed.notes``); if a process
    still cannot run, :class:`GpuRecoveryFailed` lists each pid's fate, after every
    other process was brought to RUNNING.
    """
    if isinstance(target, Frozen):
        container_id = container_id or target.container_id
        procs = _targets(target)
    else:
        procs = _by_pid(target)
    run = _Run(driver, parallelism, container_id)
    try:
        thawed = await _outlive_cancellation(_thaw(run, procs, device_map, total_bytes), run)
        if run.cancelled:
            raise asyncio.CancelledError
        return thawed
    finally:
        run.close()


# -- internals ---------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class _Outcome(Generic[T]):
    value: T | None
    error: GpuError | None
    seconds: float


@dataclass
class _Run:
    """One freeze or thaw: its driver, its threads, what happened to each pid."""

    driver: CudaCheckpointDriver
    parallelism: int
    container_id: str
    cancelled: bool = False
    history: dict[int, list[str]] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self._pool = ThreadPoolExecutor(
            max_workers=max(1, self.parallelism), thread_name_prefix="cedana-gpu"
        )

    def close(self) -> None:
        # Every submitted call has been awaited by now; nothing to wait for.
        self._pool.shutdown(wait=False)

    def note(self, pid: int, text: str) -> None:
        self.history.setdefault(pid, []).append(text)

    async def each(self, pids: Iterable[int], fn: Callable[[int], T]) -> dict[int, _Outcome[T]]:
        loop = asyncio.get_running_loop()
        futures = {pid: loop.run_in_executor(self._pool, _timed, fn, pid) for pid in pids}
        return {pid: await future for pid, future in futures.items()}


def _timed(fn: Callable[[int], T], pid: int) -> _Outcome[T]:
    start = time.monotonic()
    try:
        value = fn(pid)
    except GpuError as err:
        return _Outcome(None, err, time.monotonic() - start)
    except Exception as err:  # a backend bug must not break the recovery discipline
        wrapped = GpuInternal(f"{type(err).__name__}: {err}", pid=pid)
        wrapped.__cause__ = err
        return _Outcome(None, wrapped, time.monotonic() - start)
    return _Outcome(value, None, time.monotonic() - start)


async def _outlive_cancellation(coro: Coroutine[Any, Any, T], run: _Run) -> T:
    """Await ``coro`` to its end even if the caller is cancelled meanwhile (its
    threads cannot be interrupted, and it must leave no process locked); the
    cancellation is recorded in ``run.cancelled`` for the caller to honour."""
    task = asyncio.ensure_future(coro)
    while True:
        try:
            return await asyncio.shield(task)
        except asyncio.CancelledError:
            run.cancelled = True
            if task.done():
                return task.result()


async def _freeze(run: _Run, procs: Mapping[int, GpuProcess], lock_timeout_ms: int) -> Frozen:
    driver = run.driver
    skipped: dict[int, str] = {}
    refused: dict[int, GpuError] = {}
    live: list[int] = []
    for pid, out in (await run.each(procs, driver.state)).items():
        if out.error is None and out.value is ProcessState.RUNNING:
            live.append(pid)
        elif isinstance(out.error, GpuNotFound):
            skipped[pid] = out.error.detail
        elif out.error is not None:
            refused[pid] = out.error
        else:
            refused[pid] = GpuFailedPrecondition(
                f"is {out.value}, not running: another tool (cuda-checkpoint, CRIU's CUDA "
                "plugin) is already handling its GPU state",
                pid=pid,
                step=Step.LOCK,
            )
    for pid, err in refused.items():
        run.note(pid, f"not touched: {err.detail}")
    if refused:
        raise _failure(run, "freeze", refused, dict.fromkeys(live, "running"), touched=False)
    if run.cancelled:
        raise asyncio.CancelledError

    started = time.monotonic()
    failed = await _phase(run, live, Step.LOCK, lambda pid: driver.lock(pid, lock_timeout_ms))
    lock_s = time.monotonic() - started
    live = [pid for pid in live if pid not in failed or not _exited(failed[pid])]
    _skip_exited(failed, skipped)
    if failed or run.cancelled:
        await _undo(run, live, failed)

    started = time.monotonic()
    failed = await _phase(run, live, Step.CHECKPOINT, driver.checkpoint)
    checkpoint_s = time.monotonic() - started
    live = [pid for pid in live if pid not in failed or not _exited(failed[pid])]
    _skip_exited(failed, skipped)
    if failed or run.cancelled:
        await _undo(run, live, failed)

    frozen = Frozen(
        container_id=run.container_id,
        backend=driver.name,
        pids=tuple(live),
        memory_bytes={pid: procs[pid].memory_bytes for pid in live},
        gpu_uuids={pid: procs[pid].gpu_uuids for pid in live},
        skipped=skipped,
        lock_s=lock_s,
        checkpoint_s=checkpoint_s,
    )
    log.info(
        "GPU state of %d process(es) checkpointed",
        len(live),
        extra={"container": run.container_id, "gpu": frozen.to_dict()},
    )
    return frozen


async def _phase(
    run: _Run, pids: Iterable[int], step: Step, fn: Callable[[int], None]
) -> dict[int, GpuError]:
    """Run one step on every pid at once; the failures, by pid."""
    failed: dict[int, GpuError] = {}
    for pid, out in (await run.each(pids, fn)).items():
        if out.error is None:
            run.note(pid, f"{step} ok ({out.seconds:.3f} s)")
        else:
            run.note(pid, f"{step} FAILED: {out.error.detail}")
            failed[pid] = out.error
    return failed


async def _undo(run: _Run, pids: list[int], failed: Mapping[int, GpuError]) -> None:
    """Walk every touched process back to RUNNING, then raise (or honour a cancel)."""
    finals = await _recover_all(run, pids, None)
    if failed:
        raise _failure(run, "freeze", failed, finals)
    raise asyncio.CancelledError


async def _thaw(
    run: _Run,
    procs: Mapping[int, GpuProcess],
    device_map: Mapping[str, str] | None,
    total_bytes: int | None,
) -> Thawed:
    driver = run.driver
    skipped: dict[int, str] = {}
    failed: dict[int, GpuError] = {}
    to_restore: list[int] = []
    to_unlock: list[int] = []
    already: list[int] = []
    for pid, out in (await run.each(procs, driver.state)).items():
        if isinstance(out.error, GpuNotFound):
            skipped[pid] = out.error.detail
        elif out.error is not None:
            failed[pid] = out.error
            run.note(pid, f"get-state FAILED: {out.error.detail}")
        elif out.value is ProcessState.CHECKPOINTED:
            to_restore.append(pid)
        elif out.value is ProcessState.LOCKED:
            to_unlock.append(pid)
            run.note(pid, "found locked")
        elif out.value is ProcessState.RUNNING:
            already.append(pid)
        else:
            failed[pid] = GpuRecoveryFailed(
                "the driver reports the process FAILED: it cannot use the GPU again",
                pid=pid,
                step=Step.RESTORE,
            )
            run.note(pid, "found FAILED")

    started = time.monotonic()
    restore_failed = await _phase(
        run, to_restore, Step.RESTORE, lambda pid: driver.restore(pid, device_map)
    )
    restore_s = time.monotonic() - started
    failed.update(restore_failed)
    restored = [pid for pid in to_restore if pid not in restore_failed]

    started = time.monotonic()
    unlock_failed = await _phase(run, [*restored, *to_unlock], Step.UNLOCK, driver.unlock)
    unlock_s = time.monotonic() - started
    failed.update(unlock_failed)

    notes: list[str] = []
    exited = {pid for pid, err in failed.items() if _exited(err)}
    for pid in exited:
        skipped[pid] = failed.pop(pid).detail
    if failed:
        finals = await _recover_all(run, list(failed), device_map)
        if any(final not in ("running", EXITED) for final in finals.values()):
            raise _failure(run, "thaw", failed, finals)
        notes = [f"pid {pid}: {'; '.join(run.history.get(pid, []))}" for pid in sorted(failed)]
    if total_bytes is None:
        total_bytes = sum(procs[pid].memory_bytes for pid in restored)
    thawed = Thawed(
        container_id=run.container_id,
        backend=driver.name,
        restored=tuple(pid for pid in restored if pid not in failed),
        unlocked=tuple(pid for pid in to_unlock if pid not in failed),
        already_running=tuple(already),
        skipped=skipped,
        device_map=dict(device_map or {}),
        restore_s=restore_s,
        unlock_s=unlock_s,
        total_bytes=total_bytes,
        notes=tuple(notes),
    )
    log.info(
        "GPU state of %d process(es) restored",
        len(thawed.restored),
        extra={"container": run.container_id, "gpu": thawed.to_dict()},
    )
    return thawed


async def _recover_all(
    run: _Run, pids: Iterable[int], device_map: Mapping[str, str] | None
) -> dict[int, str]:
    """Each pid's final state after walking it back towards RUNNING, in parallel."""
    outcomes = await run.each(pids, lambda pid: _recover(run, pid, device_map))
    finals: dict[int, str] = {}
    for pid, out in outcomes.items():
        finals[pid] = out.value if out.value is not None else UNKNOWN
        run.note(pid, f"-> {finals[pid]}")
    return finals


def _recover(run: _Run, pid: int, device_map: Mapping[str, str] | None) -> str:
    driver = run.driver
    tries: Counter[Step] = Counter()
    while True:
        try:
            state = driver.state(pid)
        except GpuProcessExited:
            return EXITED
        except GpuError as err:
            tries[Step.STATE] += 1
            run.note(pid, f"get-state FAILED: {err.detail}")
            if tries[Step.STATE] >= RECOVERY_TRIES:
                return UNKNOWN
            continue
        step = TOWARDS_RUNNING.get(state)
        if step is None or tries[step] >= RECOVERY_TRIES:
            return str(state)
        tries[step] += 1
        try:
            if step is Step.RESTORE:
                driver.restore(pid, device_map)
            else:
                driver.unlock(pid)
        except GpuProcessExited:
            return EXITED
        except GpuError as err:
            run.note(pid, f"recovery {step} FAILED: {err.detail}")
        else:
            run.note(pid, f"recovery {step} ok")


def _failure(
    run: _Run,
    op: str,
    failed: Mapping[int, GpuError],
    finals: Mapping[int, str],
    *,
    touched: bool = True,
) -> GpuError:
    """One error for a failure that spans processes: the first failure's class (by
    step, then pid), or GpuRecoveryFailed when a process is left unable to run."""
    order = list(Step)
    first = min(
        failed.items(), key=lambda kv: (order.index(kv[1].step) if kv[1].step else 0, kv[0])
    )[1]
    stuck = {pid: final for pid, final in finals.items() if final not in ("running", EXITED)}
    who = f"container {run.container_id}" if run.container_id else "the container"
    reports = {
        pid: "; ".join(run.history.get(pid, [])) or "untouched"
        for pid in sorted({*failed, *finals, *run.history})
    }
    per_pid = " | ".join(f"pid {pid}: {text}" for pid, text in reports.items())
    if stuck:
        left = ", ".join(f"pid {pid} is {final}" for pid, final in sorted(stuck.items()))
        message = (
            f"GPU {op} of {who} failed ({first}) and could not be undone: {left}. The CUDA "
            "driver has no rollback: kill the container and restore it from its last "
            f"checkpoint. Per process: {per_pid}"
        )
    elif not touched:
        message = (
            f"GPU {op} of {who} refused ({first}); no process was touched. Per process: {per_pid}"
        )
    else:
        message = (
            f"GPU {op} of {who} failed ({first}); every process was returned to running, the "
            f"workload goes on. Per process: {per_pid}"
        )
    cls = GpuRecoveryFailed if stuck else type(first)
    err = cls(first.detail, pid=first.pid, step=first.step, message=message)
    err.reports = reports
    err.__cause__ = first
    log.warning(message, extra={"container": run.container_id})
    return err


def _exited(err: GpuError) -> bool:
    return isinstance(err, GpuProcessExited)


def _skip_exited(failed: dict[int, GpuError], skipped: dict[int, str]) -> None:
    for pid in [pid for pid, err in failed.items() if _exited(err)]:
        skipped[pid] = failed.pop(pid).detail


def _by_pid(processes: Iterable[GpuProcess | int]) -> dict[int, GpuProcess]:
    procs: dict[int, GpuProcess] = {}
    for p in processes:
        proc = p if isinstance(p, GpuProcess) else GpuProcess(int(p), (), 0)
        procs[proc.pid] = proc
    return procs


def _targets(frozen: Frozen) -> dict[int, GpuProcess]:
    return {
        pid: GpuProcess(pid, frozen.gpu_uuids.get(pid, ()), frozen.memory_bytes.get(pid, 0))
        for pid in frozen.pids
    }
