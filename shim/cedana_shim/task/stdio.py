"""A process's stdio, the way containerd's runc shim plumbs it.

The strings in CreateTaskRequest / ExecProcessRequest are read as URIs, the
kind decided by stdout's (containerd ``createIO``):

* empty everywhere: null IO, the process gets /dev/null;
* a path (or ``fifo://``): the client's FIFOs. The process writes into pipes the
  shim owns and a copier thread moves bytes pipe -> FIFO. Each output FIFO is
  held open for reading too, so a client that goes away never earns the
  container an EPIPE. stdin is copied FIFO -> pipe; the shim keeps a writer on
  the stdin FIFO until CloseIO so the copier sees EOF only when asked to;
* ``binary:///path?k=v``: a logging binary receives the stdout/stderr pipes as
  fds 3 and 4 and signals readiness on fd 5;
* ``file:///abs/path``: stdout and stderr appended to one file.

With a terminal, the pty master (received from runc over the console socket)
replaces the pipes: FIFO -> master for stdin, master -> stdout FIFO for output.
Copiers are threads blocked in poll(2) on the source and a cancel pipe, so a
container's output never waits for the event loop and close() can stop them.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import select
import stat
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from urllib.parse import parse_qsl, unquote, urlsplit

from ..errors import InvalidArgument

log = logging.getLogger(__name__)

COPY_BUFFER = 32 * 1024
LOGGER_READY_TIMEOUT = 10.0
LOGGER_STOP_GRACE = 12.0


@dataclass(frozen=True, slots=True)
class StdioConfig:
    stdin: str = ""
    stdout: str = ""
    stderr: str = ""
    terminal: bool = False

    @property
    def is_null(self) -> bool:
        return not (self.stdin or self.stdout or self.stderr)


@dataclass(frozen=True, slots=True)
class StdioTarget:
    """What stdout's URI asks for."""

    kind: str  # "null" | "fifo" | "binary" | "file"
    path: str = ""
    args: tuple[str, ...] = ()


def parse_target(config: StdioConfig) -> StdioTarget:
    if config.is_null:
        return StdioTarget("null")
    if not config.stdout:
        return StdioTarget("fifo")
    parts = urlsplit(config.stdout)
    scheme = parts.scheme
    if scheme in ("binary", "file") and parts.netloc:
        # binary://logger/x would otherwise silently run /x
        raise InvalidArgument(f"stdio {scheme} URI needs an absolute path: {config.stdout!r}")
    if scheme in ("", "fifo"):
        return StdioTarget("fifo", config.stdout if not scheme else unquote(parts.path))
    if scheme == "binary":
        if not parts.path.startswith("/"):
            raise InvalidArgument(f"stdio binary URI needs an absolute path: {config.stdout!r}")
        args: list[str] = []
        for key, value in parse_qsl(parts.query, keep_blank_values=True):
            args += [key, value] if value else [key]
        return StdioTarget("binary", unquote(parts.path), tuple(args))
    if scheme == "file":
        path = unquote(parts.path)
        if not path.startswith("/"):
            raise InvalidArgument(f"stdio file URI needs an absolute path: {config.stdout!r}")
        return StdioTarget("file", path)
    raise InvalidArgument(f"unknown STDIO scheme {scheme!r} in {config.stdout!r}")


def _open_fifo_writer(path: str) -> tuple[int, int | None]:
    """A write handle on the client's FIFO (plus our own read handle on it).

    The O_RDONLY handle comes first: opening write-only blocks until some
    reader exists, and ours means one always does. A regular file (seen with
    some clients) is appended to instead.
    """
    try:
        st = os.stat(path)
    except FileNotFoundError:
        st = None
    if st is not None and not stat.S_ISFIFO(st.st_mode):
        return os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CLOEXEC), None
    reader = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    writer = os.open(path, os.O_WRONLY | os.O_CLOEXEC)
    return writer, reader


def _close(fd: int | None) -> None:
    if fd is not None and fd >= 0:
        with contextlib.suppress(OSError):
            os.close(fd)


