"""The task process's side of a protected job (see runner.py): the pid Slurm waits
for, with the step's stdio. It forwards every signal it catches to the job's keeper
over a socketpair (one byte each) and exits with the status the keeper reports.

This runs on the launch path of every protected job, before any keeper exists, so
it imports only C modules (``_signal``, ``_socket``: the ``signal`` and ``socket``
modules cost ~5 and ~3 ms of enum set-up).

The keeper answers one line: the job's exit status, or :data:`RUN_UNPROTECTED` when
the job did not opt in after all (the task process then execs it as Slurm would).
"""

from __future__ import annotations

import _signal  # type: ignore[import-not-found]  # signal: ~5 ms of enum set-up
import _socket
import os

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Mapping, Sequence

# What the task process forwards (those whose default action would end it).
FORWARDED = (
    _signal.SIGHUP,
    _signal.SIGINT,
    _signal.SIGQUIT,
    _signal.SIGTERM,
    _signal.SIGUSR1,
    _signal.SIGUSR2,
    _signal.SIGALRM,
    _signal.SIGCONT,
)
RUN_UNPROTECTED = b"exec"
EXIT_RUNNER_FAILED = 125
ENV_FD_OPTION = "--env-fd"


def link() -> tuple[_socket.socket, _socket.socket]:
    """(the task process's end, the keeper's end)."""
    task_end, keeper_end = _socket.socketpair(_socket.AF_UNIX, _socket.SOCK_STREAM)
    return task_end, keeper_end


def forward_signals(task_end: _socket.socket) -> None:
    """From now on every signal that would end the task process goes to the keeper
    (buffered in the socket until the keeper reads it)."""

    def forward(sig: int, _frame: object) -> None:
        try:  # noqa: SIM105 (contextlib is not imported on the launch path)
            task_end.send(bytes([sig]))
        except OSError:
            pass

    for sig in FORWARDED:
        _signal.signal(sig, forward)


def wait_for_keeper(task_end: _socket.socket) -> int | None:
    """The job's exit status as the keeper reports it; None for :data:`RUN_UNPROTECTED`."""
    data = b""
    while not data.endswith(b"\n"):
        try:
            chunk = task_end.recv(64)
        except InterruptedError:  # pragma: no cover - PEP 475 retries recv itself
            continue
        if not chunk:
            say("the job's keeper process died without reporting the job's exit")
            return EXIT_RUNNER_FAILED
        data += chunk
    answer = data.strip()
    if answer == RUN_UNPROTECTED:
        return None
    try:
        return int(answer)
    except ValueError:
        say(f"the job's keeper answered {answer[:64]!r}")
        return EXIT_RUNNER_FAILED


def with_job_env_fd(argv: Sequence[str], environ: Mapping[str, str]) -> tuple[list[str], int]:
    """The runner's argv with an ``--env-fd`` the keeper can read from offset 0 (a
    memfd), and that fd. The plugin passes one; run by hand, this process's own
    environment is the job's. A descriptor that cannot be re-read (a pipe) is copied
    into a memfd, so that both the keeper and this process can read it."""
    args = list(argv)
    end = args.index("--") if "--" in args else len(args)
    for i in range(end - 1):
        if args[i] == ENV_FD_OPTION and args[i + 1].isdigit():
            fd = int(args[i + 1])
            try:
                os.lseek(fd, 0, os.SEEK_SET)
                seekable = True
            except OSError:
                seekable = False
            if not seekable:
                copy = _memfd(_read_all(fd))
                os.close(fd)
                args[i + 1] = str(copy)
                fd = copy
            os.set_inheritable(fd, False)  # never into the job, should we exec it here
            return args, fd
    data = b"".join(f"{k}={v}".encode(errors="surrogateescape") + b"\0" for k, v in environ.items())
    fd = _memfd(data)
    os.set_inheritable(fd, False)
    return [*args[:end], ENV_FD_OPTION, str(fd), *args[end:]], fd


def replace_env_fd(argv: Sequence[str], fd: int) -> list[str]:
    """``argv`` with its ``--env-fd`` pointing at ``fd`` (this process's number)."""
    args = list(argv)
    end = args.index("--") if "--" in args else len(args)
    for i in range(end - 1):
        if args[i] == ENV_FD_OPTION:
            args[i + 1] = str(fd)
            return args
    return [*args[:end], ENV_FD_OPTION, str(fd), *args[end:]]


def _memfd(data: bytes) -> int:
    fd = os.memfd_create("cedana-job-env", 0)
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]
    return fd


def _read_all(fd: int) -> bytes:
    chunks = []
    while chunk := os.read(fd, 1 << 16):
        chunks.append(chunk)
    return b"".join(chunks)


def say(text: str) -> None:
    try:  # noqa: SIM105 (as above)
        os.write(2, f"cedana: {text}\n".encode(errors="replace"))
    except OSError:
        pass


__all__ = [
    "EXIT_RUNNER_FAILED",
    "FORWARDED",
    "RUN_UNPROTECTED",
    "forward_signals",
    "link",
    "replace_env_fd",
    "wait_for_keeper",
    "with_job_env_fd",
]
