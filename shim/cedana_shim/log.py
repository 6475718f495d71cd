"""Structured logs, one JSON object a line, to containerd's log FIFO and the node's log file.

containerd creates ``<bundle>/log`` as a FIFO before it runs the shim and copies
whatever arrives there into its own log. The daemon opens it write-only and
sends every record there. Structured fields ride on ``extra=``:
``log.info("created", extra={"container": id})``.

The FIFO must never stall the daemon: containerd keeps it open but stops reading
it once the shim's last task is deleted, and a blocking write would then hang the
daemon (background work such as a checkpoint's compaction goes on logging) as
soon as the 64 KiB pipe buffer is full. So it is written without blocking
(:class:`FdHandler`): a record waits at most ``FIFO_WAIT`` for room, and while
the pipe stays full records are dropped at once, until containerd reads again.
A vanished reader is the same: the record is dropped.

Those late records are exactly the ones worth keeping, so the daemon also writes
every record to the node's shim log file (:func:`add_node_log`, node config
``log_file``): one ``write(2)`` with ``O_APPEND`` per record, so the lines of the
daemons sharing the file never interleave, and a size cap with rotation
(:class:`NodeLogHandler`).

A size cap also means that a burst of one error (asyncio logs a traceback for
every failed ``accept()`` once a process is out of descriptors: thousands a
second) would rotate every earlier line out of the file. So both handlers let
through at most ``REPEAT_BURST`` warnings or errors of one kind per
``REPEAT_WINDOW`` and then count the rest, which one line reports once the window
is over: "N similar lines suppressed" (:class:`RepeatFilter`).
"""

from __future__ import annotations

import json
import logging
import os
import select
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

# LogRecord attributes that are not user fields.
_STANDARD = set(vars(logging.makeLogRecord({}))) | {"message", "asctime", "taskName"}
# How long one record may wait for containerd to make room in the FIFO. containerd
# copies the FIFO continuously: a pipe still full after this is not being read.
FIFO_WAIT = 0.2
LOG_FILE_LIMIT = 10 << 20  # bytes in the live file before it is rotated
LOG_FILE_GENERATIONS = 3  # rotated files kept: <file>.1 (newest) .. <file>.3
# Warnings and errors of one kind written per window (RepeatFilter). Info lines are
# one per operation (a checkpoint, a restore) and are never held back.
REPEAT_BURST = 10
REPEAT_WINDOW = 10.0  # seconds
REPEAT_KINDS = 1024  # kinds tracked at once (a template built per call is one kind each)


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
    """Writes each record to a pipe (or any fd) without ever blocking for long.

    The fd is made non-blocking. A record up to PIPE_BUF (4 KiB) bytes is written
    whole or not at all; a longer one can find the pipe full half-way, and is then
    cut if the pipe stays full (containerd shows one broken line: better than a
    daemon that hangs). ``stalled``: the last record found no room in time; the
    next ones are tried once, without waiting, until one gets through.
    """

    def __init__(self, fd: int, wait: float = FIFO_WAIT) -> None:
        super().__init__()
        self.fd = fd
        self.wait = wait
        self.stalled = False
        os.set_blocking(fd, False)
        self._poll = select.poll()
        self._poll.register(fd, select.POLLOUT)

    def emit(self, record: logging.LogRecord) -> None:
        try:
            data = (self.format(record) + "\n").encode()
            self.stalled = not self._write(data)
        except (OSError, ValueError):
            pass  # a reader that went away must not take the shim with it

    def _write(self, data: bytes) -> bool:
        """False when the pipe had no room in time (the rest of ``data`` is dropped)."""
        deadline = time.monotonic() + (0.0 if self.stalled else self.wait)
        view = memoryview(data)
        while view:
            try:
                view = view[os.write(self.fd, view) :]
                continue
            except BlockingIOError:
                pass
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not self._poll.poll(max(1, int(remaining * 1000))):
                return False
        return True


