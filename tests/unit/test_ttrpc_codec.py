"""Sans-IO codec: fixtures fed whole, split everywhere, byte by byte, with trailing bytes."""

from __future__ import annotations

import ast
import dataclasses
import itertools
import struct
import subprocess
import sys
from collections.abc import Iterable
from pathlib import Path

import pytest
from cedana_shim.ttrpc import codec
from cedana_shim.ttrpc.codec import (
    HEADER_LENGTH,
    MESSAGE_LENGTH_MAX,
    NEED_DATA,
    Frame,
    FrameDecoder,
    LocalProtocolError,
    MessageType,
    OversizedFrame,
    ProtocolError,
    RemoteProtocolError,
    encode_frame,
)
from hypothesis import given, settings
from hypothesis import strategies as st
from support.examples import examples

Event = Frame | OversizedFrame


def header(length: int, stream_id: int, type_: int, flags: int = 0) -> bytes:
    return struct.pack(">IIBB", length, stream_id, type_, flags)


def drain(decoder: FrameDecoder) -> list[Event]:
    events: list[Event] = []
    while (event := decoder.next_event()) is not NEED_DATA:
        events.append(event)
    return events


def decode_chunks(chunks: Iterable[bytes], *, max_length: int = MESSAGE_LENGTH_MAX) -> list[Event]:
    decoder = FrameDecoder(max_length=max_length)
    events: list[Event] = []
    for chunk in chunks:
        if chunk:  # b"" would mean EOF
            decoder.feed(chunk)
        events += drain(decoder)
    decoder.feed(b"")
    events += drain(decoder)
    return events


# (name, wire bytes, events, max_length). Small max_length lets the oversized cases be
# split at every offset in reasonable time.
FIXTURES: list[tuple[str, bytes, list[Event], int]] = [
    (
        "empty request",
        header(0, 1, 1),
        [Frame(1, MessageType.REQUEST, 0, b"")],
        MESSAGE_LENGTH_MAX,
    ),
    (
        "response with payload",
        header(3, 7, 2) + b"abc",
        [Frame(7, MessageType.RESPONSE, 0, b"abc")],
        MESSAGE_LENGTH_MAX,
    ),
    (
        "back to back, data frame with flags, unknown type",
        header(2, 1, 1) + b"hi" + header(1, 1, 3, 0x05) + b"!" + header(0, 9, 0x7F, 0xFF),
        [
            Frame(1, MessageType.REQUEST, 0, b"hi"),
            Frame(1, MessageType.DATA, 0x05, b"!"),
            Frame(9, 0x7F, 0xFF, b""),
        ],
        MESSAGE_LENGTH_MAX,
    ),
    (
        "payload exactly at the limit",
        header(8, 3, 1) + bytes(range(8)),
        [Frame(3, MessageType.REQUEST, 0, bytes(range(8)))],
        8,
    ),
    (
        "oversized frame skipped, decoding stays in sync",
        header(9, 5, 1) + b"X" * 9 + header(2, 7, 1) + b"ok",
        [OversizedFrame(5, MessageType.REQUEST, 9), Frame(7, MessageType.REQUEST, 0, b"ok")],
        8,
    ),
    (
        "two oversized frames in a row, max stream id",
        header(10, 0xFFFFFFFF, 2) + b"Y" * 10 + header(9, 1, 0x42) + b"Z" * 9,
        [OversizedFrame(0xFFFFFFFF, MessageType.RESPONSE, 10), OversizedFrame(1, 0x42, 9)],
        8,
    ),
]
FIXTURE_IDS = [f[0] for f in FIXTURES]


@pytest.mark.parametrize(("name", "data", "expected", "max_length"), FIXTURES, ids=FIXTURE_IDS)
def test_whole(name: str, data: bytes, expected: list[Event], max_length: int) -> None:
    assert decode_chunks([data], max_length=max_length) == expected


@pytest.mark.parametrize(("name", "data", "expected", "max_length"), FIXTURES, ids=FIXTURE_IDS)
def test_split_at_every_offset(
    name: str, data: bytes, expected: list[Event], max_length: int
) -> None:
    for i in range(len(data) + 1):
        assert decode_chunks([data[:i], data[i:]], max_length=max_length) == expected, i


@pytest.mark.parametrize(("name", "data", "expected", "max_length"), FIXTURES, ids=FIXTURE_IDS)
def test_byte_at_a_time(name: str, data: bytes, expected: list[Event], max_length: int) -> None:
    chunks = [data[i : i + 1] for i in range(len(data))]
    assert decode_chunks(chunks, max_length=max_length) == expected


