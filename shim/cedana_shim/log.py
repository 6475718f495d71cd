"""Structured logs, one JSON object a line, to containerd's log FIFO.

containerd creates ``<bundle>/log`` as a FIFO before it runs the shim and copies
whatever arrives there into its own log. The daemon opens it write-only and
sends every record there; a vanished reader must never hurt the shim, so write
errors are swallowed (``BrokenPipeError`` included) and the record is dropped.
Structured fields ride on ``extra=``: ``log.info("created", extra={"container": id})``.
"""

from __future__ import annotations

import json
import logging
import os
import time
from typing import Any

# LogRecord attributes that are not user fields.
_STANDARD = set(vars(logging.makeLogRecord({}))) | {"message", "asctime", "taskName"}


class JsonFormatter(logging.Formatter):
    def __init__(self, static: dict[str, str] | None = None) -> None:
        super().__init__()
        self._static = static or {}

    def format(self, record: logging.LogRecord) -> str:
        entry: dict[str, Any] = {
            "time": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs * 1000):06d}Z",
            "level": record.levelname.lower(),
            "msg": record.getMessage(),
            "logger": record.name,
            **self._static,
        }
        for key, value in vars(record).items():
            if key not in _STANDARD and not key.startswith("_"):
                entry[key] = value
        if record.exc_info:
            entry["error"] = self.formatException(record.exc_info)
        return json.dumps(entry, default=str, separators=(",", ":"))


class FdHandler(logging.Handler):
    """Writes each record with one ``write(2)`` so lines never interleave."""

    def __init__(self, fd: int) -> None:
        super().__init__()
        self.fd = fd

    def emit(self, record: logging.LogRecord) -> None:
        try:
            data = (self.format(record) + "\n").encode()
            os.write(self.fd, data)
        except (OSError, ValueError):
            pass  # a reader that went away must not take the shim with it


def open_log_fifo(bundle: str) -> int | None:
    """Open ``<bundle>/log`` for writing without blocking; None if unusable."""
    try:
        fd = os.open(os.path.join(bundle, "log"), os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None
    # Non-blocking writes would drop lines whenever containerd is slow to read;
    # containerd holds the FIFO open read-write, so blocking writes cannot hang
    # on a missing reader.
    os.set_blocking(fd, True)
    return fd


def configure(fd: int | None, *, debug: bool, static: dict[str, str] | None = None) -> None:
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
    root.setLevel(logging.DEBUG if debug else logging.INFO)
    # Libraries' debug chatter (pyroute2 logs every netlink message) is not ours.
    for name in ("pyroute2", "asyncio"):
        logging.getLogger(name).setLevel(logging.WARNING)
    if fd is None:
        root.addHandler(logging.NullHandler())
        return
    handler = FdHandler(fd)
    handler.setFormatter(JsonFormatter(static))
    root.addHandler(handler)