class NodeLogHandler(logging.Handler):
    """Appends each record to the node's shim log file, which rotates at a size cap.

    Several daemons append to the same file; each write is one ``write(2)`` on an
    ``O_APPEND`` fd, so lines never interleave. Before each write the handler checks
    that its fd is still the live file and that the record fits under ``limit``.
    Rotation (``<file>`` -> ``.1`` -> ... -> ``.<generations>``, the oldest dropped) is
    done under an exclusive ``flock`` of the live file: a daemon that finds the file
    over the cap while another rotates it waits for the lock, sees that the path now
    names a new file, and only reopens. A daemon still holding the old file writes at
    most the record in flight there (it then sits in ``.1``, in order).
    """

    def __init__(
        self, path: str, limit: int = LOG_FILE_LIMIT, generations: int = LOG_FILE_GENERATIONS
    ) -> None:
        super().__init__()
        self.path = path
        self.limit = limit
        self.generations = generations
        self.fd = self._open()

    def _open(self) -> int:
        directory = os.path.dirname(self.path)
        if directory:
            try:
                os.makedirs(directory, mode=0o700)
                os.chmod(directory, 0o700)  # exactly: whatever the umask
            except FileExistsError:
                pass  # an existing directory keeps its owner's choice
        flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC
        try:
            fd = os.open(self.path, flags | os.O_EXCL, 0o600)
            os.fchmod(fd, 0o600)
        except FileExistsError:
            fd = os.open(self.path, flags)
        return fd

    def emit(self, record: logging.LogRecord) -> None:
        try:
            data = (self.format(record) + "\n").encode()
            mine = os.fstat(self.fd)
            if mine.st_size + len(data) > self.limit or not self._is_live(mine):
                self._rotate_or_reopen()
            os.write(self.fd, data)
        except (OSError, ValueError):
            pass  # a full or broken disk must not take the shim with it

    def _is_live(self, mine: os.stat_result) -> bool:
        try:
            live = os.stat(self.path)
        except FileNotFoundError:
            return False
        return (live.st_ino, live.st_dev) == (mine.st_ino, mine.st_dev)

    def _rotate_or_reopen(self) -> None:
        import fcntl

        old = self.fd
        fcntl.flock(old, fcntl.LOCK_EX)
        try:
            mine = os.fstat(old)
            if self._is_live(mine) and mine.st_size > 0:
                for n in range(self.generations - 1, 0, -1):
                    try:
                        os.replace(f"{self.path}.{n}", f"{self.path}.{n + 1}")
                    except FileNotFoundError:
                        continue
                os.replace(self.path, f"{self.path}.1")
            # else another daemon rotated it (or someone moved it away): just reopen.
            new = self._open()
        finally:
            fcntl.flock(old, fcntl.LOCK_UN)
        # Only now: if the open failed, records keep going to the old file.
        self.fd = new
        os.close(old)

    def close(self) -> None:
        self.acquire()
        try:
            if self.fd >= 0:
                os.close(self.fd)
                self.fd = -1
        finally:
            self.release()
            super().close()


@dataclass(slots=True)
class _Window:
    end: float
    seen: int = 0
    suppressed: int = 0
    level: int = logging.WARNING


