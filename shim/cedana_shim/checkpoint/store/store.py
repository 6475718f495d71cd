"""Crash-safe checkpoint store: an OCI image layout on local disk.

Layout under ``root`` (0700, every file 0600; checkpoints hold process memory)::

    oci-layout              {"imageLayoutVersion": "1.0.0"}
    index.json              OCI image index: one manifest descriptor per checkpoint
    index.lock              flock(2) target serialising every index.json writer
    blobs/sha256/<hex>      manifests, configs, zstd tar layers, page-image chunks
                            (zstd, shared by checkpoints that hold the same
                            bytes), raw file lists
    raw/<id>/<layer>/       a raw checkpoint's files (CRIU's images, a tar); or,
                            with <layer>.files.json beside it, a compacted one's
                            raw-image cache
    ingest/<id>/            staging for one checkpoint being written
        lock                flock held by the writing process while it lives
        dirs/<name>/        directories the caller fills (CRIU writes here)
        out/                temp blobs, renamed into blobs/sha256 at publish
    ingest/compact-<id>-*/  a compaction's work dir (same lock protocol)
    damaged/<id>/           raw checkpoints whose files failed their check
    spool/                  private temp space on this filesystem (restores)
    restores/<id>.jsonl     what was restored from a checkpoint, and when (restores.py)
    failures/<id>.json      a checkpoint that failed its verification or restore:
                            tried last, and never kept by retention in place of a
                            good one (failures.py)

A checkpoint becomes visible in two steps. ``publish`` (writer.py) is the
durable point, and fast: the staged files are sealed where they are and moved
into ``raw/<id>/`` while the checkpoint enters index.json in raw state (each
layer's descriptor points at its file list). ``compact`` (compactor.py), later
and in the background, turns it into tar+zstd blobs (a criu layer's page
images into chunks, chunks.py) and swaps its descriptor in index.json in
place. Membership in index.json is the commit marker both times: a checkpoint
is visible once it is there, and everything it references is durable by then.

Garbage rule: blobs and raw dirs enter ``blobs/sha256`` and ``raw/`` only while
``index.lock`` is held, immediately followed (same hold) by the index write
that references them or by their removal on failure. So under the lock, any
blob or raw dir not reachable from index.json is an orphan of a crashed write,
safe to delete with no grace period. An ingest or compaction dir is garbage
when its ``lock`` file can be flock'ed, i.e. the process that created it is gone
(the kernel drops flocks on death, whatever the pid is reused for); one without
a ``lock`` file (crash during ``begin``) is garbage after INGEST_GRACE_S (5 min).

Nothing under the root is reached through a symlink (fsutil.py); a damaged or
missing index.json is rebuilt from the blobs by every write path and by
``repair`` (repair.py), while read paths report it.

Parts: :class:`Store` builds one :class:`StoreCore` (core.py: the root fd,
index.json and ``index.lock``, blob placement, the step hook) and gives it to
every part, none of which inherits another: the failure and restore records
(failures.py, restores.py), the :class:`Catalog` (catalog.py: list, get, and the
entries, checks, index repair and sweep the other parts share), then the writer,
the compactor, the reader, the raw images, maintenance and the adopter, each given
the catalog (and the failure records, for retention and prune). Every part takes
``index.lock`` through the core around its own index write, so the rules above
hold whichever part writes. A consumer depends on the part it uses
(``store.reader``, ``store.writer``, ...); ``commit`` is the facade's own.
"""

from __future__ import annotations

from .adopt import Adopter
from .catalog import Catalog
from .compactor import Compactor
from .core import StoreCore
from .failures import FailureRecords
from .ingest import Ingest
from .maintenance import Maintenance
from .model import Entry, StepHook, StoreConfig
from .raw import RawImages
from .reader import Reader
from .restores import RestoreRecords
from .writer import Writer

__all__ = ["Store"]


class Store:
    """An opened store: its parts, each built on the one shared core (see the module doc).

    A consumer takes the part it uses: ``writer`` (begin, abort, publish),
    ``compactor``, ``catalog`` (list, get), ``reader`` (a restore's candidates,
    verify, extract, stream), ``raw`` (raw images for CRIU), ``maintenance``
    (remove, prune, gc, repair), ``adopter`` (blobs out, checkpoints in),
    ``restore_records`` and ``failure_records``.
    """

    def __init__(self, config: StoreConfig, *, step_hook: StepHook | None = None) -> None:
        self.config = config
        # Held here too, so a part of one's own can be built on it (tests replace the writer).
        self.core = core = StoreCore(config, step_hook=step_hook)
        self.root = core.root
        self.failure_records = FailureRecords(core)
        self.restore_records = RestoreRecords(core)
        self.catalog = Catalog(core, self.failure_records)
        self.writer = Writer(core, self.catalog, self.failure_records)
        self.compactor = Compactor(core, self.catalog)
        self.reader = Reader(core, self.catalog)
        self.raw = RawImages(core, self.catalog)
        self.maintenance = Maintenance(core, self.catalog, self.failure_records)
        self.adopter = Adopter(core, self.catalog)

    def commit(self, ingest: Ingest) -> Entry:
        """publish + compact, blocking: for callers with no background to compact in.

        If compaction fails (DataLoss, a full disk) the checkpoint stays
        published, raw, and the error is raised.
        """
        entry = self.writer.publish(ingest)
        compacted = self.compactor.compact(entry.id)
        return entry if compacted is None else compacted
