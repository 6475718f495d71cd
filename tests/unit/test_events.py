"""Events leave in order, as containerd's Forward expects them, and survive a reconnect."""

import asyncio
import os
import socket
import tempfile
from typing import Any

from cedana_shim.api.containerd.events import task_pb2 as ev
from cedana_shim.api.containerd.services.ttrpc_events_pb2 import ForwardRequest
from cedana_shim.task.events import EVENTS_SERVICE, TOPICS, Publisher, envelope
from cedana_shim.ttrpc.server import CallContext, Method, Server
from google.protobuf.empty_pb2 import Empty


def test_envelope_is_what_containerd_validates() -> None:
    env = envelope("k8s.io", ev.TaskExit(container_id="c", id="c", pid=7, exit_status=143), 12.5)
    assert env.topic == "/tasks/exit"
    assert env.namespace == "k8s.io"
    assert env.event.type_url == "containerd.events.TaskExit"  # bare: containerd 1.6 needs it
    assert ev.TaskExit.FromString(env.event.value).exit_status == 143
    assert env.timestamp.ToNanoseconds() == 12_500_000_000


def test_every_task_event_has_a_topic() -> None:
    names = {t.DESCRIPTOR.name for t in TOPICS if t.DESCRIPTOR.full_name.startswith("containerd.")}
    assert names == {
        "TaskCreate", "TaskStart", "TaskExit", "TaskDelete", "TaskOOM", "TaskExecAdded",
        "TaskExecStarted", "TaskPaused", "TaskResumed", "TaskCheckpointed",
    }  # fmt: skip


class FakeContainerd:
    """containerd's ttrpc events service, served by our own ttrpc server."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.received: list[tuple[str, str, dict[str, list[str]]]] = []
        self.server: Server | None = None
        self.task: asyncio.Task[None] | None = None

    async def forward(self, req: ForwardRequest, ctx: CallContext) -> Empty:
        self.received.append(
            (
                req.envelope.topic,
                req.envelope.event.type_url,
                {k: list(v) for k, v in ctx.metadata.items()},
            )
        )
        return Empty()

    def start(self) -> None:
        sock = socket.socket(socket.AF_UNIX)
        sock.bind(self.path)
        sock.listen()
        self.server = Server({EVENTS_SERVICE: {"Forward": Method(ForwardRequest, self.forward)}})
        self.task = asyncio.get_running_loop().create_task(self.server.serve_socket(sock))

    async def stop(self) -> None:
        assert self.server is not None and self.task is not None
        self.server.close()
        await self.server.wait_closed()
        self.task.cancel()
        os.unlink(self.path)


async def wait_for(predicate: Any, timeout: float = 5.0) -> None:
    async with asyncio.timeout(timeout):
        while not predicate():
            await asyncio.sleep(0.01)


def test_publisher_delivers_in_order_and_reconnects() -> None:
    async def run() -> None:
        with tempfile.TemporaryDirectory() as tmp:
            path = os.path.join(tmp, "containerd.sock.ttrpc")
            containerd = FakeContainerd(path)
            containerd.start()
            publisher = Publisher("unix://" + path, "default")
            publisher.start()
            for i in range(50):
                publisher.send(ev.TaskExecAdded(container_id="c", exec_id=str(i)))
            await wait_for(lambda: len(containerd.received) == 50)
            assert [r[0] for r in containerd.received] == ["/tasks/exec-added"] * 50
            assert containerd.received[0][2]["containerd-namespace-ttrpc"] == ["default"]

            # containerd restarts: the publisher reconnects and nothing is lost.
            await containerd.stop()
            publisher.send(ev.TaskStart(container_id="c", pid=1))
            publisher.send(ev.TaskExit(container_id="c", id="c", pid=1, exit_status=0))
            await asyncio.sleep(0.3)
            containerd.received.clear()
            containerd.start()
            await wait_for(lambda: len(containerd.received) == 2)
            assert [r[0] for r in containerd.received] == ["/tasks/start", "/tasks/exit"]
            await publisher.close()
            await containerd.stop()

    asyncio.run(run())
