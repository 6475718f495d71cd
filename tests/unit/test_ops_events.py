"""Pod Events from operation records (node/kube_events.py) and their delivery through
the real kubernetes client (node/kube.py).

No kube-apiserver can be installed here (no PyPI wheel carries one with etcd), so the
delivery tests run the client against a small HTTP stand-in that records each request
and answers as the API server does (201, 409 AlreadyExists, 403, 404, 500)."""

from __future__ import annotations

import json
import threading
from collections.abc import Iterator
from datetime import datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest
from cedana_shim.checkpoint import oplog
from cedana_shim.node.kube import KubeError, KubernetesApi, Rejected
from cedana_shim.node.kube_events import MESSAGE_LIMIT, events_for, human_bytes
from test_ops_spool import record


def reasons(rec: oplog.OpRecord) -> list[tuple[str, str]]:
    return [(e["type"], e["reason"]) for e in events_for(rec, "0001-1-0.json", "node-1")]


def test_checkpointed_says_id_trigger_size_and_duration() -> None:
    (event,) = events_for(record(size_bytes=3 << 20), "0001-1-0.json", "node-1")
    assert (event["type"], event["reason"]) == ("Normal", "Checkpointed")
    assert event["message"] == (
        "Checkpoint ck1 of container main (label web), trigger stop: 3.0 MiB in 1.50s "
        "(freeze 0.10s, dump 1.20s, commit 0.20s)"
    )
    assert event["involvedObject"] == {
        "apiVersion": "v1",
        "kind": "Pod",
        "namespace": "team-a",
        "name": "trainer-0",
        "uid": "uid-1",
        "fieldPath": "spec.containers{main}",
    }
    assert event["metadata"]["namespace"] == "team-a"
    assert event["metadata"]["name"].startswith("trainer-0.")
    assert event["source"] == {"component": "cedana-node-agent", "host": "node-1"}
    assert event["firstTimestamp"] == event["lastTimestamp"] == "2027-01-15T08:00:00Z"
    assert event["count"] == 1


def test_the_same_record_names_its_events_the_same() -> None:
    first = events_for(record(), "0001-1-0.json", "node-1")
    assert first == events_for(record(), "0001-1-0.json", "node-1")
    assert (
        first[0]["metadata"]["name"]
        != (events_for(record(), "0002-1-0.json", "node-1")[0]["metadata"]["name"])
    )


def test_checkpoint_failed() -> None:
    failed = record(outcome="failed", checkpoint_id="", detail="criu failed: EPERM")
    (event,) = events_for(failed, "n.json", "node-1")
    assert (event["type"], event["reason"]) == ("Warning", "CheckpointFailed")
    assert event["message"].endswith("failed after 1.50s: criu failed: EPERM")


def test_restores() -> None:
    restored = record(kind=oplog.RESTORE, outcome="restored", trigger="")
    assert reasons(restored) == [("Normal", "Restored")]
    (event,) = events_for(restored, "n.json", "node-1")
    assert event["message"].startswith("Container main (label web) restored from checkpoint ck1")

    fell_back = record(
        kind=oplog.RESTORE, outcome="fell_back", skipped=["ck2: restore failed: criu failed"]
    )
    assert reasons(fell_back) == [("Warning", "RestoreFellBack"), ("Normal", "Restored")]
    warning = events_for(fell_back, "n.json", "node-1")[0]
    assert "passed over ck2: restore failed: criu failed; restored from ck1" in warning["message"]
    names = [e["metadata"]["name"] for e in events_for(fell_back, "n.json", "node-1")]
    assert len(set(names)) == 2

    failed = record(
        kind=oplog.RESTORE, outcome="failed", checkpoint_id="", skipped=["ck2: damaged"]
    )
    assert reasons(failed) == [("Warning", "RestoreFellBack")]
    assert events_for(failed, "n.json", "node-1")[0]["message"].endswith(
        "passed over ck2: damaged; started without its checkpoint"
    )
    assert reasons(record(kind=oplog.RESTORE, outcome="cold", checkpoint_id="")) == []


def test_no_pod_no_event_and_background_work_has_none() -> None:
    assert reasons(record(pod="")) == []  # a container outside Kubernetes (ctr)
    assert reasons(record(kind=oplog.COMPACTION, outcome="done")) == []
    assert reasons(record(kind=oplog.PUSH, outcome="done")) == []


