"""`ctr` wrapper bound to one containerd instance, and a pty runner for `ctr ... -t`."""

from __future__ import annotations

import contextlib
import errno
import fcntl
import os
import pty
import select
import signal
import struct
import subprocess
import termios
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

from .util import WaitAborted, slower, wait_for


class CtrError(AssertionError):
    pass


@dataclass(frozen=True)
class TaskRow:
    id: str
    pid: int
    status: str


@dataclass
class Ctr:
    binary: Path
    address: Path
    namespace: str
    runtime_type: str
    env: dict[str, str] = field(default_factory=dict)

    def argv(self, *args: str) -> list[str]:
        return [
            str(self.binary),
            "--address",
            str(self.address),
            "--namespace",
            self.namespace,
            *args,
        ]

    def __call__(
        self,
        *args: str,
        timeout: float = 30,
        check: bool = True,
        input: str | None = None,
    ) -> subprocess.CompletedProcess[str]:
        """Run ctr to completion; with `check`, a non-zero exit is a test failure that
        shows the command and both streams."""
        argv = self.argv(*args)
        timeout *= slower()
        try:
            proc = subprocess.run(
                argv,
                capture_output=True,
                text=True,
                timeout=timeout,
                input=input,
                stdin=None if input is not None else subprocess.DEVNULL,
                env={**os.environ, **self.env},
                check=False,
            )
        except subprocess.TimeoutExpired as exc:
            raise CtrError(f"timed out after {timeout}s: {' '.join(argv)}") from exc
        if check and proc.returncode != 0:
            raise CtrError(
                f"{' '.join(argv)} -> exit {proc.returncode}\n"
                f"stdout: {proc.stdout}\nstderr: {proc.stderr}"
            )
        return proc

    def popen(self, *args: str, **kwargs: object) -> subprocess.Popen[str]:
        return subprocess.Popen(  # type: ignore[call-overload,no-any-return]
            self.argv(*args),
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env={**os.environ, **self.env},
            **kwargs,
        )

    def run_args(self, image: str, cid: str, *cmd: str, flags: tuple[str, ...] = ()) -> list[str]:
        """Arguments for `ctr run` with the runtime under test."""
        return ["run", "--runtime", self.runtime_type, *flags, image, cid, *cmd]

    def tasks(self) -> dict[str, TaskRow]:
        out = self("task", "ls").stdout.splitlines()
        rows = {}
        for line in out[1:]:
            parts = line.split()
            if len(parts) >= 3:
                rows[parts[0]] = TaskRow(parts[0], int(parts[1]), parts[2])
        return rows

    def task(self, cid: str) -> TaskRow | None:
        return self.tasks().get(cid)

    def containers(self) -> list[str]:
        return self("containers", "ls", "-q").stdout.split()

    def wait_status(
        self,
        cid: str,
        status: str,
        timeout: float = 10,
        proc: subprocess.Popen[str] | None = None,
    ) -> TaskRow:
        """Wait for the task to reach `status`; when `proc` (an attached `ctr run`) exits
        first, fail at once with what it printed."""

        def reached() -> TaskRow | None:
            row = self.task(cid)
            if row is not None and row.status == status:
                return row
            if proc is not None and proc.poll() is not None:
                out, err = proc.communicate()
                raise WaitAborted(
                    f"ctr exited {proc.returncode} before {cid} was {status}: "
                    f"stdout={out!r} stderr={err!r}"
                )
            return None

        return wait_for(reached, timeout=timeout, what=f"task {cid} to be {status}")

    def remove(self, cid: str) -> None:
        """Best-effort removal of a container and its task, whatever state they are in."""
        self("task", "kill", "-s", "SIGKILL", cid, check=False, timeout=10)
        with contextlib.suppress(Exception):
            wait_for(
                lambda: (t := self.task(cid)) is None or t.status == "STOPPED",
                timeout=5,
                what=f"{cid} to stop",
            )
        self("task", "delete", "-f", cid, check=False, timeout=10)
        self("containers", "delete", cid, check=False, timeout=10)

    @contextlib.contextmanager
    def detached(
        self, image: str, cid: str, *cmd: str, flags: tuple[str, ...] = ()
    ) -> Iterator[TaskRow]:
        """`ctr run -d`, waiting until the task is RUNNING; removed again on exit."""
        try:
            self(*self.run_args(image, cid, *cmd, flags=("-d", *flags)))
            yield self.wait_status(cid, "RUNNING")
        finally:
            self.remove(cid)


@dataclass
class PtyResult:
    returncode: int
    output: bytes


class PtySession:
    """A child process on a fresh pseudo-terminal: ctr only allocates a container tty
    when its own stdin is a terminal."""

    def __init__(self, argv: list[str], rows: int = 24, cols: int = 80) -> None:
        self.output = bytearray()
        self._eof = False
        pid, fd = pty.fork()
        if pid == 0:  # child
            try:
                os.execvp(argv[0], argv)
            finally:
                os._exit(127)
        self.pid = pid
        self.fd = fd
        self.resize(rows, cols)
        self.returncode: int | None = None

    def resize(self, rows: int, cols: int) -> None:
        # Changing the master's window size makes the kernel send SIGWINCH to the
        # foreground process group (ctr), which forwards the size to the task.
        fcntl.ioctl(self.fd, termios.TIOCSWINSZ, struct.pack("HHHH", rows, cols, 0, 0))

    def write(self, data: bytes) -> None:
        os.write(self.fd, data)

    def _pump(self, timeout: float) -> None:
        if self._eof:
            time.sleep(min(timeout, 0.05))
            return
        ready, _, _ = select.select([self.fd], [], [], timeout)
        if not ready:
            return
        try:
            chunk = os.read(self.fd, 65536)
        except OSError as exc:  # EIO: the slave side is closed, the child is gone
            if exc.errno != errno.EIO:
                raise
            chunk = b""
        if chunk:
            self.output += chunk
        else:
            self._eof = True

    def expect(
        self, needle: bytes | Callable[[bytes], bool], timeout: float = 10, since: int = 0
    ) -> None:
        """Read until the output from offset `since` on contains `needle` (or satisfies
        it, when callable)."""

        def match(out: bytes) -> bool:
            return needle(out) if callable(needle) else needle in out

        deadline = time.monotonic() + timeout
        while not match(bytes(self.output[since:])):
            remaining = deadline - time.monotonic()
            if remaining <= 0 or (self._eof and self.poll() is not None):
                raise AssertionError(
                    f"terminal output never matched {needle!r}; got {bytes(self.output)!r}"
                )
            self._pump(min(remaining, 0.1))

    def poll(self) -> int | None:
        if self.returncode is None:
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                self.returncode = os.waitstatus_to_exitcode(status)
        return self.returncode

    def wait(self, timeout: float = 20) -> PtyResult:
        deadline = time.monotonic() + timeout
        while self.poll() is None or not self._eof:
            if time.monotonic() > deadline:
                self.kill()
                raise AssertionError(
                    f"pty child did not exit in {timeout}s; output {bytes(self.output)!r}"
                )
            self._pump(0.05)
        assert self.returncode is not None
        return PtyResult(self.returncode, bytes(self.output))

    def kill(self) -> None:
        with contextlib.suppress(ProcessLookupError):
            os.kill(self.pid, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(self.pid, 0)
        self.returncode = self.returncode if self.returncode is not None else -9

    def close(self) -> None:
        if self.poll() is None:
            self.kill()
        with contextlib.suppress(OSError):
            os.close(self.fd)