class _Sink:
    """A destination shared by copiers; its fds close when the last copier ends.

    Closing is what tells the client "no more output": for a FIFO both our
    write and our read handle must go.
    """

    def __init__(self, write_fd: int, *extra_fds: int, path: str = "") -> None:
        self.fd = write_fd
        self.path = path
        self._fds = [write_fd, *extra_fds]
        self._users = 0
        self._lock = threading.Lock()

    def acquire(self) -> None:
        with self._lock:
            self._users += 1

    def release(self) -> None:
        with self._lock:
            self._users -= 1
            if self._users > 0:
                return
        self.close()

    def close(self) -> None:
        with self._lock:
            fds, self._fds = self._fds, []
        for fd in fds:
            _close(fd)


class _Copier(threading.Thread):
    """Moves bytes from ``src`` to ``dst`` until EOF or cancel, then ``on_done``."""

    def __init__(
        self, name: str, src: int, dst: int, cancel: int, on_done: Callable[[], None]
    ) -> None:
        super().__init__(name=name, daemon=True)
        self.src, self.dst, self.cancel, self.on_done = src, dst, cancel, on_done

    def run(self) -> None:
        poller = select.poll()
        poller.register(self.src, select.POLLIN | select.POLLHUP | select.POLLERR)
        poller.register(self.cancel, select.POLLIN)
        try:
            os.set_blocking(self.src, False)
            while True:
                ready = dict(poller.poll())
                if self.cancel in ready:
                    return
                try:
                    data = os.read(self.src, COPY_BUFFER)
                except BlockingIOError:
                    continue
                except OSError as err:
                    if err.errno == errno.EIO:  # pty master after the last slave closed
                        return
                    raise
                if not data:
                    return
                view = memoryview(data)
                while view:
                    view = view[os.write(self.dst, view) :]
        except BrokenPipeError:
            pass
        except OSError as err:
            log.warning("stdio copy stopped", extra={"copier": self.name, "error": str(err)})
        finally:
            self.on_done()


@dataclass(frozen=True, slots=True)
class LoggerPlan:
    """A ``binary://`` logger to start: fds become its 3 (stdout), 4 (stderr), 5 (ready)."""

    argv: tuple[str, ...]
    stdout_r: int
    stderr_r: int
    ready_w: int
    ready_r: int