def test_long_messages_are_cut_to_the_api_limit() -> None:
    (event,) = events_for(record(outcome="failed", detail="x" * 5000), "n.json", "node-1")
    assert len(event["message"]) == MESSAGE_LIMIT
    assert event["message"].endswith("...")


def test_human_bytes() -> None:
    assert [human_bytes(n) for n in (0, 1023, 1024, 5 << 30, 3 << 40)] == [
        "0 B", "1023 B", "1.0 KiB", "5.0 GiB", "3072.0 GiB",
    ]  # fmt: skip


class StandIn:
    """Records every request; answers POST events and GET pods as the API server would."""

    def __init__(self) -> None:
        self.requests: list[tuple[str, str, Any]] = []
        self.event_names: set[str] = set()
        self.pods = {("team-a", "trainer-0"): "uid-from-api"}
        self.status_override: int | None = None
        owner = self

        class Handler(BaseHTTPRequestHandler):
            # Headers and body leave in two writes: with Nagle each reply would wait out
            # the client's delayed ACK (40 ms a request).
            disable_nagle_algorithm = True

            def log_message(self, *args: Any) -> None:
                pass

            def _send(self, code: int, body: dict[str, Any]) -> None:
                data = json.dumps(body).encode()
                self.send_response(code)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                owner.requests.append(("POST", self.path, body))
                if owner.status_override:
                    self._send(owner.status_override, _status(owner.status_override))
                    return
                name = body["metadata"]["name"]
                if name in owner.event_names:
                    self._send(409, _status(409))
                    return
                owner.event_names.add(name)
                self._send(201, body)

            def do_GET(self) -> None:
                owner.requests.append(("GET", self.path, None))
                parts = self.path.split("/")  # /api/v1/namespaces/NS/pods/NAME
                uid = owner.pods.get((parts[4], parts[6]))
                if uid is None:
                    self._send(404, _status(404))
                    return
                self._send(200, {"apiVersion": "v1", "kind": "Pod",
                                 "metadata": {"name": parts[6], "uid": uid}})  # fmt: skip

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.thread = threading.Thread(
            target=self.httpd.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True
        )
        self.thread.start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.httpd.server_address[1]}"

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def _status(code: int) -> dict[str, Any]:
    return {"apiVersion": "v1", "kind": "Status", "status": "Failure", "code": code}


@pytest.fixture
def stand_in() -> Iterator[StandIn]:
    server = StandIn()
    yield server
    server.close()


def test_events_reach_the_api_server_and_a_repeat_is_harmless(stand_in: StandIn) -> None:
    api = KubernetesApi(api_url=stand_in.url)
    (event,) = events_for(record(), "0001-1-0.json", "node-1")
    api.create_event("team-a", event)
    api.create_event("team-a", event)  # the first answer was lost: 409, taken as posted
    method, path, body = stand_in.requests[0]
    assert (method, path) == ("POST", "/api/v1/namespaces/team-a/events")
    # The client writes the timestamps as RFC 3339 with +00:00 for Z: the same instant.
    for key in ("firstTimestamp", "lastTimestamp"):
        assert datetime.fromisoformat(body.pop(key)) == datetime.fromisoformat(event[key])
    assert body == {k: v for k, v in event.items() if not k.endswith("Timestamp")}
    assert len(stand_in.event_names) == 1


def test_pod_uid_lookup(stand_in: StandIn) -> None:
    api = KubernetesApi(api_url=stand_in.url)
    assert api.pod_uid("team-a", "trainer-0") == "uid-from-api"
    assert api.pod_uid("team-a", "gone-0") == ""
    assert stand_in.requests[0][:2] == ("GET", "/api/v1/namespaces/team-a/pods/trainer-0")


def test_refusals_and_outages_are_told_apart(stand_in: StandIn) -> None:
    api = KubernetesApi(api_url=stand_in.url)
    (event,) = events_for(record(), "0001-1-0.json", "node-1")
    stand_in.status_override = 403
    with pytest.raises(Rejected, match="HTTP 403"):
        api.create_event("team-a", event)
    stand_in.status_override = 500
    with pytest.raises(KubeError) as err:
        api.create_event("team-a", event)
    assert not isinstance(err.value, Rejected)