@pytest.mark.parametrize(("name", "data", "expected", "max_length"), FIXTURES, ids=FIXTURE_IDS)
def test_trailing_bytes_stay_buffered(
    name: str, data: bytes, expected: list[Event], max_length: int
) -> None:
    trailing = header(100, 11, 1)[:7]
    decoder = FrameDecoder(max_length=max_length)
    decoder.feed(data + trailing)
    assert drain(decoder) == expected
    assert decoder.next_event() is NEED_DATA
    assert decoder.buffered == len(trailing)
    decoder.feed(b"")
    with pytest.raises(RemoteProtocolError, match="header"):
        decoder.next_event()


def test_events_are_reported_one_at_a_time() -> None:
    decoder = FrameDecoder()
    decoder.feed(encode_frame(Frame(1, 1, 0, b"a")) + encode_frame(Frame(3, 1, 0, b"b")))
    assert decoder.next_event() == Frame(1, MessageType.REQUEST, 0, b"a")
    assert decoder.next_event() == Frame(3, MessageType.REQUEST, 0, b"b")
    assert decoder.next_event() is NEED_DATA


def test_known_types_decode_as_enum_unknown_as_int() -> None:
    events = decode_chunks([header(0, 1, 2), header(0, 1, 200)])
    assert [type(e.type) for e in events] == [MessageType, int]


@pytest.mark.parametrize(
    "data",
    [
        header(5, 1, 1)[:1],
        header(5, 1, 1)[:9],
        header(5, 1, 1),
        header(5, 1, 1) + b"abcd",
        header(9, 1, 1) + b"X" * 8,  # inside a skipped oversized payload
    ],
    ids=["1 header byte", "9 header bytes", "header only", "short payload", "short oversized"],
)
def test_eof_inside_a_frame_is_a_remote_error_and_sticks(data: bytes) -> None:
    decoder = FrameDecoder(max_length=8)
    decoder.feed(data)
    assert decoder.next_event() is NEED_DATA
    decoder.feed(b"")
    with pytest.raises(RemoteProtocolError):
        decoder.next_event()
    with pytest.raises(RemoteProtocolError):
        decoder.next_event()


def test_clean_eof_gives_need_data_forever() -> None:
    decoder = FrameDecoder()
    decoder.feed(b"")
    decoder.feed(b"")
    assert decoder.eof
    assert decoder.next_event() is NEED_DATA
    assert decoder.next_event() is NEED_DATA
    with pytest.raises(LocalProtocolError):
        decoder.feed(b"late")


def test_oversized_payload_is_never_buffered() -> None:
    # The real limit: a 4 MiB + 1 payload streamed in 64 KiB chunks.
    decoder = FrameDecoder()
    length = MESSAGE_LENGTH_MAX + 1
    decoder.feed(header(length, 3, 1))
    assert decoder.next_event() is NEED_DATA
    assert decoder.buffered == 0
    chunk = b"\xaa" * 65536
    sent = 0
    while sent < length:
        piece = chunk[: length - sent]
        decoder.feed(piece)
        sent += len(piece)
        assert decoder.buffered == 0
        if sent < length:
            assert decoder.next_event() is NEED_DATA
    decoder.feed(encode_frame(Frame(5, 1, 0, b"next")))
    assert drain(decoder) == [
        OversizedFrame(3, MessageType.REQUEST, length),
        Frame(5, MessageType.REQUEST, 0, b"next"),
    ]


def test_oversized_discard_spanning_a_buffered_chunk() -> None:
    # Header and part of the skipped payload arrive in one chunk with no next_event()
    # call between feeds; the already-buffered part must be dropped too.
    decoder = FrameDecoder(max_length=4)
    decoder.feed(header(6, 1, 1) + b"123")
    decoder.feed(b"456" + header(1, 3, 1))
    decoder.feed(b"z")
    assert drain(decoder) == [OversizedFrame(1, 1, 6), Frame(3, 1, 0, b"z")]


def test_encode_known_vector() -> None:
    frame = Frame(0x01020304, MessageType.RESPONSE, 0x05, b"ab")
    assert encode_frame(frame) == b"\x00\x00\x00\x02\x01\x02\x03\x04\x02\x05ab"
    assert len(encode_frame(Frame(1, 1))) == HEADER_LENGTH


def test_encode_refuses_oversized_payload() -> None:
    assert len(encode_frame(Frame(1, 1, 0, bytes(MESSAGE_LENGTH_MAX)))) == (
        HEADER_LENGTH + MESSAGE_LENGTH_MAX
    )
    with pytest.raises(LocalProtocolError, match="exceeds maximum"):
        encode_frame(Frame(1, 1, 0, bytes(MESSAGE_LENGTH_MAX + 1)))


@pytest.mark.parametrize(
    ("stream_id", "type_", "flags"),
    [(-1, 1, 0), (1 << 32, 1, 0), (1, -1, 0), (1, 256, 0), (1, 1, -1), (1, 1, 256)],
)
def test_bad_ids_are_local_errors(stream_id: int, type_: int, flags: int) -> None:
    with pytest.raises(LocalProtocolError):
        encode_frame(Frame(stream_id, type_, flags, b""))


