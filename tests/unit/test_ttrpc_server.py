"""ttrpc server: behaviour over an in-memory stream, then live over a real unix socket."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import random
import shutil
import socket
import struct
import tempfile
from collections.abc import AsyncIterator, Coroutine, Iterable
from typing import Any, TypeVar

import pytest
from cedana_shim import errors
from cedana_shim.api.ttrpc.request_pb2 import KeyValue, Request, Response
from cedana_shim.errors import Code
from cedana_shim.ttrpc import server as server_module
from cedana_shim.ttrpc.codec import (
    MESSAGE_LENGTH_MAX,
    NEED_DATA,
    Frame,
    FrameDecoder,
    MessageType,
    encode_frame,
)
from cedana_shim.ttrpc.server import CallContext, Method, Server, Services
from google.protobuf.message import Message
from google.protobuf.wrappers_pb2 import BytesValue, StringValue

T = TypeVar("T")
SVC = "test.v1.Echo"


def run(coro: Coroutine[Any, Any, T], timeout: float = 10.0) -> T:
    async def main() -> T:
        async with asyncio.timeout(timeout):
            return await coro

    return asyncio.run(main())


def request_frame(
    stream_id: int,
    method: str = "Echo",
    message: Message | None = None,
    *,
    service: str = SVC,
    payload: bytes | None = None,
    timeout_nano: int = 0,
    metadata: Iterable[tuple[str, str]] = (),
) -> bytes:
    if payload is None:
        payload = (message or StringValue(value="hi")).SerializeToString()
    envelope = Request(
        service=service,
        method=method,
        payload=payload,
        timeout_nano=timeout_nano,
        metadata=[KeyValue(key=k, value=v) for k, v in metadata],
    )
    return encode_frame(Frame(stream_id, MessageType.REQUEST, 0, envelope.SerializeToString()))


class MemoryStream:
    """In-memory Stream: the test plays the client, responses are decoded as they arrive."""

    def __init__(self) -> None:
        self._inbound = bytearray()
        self._eof = False
        self._readable = asyncio.Event()
        self._decoder = FrameDecoder()
        self.responses: asyncio.Queue[tuple[int, Response]] = asyncio.Queue()
        self.frames: list[Frame] = []
        self.closed = False
        self.fail_writes = False

    def send(self, data: bytes) -> None:
        self._inbound += data
        self._readable.set()

    def send_eof(self) -> None:
        self._eof = True
        self._readable.set()

    async def read(self, max_bytes: int) -> bytes:
        while not self._inbound and not self._eof:
            self._readable.clear()
            await self._readable.wait()
        data = bytes(self._inbound[:max_bytes])
        del self._inbound[:max_bytes]
        return data

    async def write(self, data: bytes) -> None:
        if self.closed or self.fail_writes:
            raise BrokenPipeError("peer gone")
        await asyncio.sleep(0)
        self._decoder.feed(data)
        while (event := self._decoder.next_event()) is not NEED_DATA:
            assert isinstance(event, Frame)
            assert event.type == MessageType.RESPONSE and event.flags == 0
            self.frames.append(event)
            self.responses.put_nowait((event.stream_id, Response.FromString(event.payload)))

    def close(self) -> None:
        self.closed = True

    async def response(self, timeout: float = 2.0) -> tuple[int, Response]:
        async with asyncio.timeout(timeout):
            return await self.responses.get()


async def echo(request: StringValue, ctx: CallContext) -> StringValue:
    return StringValue(value=f"echo {request.value}")


ECHO: Services = {SVC: {"Echo": Method(StringValue, echo)}}


class Harness:
    def __init__(self, services: Services) -> None:
        self.server = Server(services, check_peer_uid=False)
        self.stream = MemoryStream()
        self.task = asyncio.create_task(self.server.serve_stream(self.stream))

    async def expect(self, stream_id: int, code: Code, message: str | None = None) -> Response:
        got_id, response = await self.stream.response()
        assert got_id == stream_id
        assert response.HasField("status")
        assert response.status.code == code, response.status
        if message is not None:
            assert response.status.message == message
        if code != Code.OK:
            assert response.payload == b"", "errors carry no payload"
        return response

    async def expect_echo(self, stream_id: int) -> None:
        self.stream.send(request_frame(stream_id))
        response = await self.expect(stream_id, Code.OK)
        assert StringValue.FromString(response.payload).value == "echo hi"

    async def finish(self) -> None:
        self.stream.send_eof()
        await self.task


# -- in-memory ---------------------------------------------------------------------------


def test_unary_call_sends_empty_ok_status_and_payload() -> None:
    async def main() -> None:
        h = Harness(ECHO)
        h.stream.send(request_frame(1, message=StringValue(value="x")))
        response = await h.expect(1, Code.OK, "")
        assert StringValue.FromString(response.payload).value == "echo x"
        # Go's server sends status as a present-but-empty message: field 1, length 0.
        assert h.stream.frames[0].payload.startswith(b"\x0a\x00")
        await h.finish()
        assert h.stream.closed

    run(main())


def test_call_context_carries_metadata_and_timeout() -> None:
    seen: list[CallContext] = []

    async def record(request: StringValue, ctx: CallContext) -> StringValue:
        seen.append(ctx)
        return request

    async def main() -> None:
        h = Harness({SVC: {"Record": Method(StringValue, record)}})
        meta = [("containerd-namespace-ttrpc", "k8s.io"), ("x", "1"), ("x", "2")]
        h.stream.send(request_frame(1, "Record", timeout_nano=2_500_000_000, metadata=meta))
        await h.expect(1, Code.OK)
        h.stream.send(request_frame(3, "Record", timeout_nano=-5))
        await h.expect(3, Code.OK)
        await h.finish()

    run(main())
    assert seen[0].service == SVC and seen[0].method == "Record"
    assert dict(seen[0].metadata) == {"containerd-namespace-ttrpc": ("k8s.io",), "x": ("1", "2")}
    assert seen[0].timeout == 2.5
    assert seen[1].timeout is None and dict(seen[1].metadata) == {}


def test_concurrent_calls_are_answered_in_completion_order() -> None:
    release = asyncio.Event()
    started: list[str] = []

    async def slow(request: StringValue, ctx: CallContext) -> StringValue:
        started.append("slow")
        await release.wait()
        return StringValue(value="slow")

    async def fast(request: StringValue, ctx: CallContext) -> StringValue:
        started.append("fast")
        return StringValue(value="fast")

    async def main() -> None:
        h = Harness({SVC: {"Slow": Method(StringValue, slow), "Fast": Method(StringValue, fast)}})
        h.stream.send(request_frame(1, "Slow") + request_frame(3, "Fast"))
        response = await h.expect(3, Code.OK)
        assert StringValue.FromString(response.payload).value == "fast"
        assert started == ["slow", "fast"], "the slow call was already running"
        release.set()
        response = await h.expect(1, Code.OK)
        assert StringValue.FromString(response.payload).value == "slow"
        await h.finish()

    run(main())


def test_many_interleaved_calls_each_answered_once() -> None:
    rng = random.Random(7)

    async def jitter(request: StringValue, ctx: CallContext) -> StringValue:
        await asyncio.sleep(rng.random() / 100)
        return request

    async def main() -> None:
        h = Harness({SVC: {"J": Method(StringValue, jitter)}})
        ids = list(range(1, 200, 2))
        h.stream.send(b"".join(request_frame(i, "J", StringValue(value=str(i))) for i in ids))
        answers = {}
        for _ in ids:
            stream_id, response = await h.stream.response()
            assert stream_id not in answers
            answers[stream_id] = StringValue.FromString(response.payload).value
        assert answers == {i: str(i) for i in ids}
        await h.finish()

    run(main())


@pytest.mark.parametrize(
    ("ids", "bad", "message"),
    [
        ([2], 2, "StreamID must be odd for client initiated streams"),
        ([0], 0, "StreamID must be odd for client initiated streams"),
        ([5, 5], 5, "StreamID cannot be re-used and must increment"),
        ([5, 3], 3, "StreamID cannot be re-used and must increment"),
    ],
)
def test_bad_stream_ids_are_invalid_argument_and_serving_continues(
    ids: list[int], bad: int, message: str
) -> None:
    calls: list[str] = []

    async def count(request: StringValue, ctx: CallContext) -> StringValue:
        calls.append(request.value)
        return request

    async def main() -> None:
        h = Harness({SVC: {"Echo": Method(StringValue, count)}})
        for i in ids[:-1]:
            h.stream.send(request_frame(i))
            await h.expect(i, Code.OK)
        h.stream.send(request_frame(bad))
        await h.expect(bad, Code.INVALID_ARGUMENT, message)
        h.stream.send(request_frame(7))
        await h.expect(7, Code.OK)
        await h.finish()

    run(main())
    assert len(calls) == len(ids), "the rejected request never reached the handler"


def test_data_and_unknown_frames_are_ignored() -> None:
    async def main() -> None:
        h = Harness(ECHO)
        h.stream.send(encode_frame(Frame(1, MessageType.DATA, 0x01, b"stream data")))
        h.stream.send(encode_frame(Frame(3, 0x7F, 0, b"future type")))
        h.stream.send(encode_frame(Frame(4, MessageType.RESPONSE, 0, b"")))
        # The ignored frames consumed no stream id: 1 is still a fresh request id.
        await h.expect_echo(1)
        assert len(h.stream.frames) == 1
        await h.finish()

    run(main())


def test_oversized_frame_is_resource_exhausted_and_connection_stays_in_sync() -> None:
    async def main() -> None:
        h = Harness(ECHO)
        size = MESSAGE_LENGTH_MAX + 1
        h.stream.send(struct.pack(">IIBB", size, 5, 1, 0) + bytes(size))
        await h.expect(
            5,
            Code.RESOURCE_EXHAUSTED,
            f"message length {size} exceed maximum message size of {MESSAGE_LENGTH_MAX}",
        )
        # Go does not count an oversized request as seen: 5 is not burned.
        await h.expect_echo(5)
        await h.finish()

    run(main())


@pytest.mark.parametrize(
    "envelope",
    [b"\xff\xff\xff", b"\x0a\x05ab", b"\x0a\x02\xff\xfe"],
    ids=["garbage", "truncated field", "bad utf-8 service"],
)
def test_undecodable_envelope_is_invalid_argument(envelope: bytes) -> None:
    async def main() -> None:
        h = Harness(ECHO)
        h.stream.send(encode_frame(Frame(1, MessageType.REQUEST, 0, envelope)))
        response = await h.expect(1, Code.INVALID_ARGUMENT)
        assert response.status.message.startswith("bad request")
        await h.expect_echo(3)
        await h.finish()

    run(main())


def test_undecodable_payload_is_invalid_argument() -> None:
    async def main() -> None:
        h = Harness(ECHO)
        h.stream.send(request_frame(1, payload=b"\x0a\x05ab"))
        response = await h.expect(1, Code.INVALID_ARGUMENT)
        assert response.status.message.startswith(f"bad {SVC}/Echo request")
        await h.expect_echo(3)
        await h.finish()

    run(main())


def test_unknown_service_and_method_are_unimplemented() -> None:
    async def main() -> None:
        h = Harness(ECHO)
        h.stream.send(request_frame(1, service="nope.v1.Nope"))
        await h.expect(1, Code.UNIMPLEMENTED, "service nope.v1.Nope")
        h.stream.send(request_frame(3, method="Shout"))
        await h.expect(3, Code.UNIMPLEMENTED, "method Shout")
        await h.finish()

    run(main())


def test_shim_error_becomes_its_status_without_a_traceback(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def missing(request: StringValue, ctx: CallContext) -> StringValue:
        raise errors.NotFound("container abc not found")

    async def main() -> None:
        h = Harness({SVC: {"Get": Method(StringValue, missing)}})
        h.stream.send(request_frame(1, "Get"))
        await h.expect(1, Code.NOT_FOUND, "container abc not found")
        await h.finish()

    with caplog.at_level(logging.DEBUG):
        run(main())
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]


def test_unexpected_exception_is_unknown_and_logged_with_traceback(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async def broken(request: StringValue, ctx: CallContext) -> StringValue:
        raise RuntimeError("bug in handler")

    async def main() -> None:
        h = Harness({SVC: {"Broken": Method(StringValue, broken), **ECHO[SVC]}})
        h.stream.send(request_frame(1, "Broken"))
        await h.expect(1, Code.UNKNOWN, "bug in handler")
        await h.expect_echo(3)
        await h.finish()

    with caplog.at_level(logging.ERROR, logger=server_module.__name__):
        run(main())
    [record] = [r for r in caplog.records if r.levelno >= logging.ERROR]
    assert record.name == server_module.__name__
    assert record.exc_info is not None and isinstance(record.exc_info[1], RuntimeError)
    assert f"{SVC}/Broken" in record.getMessage()


def test_deadline_from_timeout_nano_is_deadline_exceeded() -> None:
    cancelled = asyncio.Event()

    async def hang(request: StringValue, ctx: CallContext) -> StringValue:
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            cancelled.set()
            raise
        return request

    async def main() -> None:
        h = Harness({SVC: {"Hang": Method(StringValue, hang)}})
        loop = asyncio.get_running_loop()
        start = loop.time()
        h.stream.send(request_frame(1, "Hang", timeout_nano=50_000_000))
        response = await h.expect(1, Code.DEADLINE_EXCEEDED)
        assert loop.time() - start < 1.0
        assert "deadline" in response.status.message
        assert cancelled.is_set(), "the handler was cancelled, not abandoned"
        await h.finish()

    run(main())


def test_handlers_own_timeout_error_is_not_a_deadline(caplog: pytest.LogCaptureFixture) -> None:
    async def times_out(request: StringValue, ctx: CallContext) -> StringValue:
        raise TimeoutError("runc took too long")

    async def main() -> None:
        h = Harness({SVC: {"T": Method(StringValue, times_out)}})
        h.stream.send(request_frame(1, "T", timeout_nano=60_000_000_000))
        await h.expect(1, Code.UNKNOWN, "runc took too long")
        await h.finish()

    with caplog.at_level(logging.ERROR):
        run(main())


def test_oversized_response_is_resource_exhausted() -> None:
    async def big(request: StringValue, ctx: CallContext) -> BytesValue:
        return BytesValue(value=bytes(MESSAGE_LENGTH_MAX))

    async def main() -> None:
        h = Harness({SVC: {"Big": Method(StringValue, big), **ECHO[SVC]}})
        h.stream.send(request_frame(1, "Big"))
        response = await h.expect(1, Code.RESOURCE_EXHAUSTED)
        assert "exceeds maximum message size" in response.status.message
        await h.expect_echo(3)
        await h.finish()

    run(main())


def test_truncated_frame_at_eof_closes_the_connection(caplog: pytest.LogCaptureFixture) -> None:
    async def main() -> None:
        h = Harness(ECHO)
        await h.expect_echo(1)
        h.stream.send(request_frame(3)[:-2])
        h.stream.send_eof()
        await h.task
        assert h.stream.closed
        assert h.stream.responses.empty()

    with caplog.at_level(logging.WARNING):
        run(main())
    assert any("EOF inside a frame" in r.getMessage() for r in caplog.records)


def test_client_disconnect_with_calls_in_flight_drops_their_responses(
    caplog: pytest.LogCaptureFixture,
) -> None:
    entered = asyncio.Event()
    cancelled = asyncio.Event()

    async def wait(request: StringValue, ctx: CallContext) -> StringValue:
        entered.set()
        try:
            await asyncio.sleep(60)
        except asyncio.CancelledError:
            cancelled.set()
            raise
        return request

    async def main() -> None:
        h = Harness({SVC: {"Wait": Method(StringValue, wait)}})
        h.stream.send(request_frame(1, "Wait") + request_frame(3, "Wait"))
        await entered.wait()
        h.stream.send_eof()
        await h.task
        assert cancelled.is_set()
        assert h.stream.closed
        assert h.stream.frames == []

    with caplog.at_level(logging.DEBUG):
        run(main())
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


def test_failed_write_ends_only_that_connection(caplog: pytest.LogCaptureFixture) -> None:
    async def main() -> None:
        server = Server(ECHO, check_peer_uid=False)
        bad, good = MemoryStream(), MemoryStream()
        bad.fail_writes = True
        bad_task = asyncio.create_task(server.serve_stream(bad))
        good_task = asyncio.create_task(server.serve_stream(good))
        bad.send(request_frame(1))
        await bad_task  # ends on its own, no EOF needed
        assert bad.closed
        good.send(request_frame(1))
        stream_id, response = await good.response()
        assert (stream_id, response.status.code) == (1, Code.OK)
        good.send_eof()
        await good_task

    with caplog.at_level(logging.DEBUG):
        run(main())
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]


def test_broken_connection_does_not_affect_another() -> None:
    release = asyncio.Event()

    async def slow(request: StringValue, ctx: CallContext) -> StringValue:
        await release.wait()
        return request

    async def main() -> None:
        server = Server({SVC: {"Slow": Method(StringValue, slow), **ECHO[SVC]}})
        one, two = MemoryStream(), MemoryStream()
        one_task = asyncio.create_task(server.serve_stream(one))
        two_task = asyncio.create_task(server.serve_stream(two))
        one.send(request_frame(1, "Slow"))
        two.send(request_frame(1, "Slow"))
        await asyncio.sleep(0.01)
        one.send(b"\x00\x00\x00\x09garbage")
        one.send_eof()
        await one_task
        release.set()
        stream_id, response = await two.response()
        assert (stream_id, response.status.code) == (1, Code.OK)
        two.send(request_frame(3))
        stream_id, response = await two.response()
        assert (stream_id, response.status.code) == (3, Code.OK)
        assert one.frames == []
        two.send_eof()
        await two_task

    run(main())


def test_close_stops_reading_but_lets_calls_in_flight_finish() -> None:
    release = asyncio.Event()
    entered = asyncio.Event()

    async def slow(request: StringValue, ctx: CallContext) -> StringValue:
        entered.set()
        await release.wait()
        return StringValue(value="done")

    async def main() -> None:
        h = Harness({SVC: {"Slow": Method(StringValue, slow), **ECHO[SVC]}})
        h.stream.send(request_frame(1, "Slow"))
        await entered.wait()
        h.server.close()
        h.stream.send(request_frame(3))
        closed = asyncio.create_task(h.server.wait_closed())
        await asyncio.sleep(0.02)
        assert not closed.done() and not h.task.done()
        release.set()
        response = await h.expect(1, Code.OK)
        assert StringValue.FromString(response.payload).value == "done"
        await h.task
        await closed
        assert h.stream.closed
        assert [f.stream_id for f in h.stream.frames] == [1], "request 3 came after close()"
        # A closed server refuses new connections at once.
        late = MemoryStream()
        await h.server.serve_stream(late)
        assert late.closed

    run(main())


def test_a_shutdown_handler_can_close_the_server_and_still_answer() -> None:
    holder: list[Server] = []

    async def shutdown(request: StringValue, ctx: CallContext) -> StringValue:
        holder[0].close()
        await asyncio.sleep(0.01)
        return StringValue(value="bye")

    async def main() -> None:
        h = Harness({SVC: {"Shutdown": Method(StringValue, shutdown)}})
        holder.append(h.server)
        h.stream.send(request_frame(1, "Shutdown"))
        await h.server.wait_closed()
        response = await h.expect(1, Code.OK)
        assert StringValue.FromString(response.payload).value == "bye"
        assert h.task.done() and h.stream.closed

    run(main())


# -- live, over a real unix socket -------------------------------------------------------


@contextlib.asynccontextmanager
async def live_server(
    services: Services, *, check_peer_uid: bool = True
) -> AsyncIterator[tuple[Server, str, asyncio.Task[None]]]:
    # Short path under /tmp: sun_path is limited to 108 bytes.
    directory = tempfile.mkdtemp(prefix="ttrpc-", dir="/tmp")
    path = os.path.join(directory, "s")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(64)
    server = Server(services, check_peer_uid=check_peer_uid)
    task = asyncio.create_task(server.serve_socket(listener))
    try:
        yield server, path, task
    finally:
        server.close()
        async with asyncio.timeout(5):
            await server.wait_closed()
            await task
        listener.close()
        shutil.rmtree(directory)


class RawConnection:
    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self.reader, self.writer = reader, writer
        self.decoder = FrameDecoder()

    @classmethod
    async def open(cls, path: str) -> RawConnection:
        return cls(*await asyncio.open_unix_connection(path))

    async def next_frame(self, timeout: float = 2.0) -> Frame | None:
        """The next frame, or None at EOF."""
        async with asyncio.timeout(timeout):
            while (event := self.decoder.next_event()) is NEED_DATA:
                if self.decoder.eof:
                    return None
                self.decoder.feed(await self.reader.read(65536))
        assert isinstance(event, Frame)
        return event

    async def echo(self, stream_id: int, value: str) -> None:
        self.writer.write(request_frame(stream_id, message=StringValue(value=value)))
        frame = await self.next_frame()
        assert frame is not None and frame.stream_id == stream_id
        response = Response.FromString(frame.payload)
        assert response.status.code == Code.OK
        assert StringValue.FromString(response.payload).value == f"echo {value}"

    def close(self) -> None:
        self.writer.close()


def test_peer_with_another_uid_is_dropped(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    async def main() -> None:
        async with live_server(ECHO) as (_, path, _task):
            ok = await RawConnection.open(path)
            await ok.echo(1, "same uid")
            monkeypatch.setattr(os, "geteuid", lambda: os.getuid() + 1)
            intruder = await RawConnection.open(path)
            intruder.writer.write(request_frame(1))
            try:
                answer = await intruder.next_frame()
            except ConnectionResetError:  # closed with our request unread
                answer = None
            assert answer is None, "dropped without an answer"
            monkeypatch.undo()
            await ok.echo(3, "still fine")
            ok.close()
            intruder.close()

    with caplog.at_level(logging.WARNING):
        run(main())
    assert any("is not" in r.getMessage() and "uid" in r.getMessage() for r in caplog.records)


def _fuzz_moves(rng: random.Random) -> bytes:
    """A byte stream mixing every kind of bad input with some valid calls."""
    parts: list[bytes] = []
    next_id = 1
    for _ in range(rng.randint(1, 12)):
        move = rng.choice(
            [
                *["noise", "huge", "even", "reuse", "garbage", "valid", "valid", "data"],
                *["unknown", "cut", "unimplemented", "skipped"],
            ]
        )
        if move == "noise":
            parts.append(rng.randbytes(rng.randint(1, 64)))
        elif move == "huge":
            length = rng.choice([MESSAGE_LENGTH_MAX + 1, 0x7FFF_FFFF, 0xFFFF_FFFF])
            parts.append(struct.pack(">IIBB", length, next_id, 1, 0) + rng.randbytes(32))
        elif move == "even":
            parts.append(request_frame(rng.randrange(0, 1 << 32, 2)))
        elif move == "reuse":
            parts.append(request_frame(max(1, next_id - 2)))
        elif move == "garbage":
            body = rng.randbytes(rng.randint(0, 48))
            parts.append(encode_frame(Frame(next_id, MessageType.REQUEST, 0, body)))
            next_id += 2
        elif move == "valid":
            parts.append(request_frame(next_id, rng.choice(["Echo", "Sleep"])))
            next_id += 2
        elif move == "unimplemented":
            parts.append(request_frame(next_id, "Nope", service=rng.choice([SVC, "x.v1.Y"])))
            next_id += 2
        elif move == "skipped":
            # Oversized but complete: answered RESOURCE_EXHAUSTED, and the stream resyncs.
            size = MESSAGE_LENGTH_MAX + rng.randint(1, 100)
            parts.append(struct.pack(">IIBB", size, next_id, 1, 0) + bytes(size))
        elif move == "data":
            parts.append(encode_frame(Frame(next_id, MessageType.DATA, 1, rng.randbytes(8))))
        elif move == "unknown":
            parts.append(encode_frame(Frame(next_id, rng.randint(4, 255), 0, b"?")))
        else:
            parts.append(request_frame(next_id)[: rng.randint(1, 20)])
    return b"".join(parts)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_live_server_survives_random_bytes(seed: int, caplog: pytest.LogCaptureFixture) -> None:
    rng = random.Random(seed)

    async def sleepy(request: StringValue, ctx: CallContext) -> StringValue:
        await asyncio.sleep(rng.random() / 50)
        return StringValue(value=f"echo {request.value}")

    services: Services = {
        SVC: {"Echo": Method(StringValue, echo), "Sleep": Method(StringValue, sleepy)}
    }

    async def attack(path: str, rng: random.Random) -> None:
        conn = await RawConnection.open(path)
        wire = _fuzz_moves(rng)
        cuts = sorted(rng.sample(range(len(wire) + 1), k=min(3, len(wire) + 1)))
        for a, b in zip([0, *cuts], [*cuts, len(wire)], strict=True):
            conn.writer.write(wire[a:b])
            await conn.writer.drain()
            await asyncio.sleep(0)
        if rng.random() < 0.5:
            conn.writer.close()  # vanish with calls possibly in flight
            return
        conn.writer.write_eof()
        # Whatever comes back must be well-formed Responses, then a clean EOF.
        while (frame := await conn.next_frame()) is not None:
            assert frame.type == MessageType.RESPONSE and frame.flags == 0
            response = Response.FromString(frame.payload)
            assert response.HasField("status") and response.status.code in set(Code)
            if response.status.code != Code.OK:
                assert response.payload == b""
        conn.close()

    async def main() -> None:
        async with live_server(services) as (_, path, serving):
            survivor = await RawConnection.open(path)
            await survivor.echo(1, "before")
            for round_ in range(3):
                await asyncio.gather(
                    *(attack(path, random.Random(f"{seed}/{round_}/{i}")) for i in range(4))
                )
            assert not serving.done()
            fresh = await RawConnection.open(path)
            await fresh.echo(1, "new connection")
            await survivor.echo(3, "old connection")
            fresh.close()
            survivor.close()

    with caplog.at_level(logging.WARNING):
        run(main(), timeout=20)
    assert not [r for r in caplog.records if r.levelno >= logging.ERROR]
