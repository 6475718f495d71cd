"""ttrpc layer: a sans-IO frame codec plus an asyncio server and client on top of it.

The server and client are loaded on first use so that importing the codec (for example
from a short-lived CLI command) does not pull in asyncio.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

from cedana_shim.ttrpc.codec import (
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

if TYPE_CHECKING:
    from cedana_shim.ttrpc.client import Client
    from cedana_shim.ttrpc.server import CallContext, Method, Server, Services
    from cedana_shim.ttrpc.status import error_from_status, status_from_exception
    from cedana_shim.ttrpc.transport import AsyncioStream, FrameReader, Stream

__all__ = [
    "MESSAGE_LENGTH_MAX",
    "NEED_DATA",
    "AsyncioStream",
    "CallContext",
    "Client",
    "Frame",
    "FrameDecoder",
    "FrameReader",
    "LocalProtocolError",
    "MessageType",
    "Method",
    "OversizedFrame",
    "ProtocolError",
    "RemoteProtocolError",
    "Server",
    "Services",
    "Stream",
    "encode_frame",
    "error_from_status",
    "status_from_exception",
]

_LAZY = {
    "Client": "client",
    "AsyncioStream": "transport",
    "FrameReader": "transport",
    "CallContext": "server",
    "Method": "server",
    "Server": "server",
    "Services": "server",
    "Stream": "transport",
    "error_from_status": "status",
    "status_from_exception": "status",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(f"{__name__}.{module}"), name)
    globals()[name] = value
    return value
