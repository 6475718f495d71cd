"""The receive loop client and server share: frames out of any chunking of the bytes,
EOF between frames ends it, EOF inside one or a failed read raises."""

from __future__ import annotations

import asyncio

import pytest
from cedana_shim.ttrpc.codec import (
    HEADER_LENGTH,
    MESSAGE_LENGTH_MAX,
    Frame,
    MessageType,
    OversizedFrame,
    RemoteProtocolError,
    encode_frame,
)
from cedana_shim.ttrpc.transport import READ_SIZE, FrameReader


class ChunkedStream:
    """Hands out ``chunks`` one per read (then EOF), or raises ``error`` at the end."""

    def __init__(self, chunks: list[bytes], error: OSError | None = None) -> None:
        self._chunks = list(chunks)
        self._error = error
        self.reads: list[int] = []

    async def read(self, max_bytes: int) -> bytes:
        self.reads.append(max_bytes)
        if self._chunks:
            return self._chunks.pop(0)
        if self._error is not None:
            raise self._error
        return b""

    async def write(self, data: bytes) -> None:
        raise AssertionError("the reader never writes")

    def close(self) -> None:
        pass


async def collect(stream: ChunkedStream) -> list[Frame | OversizedFrame]:
    return [event async for event in FrameReader(stream)]


def frames(*stream_ids: int) -> list[Frame]:
    return [Frame(i, MessageType.REQUEST, 0, f"payload {i}".encode()) for i in stream_ids]


def test_frames_from_any_chunking_then_clean_eof() -> None:
    sent = frames(1, 3, 5)
    wire = b"".join(encode_frame(f) for f in sent)
    for chunks in ([wire], [wire[i : i + 1] for i in range(len(wire))], [wire[:7], wire[7:]]):
        stream = ChunkedStream(chunks)
        assert asyncio.run(collect(stream)) == sent
        assert set(stream.reads) == {READ_SIZE}


def test_oversized_frame_is_a_notice_and_the_next_frame_still_arrives() -> None:
    length = MESSAGE_LENGTH_MAX + 1
    header = length.to_bytes(4, "big") + (7).to_bytes(4, "big") + bytes([1, 0])
    (after,) = frames(9)
    stream = ChunkedStream([header, bytes(length), encode_frame(after)])
    assert asyncio.run(collect(stream)) == [OversizedFrame(7, MessageType.REQUEST, length), after]


def test_eof_inside_a_frame_is_a_protocol_error_after_the_whole_frames() -> None:
    (whole,) = frames(1)
    cut = encode_frame(Frame(3, MessageType.REQUEST, 0, b"x" * 100))[: HEADER_LENGTH + 5]
    got: list[Frame | OversizedFrame] = []

    async def main() -> None:
        async for event in FrameReader(ChunkedStream([encode_frame(whole) + cut])):
            got.append(event)

    with pytest.raises(RemoteProtocolError, match="EOF inside a frame"):
        asyncio.run(main())
    assert got == [whole]


def test_a_failed_read_raises_its_os_error() -> None:
    stream = ChunkedStream([encode_frame(frames(1)[0])], ConnectionResetError("reset by peer"))
    with pytest.raises(ConnectionResetError, match="reset by peer"):
        asyncio.run(collect(stream))
