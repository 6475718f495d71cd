"""A minimal protobuf writer for messages too small to justify the runtime.

``delete`` runs once per container and must print a DeleteResponse; importing
the protobuf runtime would triple its start-up time. The few fields it needs
are encoded here by hand (the integration tests reuse it for the containerd
requests whose services have no generated bindings); tests check the
encodings against the generated classes.
"""

from __future__ import annotations

import time


def _varint(value: int) -> bytes:
    value &= (1 << 64) - 1  # negative int64 values are ten-byte two's complement
    out = bytearray()
    while True:
        byte = value & 0x7F
        value >>= 7
        if value:
            out.append(byte | 0x80)
        else:
            out.append(byte)
            return bytes(out)


def varint_field(number: int, value: int) -> bytes:
    return _varint(number << 3) + _varint(value) if value else b""


def bytes_field(number: int, value: bytes) -> bytes:
    return _varint(number << 3 | 2) + _varint(len(value)) + value


def timestamp(seconds: float) -> bytes:
    whole = int(seconds // 1)
    nanos = round((seconds - whole) * 1e9)
    if nanos >= 1_000_000_000:
        whole, nanos = whole + 1, nanos - 1_000_000_000
    return varint_field(1, whole) + varint_field(2, nanos)


def delete_response(pid: int, exit_status: int, exited_at: float | None = None) -> bytes:
    """containerd.task.v2.DeleteResponse{pid=1, exit_status=2, exited_at=3}."""
    when = time.time() if exited_at is None else exited_at
    return varint_field(1, pid) + varint_field(2, exit_status) + bytes_field(3, timestamp(when))
