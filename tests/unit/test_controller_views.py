"""The controller's pure parts: one checkpoint per id across nodes, failures picked
from the agents' records, and which pod replaced an evicted one."""

from __future__ import annotations

from typing import Any

from cedana_shim.controller import views
from cedana_shim.controller.service import replacement


def test_a_checkpoint_on_two_nodes_is_one_item_with_both_nodes() -> None:
    lists = [
        {"node": "a", "checkpoints": [
            {"id": "1", "created": "2026-01-01T00:00:01Z", "pinned": False, "pendingPush": True},
            {"id": "2", "created": "2026-01-01T00:00:02Z", "pinned": False},
        ]},
        {"node": "b", "checkpoints": [
            {"id": "1", "created": "2026-01-01T00:00:01Z", "pinned": True, "pendingPush": False},
        ]},
    ]  # fmt: skip
    records = [{"kind": "checkpoint", "checkpoint_id": "1", "duration_seconds": 0.5}]
    merged = views.merged_checkpoints(lists, records)
    assert [c["id"] for c in merged] == ["2", "1"], "newest first"
    one = merged[1]
    assert (one["nodes"], one["pinned"], one["pendingPush"], one["durationSeconds"]) == (
        ["a", "b"], True, True, 0.5
    )  # fmt: skip
    assert merged[0]["durationSeconds"] is None, "no record remembered: unknown, not 0"


def test_failures_are_failed_operations_and_restores_that_fell_back() -> None:
    records = [
        {"kind": "checkpoint", "outcome": "committed"},
        {"kind": "checkpoint", "outcome": "failed", "detail": "disk full"},
        {"kind": "restore", "outcome": "restored", "skipped": ["x: corrupt"]},
        {"kind": "restore", "outcome": "cold", "skipped": []},
        {"kind": "restore", "outcome": "restored", "skipped": []},
    ]
    assert views.failures(records) == [records[1], records[2]]


def _pod(name: str, uid: str, node: str = "b", owner: str = "", **meta: Any) -> dict[str, Any]:
    owners = [{"uid": owner, "controller": True}] if owner else []
    return {
        "metadata": {"name": name, "uid": uid, "ownerReferences": owners, **meta},
        "spec": {"nodeName": node} if node else {},
    }


def test_the_replacement_is_the_same_owners_new_scheduled_pod_or_the_same_name() -> None:
    old_uid, rs = "u-old", {"rs-1"}
    pods = [
        _pod("web-abc", old_uid, owner="rs-1"),  # the evicted one, still listed
        _pod("web-dying", "u-2", owner="rs-1", deletionTimestamp="2026-01-01T00:00:00Z"),
        _pod("web-pending", "u-3", node="", owner="rs-1"),  # not scheduled yet
        _pod("other", "u-4", owner="rs-2"),
    ]
    assert replacement(pods, "web-abc", old_uid, rs) is None
    pods.append(_pod("web-new", "u-5", owner="rs-1"))
    assert replacement(pods, "web-abc", old_uid, rs) == pods[-1]
    # A StatefulSet's (or a bare pod recreated by hand) keeps its name.
    assert replacement([_pod("db-0", "u-6")], "db-0", "u-old", set()) is not None
    assert replacement([_pod("db-1", "u-7")], "db-0", "u-old", set()) is None


def test_restore_by_hand_names_the_label_and_the_checkpoint() -> None:
    lines = views.restore_by_hand({"id": "20260101T000000Z-0123abcd", "label": "train"})
    assert lines.splitlines() == [
        "env:",
        '- {name: CEDANA_CHECKPOINT, value: "train"}',
        '- {name: CEDANA_RESTORE, value: "20260101T000000Z-0123abcd"}',
    ]


def test_registry_use_counts_a_shared_blob_once_per_sum() -> None:
    from cedana_shim.controller.registry_use import summarize

    answer = {
        "node": "a",
        "registry": "reg:5000",
        "checkpoints": [
            {"namespace": "n1", "label": "web", "id": "1", "blobs": [["m1", 5], ["base", 100]]},
            {"namespace": "n1", "label": "web", "id": "2", "blobs": [["m2", 5], ["base", 100]]},
            {"namespace": "n1", "label": "db", "id": "3", "blobs": [["m3", 7], ["d", 30]]},
            {"namespace": "n2", "label": "web", "id": "4", "blobs": [["m4", 5], ["base", 100]]},
        ],
    }
    use = summarize(answer)
    assert (use["bytes"], use["checkpoints"], use["via"]) == (5 * 3 + 100 + 7 + 30, 4, "a")
    n1, n2 = use["namespaces"]
    assert (n1["namespace"], n1["bytes"], n2["bytes"]) == ("n1", 5 + 5 + 100 + 7 + 30, 105)
    assert [(x["label"], x["bytes"]) for x in n1["labels"]] == [("db", 37), ("web", 110)]