class ProcessIO:
    """The shim's side of one process's stdio."""

    def __init__(self, container_id: str, config: StdioConfig, uid: int = 0, gid: int = 0) -> None:
        self.name = container_id
        self.config = config
        self.target = parse_target(config)
        self._uid, self._gid = uid, gid
        self._for_child: list[int] = []  # closed once runc handed them to the process
        self._held: list[int] = []  # closed at close()
        self._sinks: list[_Sink] = []
        self._copiers: list[_Copier] = []
        self._cancel_r, self._cancel_w = os.pipe2(os.O_CLOEXEC)
        self._stdin_w: int | None = None  # our end of the process's stdin pipe
        self._stdin_closer: int | None = None  # writer on the stdin FIFO, until CloseIO
        self.logger: LoggerPlan | None = None
        self.console: int | None = None

    # -- before runc runs ----------------------------------------------------------

    def prepare(self) -> tuple[int, int, int]:
        """The (stdin, stdout, stderr) fds runc should give a non-terminal process."""
        devnull = os.open(os.devnull, os.O_RDWR | os.O_CLOEXEC)
        self._for_child.append(devnull)
        stdin = stdout = stderr = devnull
        kind = self.target.kind
        if kind == "null":
            return stdin, stdout, stderr
        if self.config.stdin:
            stdin, self._stdin_w = self._pipe()
            self._for_child.append(stdin)
        if kind == "fifo":
            if self.config.stdout:
                stdout = self._pipe_into(self._fifo_sink(self.config.stdout), "stdout")
            if self.config.stderr:
                stderr = self._pipe_into(self._fifo_sink(self.config.stderr), "stderr")
        elif kind == "file":
            os.makedirs(os.path.dirname(self.target.path), exist_ok=True)
            flags = os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC
            sink = self._new_sink(os.open(self.target.path, flags, 0o644))
            stdout = self._pipe_into(sink, "stdout")
            stderr = self._pipe_into(sink, "stderr")
        else:  # binary: the logger reads the pipes itself
            out_r, stdout = self._pipe()
            err_r, stderr = self._pipe()
            ready_r, ready_w = os.pipe2(os.O_CLOEXEC)
            self._for_child += [stdout, stderr]
            self._held += [out_r, err_r, ready_r, ready_w]
            self.logger = LoggerPlan(
                (self.target.path, *self.target.args), out_r, err_r, ready_w, ready_r
            )
        return stdin, stdout, stderr

    def logger_spawned(self) -> None:
        """The logger holds its pipe ends now; ours would keep its reads from ending."""
        if self.logger is None:
            return
        for fd in (self.logger.stdout_r, self.logger.stderr_r, self.logger.ready_w):
            if fd in self._held:
                self._held.remove(fd)
                _close(fd)

    def _pipe(self) -> tuple[int, int]:
        r, w = os.pipe2(os.O_CLOEXEC)
        if self._uid or self._gid:
            for fd in (r, w):
                os.fchown(fd, self._uid, self._gid)
        return r, w

    def _new_sink(self, write_fd: int, *extra: int, path: str = "") -> _Sink:
        sink = _Sink(write_fd, *extra, path=path)
        self._sinks.append(sink)
        return sink

    def _fifo_sink(self, path: str) -> _Sink:
        for sink in self._sinks:  # stdout and stderr may name the same FIFO
            if sink.path == path:
                return sink
        writer, reader = _open_fifo_writer(path)
        return self._new_sink(writer, *(() if reader is None else (reader,)), path=path)

    def _pipe_into(self, sink: _Sink, stream: str) -> int:
        r, w = self._pipe()
        self._for_child.append(w)
        self._held.append(r)
        self._copy(stream, r, sink)
        return w

    def _copy(self, stream: str, src: int, sink: _Sink) -> None:
        sink.acquire()
        self._copiers.append(
            _Copier(f"{self.name}-{stream}", src, sink.fd, self._cancel_r, sink.release)
        )

    # -- once runc has handed the fds over -------------------------------------------

    def start(self, console_master: int | None = None) -> None:
        """Close the process's ends here and start copying."""
        for fd in self._for_child:
            _close(fd)
        self._for_child.clear()
        stdin_dst = self._stdin_w
        if console_master is not None:
            self.console = console_master
            self._held.append(console_master)
            if self.config.stdout:
                self._copy("console", console_master, self._fifo_sink(self.config.stdout))
            if self.config.stdin:
                stdin_dst = self._stdin_w = os.dup(console_master)
        if self.config.stdin and stdin_dst is not None:
            src = os.open(self.config.stdin, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
            self._held.append(src)
            # Our own writer keeps the FIFO from reading EOF until CloseIO.
            self._stdin_closer = os.open(
                self.config.stdin, os.O_WRONLY | os.O_NONBLOCK | os.O_CLOEXEC
            )
            self._copiers.append(
                _Copier(f"{self.name}-stdin", src, stdin_dst, self._cancel_r, self._end_stdin)
            )
        for copier in self._copiers:
            copier.start()

    def _end_stdin(self) -> None:
        w, self._stdin_w = self._stdin_w, None
        _close(w)  # the process reads EOF

    # -- RPC-driven ------------------------------------------------------------------

    def close_stdin(self) -> None:
        """CloseIO: EOF reaches the process once the client's writer is gone too."""
        closer, self._stdin_closer = self._stdin_closer, None
        _close(closer)

    def wait(self, timeout: float) -> bool:
        """Wait for the output copiers to drain; False if they did not within ``timeout``.

        They end at EOF, once every holder of the pipes' write ends is gone, which
        a grandchild may put off for ever; hence the bound, for all of them.
        """
        deadline = time.monotonic() + timeout
        for copier in self._copiers:
            if copier.name.endswith("-stdin") or not copier.is_alive():
                continue
            copier.join(max(0.0, deadline - time.monotonic()))
            if copier.is_alive():
                return False
        return True

    def close(self) -> None:
        """Stop every copier and release every fd. Idempotent."""
        if self._cancel_w < 0:
            return
        os.write(self._cancel_w, b"x")
        for copier in self._copiers:
            if copier.is_alive():
                copier.join(1.0)
        for sink in self._sinks:
            sink.close()
        for fd in [*self._for_child, *self._held, self._stdin_closer, self._stdin_w]:
            _close(fd)
        self._for_child, self._held = [], []
        self._stdin_closer = self._stdin_w = None
        _close(self._cancel_w)
        _close(self._cancel_r)
        self._cancel_w = self._cancel_r = -1


def set_window_size(fd: int, width: int, height: int) -> None:
    import struct
    import termios

    fcntl.ioctl(fd, termios.TIOCSWINSZ, struct.pack("HHHH", height, width, 0, 0))
