"""containerd's event stream (Events/Subscribe over gRPC), for event-driven waits in the
checkpoint/restore tests.

`ctr events` drops events whose type it cannot resolve, which is every cedana event
(`/cedana/checkpoint/committed`, `/cedana/checkpoint/failed`, `/cedana/restore`), so
the tests subscribe themselves. The bindings for containerd's events service are not
in the repo; the envelope containerd streams has the same fields as the ttrpc
`Envelope` the shim forwards (timestamp=1, namespace=2, topic=3, event=4), and the
requests are one or two fields, encoded by hand:

    message SubscribeRequest { repeated string filters = 1; }
    message PublishRequest { string topic = 1; google.protobuf.Any event = 2; }
"""

# grpcio ships no type stubs.
# mypy: disable-error-code="import-untyped"

from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import grpc
from cedana_shim.api.cedana.v1 import cedana_pb2 as cedana_ev
from cedana_shim.api.containerd.events import task_pb2 as task_ev
from cedana_shim.api.containerd.services.ttrpc_events_pb2 import Envelope
from cedana_shim.wire import bytes_field
from google.protobuf import any_pb2
from google.protobuf.message import Message

from .util import WaitTimeout, slower

_SERVICE = "/containerd.services.events.v1.Events"
_SYNC_TOPIC = "/cedana-itest/sync"

TOPIC_COMMITTED = "/cedana/checkpoint/committed"
TOPIC_FAILED = "/cedana/checkpoint/failed"
TOPIC_RESTORE = "/cedana/restore"
TOPIC_EXIT = "/tasks/exit"
TOPIC_OOM = "/tasks/oom"

_DECODERS: dict[str, type[Message]] = {
    TOPIC_COMMITTED: cedana_ev.CheckpointCommitted,
    TOPIC_FAILED: cedana_ev.CheckpointFailed,
    TOPIC_RESTORE: cedana_ev.RestoreOutcome,
    TOPIC_EXIT: task_ev.TaskExit,
    TOPIC_OOM: task_ev.TaskOOM,
    "/tasks/start": task_ev.TaskStart,
    "/tasks/create": task_ev.TaskCreate,
    "/tasks/delete": task_ev.TaskDelete,
}


@dataclass(frozen=True)
class Event:
    namespace: str
    topic: str
    type_url: str
    message: Message | None  # decoded payload for the topics in _DECODERS
    received: float  # time.monotonic() when the harness got it

    def field(self, name: str) -> object:
        return getattr(self.message, name) if self.message is not None else None

    @property
    def checkpoint_id(self) -> str:
        return str(self.field("checkpoint_id") or "")


