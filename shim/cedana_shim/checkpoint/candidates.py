"""Which checkpoints a restore tries, in what order, and which it passes over: pure
functions of the candidates and of what this node and container are.

The restore session (restore.py) does the I/O: it lists the candidates here and in
the registry, reads the store's failure records, fetches a registry candidate's
metadata, and answers the questions these functions ask (the container's image
digest, whether CRIU finds this CPU fit, whether the GPUs fit) before anything large
is downloaded or unpacked. The order:

* by label (:func:`ranked`): newest first, at equal times the copy on this node
  first, and those that failed before last, so that one that cannot be restored (a
  forged one, a newer date its only merit) is not tried first by every start;
* by hand (:func:`named`): the one checkpoint ``CEDANA_RESTORE`` names.

Each candidate then passes the checks, cheapest first: damage, the tool versions,
the image (always for a registry's, by hand for this node's), and for a registry's,
before its pull, the CPU and the GPUs (:func:`registry_verdict`). A candidate on this
node has its GPUs weighed when it is unpacked: the device map is part of its plan.
"""

from __future__ import annotations

import enum
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ..errors import DataLoss, FailedPrecondition, InvalidArgument, NotFound, ShimError
from .compat import image_mismatch, incompatible
from .store import Entry
from .store.failures import Failure, failed_last, has_failed

if TYPE_CHECKING:
    from .remote import RemoteCheckpoint


@dataclass(frozen=True, slots=True)
class Refusal:
    """Why a candidate is passed over, and the error class a restore by hand refused
    for it fails with. ``failed``: the checkpoint itself is bad, which the store's
    failure records keep (it is tried last from then on)."""

    kind: type[ShimError]
    why: str
    failed: bool = False


@dataclass(frozen=True, slots=True)
class NodeFacts:
    """This node and this container, as far as the choice goes."""

    versions: Mapping[str, str]  # this node's tool versions, as a checkpoint records them
    image: str  # the container's image name; "" when unknown (a container made with ctr)
    pinned_digest: str  # the image digest the policy pinned; "" for a tag
    by_hand: bool  # CEDANA_RESTORE: this node's checkpoints are held against the image too


class Question(enum.Enum):
    """What only I/O can tell about a registry's candidate."""

    IMAGE_DIGEST = "this container's image digest"  # containerd
    CPU_FIT = "does this node's CPU fit"  # criu cpuinfo check
    GPU_FIT = "do this node's GPUs fit"  # NVML


@dataclass(frozen=True, slots=True)
class RegistryFacts:
    """What is known of a registry's candidate before its pull: its metadata, and the
    answers to the questions asked so far (None: not asked yet)."""

    metadata: Mapping[str, Any]
    image_digest: str | None = None  # "": containerd could not tell
    cpu_misfit: str | None = None  # why this CPU does not fit; "" when it does
    gpu_misfit: str | None = None  # why these GPUs do not fit; "" when they do


def ranked(
    local: Sequence[Entry], listed: Sequence[RemoteCheckpoint], failures: Mapping[str, Failure]
) -> list[Entry | RemoteCheckpoint]:
    """A label's checkpoints on this node (``local``) and in the registry (``listed``)
    in the order they are tried; the registry's copy of one this node has counts
    once, as this node's."""
    here = {e.id for e in local}
    found: list[Entry | RemoteCheckpoint] = [
        *local,
        *(c for c in listed if c.checkpoint_id not in here),
    ]
    # Stable: at equal times the local copy (listed first) wins.
    found.sort(key=lambda c: c.created, reverse=True)
    return failed_last(found, lambda c: _has_failed(c, failures))


def named(
    ref: str, scope: str, local: Sequence[Entry], listed: Sequence[RemoteCheckpoint]
) -> Entry | RemoteCheckpoint | Refusal:
    """The one checkpoint a restore by hand names (``ref``: an id, or a prefix of
    one) among the store's matches (``local``) and what the registry lists for the
    namespace (``listed``: complete ones, an exact id before prefixes); a refusal when
    none or several match."""
    here = {e.id for e in local}
    complete = [c for c in listed if c.complete and c.checkpoint_id not in here]
    exact = [c for c in complete if c.checkpoint_id == ref]
    remote = exact or [c for c in complete if c.checkpoint_id.startswith(ref)]
    found: list[Entry | RemoteCheckpoint] = [*local, *remote]
    if len(found) == 1:
        return found[0]
    if not found:
        # The same words whether or not another namespace has it: never reveal that.
        return Refusal(NotFound, f"no checkpoint {ref!r} in namespace {scope!r}")
    ids = [c.id if isinstance(c, Entry) else c.checkpoint_id for c in found]
    shown = ", ".join(ids[:5]) + (", ..." if len(ids) > 5 else "")
    return Refusal(
        InvalidArgument,
        f"{len(ids)} checkpoints start with {ref!r} ({shown}); give more of the id",
    )


def entry_refusal(entry: Entry, node: NodeFacts) -> Refusal | None:
    """Why this node must not restore ``entry`` of its store (one listed here, or
    just pulled); None when it may try."""
    if entry.damage is not None:
        return Refusal(DataLoss, f"damaged: {entry.damage}", failed=True)
    why = incompatible(entry.metadata, node.versions)
    if not why and node.by_hand:
        why = image_mismatch(entry.metadata, node.image, node.pinned_digest)
    return Refusal(FailedPrecondition, why) if why else None


def registry_verdict(facts: RegistryFacts, node: NodeFacts) -> Refusal | Question | None:
    """What to do with a registry's candidate before its pull: refuse it, answer a
    question first (asked only once every check before it passed), or pull it
    (None)."""
    why = incompatible(facts.metadata, node.versions)
    if why:
        return Refusal(FailedPrecondition, why)
    if facts.image_digest is None:
        return Question.IMAGE_DIGEST
    why = image_mismatch(facts.metadata, node.image, facts.image_digest)
    if why:
        return Refusal(FailedPrecondition, why)
    if facts.cpu_misfit is None:
        return Question.CPU_FIT
    if facts.cpu_misfit:
        return Refusal(FailedPrecondition, facts.cpu_misfit)
    if facts.gpu_misfit is None:
        return Question.GPU_FIT
    if facts.gpu_misfit:
        return Refusal(FailedPrecondition, facts.gpu_misfit)
    return None


def _has_failed(candidate: Entry | RemoteCheckpoint, failures: Mapping[str, Failure]) -> bool:
    if isinstance(candidate, Entry):
        return has_failed(failures, candidate.id)
    return has_failed(failures, candidate.checkpoint_id, candidate.tag)
