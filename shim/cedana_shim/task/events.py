"""Task events, published to containerd in order.

The service hands events to an event sender (lifecycle/events.py); it never waits
for delivery and never fails because of it. :class:`Publisher` is the production
sender: one queue, one forwarder task, ttrpc ``Events/Forward`` to
``$TTRPC_ADDRESS`` (containerd >= 1.3), reconnecting and retrying each event a
bounded number of times before logging it as lost.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time

from google.protobuf.any_pb2 import Any
from google.protobuf.empty_pb2 import Empty
from google.protobuf.message import Message

from ..api.cedana.v1 import cedana_pb2 as cedana_ev
from ..api.containerd.events import task_pb2 as ev
from ..api.containerd.services.ttrpc_events_pb2 import Envelope, ForwardRequest
from ..errors import ShimError
from ..ttrpc.client import Client

log = logging.getLogger(__name__)

TOPICS: dict[type[Message], str] = {
    ev.TaskCreate: "/tasks/create",
    ev.TaskStart: "/tasks/start",
    ev.TaskExit: "/tasks/exit",
    ev.TaskDelete: "/tasks/delete",
    ev.TaskOOM: "/tasks/oom",
    ev.TaskExecAdded: "/tasks/exec-added",
    ev.TaskExecStarted: "/tasks/exec-started",
    ev.TaskPaused: "/tasks/paused",
    ev.TaskResumed: "/tasks/resumed",
    ev.TaskCheckpointed: "/tasks/checkpointed",
    cedana_ev.CheckpointCommitted: "/cedana/checkpoint/committed",
    cedana_ev.CheckpointFailed: "/cedana/checkpoint/failed",
    cedana_ev.RestoreOutcome: "/cedana/restore",
}
EVENTS_SERVICE = "containerd.services.events.ttrpc.v1.Events"
QUEUE_LIMIT = 2048
MAX_ATTEMPTS = 5
CALL_TIMEOUT = 5.0
DRAIN_TIMEOUT = 5.0


def envelope(namespace: str, event: Message, when: float | None = None) -> Envelope:
    env = Envelope(namespace=namespace, topic=TOPICS[type(event)])
    env.timestamp.FromNanoseconds(int((time.time() if when is None else when) * 1e9))
    # containerd 1.6 resolves bare type names; Any.Pack would add a URL prefix.
    env.event.CopyFrom(Any(type_url=event.DESCRIPTOR.full_name, value=event.SerializeToString()))
    return env


class Publisher:
    """Forwards events to containerd's ttrpc events service, in order."""

    def __init__(self, ttrpc_address: str, namespace: str) -> None:
        self._address = ttrpc_address.removeprefix("unix://")
        self._namespace = namespace
        self._queue: asyncio.Queue[Envelope] = asyncio.Queue(QUEUE_LIMIT)
        self._client: Client | None = None
        self._task: asyncio.Task[None] | None = None

    def start(self) -> None:
        self._task = asyncio.get_running_loop().create_task(self._forward())

    def send(self, event: Message) -> None:
        env = envelope(self._namespace, event)
        try:
            self._queue.put_nowait(env)
        except asyncio.QueueFull:
            log.error("event queue full, dropping event", extra={"topic": env.topic})

    async def close(self) -> None:
        """Deliver what is queued (bounded), then stop."""
        try:
            await asyncio.wait_for(self._queue.join(), DRAIN_TIMEOUT)
        except TimeoutError:
            log.warning("gave up delivering events", extra={"pending": self._queue.qsize()})
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        if self._client is not None:
            await self._client.close()

    async def _forward(self) -> None:
        while True:
            env = await self._queue.get()
            try:
                await self._deliver(env)
            finally:
                self._queue.task_done()

    async def _deliver(self, env: Envelope) -> None:
        for attempt in range(1, MAX_ATTEMPTS + 1):
            try:
                if self._client is None or self._client.closed:
                    self._client = await Client.connect(self._address, timeout=CALL_TIMEOUT)
                await self._client.call(
                    EVENTS_SERVICE,
                    "Forward",
                    ForwardRequest(envelope=env),
                    Empty,
                    timeout=CALL_TIMEOUT,
                    metadata={"containerd-namespace-ttrpc": self._namespace},
                )
                return
            except (ShimError, OSError, TimeoutError) as err:
                if self._client is not None:
                    await self._client.close()
                    self._client = None
                if attempt == MAX_ATTEMPTS:
                    log.error(
                        "event lost after retries",
                        extra={"topic": env.topic, "attempts": attempt, "error": str(err)},
                    )
                    return
                # Back off over ~4 s: long enough to ride out a containerd restart.
                await asyncio.sleep(0.25 * 2 ** (attempt - 1))