class EventStream:
    """Every event containerd publishes from the moment `open()` returns (a sync event
    round-trip proves the subscription is live before the test acts)."""

    def __init__(self, socket: Path) -> None:
        self._socket = socket
        self._channel = grpc.insecure_channel(f"unix://{socket}")
        self._events: list[Event] = []
        self._cond = threading.Condition()
        self._call: grpc.Future | None = None
        self._thread: threading.Thread | None = None
        self._error: BaseException | None = None

    def open(self, timeout: float = 10) -> EventStream:
        subscribe = self._channel.unary_stream(
            f"{_SERVICE}/Subscribe",
            request_serializer=lambda b: b,
            response_deserializer=Envelope.FromString,
        )
        self._call = subscribe(b"")
        self._thread = threading.Thread(target=self._pump, daemon=True, name="events")
        self._thread.start()
        token = uuid.uuid4().hex
        deadline = time.monotonic() + timeout
        # Publish until our own sync event comes back: then the server has us.
        while True:
            self._publish_sync(token)
            try:
                self.wait(
                    lambda e: e.topic == _SYNC_TOPIC and e.type_url.endswith(token),
                    timeout=0.5,
                    what="the event subscription to be live",
                )
                return self
            except WaitTimeout:
                if time.monotonic() > deadline:
                    raise

    def _publish_sync(self, token: str) -> None:
        publish = self._channel.unary_unary(
            f"{_SERVICE}/Publish",
            request_serializer=lambda b: b,
            response_deserializer=lambda b: b,
        )
        event = any_pb2.Any(type_url=f"cedana-itest.Sync/{token}", value=b"")
        publish(
            bytes_field(1, _SYNC_TOPIC.encode()) + bytes_field(2, event.SerializeToString()),
            metadata=[("containerd-namespace", "default")],
            timeout=10,
        )

    def _pump(self) -> None:
        assert self._call is not None
        try:
            for env in self._call:
                decoder = _DECODERS.get(env.topic)
                message = None
                if decoder is not None:
                    message = decoder.FromString(env.event.value)
                event = Event(
                    env.namespace, env.topic, env.event.type_url, message, time.monotonic()
                )
                with self._cond:
                    self._events.append(event)
                    self._cond.notify_all()
        except grpc.RpcError as exc:
            if exc.code() != grpc.StatusCode.CANCELLED:
                self._error = exc
        finally:
            with self._cond:
                self._cond.notify_all()

    def close(self) -> None:
        if self._call is not None:
            self._call.cancel()
        if self._thread is not None:
            self._thread.join(5)
        self._channel.close()

    def __enter__(self) -> EventStream:
        return self.open()

    def __exit__(self, *exc: object) -> None:
        self.close()

    # -- queries ----------------------------------------------------------------------

    def events(self, predicate: Callable[[Event], bool] | None = None) -> list[Event]:
        with self._cond:
            return [e for e in self._events if predicate is None or predicate(e)]

    def wait(
        self, predicate: Callable[[Event], bool], *, timeout: float, what: str = "an event"
    ) -> Event:
        timeout *= slower()
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                for e in self._events:
                    if predicate(e):
                        return e
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    seen = [(e.topic, e.field("container_id")) for e in self._events[-20:]]
                    raise WaitTimeout(
                        f"timed out after {timeout:.1f}s waiting for {what}; "
                        f"last events: {seen}; stream error: {self._error!r}"
                    )
                if self._error is not None:
                    raise WaitTimeout(f"event stream broke waiting for {what}: {self._error!r}")
                self._cond.wait(min(remaining, 0.5))

    def wait_topic(
        self, topic: str, container_id: str, *, timeout: float, since: int = 0, **fields: object
    ) -> Event:
        """The first `topic` event for `container_id` (index >= `since`) whose decoded
        payload has all of `fields`."""

        def match(e: Event) -> bool:
            return (
                e.topic == topic
                and e.field("container_id") == container_id
                and all(e.field(k) == v for k, v in fields.items())
            )

        def indexed(e: Event) -> bool:
            return match(e) and self._index(e) >= since

        return self.wait(indexed, timeout=timeout, what=f"{topic} for {container_id} {fields}")

    def wait_commit(self, container_id: str, *, timeout: float, since: int = 0) -> Event:
        """The `/cedana/checkpoint/committed` event of the container's next checkpoint;
        a `/cedana/checkpoint/failed` for it fails at once, with the shim's error."""

        def done(e: Event) -> bool:
            return (
                e.topic in (TOPIC_COMMITTED, TOPIC_FAILED)
                and e.field("container_id") == container_id
                and self._index(e) >= since
            )

        event = self.wait(done, timeout=timeout, what=f"the checkpoint of {container_id}")
        if event.topic == TOPIC_FAILED:
            raise AssertionError(
                f"the checkpoint of {container_id} ({event.field('reason')}) failed: "
                f"{event.field('error')}"
            )
        return event

    def _index(self, event: Event) -> int:
        for i, e in enumerate(self._events):
            if e is event:
                return i
        return -1

    def mark(self) -> int:
        """A position: `wait_topic(..., since=mark)` ignores what came before."""
        with self._cond:
            return len(self._events)

    def of(self, topic: str, container_id: str) -> list[Event]:
        return self.events(lambda e: e.topic == topic and e.field("container_id") == container_id)
