"""What each finished operation hands to the node agent: one record in a spool.

Shims live as long as their pod; the node agent (``cedana node run``) lives as long
as the node. So every shim writes one small JSON record per finished checkpoint,
restore, compaction or push into ``<store>/ops/`` (root-only, like the store) and
forgets it; the agent posts the Kubernetes Events, updates its metrics and deletes
what it consumed (node/ops_spool.py). A shim that exits right after its operation
loses nothing: the record is on disk before the operation's log line is written.

A record is written to a temp name and renamed into place, so a reader never sees
half of one. The spool is bounded (:data:`MAX_RECORDS`): a writer that finds it full
(no agent on this node) deletes the oldest records and adds their number to the
``dropped`` counter file, under ``ops/lock``; the agent reports that counter.

Beside the records, ``ops/criu-logs/`` keeps the tail of CRIU's log of each failed
dump or restore (runtime/criu_log.py, at most 64 of 64 KiB): the failure's message
names it, and it outlives the container whose work dir CRIU wrote it in.

Import-light on purpose: it runs on the checkpoint's and the restore's paths.
"""

from __future__ import annotations

import contextlib
import fcntl
import itertools
import json
import logging
import os
import time
from collections.abc import Iterator, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, Final

log = logging.getLogger(__name__)

SPOOL_DIR: Final = "ops"
MAX_RECORDS: Final = 1000
DROPPED_FILE: Final = "dropped"
LOCK_FILE: Final = "lock"
RECORD_SUFFIX: Final = ".json"
CRIU_LOGS_DIR: Final = "criu-logs"
_TMP_PREFIX: Final = ".tmp-"
_sequence = itertools.count()

# Record kinds.
CHECKPOINT: Final = "checkpoint"  # committed (durable), or failed
RESTORE: Final = "restore"  # restored, fell back, cold, failed
COMPACTION: Final = "compaction"  # compressed in the background
PUSH: Final = "push"  # pushed to the registry


@dataclass(frozen=True, slots=True)
class OpRecord:
    """One finished operation, as the agent reads it back (see node/ops_spool.py)."""

    kind: str
    outcome: str  # checkpoint: committed | failed; restore: restored | fell_back | cold
    # | failed; compaction and push: done | failed
    container_id: str
    namespace: str  # the pod's Kubernetes namespace (containerd's outside the CRI)
    label: str
    pod: str = ""
    pod_uid: str = ""  # empty when the shim did not know it: the agent looks it up
    container: str = ""
    trigger: str = ""  # checkpoint: stop | periodic | manual | task-api | ...
    checkpoint_id: str = ""
    size_bytes: int = 0  # a checkpoint's raw size; a compaction's stored size
    raw_bytes: int = 0  # a compaction's raw size
    duration_seconds: float = 0.0  # wall time of the whole operation
    phases: dict[str, float] = field(default_factory=dict)  # seconds; they sum to duration
    detail: str = ""  # why it failed, or which candidates a restore passed over
    skipped: list[str] = field(default_factory=list)  # a restore's "<id>: why", in order
    versions: dict[str, str] = field(default_factory=dict)  # shim, criu, runc
    time: float = 0.0  # when it finished (seconds since the epoch)


class PhaseClock:
    """Phase durations of one operation; whatever no phase covered is ``other``, so
    the phases always add up to the wall time."""

    def __init__(self) -> None:
        self.started = time.monotonic()
        self.phases: dict[str, float] = {}

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        begun = time.monotonic()
        try:
            yield
        finally:
            self.add(name, time.monotonic() - begun)

    def add(self, name: str, seconds: float) -> None:
        self.phases[name] = self.phases.get(name, 0.0) + seconds

    def finish(self) -> tuple[float, dict[str, float]]:
        """(wall seconds, phases rounded to the millisecond, ``other`` included)."""
        total = round(time.monotonic() - self.started, 3)
        return total, sum_to(total, self.phases)


def sum_to(total: float, phases: Mapping[str, float]) -> dict[str, float]:
    """``phases`` rounded to the millisecond plus ``other``: the rest of ``total``.
    Phases that took no time (did not run) are left out."""
    rounded = {name: round(seconds, 3) for name, seconds in phases.items()}
    rounded = {name: seconds for name, seconds in rounded.items() if seconds > 0}
    rest = round(total - sum(rounded.values()), 3)
    if rest > 0:
        rounded["other"] = round(rounded.get("other", 0.0) + rest, 3)
    return rounded


