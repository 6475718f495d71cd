"""ttrpc client: round trips with our server over a real unix socket, and scripted fake
servers for the edge cases (containerd itself: tests/privileged/test_ttrpc_containerd.py)."""

from __future__ import annotations

import asyncio
import contextlib
import os
import shutil
import socket
import struct
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from typing import Any, TypeVar

import pytest
from cedana_shim import errors
from cedana_shim.api.google_rpc.status_pb2 import Status
from cedana_shim.api.ttrpc.request_pb2 import Request, Response
from cedana_shim.ttrpc.client import Client
from cedana_shim.ttrpc.codec import (
    MESSAGE_LENGTH_MAX,
    Frame,
    MessageType,
    encode_frame,
)
from cedana_shim.ttrpc.server import CallContext, Method, Server, Services
from google.protobuf.empty_pb2 import Empty
from google.protobuf.wrappers_pb2 import StringValue

T = TypeVar("T")
SVC = "test.v1.Echo"


def run(coro: Coroutine[Any, Any, T], timeout: float = 10.0) -> T:
    async def main() -> T:
        async with asyncio.timeout(timeout):
            return await coro

    return asyncio.run(main())


@contextlib.contextmanager
def socket_path() -> Any:
    directory = tempfile.mkdtemp(prefix="ttrpc-", dir="/tmp")
    try:
        yield os.path.join(directory, "s")
    finally:
        shutil.rmtree(directory)


@contextlib.asynccontextmanager
async def serving(services: Services) -> AsyncIterator[tuple[Server, str]]:
    with socket_path() as path:
        listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        listener.bind(path)
        listener.listen()
        server = Server(services)
        task = asyncio.create_task(server.serve_socket(listener))
        try:
            yield server, path
        finally:
            server.close()
            await server.wait_closed()
            await task
            listener.close()


Script = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


@contextlib.asynccontextmanager
async def fake_server(script: Script) -> AsyncIterator[str]:
    """A raw server that runs ``script`` on each connection, to misbehave on purpose."""

    async def handle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            await script(reader, writer)
        finally:
            writer.close()

    with socket_path() as path:
        server = await asyncio.start_unix_server(handle, path)
        try:
            yield path
        finally:
            server.close()
            await server.wait_closed()


async def read_request(reader: asyncio.StreamReader) -> tuple[Frame, Request]:
    head = await reader.readexactly(10)
    length, stream_id, type_, flags = struct.unpack(">IIBB", head)
    frame = Frame(stream_id, type_, flags, await reader.readexactly(length))
    return frame, Request.FromString(frame.payload)


def response_frame(stream_id: int, response: Response) -> bytes:
    return encode_frame(Frame(stream_id, MessageType.RESPONSE, 0, response.SerializeToString()))


async def echo(request: StringValue, ctx: CallContext) -> StringValue:
    return StringValue(value=f"echo {request.value}")


# -- against our server ------------------------------------------------------------------


def test_round_trip_with_metadata_and_timeout() -> None:
    seen: list[CallContext] = []

    async def record(request: StringValue, ctx: CallContext) -> StringValue:
        seen.append(ctx)
        return StringValue(value=request.value.upper())

    async def main() -> None:
        async with serving({SVC: {"Record": Method(StringValue, record)}}) as (_, path):
            client = await Client.connect(f"unix://{path}")
            reply = await client.call(
                SVC,
                "Record",
                StringValue(value="abc"),
                StringValue,
                timeout=3.0,
                metadata={"containerd-namespace-ttrpc": "default"},
            )
            assert reply == StringValue(value="ABC")
            assert await client.call(SVC, "Record", StringValue(), StringValue) == StringValue()
            await client.close()
            assert client.closed

    run(main())
    assert seen[0].metadata == {"containerd-namespace-ttrpc": ("default",)}
    assert seen[0].timeout is not None and 2.9 < seen[0].timeout <= 3.0
    assert seen[1].timeout is None


def test_concurrent_calls_complete_out_of_order() -> None:
    release = asyncio.Event()

    async def slow(request: StringValue, ctx: CallContext) -> StringValue:
        await release.wait()
        return StringValue(value="slow")

    async def main() -> None:
        services: Services = {
            SVC: {"Slow": Method(StringValue, slow), "Echo": Method(StringValue, echo)}
        }
        async with serving(services) as (_, path), await Client.connect(path) as client:
            slow_call = asyncio.create_task(client.call(SVC, "Slow", StringValue(), StringValue))
            fast = await asyncio.gather(
                *(
                    client.call(SVC, "Echo", StringValue(value=str(i)), StringValue)
                    for i in range(20)
                )
            )
            assert [r.value for r in fast] == [f"echo {i}" for i in range(20)]
            assert not slow_call.done()
            release.set()
            assert (await slow_call).value == "slow"

    run(main())


