"""Sans-IO ttrpc frame codec: bytes in, frames out (like h11, no sockets, no event loop).

Wire format (containerd/ttrpc ``channel.go``): a 10-byte big-endian header (uint32 data
length, uint32 stream id, uint8 type, uint8 flags) followed by ``length`` bytes of data.
Data longer than :data:`MESSAGE_LENGTH_MAX` is not an error for the connection: the
receiver skips it and answers that stream with RESOURCE_EXHAUSTED, so the decoder
discards such a payload and reports an :class:`OversizedFrame` instead.
"""

from __future__ import annotations

import enum
import struct
from dataclasses import dataclass
from typing import Final, Literal

__all__ = [
    "HEADER_LENGTH",
    "MESSAGE_LENGTH_MAX",
    "NEED_DATA",
    "STREAM_ID_MAX",
    "Event",
    "Frame",
    "FrameDecoder",
    "LocalProtocolError",
    "MessageType",
    "NeedData",
    "OversizedFrame",
    "ProtocolError",
    "RemoteProtocolError",
    "encode_frame",
]

HEADER_LENGTH: Final = 10
MESSAGE_LENGTH_MAX: Final = 4 << 20
STREAM_ID_MAX: Final = 0xFFFF_FFFF

_HEADER: Final = struct.Struct(">IIBB")


class MessageType(enum.IntEnum):
    REQUEST = 1
    RESPONSE = 2
    DATA = 3


class ProtocolError(Exception):
    """A ttrpc framing rule was broken; catch this, raise a subclass.

    Split by blame as in h11: :class:`LocalProtocolError` means our caller asked for
    something the wire cannot carry, :class:`RemoteProtocolError` means the peer sent
    something we cannot decode.
    """

    def __init__(self, *args: object) -> None:
        if type(self) is ProtocolError:
            raise TypeError("raise LocalProtocolError or RemoteProtocolError, not ProtocolError")
        super().__init__(*args)


class LocalProtocolError(ProtocolError):
    pass


class RemoteProtocolError(ProtocolError):
    pass


class NeedData(enum.Enum):
    """Sentinel type; an enum so ``event is NEED_DATA`` narrows under mypy."""

    NEED_DATA = "NEED_DATA"

    def __repr__(self) -> str:
        return self.value


NEED_DATA: Final = NeedData.NEED_DATA


def _check_u8(name: str, value: int) -> None:
    if not 0 <= value <= 0xFF:
        raise LocalProtocolError(f"{name} {value} does not fit in one byte")


@dataclass(frozen=True, slots=True)
class Frame:
    """One complete ttrpc message.

    ``type`` is an ``int`` rather than :class:`MessageType` so that frames of types this
    codec does not know still decode; the server ignores them, as containerd's does.
    """

    stream_id: int
    type: int
    flags: int = 0
    payload: bytes = b""

    def __post_init__(self) -> None:
        # Validated here, not only in encode_frame, so a Frame that exists can always be
        # put on the wire apart from its size (which the receiver decides about).
        if not 0 <= self.stream_id <= STREAM_ID_MAX:
            raise LocalProtocolError(f"stream id {self.stream_id} is not a uint32")
        _check_u8("message type", self.type)
        _check_u8("flags", self.flags)
        if not isinstance(self.payload, bytes):
            raise LocalProtocolError(f"payload must be bytes, not {type(self.payload).__name__}")


@dataclass(frozen=True, slots=True)
class OversizedFrame:
    """A frame whose data exceeded the limit; its data was skipped, not buffered."""

    stream_id: int
    type: int
    length: int


Event = Frame | OversizedFrame


def encode_frame(frame: Frame) -> bytes:
    """Serialise ``frame``; refuses data the peer would reject, as Go's ``channel.send``."""
    length = len(frame.payload)
    if length > MESSAGE_LENGTH_MAX:
        raise LocalProtocolError(
            f"message length {length} exceeds maximum message size of {MESSAGE_LENGTH_MAX}"
        )
    return _HEADER.pack(length, frame.stream_id, frame.type, frame.flags) + frame.payload


class FrameDecoder:
    """Incremental decoder. ``feed`` bytes, then call ``next_event`` until NEED_DATA.

    ``feed(b"")`` marks EOF; EOF inside a frame (or inside a skipped oversized payload)
    is a :class:`RemoteProtocolError`, after which the decoder stays failed.
    ``max_length`` exists for tests; the wire limit is :data:`MESSAGE_LENGTH_MAX`.
    """

    def __init__(self, *, max_length: int = MESSAGE_LENGTH_MAX) -> None:
        self._max_length = max_length
        self._buf = bytearray()
        self._eof = False
        self._failed = False
        # While > 0 we are inside an oversized frame's data and drop bytes on arrival.
        self._discard = 0
        self._oversized: OversizedFrame | None = None

    @property
    def buffered(self) -> int:
        """Bytes held for an incomplete frame (never more than a header plus max_length)."""
        return len(self._buf)

    @property
    def eof(self) -> bool:
        return self._eof

    def feed(self, data: bytes) -> None:
        if self._eof:
            if data:
                raise LocalProtocolError("data fed after EOF")
            return
        if not data:
            self._eof = True
            return
        if self._discard:
            # Invariant: the buffer is empty while discarding (next_event drained it into
            # the discard count), so these bytes belong to the skipped payload first.
            skip = min(self._discard, len(data))
            self._discard -= skip
            if skip == len(data):
                return
            self._buf += memoryview(data)[skip:]
            return
        self._buf += data

    def next_event(self) -> Frame | OversizedFrame | Literal[NeedData.NEED_DATA]:
        if self._failed:
            raise RemoteProtocolError("decoder already failed")
        try:
            return self._next_event()
        except RemoteProtocolError:
            self._failed = True
            raise

    def _next_event(self) -> Frame | OversizedFrame | Literal[NeedData.NEED_DATA]:
        if self._discard:
            skip = min(self._discard, len(self._buf))
            del self._buf[:skip]
            self._discard -= skip
        if self._discard:
            if self._eof:
                raise RemoteProtocolError(
                    f"EOF with {self._discard} bytes of an oversized frame still to come"
                )
            return NEED_DATA
        if self._oversized is not None:
            event, self._oversized = self._oversized, None
            return event

        if len(self._buf) < HEADER_LENGTH:
            if self._eof and self._buf:
                raise RemoteProtocolError(f"EOF inside a frame header ({len(self._buf)} bytes)")
            return NEED_DATA
        length, stream_id, type_, flags = _HEADER.unpack_from(self._buf)

        if length > self._max_length:
            del self._buf[:HEADER_LENGTH]
            self._discard = length
            self._oversized = OversizedFrame(stream_id, _message_type(type_), length)
            return self._next_event()

        end = HEADER_LENGTH + length
        if len(self._buf) < end:
            if self._eof:
                raise RemoteProtocolError(
                    f"EOF inside a frame: have {len(self._buf) - HEADER_LENGTH} of {length} bytes"
                )
            return NEED_DATA
        with memoryview(self._buf) as view:
            payload = bytes(view[HEADER_LENGTH:end])
        del self._buf[:end]
        return Frame(stream_id, _message_type(type_), flags, payload)


def _message_type(value: int) -> int:
    try:
        return MessageType(value)
    except ValueError:
        return value
