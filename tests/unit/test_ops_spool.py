"""The operations spool: records written by shims (checkpoint/oplog.py) and consumed
by the node agent (node/ops_spool.py): atomic records read back in order, a full
spool dropping its oldest with a counter, hostile records, and the agent's round
(events posted, then counted, then deleted; an unreachable API server keeps them
for the next round, a refusing one does not)."""

from __future__ import annotations

import json
import os
import stat
from collections import deque
from pathlib import Path
from typing import Any

import pytest
from cedana_shim.checkpoint import oplog
from cedana_shim.checkpoint.remote import Outbox
from cedana_shim.checkpoint.store import StoreConfig
from cedana_shim.node.kube import KubeError, Rejected
from cedana_shim.node.manager import Stop, in_background
from cedana_shim.node.metrics import AgentMetrics
from cedana_shim.node.ops_spool import OpsObserver
from store_support import make_store, publish


def record(**changes: Any) -> oplog.OpRecord:
    values: dict[str, Any] = {
        "kind": oplog.CHECKPOINT,
        "outcome": "committed",
        "container_id": "c1",
        "namespace": "team-a",
        "label": "web",
        "pod": "trainer-0",
        "pod_uid": "uid-1",
        "container": "main",
        "trigger": "stop",
        "checkpoint_id": "ck1",
        "size_bytes": 4096,
        "duration_seconds": 1.5,
        "phases": {"freeze": 0.1, "dump": 1.2, "commit": 0.2},
        "time": 1_800_000_000.0,
    }
    values.update(changes)
    return oplog.OpRecord(**values)


class RecordingApi:
    """The EventApi edge: what was posted; ``failure`` raised by every call."""

    def __init__(self) -> None:
        self.events: list[tuple[str, dict[str, Any]]] = []
        self.uids: dict[tuple[str, str], str] = {}
        self.failure: Exception | None = None

    def create_event(self, namespace: str, event: dict[str, Any]) -> None:
        if self.failure is not None:
            raise self.failure
        self.events.append((namespace, event))

    def pod_uid(self, namespace: str, name: str) -> str:
        if self.failure is not None:
            raise self.failure
        return self.uids.get((namespace, name), "")


def sample(metrics: AgentMetrics, name: str, **labels: str) -> float:
    value = metrics.registry.get_sample_value(name, labels)
    return 0.0 if value is None else value


def test_records_round_trip_in_order_and_privately(tmp_path: Path) -> None:
    first, second = record(checkpoint_id="ck1"), record(checkpoint_id="ck2", outcome="failed")
    oplog.write(str(tmp_path), first)
    oplog.write(str(tmp_path), second)
    spool = oplog.spool_path(str(tmp_path))
    names = oplog.records(spool)
    assert len(names) == 2
    assert [oplog.parse((Path(spool) / n).read_bytes()) for n in names] == [first, second]
    assert stat.S_IMODE(os.stat(spool).st_mode) == 0o700
    assert all(stat.S_IMODE(os.stat(Path(spool) / n).st_mode) == 0o600 for n in names)
    assert not [n for n in os.listdir(spool) if n.startswith(".tmp-")]


