"""Shared pieces of the ``cedana`` admin CLI: its error type and pure formatting.

Everything here is a pure function of its arguments (the clock and the terminal
width are passed in), so the output of the commands can be tested exactly.
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from datetime import UTC, datetime
from typing import Final

__all__ = [
    "ROOT_HINT",
    "CliError",
    "format_elapsed",
    "format_local",
    "format_relative",
    "human_size",
    "is_root",
    "parse_rfc3339",
    "render_progress",
    "render_table",
    "render_transfer",
]

ROOT_HINT: Final = "run cedana as root (sudo cedana ...)"
SPINNER: Final = "⠋⠙⠹⠸⠼⠴⠦⠧⠇⠏"
ASCII_SPINNER: Final = "|/-\\"
BAR_WIDTH: Final = 12
BAR_BLOCK: Final = 3
_UNITS: Final = ("KiB", "MiB", "GiB", "TiB", "PiB", "EiB")


class CliError(Exception):
    """An expected failure: printed as ``cedana: <message>``, exit status ``status``."""

    def __init__(self, message: str, status: int = 1) -> None:
        super().__init__(message)
        self.status = status


def is_root() -> bool:
    return os.geteuid() == 0


# -- sizes and times -----------------------------------------------------------------


def human_size(n: int) -> str:
    """Binary units, one decimal: ``512 B``, ``1.0 KiB``, ``12.3 MiB``."""
    if n < 1024:
        return f"{n} B"
    value = float(n)
    for unit in _UNITS:
        value /= 1024
        if round(value, 1) < 1024 or unit == _UNITS[-1]:
            return f"{value:.1f} {unit}"
    raise AssertionError("unreachable")


def format_elapsed(seconds: float) -> str:
    """``0.4s``, ``59.9s``, ``1m05s``, ``2h03m07s``."""
    seconds = max(0.0, seconds)
    if seconds < 60:
        return f"{seconds:.1f}s"
    whole = int(seconds)
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes:02d}m{secs:02d}s"
    return f"{minutes}m{secs:02d}s"


def format_relative(then: datetime, now: datetime) -> str:
    """How long ago ``then`` was: ``just now``, ``45s ago``, ``5m ago``, ``3h ago``, ``2d ago``."""
    delta = (now - then).total_seconds()
    if delta < -1:
        return "in the future"  # clock skew between the node that wrote it and this one
    if delta < 1:
        return "just now"
    for limit, size, unit in ((60, 1, "s"), (3600, 60, "m"), (86400, 3600, "h")):
        if delta < limit:
            return f"{int(delta // size)}{unit} ago"
    days = int(delta // 86400)
    return f"{days}d ago" if days < 365 else f"{days // 365}y ago"


def parse_rfc3339(value: str) -> datetime | None:
    from cedana_shim.checkpoint.store.layout import parse_created

    return parse_created(value)


def format_local(created: str, now: datetime, *, seconds: bool = False) -> str:
    """An RFC 3339 time as local time plus how long ago: ``2026-11-29 19:30 (5m ago)``."""
    when = parse_rfc3339(created)
    if when is None:
        return created or "-"
    local = when.astimezone().strftime("%Y-%m-%d %H:%M:%S %z" if seconds else "%Y-%m-%d %H:%M")
    return f"{local} ({format_relative(when, now)})"


def utcnow() -> datetime:
    return datetime.now(UTC)


# -- tables ------------------------------------------------------------------------------


def render_table(headers: Sequence[str], rows: Sequence[Sequence[str]], *, gap: int = 3) -> str:
    """Columns aligned on the widest cell; the last column is not padded."""
    widths = [len(h) for h in headers]
    for row in rows:
        for i, cell in enumerate(row):
            widths[i] = max(widths[i], len(cell))
    lines = []
    for row in (headers, *rows):
        cells = [cell.ljust(widths[i]) for i, cell in enumerate(row[:-1])]
        lines.append((" " * gap).join([*cells, row[-1]]).rstrip())
    return "\n".join(lines) + "\n"


# -- the progress line -------------------------------------------------------------------


def _bar(tick: int, width: int = BAR_WIDTH, block: int = BAR_BLOCK) -> str:
    """An indeterminate progress bar: a block bouncing between the brackets."""
    span = width - block
    pos = tick % (2 * span)
    if pos > span:
        pos = 2 * span - pos
    return "[" + " " * pos + "=" * block + " " * (span - pos) + "]"


def render_progress(
    what: str, elapsed: float, tick: int, width: int, *, ascii: bool = False
) -> str:
    """One line of progress for a terminal ``width`` columns wide (no control characters):
    ``⠹ checkpointing container c1  [  ===       ]  3.2s``. The description is cut
    (with ``...``) so the line never wraps; the elapsed time is always kept."""
    frames = ASCII_SPINNER if ascii else SPINNER
    spin = frames[tick % len(frames)]
    tail = f"  {_bar(tick)}  {format_elapsed(elapsed)}"
    room = max(width - 1, 1) - len(spin) - 1 - len(tail)
    if room < len(what):
        if room < 8:  # too narrow for the bar: spinner, description, time
            tail = f"  {format_elapsed(elapsed)}"
            room = max(width - 1, 1) - len(spin) - 1 - len(tail)
        what = what[: max(room - 3, 0)] + "..." if room >= 3 else ""
    return f"{spin} {what}{tail}"


def render_transfer(what: str, done: int, total: int, elapsed: float, width: int) -> str:
    """One line of a transfer's progress, never wider than ``width`` (no control
    characters): ``pushing 2026...  [=====     ]  45.2 MiB / 100.0 MiB  12.3 MB/s``."""
    fraction = min(done / total, 1.0) if total > 0 else 1.0
    filled = int(fraction * BAR_WIDTH)
    bar = "[" + "=" * filled + " " * (BAR_WIDTH - filled) + "]"
    rate = done / elapsed / 1e6 if elapsed > 0 else 0.0
    tail = f"  {bar}  {human_size(done)} / {human_size(total)}  {rate:.1f} MB/s"
    room = max(width - 1, 1) - len(tail)
    if room < len(what):
        what = what[: max(room - 3, 0)] + "..." if room >= 3 else ""
    return f"{what}{tail}"