@pytest.mark.parametrize(
    ("raise_", "expected"),
    [
        (errors.NotFound("container x not found"), errors.NotFound),
        (
            errors.FailedPrecondition("cannot start process in running state"),
            errors.FailedPrecondition,
        ),
        (RuntimeError("plain bug"), errors.Unknown),
    ],
)
def test_error_status_raises_the_matching_class(
    raise_: Exception, expected: type[errors.ShimError]
) -> None:
    async def fail(request: StringValue, ctx: CallContext) -> StringValue:
        raise raise_

    async def main() -> None:
        services: Services = {SVC: {"Fail": Method(StringValue, fail)}}
        async with serving(services) as (_, path), await Client.connect(path) as client:
            with pytest.raises(expected) as info:
                await client.call(SVC, "Fail", StringValue(), StringValue)
            assert type(info.value) is expected
            assert str(info.value) == str(raise_)
            with pytest.raises(errors.Unimplemented, match="service nope"):
                await client.call("nope", "Fail", StringValue(), StringValue)
            with pytest.raises(errors.Unimplemented, match="method Nope"):
                await client.call(SVC, "Nope", StringValue(), StringValue)
            assert not client.closed, "errors do not hurt the connection"

    run(main())


def test_deadline_exceeded_and_connection_still_usable() -> None:
    async def hang(request: StringValue, ctx: CallContext) -> StringValue:
        await asyncio.sleep(60)
        return request

    async def main() -> None:
        services: Services = {
            SVC: {"Hang": Method(StringValue, hang), "Echo": Method(StringValue, echo)}
        }
        async with serving(services) as (_, path), await Client.connect(path) as client:
            start = time.monotonic()
            with pytest.raises(errors.DeadlineExceeded):
                await client.call(SVC, "Hang", StringValue(), StringValue, timeout=0.1)
            assert time.monotonic() - start < 1.0
            with pytest.raises(errors.DeadlineExceeded):
                await client.call(SVC, "Hang", StringValue(), StringValue, timeout=0)
            reply = await client.call(SVC, "Echo", StringValue(value="x"), StringValue)
            assert reply.value == "echo x"

    run(main())


def test_server_going_away_mid_call_makes_calls_unavailable() -> None:
    entered = asyncio.Event()

    async def hang(request: StringValue, ctx: CallContext) -> StringValue:
        entered.set()
        await asyncio.sleep(60)
        return request

    async def main() -> None:
        with socket_path() as path:
            listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            listener.bind(path)
            listener.listen()
            server = Server({SVC: {"Hang": Method(StringValue, hang)}})
            serve = asyncio.create_task(server.serve_socket(listener))
            client = await Client.connect(path)
            pending = asyncio.create_task(client.call(SVC, "Hang", StringValue(), StringValue))
            await entered.wait()
            # Kill the daemon side abruptly: its tasks (and the connection) go away.
            serve.cancel()
            for task in asyncio.all_tasks():
                if task.get_name() == "ttrpc connection":
                    task.cancel()
            with pytest.raises(errors.Unavailable):
                await pending
            assert client.closed
            with pytest.raises(errors.Unavailable):
                await client.call(SVC, "Hang", StringValue(), StringValue)
            await client.close()
            listener.close()

    run(main())