def test_payload_must_be_bytes() -> None:
    with pytest.raises(LocalProtocolError):
        Frame(1, 1, 0, bytearray(b"x"))  # type: ignore[arg-type]


def test_frame_is_frozen_and_slotted() -> None:
    frame = Frame(1, 1)
    assert not hasattr(frame, "__dict__")
    with pytest.raises(dataclasses.FrozenInstanceError):
        frame.stream_id = 3  # type: ignore[misc]
    assert frame == Frame(1, MessageType.REQUEST, 0, b"")
    assert hash(frame) == hash(Frame(1, 1, 0, b""))


def test_protocol_error_is_abstract() -> None:
    with pytest.raises(TypeError):
        ProtocolError("nope")
    assert isinstance(LocalProtocolError("x"), ProtocolError)
    assert isinstance(RemoteProtocolError("x"), ProtocolError)
    assert str(RemoteProtocolError("why")) == "why"


def test_need_data_repr() -> None:
    assert repr(NEED_DATA) == "NEED_DATA"


def test_codec_does_no_io() -> None:
    tree = ast.parse(Path(codec.__file__).read_text())
    imported: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            imported |= {alias.name.split(".")[0] for alias in node.names}
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0, "codec must not import sibling modules"
            imported.add((node.module or "").split(".")[0])
        elif isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            assert node.func.id not in {"__import__", "open"}
    assert not imported & {"asyncio", "socket", "selectors", "ssl", "select", "trio"}
    assert imported <= {"__future__", "enum", "struct", "dataclasses", "typing"}


def test_importing_the_codec_does_not_load_asyncio() -> None:
    # Also guards the package __init__: it must keep server/client lazy.
    code = (
        "import sys, cedana_shim.ttrpc.codec\n"
        "bad = {'asyncio', 'socket'} & set(sys.modules)\n"
        "assert not bad, bad\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True)


# -- properties --------------------------------------------------------------------------


@st.composite
def chunked(draw: st.DrawFn, data: bytes) -> list[bytes]:
    cuts = sorted(draw(st.lists(st.integers(0, len(data)), max_size=12)))
    bounds = [0, *cuts, len(data)]
    return [data[a:b] for a, b in itertools.pairwise(bounds)]


@st.composite
def wire_bytes(draw: st.DrawFn) -> bytes:
    # Mostly plausible headers (so frames and oversize skips really happen) mixed with noise.
    parts = draw(
        st.lists(
            st.one_of(
                st.binary(max_size=24),
                st.builds(
                    lambda n, sid, t, f, body: header(n, sid, t, f) + body,
                    st.integers(0, 40),
                    st.integers(0, 0xFFFFFFFF),
                    st.integers(0, 255),
                    st.integers(0, 255),
                    st.binary(max_size=40),
                ),
            ),
            max_size=8,
        )
    )
    return b"".join(parts)


def decode_outcome(
    chunks: Iterable[bytes], *, max_length: int, eof: bool
) -> tuple[list[object], bool]:
    """Events seen, and whether a ProtocolError ended decoding."""
    decoder = FrameDecoder(max_length=max_length)
    events: list[object] = []
    try:
        for chunk in [*(c for c in chunks if c), *([b""] if eof else [])]:
            decoder.feed(chunk)
            while (event := decoder.next_event()) is not NEED_DATA:
                events.append(event)
    except ProtocolError as exc:
        assert isinstance(exc, RemoteProtocolError), "the peer's bytes can only be its fault"
        return events, True
    return events, False


@settings(max_examples=examples(300), deadline=None)
@given(st.data(), wire_bytes(), st.sampled_from([16, MESSAGE_LENGTH_MAX]), st.booleans())
def test_arbitrary_bytes_yield_events_or_protocol_error(
    data: st.DataObject, wire: bytes, max_length: int, eof: bool
) -> None:
    events, failed = decode_outcome(data.draw(chunked(wire)), max_length=max_length, eof=eof)
    assert not failed or eof, "without EOF nothing is ever an error, only NEED_DATA"
    for event in events:
        assert isinstance(event, Frame | OversizedFrame)
        if isinstance(event, Frame):
            assert len(event.payload) <= max_length
        else:
            assert event.length > max_length
    # Chunking never changes the outcome.
    assert (events, failed) == decode_outcome([wire], max_length=max_length, eof=eof)


frames = st.builds(
    Frame,
    stream_id=st.integers(0, 0xFFFFFFFF),
    type=st.integers(0, 255),
    flags=st.integers(0, 255),
    payload=st.binary(max_size=64),
)


@settings(max_examples=examples(200), deadline=None)
@given(st.data(), st.lists(frames, max_size=10))
def test_round_trip(data: st.DataObject, sent: list[Frame]) -> None:
    wire = b"".join(encode_frame(f) for f in sent)
    assert decode_chunks(data.draw(chunked(wire))) == sent
