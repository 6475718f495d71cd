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
"""

from __future__ import annotations

from .adopt import Adopter
from .compactor import Compactor
from .ingest import Ingest
from .maintenance import Maintenance
from .model import Entry
from .raw import RawImages
from .reader import Reader
from .restores import RestoreRecords
from .writer import Writer

__all__ = ["Store"]


class Store(Writer, Compactor, Reader, RawImages, Maintenance, Adopter, RestoreRecords):
    def commit(self, ingest: Ingest) -> Entry:
        """publish + compact, blocking: for callers with no background to compact in.

        If compaction fails (DataLoss, a full disk) the checkpoint stays
        published, raw, and the error is raised.
        """
        entry = self.publish(ingest)
        compacted = self.compact(entry.id)
        return entry if compacted is None else compacted