def test_connection_dropped_by_peer_mid_call() -> None:
    async def hang_up(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        writer.close()

    async def main() -> None:
        async with fake_server(hang_up) as path:
            client = await Client.connect(path)
            with pytest.raises(errors.Unavailable, match="connection closed"):
                await client.call(SVC, "Echo", StringValue(), StringValue)
            assert client.closed
            with pytest.raises(errors.Unavailable):
                await client.call(SVC, "Echo", StringValue(), StringValue)
            await client.close()

    run(main())


def test_truncated_response_at_eof_is_unavailable() -> None:
    async def truncate(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        frame, _ = await read_request(reader)
        writer.write(struct.pack(">IIBB", 50, frame.stream_id, 2, 0) + b"short")
        await writer.drain()
        writer.close()

    async def main() -> None:
        async with fake_server(truncate) as path:
            client = await Client.connect(path)
            with pytest.raises(errors.Unavailable, match="EOF inside a frame"):
                await client.call(SVC, "Echo", StringValue(), StringValue)
            await client.close()

    run(main())


def test_close_fails_pending_calls() -> None:
    async def silent(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        await read_request(reader)
        await reader.read()

    async def main() -> None:
        async with fake_server(silent) as path:
            client = await Client.connect(path)
            pending = asyncio.create_task(client.call(SVC, "Echo", StringValue(), StringValue))
            await asyncio.sleep(0.05)
            await client.close()
            with pytest.raises(errors.Unavailable, match="client closed"):
                await pending
            await client.close()  # idempotent

    run(main())


def test_connect_failures_are_unavailable() -> None:
    async def main() -> None:
        with socket_path() as path:
            with pytest.raises(errors.Unavailable, match="dial"):
                await Client.connect(path)
            with pytest.raises(errors.Unavailable):
                await Client.connect(f"unix://{path}")

    run(main())


# -- against scripted servers: wire format and edge cases --------------------------------


def test_request_wire_format_matches_go_client() -> None:
    captured: list[tuple[Frame, Request]] = []

    async def capture(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        for _ in range(3):
            frame, request = await read_request(reader)
            captured.append((frame, request))
            # A missing status means OK to Go's client, and so to ours.
            writer.write(response_frame(frame.stream_id, Response(payload=b"")))
        await writer.drain()

    async def main() -> None:
        async with fake_server(capture) as path, await Client.connect(path) as client:
            for _ in range(2):
                await client.call(SVC, "Echo", StringValue(value="p"), Empty)
            await client.call(
                "containerd.services.events.ttrpc.v1.Events",
                "Forward",
                StringValue(value="p"),
                Empty,
                timeout=5,
                metadata={"containerd-namespace-ttrpc": "k8s.io", "a": "b"},
            )

    run(main())
    assert [f.stream_id for f, _ in captured] == [1, 3, 5]
    assert all((f.type, f.flags) == (MessageType.REQUEST, 0) for f, _ in captured)
    first = captured[0][1]
    assert (first.service, first.method, first.timeout_nano, list(first.metadata)) == (
        SVC,
        "Echo",
        0,
        [],
    )
    assert StringValue.FromString(first.payload).value == "p"
    last = captured[2][1]
    assert last.timeout_nano == 5_000_000_000
    assert [(kv.key, kv.value) for kv in last.metadata] == [
        ("containerd-namespace-ttrpc", "k8s.io"),
        ("a", "b"),
    ]


def test_responses_routed_by_stream_id_with_junk_ignored() -> None:
    async def shuffle(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        frames = [await read_request(reader) for _ in range(4)]
        by_value = {StringValue.FromString(r.payload).value: f.stream_id for f, r in frames}
        ok = Status()
        # Junk first: a response nobody asked for, a DATA frame, an unknown type.
        writer.write(response_frame(99, Response(status=ok)))
        writer.write(encode_frame(Frame(by_value["a"], MessageType.DATA, 0, b"x")))
        writer.write(encode_frame(Frame(by_value["a"], 0x7F, 0, b"")))
        # Then answers in reverse order, one oversized, one with a broken envelope.
        writer.write(response_frame(by_value["d"], Response(status=Status(code=5, message="gone"))))
        size = MESSAGE_LENGTH_MAX + 1
        writer.write(struct.pack(">IIBB", size, by_value["c"], 2, 0) + bytes(size))
        writer.write(encode_frame(Frame(by_value["b"], MessageType.RESPONSE, 0, b"\xff\xff")))
        payload = StringValue(value="A").SerializeToString()
        writer.write(response_frame(by_value["a"], Response(status=ok, payload=payload)))
        await writer.drain()
        await reader.read()

    async def main() -> None:
        async with fake_server(shuffle) as path, await Client.connect(path) as client:
            results = await asyncio.gather(
                *(client.call(SVC, "Echo", StringValue(value=v), StringValue) for v in "abcd"),
                return_exceptions=True,
            )
            assert not client.closed

        a, b, c, d = results
        assert a == StringValue(value="A")
        assert isinstance(b, errors.Internal) and "envelope" in str(b)
        assert isinstance(c, errors.ResourceExhausted)
        assert isinstance(d, errors.NotFound) and str(d) == "gone"

    run(main())


def test_oversized_request_is_refused_locally() -> None:
    async def main() -> None:
        services: Services = {SVC: {"Echo": Method(StringValue, echo)}}
        async with serving(services) as (_, path), await Client.connect(path) as client:
            with pytest.raises(errors.ResourceExhausted):
                await client.call(
                    SVC, "Echo", StringValue(value="x" * MESSAGE_LENGTH_MAX), StringValue
                )
            reply = await client.call(SVC, "Echo", StringValue(value="y"), StringValue)
            assert reply.value == "echo y"

    run(main())


def test_undecodable_response_payload_is_internal() -> None:
    async def bad_payload(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        frame, _ = await read_request(reader)
        writer.write(
            response_frame(frame.stream_id, Response(status=Status(), payload=b"\x0a\x09"))
        )
        await writer.drain()
        await reader.read()

    async def main() -> None:
        async with fake_server(bad_payload) as path, await Client.connect(path) as client:
            with pytest.raises(errors.Internal, match="bad response"):
                await client.call(SVC, "Echo", StringValue(), StringValue)

    run(main())
