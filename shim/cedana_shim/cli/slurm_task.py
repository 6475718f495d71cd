"""``cedana-slurm-task``: the Slurm job runner's composition root (what the SPANK
plugin execs for an opted-in batch step; the runner itself lives in cedana_shim.slurm).

This process becomes the job's *task process* (slurm/task_link.py). The job's
*keeper* (slurm/runner.py) is forked by a warm template, the fork server of kind
``slurm`` (cli/forkserver.py: ``forkserver-slurm-<code fingerprint>.sock``, the same
lifecycle as the shim's), which imported the runner, the checkpoint pipeline and
the node wiring once: a job then starts without ~0.3 s of imports on its launch
path. When no server answers, this process double-forks the keeper itself (the cold
path, imports included) and starts a server in the background for the next job;
``CEDANA_FORKSERVER=0`` in the runner's environment always takes the cold path.

Launch path: only C modules and the fork client are imported before the keeper
runs; the request carries the runner's argv and four descriptors: the keeper's end
of the link, the step's stdout and stderr, and the job's environment (a memfd).
"""

from __future__ import annotations

import os
import sys

from ..slurm import task_link
from .fork_client import ForkServerUnavailable, request_fork, spawn_server
from .paths import code_fingerprint, forkserver_socket_path

TYPE_CHECKING = False
if TYPE_CHECKING:
    from collections.abc import Sequence

SAFE_PATH = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
KIND = "slurm"
TITLE = "cedana-slurm-task"


def main() -> int:
    argv = sys.argv[1:]
    task_end, keeper_end = task_link.link()
    task_link.forward_signals(task_end)  # Slurm may signal the step from now on
    use_server = os.environ.get("CEDANA_FORKSERVER", "1") != "0"
    argv, env_fd = task_link.with_job_env_fd(argv, os.environ)
    # Nothing of this environment reaches the keeper or the server it may start.
    os.environ.clear()
    os.environ["PATH"] = SAFE_PATH
    started = False
    if use_server:
        server = forkserver_socket_path(code_fingerprint(), KIND)
        try:
            request_fork(server, [keeper_end.fileno(), 1, 2, env_fd], argv, "/", {}, b"")
            started = True
        except ForkServerUnavailable:
            spawn_server(server, orphan=True)
    if not started:
        cold_keeper(argv, keeper_end.fileno(), task_end.fileno())
    keeper_end.close()
    status = task_link.wait_for_keeper(task_end)
    if status is None:
        from ..slurm.runner import run_unprotected

        task_end.close()
        run_unprotected(argv)
    return status


def cold_keeper(argv: Sequence[str], keeper_fd: int, task_fd: int) -> None:
    """Double-fork the keeper from this process (no warm template answered)."""
    task_pid = os.getpid()
    child = os.fork()
    if child == 0:
        code = task_link.EXIT_RUNNER_FAILED
        try:
            os.close(task_fd)
            os.setsid()
            code = run_keeper(argv, keeper_fd, task_pid) if os.fork() == 0 else 0
        finally:
            os._exit(code)
    os.waitpid(child, 0)


def run_keeper(argv: Sequence[str], keeper_fd: int, task_pid: int) -> int:
    """The keeper, wired to the node's pipelines (cold path and template alike)."""
    import socket

    from ..slurm import runner
    from .proctitle import set_name, set_title
    from .wiring import NodePipelines

    # What `ps` shows: the job step it keeps (a template's child would show the
    # template's command line, a cold one the task's).
    set_title([TITLE, "keeper", _step_name(argv)])
    set_name("cedana-keeper")
    return runner.run_keeper(argv, socket.socket(fileno=keeper_fd), task_pid, NodePipelines)


def _step_name(argv: Sequence[str]) -> str:
    ours = list(argv[: list(argv).index("--")] if "--" in argv else argv)
    given = {ours[i]: ours[i + 1] for i in range(len(ours) - 1)}
    return f"{given.get('--job-id', '?')}.{given.get('--step-id', '?')}"
