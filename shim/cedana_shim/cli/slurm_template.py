"""The fork server template of kind ``slurm``: it forks the keepers of protected Slurm
job steps (cli/slurm_task.py is the client; cli/forkserver.py the server)."""

from __future__ import annotations

import contextlib
import os
from typing import NoReturn

from ..slurm import task_link
from .forkserver import ForkRequest, Template
from .slurm_task import TITLE, run_keeper


class KeeperTemplate(Template):
    """The fork server of kind ``slurm``: forks keepers, one per protected job step.

    The server was started by some job's task process: before it serves, it leaves
    that job's cgroups for the root ones (where each keeper must be anyway, see
    slurm/cgroups.py) and the job's mount namespace for pid 1's, so that no job's
    resources are held by it (each keeper takes slurmstepd's rlimits, runner.py);
    ``spawn_server(orphan=True)`` took it out of the job's process tree, and
    ``setsid`` out of its session."""

    title = (TITLE, "template")
    comm = "cedana-slurm-tm"
    keeps_spare = False  # a keeper's set-up is all its job's (runner.py)

    def warm_up(self) -> None:
        import socket  # noqa: F401

        from ..slurm import cgroups, job_run, runner  # noqa: F401
        from ..slurm.namespace import enter_mounts_of
        from . import wiring  # noqa: F401

        cgroups.leave_for_root()
        # Best effort: where pid 1's namespace is out of reach (a sandbox), each keeper
        # still joins its own task's.
        with contextlib.suppress(OSError):
            enter_mounts_of(1)

    def check(self, request: ForkRequest) -> object:
        if len(request.fds) != 4:
            raise ValueError(f"expected 4 fds (link, stdout, stderr, env), got {len(request.fds)}")
        if request.peer_pid <= 0:
            raise ValueError("no peer pid")
        return None

    def run(self, request: ForkRequest, checked: object) -> NoReturn:
        code = task_link.EXIT_RUNNER_FAILED
        try:
            import signal

            os.setsid()
            for sig in (signal.SIGCHLD, signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
                signal.signal(sig, signal.SIG_DFL)
            link, out, err, env = request.fds
            devnull = os.open(os.devnull, os.O_RDWR)
            for src, dest in ((devnull, 0), (out, 1), (err, 2)):
                os.dup2(src, dest)
            for fd in (devnull, out, err):
                if fd > 2:
                    os.close(fd)
            argv = task_link.replace_env_fd(request.argv, env)
            code = run_keeper(argv, link, request.peer_pid)
        finally:
            os._exit(code)