def spool_path(store_root: str) -> str:
    return os.path.join(store_root, SPOOL_DIR)


def criu_logs_path(store_root: str) -> str:
    """Where the copies of CRIU's logs of failed runs are kept."""
    return os.path.join(store_root, SPOOL_DIR, CRIU_LOGS_DIR)


def write(store_root: str, record: OpRecord) -> None:
    """Put ``record`` in the store's spool; logged, never raised: an operation must
    not fail because its report could not be filed."""
    spool = spool_path(store_root)
    name = f"{time.time_ns():020d}-{os.getpid()}-{next(_sequence)}{RECORD_SUFFIX}"
    data = json.dumps(asdict(record), separators=(",", ":")).encode()
    try:
        os.makedirs(spool, mode=0o700, exist_ok=True)
        tmp = os.path.join(spool, _TMP_PREFIX + name)
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        try:
            os.write(fd, data)
        finally:
            os.close(fd)
        os.rename(tmp, os.path.join(spool, name))
        _bound(spool, MAX_RECORDS)
    except OSError as err:
        log.warning(
            "cannot hand the operation's record to the node agent; its event and metrics are lost",
            extra={"spool": spool, "kind": record.kind, "error": str(err)},
        )


def records(spool: str) -> list[str]:
    """Names of the complete records, oldest first."""
    try:
        names = os.listdir(spool)
    except FileNotFoundError:
        return []
    return sorted(n for n in names if n.endswith(RECORD_SUFFIX) and not n.startswith("."))


@contextlib.contextmanager
def locked(spool: str) -> Iterator[None]:
    """The spool's lock: the drop counter and the drops themselves happen under it."""
    fd = os.open(os.path.join(spool, LOCK_FILE), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def read_dropped(spool: str) -> int:
    try:
        with open(os.path.join(spool, DROPPED_FILE)) as f:
            value = json.load(f)
    except (OSError, ValueError):
        return 0
    return value if isinstance(value, int) and value > 0 else 0


def write_dropped(spool: str, count: int) -> None:
    path = os.path.join(spool, DROPPED_FILE)
    tmp = f"{path}.tmp-{os.getpid()}"
    with open(os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600), "w") as f:
        f.write(str(count))
    os.rename(tmp, path)


def _bound(spool: str, limit: int) -> None:
    if len(records(spool)) <= limit:
        return
    with locked(spool):
        names = records(spool)
        excess = names[: max(0, len(names) - limit)]
        dropped = 0
        for name in excess:
            with contextlib.suppress(FileNotFoundError):  # the agent took it meanwhile
                os.unlink(os.path.join(spool, name))
                dropped += 1
        if dropped:
            write_dropped(spool, read_dropped(spool) + dropped)
            log.warning(
                "operation spool full (no node agent reading it?): oldest records dropped",
                extra={"spool": spool, "dropped": dropped, "limit": limit},
            )


def parse(data: bytes) -> OpRecord | None:
    """A record read back from the spool; None when it is not one (logged by the
    caller). Unknown keys are ignored: a newer shim may add some."""
    try:
        raw: Any = json.loads(data)
    except ValueError:
        return None
    if not isinstance(raw, dict):
        return None
    values: dict[str, Any] = {}
    for name, default in _DEFAULTS.items():
        value = raw.get(name, default)
        if isinstance(default, float) and isinstance(value, int) and not isinstance(value, bool):
            value = float(value)
        if type(value) is not type(default):
            return None
        values[name] = value
    if not all(isinstance(v, (int, float)) for v in values["phases"].values()):
        return None
    if not all(isinstance(v, str) for v in (*values["skipped"], *values["versions"].values())):
        return None
    if not values["kind"] or not values["outcome"]:
        return None
    return OpRecord(**values)


_DEFAULTS: Final[dict[str, Any]] = {
    "kind": "",
    "outcome": "",
    "container_id": "",
    "namespace": "",
    "label": "",
    "pod": "",
    "pod_uid": "",
    "container": "",
    "trigger": "",
    "checkpoint_id": "",
    "size_bytes": 0,
    "raw_bytes": 0,
    "duration_seconds": 0.0,
    "phases": {},
    "detail": "",
    "skipped": [],
    "versions": {},
    "time": 0.0,
}