def test_a_full_spool_drops_the_oldest_and_counts_them(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(oplog, "MAX_RECORDS", 3)
    for n in range(5):
        oplog.write(str(tmp_path), record(checkpoint_id=f"ck{n}"))
    spool = oplog.spool_path(str(tmp_path))
    kept = [oplog.parse((Path(spool) / n).read_bytes()) for n in oplog.records(spool)]
    assert [r.checkpoint_id for r in kept if r is not None] == ["ck2", "ck3", "ck4"]
    assert oplog.read_dropped(spool) == 2

    metrics = AgentMetrics()
    assert OpsObserver(None, metrics, "node-1").consume(spool) == 3
    assert sample(metrics, "cedana_operation_records_lost_total", reason="spool_full") == 2
    assert oplog.read_dropped(spool) == 0
    assert oplog.records(spool) == []


def test_an_unwritable_spool_never_fails_the_operation(tmp_path: Path) -> None:
    (tmp_path / oplog.SPOOL_DIR).write_text("a file where the spool should be")
    oplog.write(str(tmp_path), record())  # logged, not raised


@pytest.mark.parametrize(
    "data",
    [
        b"not json",
        b"[1, 2]",
        b'{"kind": "checkpoint"}',  # no outcome
        b'{"kind": "checkpoint", "outcome": "committed", "size_bytes": "big"}',
        b'{"kind": "checkpoint", "outcome": "committed", "phases": {"dump": "slow"}}',
        b'{"kind": "restore", "outcome": "cold", "skipped": [1]}',
    ],
)
def test_hostile_records_are_refused(data: bytes) -> None:
    assert oplog.parse(data) is None


def test_unknown_keys_are_ignored_and_ints_taken_as_seconds() -> None:
    parsed = oplog.parse(
        json.dumps(
            {
                "kind": "checkpoint",
                "outcome": "committed",
                "duration_seconds": 2,
                "from_a_newer_shim": True,
            }
        ).encode()
    )
    assert parsed is not None
    assert parsed.duration_seconds == 2.0


def test_phases_add_up_to_the_wall_time() -> None:
    assert oplog.sum_to(2.0, {"dump": 1.2344, "commit": 0.5}) == {
        "dump": 1.234, "commit": 0.5, "other": 0.266,
    }  # fmt: skip
    assert oplog.sum_to(1.0, {"dump": 1.0}) == {"dump": 1.0}
    assert oplog.sum_to(1.0, {"restore": 0.9, "gpu": 0.0, "pull": 0.0001}) == {
        "restore": 0.9,
        "other": 0.1,
    }


def test_a_round_posts_counts_and_deletes(tmp_path: Path) -> None:
    oplog.write(str(tmp_path), record())
    oplog.write(str(tmp_path), record(pod_uid="", kind=oplog.RESTORE, outcome="restored"))
    spool = oplog.spool_path(str(tmp_path))
    (Path(spool) / "99999999999999999999-1-0.json").write_bytes(b"{")
    api = RecordingApi()
    api.uids[("team-a", "trainer-0")] = "uid-looked-up"
    metrics = AgentMetrics()
    observer = OpsObserver(api, metrics, "node-1")

    assert observer.round(StoreConfig(root=str(tmp_path))) == 3
    assert [(ns, e["reason"], e["involvedObject"].get("uid")) for ns, e in api.events] == [
        ("team-a", "Checkpointed", "uid-1"),
        ("team-a", "Restored", "uid-looked-up"),
    ]
    assert sample(metrics, "cedana_checkpoints_total", trigger="stop", outcome="committed") == 1
    assert sample(metrics, "cedana_restores_total", outcome="restored") == 1
    assert sample(metrics, "cedana_operation_records_lost_total", reason="unreadable") == 1
    assert oplog.records(spool) == []


def test_an_unreachable_api_server_keeps_the_records_for_the_next_round(tmp_path: Path) -> None:
    oplog.write(str(tmp_path), record(checkpoint_id="ck1"))
    oplog.write(str(tmp_path), record(checkpoint_id="ck2"))
    spool = oplog.spool_path(str(tmp_path))
    api = RecordingApi()
    api.failure = KubeError("POST event: connection refused")
    metrics = AgentMetrics()
    observer = OpsObserver(api, metrics, "node-1")

    assert observer.consume(spool) == 0
    assert len(oplog.records(spool)) == 2
    assert sample(metrics, "cedana_checkpoints_total", trigger="stop", outcome="committed") == 0

    api.failure = None
    assert observer.consume(spool) == 2
    assert [e["message"].split()[1] for _, e in api.events] == ["ck1", "ck2"]
    assert sample(metrics, "cedana_checkpoints_total", trigger="stop", outcome="committed") == 2


def test_a_refused_event_is_not_retried(tmp_path: Path) -> None:
    oplog.write(str(tmp_path), record())
    api = RecordingApi()
    api.failure = Rejected("POST event: HTTP 403 Forbidden")
    metrics = AgentMetrics()
    assert OpsObserver(api, metrics, "node-1").round(StoreConfig(root=str(tmp_path))) == 1
    assert sample(metrics, "cedana_checkpoints_total", trigger="stop", outcome="committed") == 1


def test_the_store_gauges(tmp_path: Path) -> None:
    store = make_store(tmp_path)
    first, second = publish(store, "a"), publish(store, "b")
    Outbox(store.root).add(second.id)
    metrics = AgentMetrics()
    OpsObserver(None, metrics, "node-1").round(store.config)
    assert sample(metrics, "cedana_store_checkpoints") == 2
    assert sample(metrics, "cedana_store_size_bytes") == first.size + second.size
    assert sample(metrics, "cedana_pending_pushes") == 1


def test_a_scrape_during_a_round_sees_the_store_gauges_already(
    tmp_path: Path,
) -> None:
    """The gauges are refreshed before the spool is consumed: a scrape while a long
    spool is posted (here: at each event) sees the store already."""
    store = make_store(tmp_path)
    publish(store, "a")
    oplog.write(store.root, record(kind=oplog.RESTORE, outcome="restored"))
    metrics = AgentMetrics()
    seen: list[float] = []

    class ScrapingApi(RecordingApi):
        def create_event(self, namespace: str, event: dict[str, Any]) -> None:
            seen.append(sample(metrics, "cedana_store_checkpoints"))
            super().create_event(namespace, event)

    assert OpsObserver(ScrapingApi(), metrics, "node-1").round(store.config) == 1
    assert seen == [1]


def test_the_observer_thread_outlives_a_failing_round() -> None:
    stop = Stop()
    rounds: list[int] = []

    def chore() -> None:
        rounds.append(len(rounds))
        if len(rounds) == 1:
            raise RuntimeError("the store vanished")
        if len(rounds) == 3:
            stop.event.set()

    thread = in_background(chore, interval=0.01, stop=stop, name="observer")
    thread.join(timeout=10)
    assert not thread.is_alive()
    assert rounds == [0, 1, 2]


def test_the_history_outlives_the_agent(tmp_path: Path) -> None:
    """A new agent (a restart, a new pod of the DaemonSet) starts with the history the
    last one kept in the store, bounded as the deque is, the newest last."""
    store = StoreConfig(root=str(tmp_path))
    for n in range(3):
        oplog.write(str(tmp_path), record(checkpoint_id=f"ck{n}"))
    first: deque[dict[str, Any]] = deque(maxlen=2)
    assert OpsObserver(None, AgentMetrics(), "node-1", first).round(store) == 3
    assert [h["checkpoint_id"] for h in first] == ["ck1", "ck2"]

    oplog.write(str(tmp_path), record(kind=oplog.RESTORE, outcome="restored", checkpoint_id="ck3"))
    later: deque[dict[str, Any]] = deque(maxlen=2)
    assert OpsObserver(None, AgentMetrics(), "node-1", later).round(store) == 1
    assert [(h["checkpoint_id"], h["node"]) for h in later] == [
        ("ck2", "node-1"),
        ("ck3", "node-1"),
    ]
    assert stat.S_IMODE(os.stat(tmp_path / oplog.SPOOL_DIR / "history.jsonl").st_mode) == 0o600


def test_an_unreadable_history_is_an_empty_one(tmp_path: Path) -> None:
    spool = tmp_path / oplog.SPOOL_DIR
    spool.mkdir()
    (spool / "history.jsonl").write_bytes(b'not json\n[1]\n{"checkpoint_id": "ok"}\n')
    history: deque[dict[str, Any]] = deque(maxlen=5)
    OpsObserver(None, AgentMetrics(), "node-1", history).round(StoreConfig(root=str(tmp_path)))
    assert list(history) == [{"checkpoint_id": "ok"}]
