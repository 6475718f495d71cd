"""Which checkpoints a restore tries and in what order (checkpoint/candidates.py), as
tables: the label's order across this node and the registry with failure records, the
one a restore by hand names, and why a candidate is passed over, from what this node
and container are and the answers to the questions only I/O can tell."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import Any

import pytest
from cedana_shim.checkpoint.candidates import (
    NodeFacts,
    Question,
    Refusal,
    RegistryFacts,
    entry_refusal,
    named,
    ranked,
    registry_verdict,
)
from cedana_shim.checkpoint.remote import RemoteCheckpoint
from cedana_shim.checkpoint.store import Entry
from cedana_shim.checkpoint.store.failures import Failure
from cedana_shim.errors import DataLoss, FailedPrecondition, InvalidArgument, NotFound

SCOPE = "team-a"
VERSIONS = {"arch": "x86_64", "kernel": "6.8.0-45-generic", "criu": "Version: 4.2"}
TAKEN_HERE = {"arch": "x86_64", "kernel": "6.8.0", "criu": "4.1"}  # as old as this node
DIGEST_1, DIGEST_2 = "sha256:" + "1" * 64, "sha256:" + "2" * 64


def entry(
    checkpoint_id: str,
    created: str = "2026-01-01T00:00:00Z",
    damage: str | None = None,
    **meta: Any,
) -> Entry:
    metadata = {"versions": TAKEN_HERE, "image": "app:1", **meta}
    return Entry(checkpoint_id, SCOPE, "web", created, "", 0, metadata, (), damage=damage)


def pushed(
    checkpoint_id: str, created: str = "2026-01-01T00:00:00Z", tag: str = "", complete: bool = True
) -> RemoteCheckpoint:
    return RemoteCheckpoint(
        repository=f"cedana/{SCOPE}", tag=tag or f"t-{checkpoint_id}",
        checkpoint_id=checkpoint_id, scope=SCOPE, label="web", created=created,
        node="node-b", complete=complete,
    )  # fmt: skip


def ids(candidates: Sequence[Entry | RemoteCheckpoint]) -> list[str]:
    """Each candidate's id, a registry's marked ``r:``."""
    return [c.id if isinstance(c, Entry) else f"r:{c.checkpoint_id}" for c in candidates]


def failed(checkpoint_id: str, tag: str = "") -> tuple[str, Failure]:
    return checkpoint_id, Failure(checkpoint_id, tag, "restore failed", "2026-01-02T00:00:00Z")


def at(hour: int) -> str:
    return f"2026-01-01T{hour:02}:00:00Z"


# -- by label: the order ------------------------------------------------------------

RANKED: dict[str, tuple[list[Entry], list[RemoteCheckpoint], dict[str, Failure], list[str]]] = {
    "nothing anywhere": ([], [], {}, []),
    "newest first, here and in the registry": (
        [entry("a", at(1)), entry("b", at(3))], [pushed("c", at(2))], {}, ["b", "r:c", "a"],
    ),
    "at equal times this node's copy first": (
        [entry("a", at(2))], [pushed("r", at(2))], {}, ["a", "r:r"],
    ),
    "the registry's copy of one here counts once, as this node's": (
        [entry("a", at(1))], [pushed("a", at(5)), pushed("b", at(2))], {}, ["r:b", "a"],
    ),
    "those that failed before go last, newest first among them": (
        [entry("a", at(3)), entry("b", at(1))], [pushed("c", at(2)), pushed("d", at(4))],
        dict([failed("a"), failed("d")]), ["r:c", "b", "r:d", "a"],
    ),
    "a failure of one taken here names it under any tag": (
        [entry("b", at(1))], [pushed("a", at(3), tag="t9")], dict([failed("a")]), ["b", "r:a"],
    ),
    "a failure of a pulled one names it under its own tag only": (
        [entry("b", at(1))], [pushed("a", at(3), tag="t9")], dict([failed("a", tag="t1")]),
        ["r:a", "b"],
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", RANKED)
def test_a_labels_candidates_are_ranked(case: str) -> None:
    local, listed, failures, expected = RANKED[case]
    assert ids(ranked(local, listed, failures)) == expected


# -- by hand: the one named -----------------------------------------------------------

NAMED: dict[str, tuple[str, list[Entry], list[RemoteCheckpoint], str | tuple[type, str]]] = {
    "one here": ("ab", [entry("abc")], [pushed("xyz")], "abc"),
    "one in the registry, by prefix": ("ab", [], [pushed("abc"), pushed("xyz")], "r:abc"),
    "an exact id before the prefixes it starts": (
        "abc", [], [pushed("abc"), pushed("abcd")], "r:abc",
    ),
    "the registry's copy of the one here counts once": (
        "ab", [entry("abc")], [pushed("abc")], "abc",
    ),
    "a push in flight is not a checkpoint yet": (
        "ab", [], [pushed("abc", complete=False)], (NotFound, "no checkpoint 'ab' in namespace"),
    ),
    "none": ("q", [], [], (NotFound, f"no checkpoint 'q' in namespace '{SCOPE}'")),
    "one here and another in the registry": (
        "ab", [entry("abc")], [pushed("abd")],
        (InvalidArgument, "2 checkpoints start with 'ab' (abc, abd); give more of the id"),
    ),
    "more than five are cut short": (
        "a", [], [pushed(f"a{i}") for i in range(7)],
        (InvalidArgument, "7 checkpoints start with 'a' (a0, a1, a2, a3, a4, ...)"),
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", NAMED)
def test_a_restore_by_hand_gets_the_one_checkpoint_it_names(case: str) -> None:
    ref, local, listed, expected = NAMED[case]
    chosen = named(ref, SCOPE, local, listed)
    if isinstance(expected, str):
        assert not isinstance(chosen, Refusal)
        assert ids([chosen]) == [expected]
        return
    assert isinstance(chosen, Refusal)
    kind, why = expected
    assert chosen.kind is kind and why in chosen.why and not chosen.failed


# -- a checkpoint in this node's store ------------------------------------------------

BY_LABEL = NodeFacts(VERSIONS, image="app:2", pinned_digest="", by_hand=False)
BY_HAND = NodeFacts(VERSIONS, image="app:2", pinned_digest="", by_hand=True)

ENTRIES: dict[str, tuple[Entry, NodeFacts, tuple[type, str, bool] | None]] = {
    "fits": (entry("a", image="app:2"), BY_HAND, None),
    "damaged: recorded as failed": (
        entry("a", damage="config unreadable"), BY_LABEL,
        (DataLoss, "damaged: config unreadable", True),
    ),
    "damage before the versions": (
        entry("a", damage="x", versions={"arch": "s390x"}), BY_LABEL,
        (DataLoss, "damaged: x", True),
    ),
    "no versions recorded": (
        entry("a", versions=None), BY_LABEL,
        (FailedPrecondition, "the checkpoint records no tool versions", False),
    ),
    "another architecture": (
        entry("a", versions={**TAKEN_HERE, "arch": "aarch64"}), BY_LABEL,
        (FailedPrecondition, "it was taken on aarch64, this node is x86_64", False),
    ),
    "a newer kernel": (
        entry("a", versions={**TAKEN_HERE, "kernel": "6.9.1"}), BY_LABEL,
        (FailedPrecondition, "kernel 6.9.1, this node has the older 6.8.0: upgrade kernel", False),
    ),
    "a newer CRIU": (
        entry("a", versions={**TAKEN_HERE, "criu": "4.3"}), BY_LABEL,
        (FailedPrecondition, "with CRIU 4.3, this node has the older 4.2", False),
    ),
    "by label, another image is not held against it": (entry("a"), BY_LABEL, None),
    "by hand, another image is": (
        entry("a"), BY_HAND,
        (FailedPrecondition, "taken from image app:1, this container's image is app:2", False),
    ),
    "by hand, the versions before the image": (
        entry("a", versions={**TAKEN_HERE, "arch": "aarch64"}), BY_HAND,
        (FailedPrecondition, "it was taken on aarch64", False),
    ),
    "by hand, the pinned digest before the names": (
        entry("a", image="app:2", imageDigest=DIGEST_1),
        NodeFacts(VERSIONS, image="app:2", pinned_digest=DIGEST_2, by_hand=True),
        (FailedPrecondition, f"this container's image is app:2 ({DIGEST_2})", False),
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", ENTRIES)
def test_a_checkpoint_here_is_refused_for_the_first_reason(case: str) -> None:
    candidate, here, expected = ENTRIES[case]
    refusal = entry_refusal(candidate, here)
    if expected is None:
        assert refusal is None
        return
    assert refusal is not None
    kind, why, was_bad = expected
    assert (refusal.kind, refusal.failed) == (kind, was_bad)
    assert why in refusal.why


# -- a registry's candidate, before its pull -----------------------------------------

FITS: Mapping[str, str] = {"image_digest": "", "cpu_misfit": "", "gpu_misfit": ""}

# metadata, this node's answers to the questions asked -> the questions asked, in order,
# and the verdict: None (pull it) or the refusal's reason.
REGISTRY: dict[str, tuple[dict[str, Any], Mapping[str, str], list[Question], str | None]] = {
    "fits: every question asked, cheapest first": (
        {"image": "app:2"}, FITS,
        [Question.IMAGE_DIGEST, Question.CPU_FIT, Question.GPU_FIT], None,
    ),
    "older tools here: refused before any question": (
        {"versions": {**TAKEN_HERE, "kernel": "7.0"}}, FITS, [], "with kernel 7.0",
    ),
    "another image: refused before the CPU is asked": (
        {"image": "app:1"}, FITS, [Question.IMAGE_DIGEST],
        "taken from image app:1, this container's image is app:2",
    ),
    "the digests decide when both are known": (
        {"image": "mirror/app:2", "imageDigest": DIGEST_1}, {**FITS, "image_digest": DIGEST_1},
        [Question.IMAGE_DIGEST, Question.CPU_FIT, Question.GPU_FIT], None,
    ),
    "another digest": (
        {"image": "app:2", "imageDigest": DIGEST_1}, {**FITS, "image_digest": DIGEST_2},
        [Question.IMAGE_DIGEST], f"({DIGEST_1}), this container's image is app:2 ({DIGEST_2})",
    ),
    "the CPU does not fit: the GPUs are not asked": (
        {"image": "app:2"}, {**FITS, "cpu_misfit": "this node's CPU lacks avx512"},
        [Question.IMAGE_DIGEST, Question.CPU_FIT], "this node's CPU lacks avx512",
    ),
    "the GPUs do not fit": (
        {"image": "app:2"}, {**FITS, "gpu_misfit": "GPU: 2 needed, 1 here"},
        [Question.IMAGE_DIGEST, Question.CPU_FIT, Question.GPU_FIT], "GPU: 2 needed, 1 here",
    ),
}  # fmt: skip

ANSWERING = {
    Question.IMAGE_DIGEST: "image_digest",
    Question.CPU_FIT: "cpu_misfit",
    Question.GPU_FIT: "gpu_misfit",
}


@pytest.mark.parametrize("case", REGISTRY)
def test_a_registry_candidate_is_weighed_cheapest_check_first(case: str) -> None:
    """A question is asked only once every check before it passed (each costs I/O:
    containerd, CRIU, NVML); a refusal is a FailedPrecondition, never a failure record:
    a checkpoint this node cannot take may suit another."""
    meta, answers, questions, why = REGISTRY[case]
    facts = RegistryFacts({"versions": TAKEN_HERE, **meta})
    asked: list[Question] = []
    while isinstance(verdict := registry_verdict(facts, BY_LABEL), Question):
        assert verdict not in asked
        asked.append(verdict)
        answer = ANSWERING[verdict]
        facts = replace(facts, **{answer: answers[answer]})
    assert asked == questions
    if why is None:
        assert verdict is None
        return
    assert verdict is not None
    assert verdict.kind is FailedPrecondition and not verdict.failed
    assert why in verdict.why