class RepeatFilter(logging.Filter):
    """Lets through at most ``burst`` warnings or errors of one kind per ``window``
    seconds, for the one handler it is given to.

    A kind is the logger, the message template (``record.msg``, before its
    arguments and ``extra`` fields are filled in) and the exception's type: a flood
    of one failure, whatever its changing details. The window opens at a kind's
    first record; what comes after ``burst`` of them is dropped and counted, and the
    first record the handler gets once the window is over (of any kind) is preceded
    by one line of that logger: ``"N similar lines suppressed"``, the template in
    ``like``. Records below WARNING always pass.
    """

    SUMMARY = "_cedana_repeat_summary"

    def __init__(
        self,
        handler: logging.Handler,
        burst: int = REPEAT_BURST,
        window: float = REPEAT_WINDOW,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__()
        self._handler = handler
        self.burst = burst
        self.window = window
        self._clock = clock
        self._lock = threading.Lock()
        self._windows: dict[tuple[str, str, str], _Window] = {}
        self._next_end = float("inf")  # the earliest end of a window that dropped some

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, self.SUMMARY, False):
            return True
        now = self._clock()
        with self._lock:
            due = self._ended(now) if now >= self._next_end else []
            passes = record.levelno < logging.WARNING or self._admit(record, now)
        for key, window in due:  # outside the lock: the handler filters these too
            self._handler.handle(self._summary(key, window))
        return passes

    def _admit(self, record: logging.LogRecord, now: float) -> bool:
        error = record.exc_info[0].__name__ if record.exc_info and record.exc_info[0] else ""
        key = (record.name, str(record.msg), error)
        window = self._windows.get(key)
        if window is None or now >= window.end:
            if len(self._windows) >= REPEAT_KINDS:
                self._forget_quiet(now)
            window = self._windows[key] = _Window(now + self.window)
        window.seen += 1
        if window.seen <= self.burst:
            return True
        window.suppressed += 1
        window.level = max(window.level, record.levelno)
        self._next_end = min(self._next_end, window.end)
        return False

    def _ended(self, now: float) -> list[tuple[tuple[str, str, str], _Window]]:
        """The windows over that dropped records, forgotten (the next record of their
        kind opens a new one); notes when the next such window ends."""
        due = [(k, w) for k, w in self._windows.items() if w.suppressed and now >= w.end]
        for key, _ in due:
            del self._windows[key]
        ends = [w.end for w in self._windows.values() if w.suppressed]
        self._next_end = min(ends, default=float("inf"))
        return due

    def _forget_quiet(self, now: float) -> None:
        """Room for another kind: windows over, then any that dropped nothing."""
        for key in [k for k, w in self._windows.items() if now >= w.end and not w.suppressed]:
            del self._windows[key]
        if len(self._windows) >= REPEAT_KINDS:
            for key in [k for k, w in self._windows.items() if not w.suppressed]:
                del self._windows[key]

    def _summary(self, key: tuple[str, str, str], window: _Window) -> logging.LogRecord:
        name, template, error = key
        summary = logging.LogRecord(
            name, window.level, __file__, 0, "%d similar lines suppressed",
            (window.suppressed,), None,
        )  # fmt: skip
        summary.like = template
        if error:
            summary.error_type = error
        summary.window_s = self.window
        setattr(summary, self.SUMMARY, True)
        return summary


def limit_repeats(handler: logging.Handler) -> logging.Handler:
    """``handler`` with a :class:`RepeatFilter` of its own; returns it."""
    handler.addFilter(RepeatFilter(handler, REPEAT_BURST, REPEAT_WINDOW))
    return handler


class _Setup:
    """What :func:`configure` chose, for handlers added later."""

    formatter = JsonFormatter()


def open_log_fifo(bundle: str) -> int | None:
    """Open ``<bundle>/log`` for writing without blocking; None if unusable.

    The fd stays non-blocking (see :class:`FdHandler`).
    """
    try:
        return os.open(os.path.join(bundle, "log"), os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    except OSError:
        return None


def configure(fd: int | None, *, debug: bool, static: dict[str, str] | None = None) -> None:
    root = logging.getLogger()
    for handler in list(root.handlers):
        root.removeHandler(handler)
        if isinstance(handler, NodeLogHandler):
            handler.close()
    root.setLevel(logging.DEBUG if debug else logging.INFO)
    # Libraries' debug chatter (pyroute2 logs every netlink message) is not ours.
    for name in ("pyroute2", "asyncio"):
        logging.getLogger(name).setLevel(logging.WARNING)
    _Setup.formatter = JsonFormatter(static)
    if fd is None:
        root.addHandler(logging.NullHandler())
        return
    handler = FdHandler(fd)
    handler.setFormatter(_Setup.formatter)
    root.addHandler(limit_repeats(handler))


def add_node_log(path: str) -> None:
    """Also write every record to the node's shim log file ``path`` ("" turns it off).

    Call it once the node config is known (after :func:`configure`); calling it again
    with another path moves the log there. A file that cannot be opened is reported
    through the other handlers and otherwise ignored.
    """
    root = logging.getLogger()
    for handler in list(root.handlers):
        if isinstance(handler, NodeLogHandler):
            if handler.path == path:
                return
            root.removeHandler(handler)
            handler.close()
    if not path:
        return
    try:
        handler = NodeLogHandler(path)
    except OSError as err:
        logging.getLogger(__name__).warning(
            "cannot open the node's shim log file; logging to containerd only",
            extra={"log_file": path, "error": str(err)},
        )
        return
    handler.setFormatter(_Setup.formatter)
    root.addHandler(limit_repeats(handler))
