"""The byte stream under a ttrpc connection, and the one receive loop over it.

Client and server read frames the same way: read from the :class:`Stream`, feed the
sans-IO :class:`~cedana_shim.ttrpc.codec.FrameDecoder`, hand out what it decodes.
:class:`FrameReader` does exactly that, so both ends meet EOF and broken framing
alike: iteration ends at a clean EOF (between frames), a peer that broke the framing
(EOF inside a frame included) raises :class:`~cedana_shim.ttrpc.codec.RemoteProtocolError`,
a failed read raises its OSError. What a frame means is the caller's business.
"""

from __future__ import annotations

import asyncio
from typing import Final, Protocol

from cedana_shim.ttrpc.codec import NEED_DATA, Frame, FrameDecoder, OversizedFrame

__all__ = ["READ_SIZE", "AsyncioStream", "FrameReader", "Stream"]

READ_SIZE: Final = 64 * 1024


class Stream(Protocol):
    """One byte-stream connection, as httpcore's ``AsyncNetworkStream``."""

    async def read(self, max_bytes: int) -> bytes:
        """Up to ``max_bytes`` bytes; ``b""`` at EOF."""
        ...

    async def write(self, data: bytes) -> None: ...

    def close(self) -> None: ...


class AsyncioStream:
    """:class:`Stream` over an asyncio reader/writer pair."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        self._reader = reader
        self._writer = writer

    async def read(self, max_bytes: int) -> bytes:
        return await self._reader.read(max_bytes)

    async def write(self, data: bytes) -> None:
        # write() buffers the whole frame synchronously, so a cancelled drain() can never
        # leave half a frame on the wire.
        self._writer.write(data)
        await self._writer.drain()

    def close(self) -> None:
        self._writer.close()


class FrameReader:
    """``async for event in FrameReader(stream)``: every frame, or notice of a frame
    too long to take, until EOF.

    A class rather than an async generator: a consumer that stops early (cancelled,
    or failing on a frame) leaves nothing to finalise behind it.
    """

    def __init__(self, stream: Stream) -> None:
        self._stream = stream
        self._decoder = FrameDecoder()

    def __aiter__(self) -> FrameReader:
        return self

    async def __anext__(self) -> Frame | OversizedFrame:
        while True:
            event = self._decoder.next_event()
            if event is not NEED_DATA:
                return event
            if self._decoder.eof:
                raise StopAsyncIteration
            self._decoder.feed(await self._stream.read(READ_SIZE))
