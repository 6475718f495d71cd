"""Checkpoints in an OCI registry: the store every node shares (see remote.py).

The node-local store (checkpoint/store) stays the source of every checkpoint; this
package pushes its checkpoints to the registry (compacting a raw one on the way; an
outbox keeps the pushes still to do), lists what the registry holds from its tags,
and pulls a checkpoint into the local store, verified, all or nothing.
"""

from .model import RemoteCheckpoint
from .outbox import Outbox, SyncResult, sync
from .remote import OnCompacted, RemoteStore

__all__ = ["OnCompacted", "Outbox", "RemoteCheckpoint", "RemoteStore", "SyncResult", "sync"]
