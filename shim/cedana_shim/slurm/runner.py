"""``cedana-slurm-task``: the job runner the SPANK plugin execs in an opted-in task.

Contract with the plugin (it execs this as root in the task's own process, with
the job's environment plus ``CEDANA_SLURM=1``)::

    cedana-slurm-task --job-id ID --step-id STEP --uid UID --gid GID [--gids G1,G2]
                      --cwd DIR [--config PATH] [--env-fd N] -- ARGV...

``--env-fd N`` (preferred): the job's environment is read from fd N (NUL-separated
``KEY=VALUE``), so that the plugin can exec this root process with a clean
environment of its own (a user's LD_PRELOAD or PYTHONPATH must never reach it).

Exit status: the job's own (its exit code, or 128+signal when a signal ended it
or when it was checkpointed and stopped for that signal); 125 when the runner
could not run the job at all (the reason is on the job's stderr); 2 for a bad
command line.

Two processes, because Slurm signals a step by its process tree
(proctrack/linuxproc) or process group (proctrack/pgid) and the job must not get
SIGTERM before its checkpoint is durable:

* the *task process* (this one: the pid Slurm waits for, with the step's stdio)
  only forwards every signal it catches to the keeper and exits with the status
  the keeper reports;
* the *keeper* (double-forked, in a session of its own, so outside the step's
  tree and process group) holds the container (the job's processes are its
  children) and runs :class:`~.job_run.JobRun`. When the task process dies
  (SIGKILL at the end of KillWait) the keeper abandons any checkpoint in progress
  (nothing of it becomes visible) and kills the job.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import pwd
import re
import signal
import socket
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Final, NoReturn

from ..checkpoint.policy import Policy, policy_for
from ..errors import InvalidArgument, ShimError
from .job_spec import JobRequest

if TYPE_CHECKING:
    from .job_run import PipelinesFactory

SAFE_PATH: Final = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
FORWARDED: Final = (
    signal.SIGHUP,
    signal.SIGINT,
    signal.SIGQUIT,
    signal.SIGTERM,
    signal.SIGUSR1,
    signal.SIGUSR2,
    signal.SIGALRM,
    signal.SIGCONT,
)
EXIT_RUNNER_FAILED: Final = 125
_JOB_ID = re.compile(r"[0-9]{1,10}")
_STEP_ID = re.compile(r"[A-Za-z0-9_]{1,32}")
_NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")
CLUSTER_ENV: Final = "SLURM_CLUSTER_NAME"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="cedana-slurm-task",
        description="Run a Slurm job step in a checkpointable container (started by "
        "cedana's SPANK plugin, not by hand).",
    )
    p.add_argument("--job-id", required=True)
    p.add_argument("--step-id", required=True)
    p.add_argument("--uid", required=True, type=int)
    p.add_argument("--gid", required=True, type=int)
    p.add_argument("--gids", default="", help="comma-separated supplementary groups")
    p.add_argument("--cwd", required=True)
    p.add_argument("--config", default="", help="the node config (default: the node's own)")
    p.add_argument(
        "--env-fd",
        type=int,
        default=None,
        help="read the job's environment from this fd (NUL-separated KEY=VALUE) instead "
        "of taking this process's own",
    )
    p.add_argument("argv", nargs=argparse.REMAINDER)
    return p


def parse_request(argv: Sequence[str], env: Mapping[str, str]) -> tuple[JobRequest, str]:
    """The job step the plugin describes, and the node config path; InvalidArgument
    names what is wrong."""
    args = _parser().parse_args(list(argv))
    command = list(args.argv)
    if command[:1] == ["--"]:
        command = command[1:]
    if not command:
        raise InvalidArgument("no job command after --")
    if not _JOB_ID.fullmatch(args.job_id):
        raise InvalidArgument(f"job id {args.job_id!r} is not a number")
    if not _STEP_ID.fullmatch(args.step_id):
        raise InvalidArgument(f"step id {args.step_id!r} is not a Slurm step name")
    try:
        gids = tuple(int(g) for g in args.gids.split(",") if g)
    except ValueError:
        raise InvalidArgument(f"--gids {args.gids!r} is not a list of numbers") from None
    if args.config and not os.path.isabs(args.config):
        raise InvalidArgument(f"--config {args.config!r} is not an absolute path")
    if args.env_fd is not None:
        env = _read_env(args.env_fd)
    job_env = {k: v for k, v in env.items() if k != "CEDANA_SLURM"}
    request = JobRequest(
        job_id=args.job_id,
        step_id=args.step_id,
        uid=args.uid,
        gid=args.gid,
        gids=gids,
        cwd=args.cwd,
        argv=tuple(command),
        env=job_env,
    )
    return request, args.config


def _read_env(fd: int) -> dict[str, str]:
    try:
        with os.fdopen(fd, "rb") as f:
            data = f.read()
    except OSError as err:
        raise InvalidArgument(f"cannot read the job's environment from fd {fd}: {err}") from None
    env: dict[str, str] = {}
    for item in data.split(b"\0"):
        key, sep, value = item.decode(errors="surrogateescape").partition("=")
        if key and sep:
            env[key] = value
    return env


def job_scope(cluster: str, uid: int) -> str:
    """``slurm-<cluster>-<user>``: labels are the user's own on this cluster. The user
    comes from the uid Slurm runs the job as, never from a variable the user sets."""
    try:
        user = pwd.getpwuid(uid).pw_name
    except KeyError:
        user = f"uid{uid}"
    for what, value in (("cluster name (SLURM_CLUSTER_NAME)", cluster), ("user name", user)):
        if not _NAME.fullmatch(value):
            raise InvalidArgument(
                f"{what} {value!r} cannot name a checkpoint scope: use 1-64 letters, "
                "digits, '.', '_' or '-'"
            )
    return f"slurm-{cluster}-{user}"


def main(argv: Sequence[str], pipelines: PipelinesFactory) -> int:
    """The runner; ``pipelines`` builds the node's checkpoint pipelines (the console
    script's composition root passes ``cli.wiring.NodePipelines``)."""
    env = dict(os.environ)
    # Slurm gave the task the user's umask: the job keeps it, root's files do not.
    job_umask = os.umask(0o022)
    # The job's environment is the user's: nothing in it may steer this root process
    # or the tools it runs (runc, CRIU, hooks). It goes to the job only.
    os.environ.clear()
    os.environ["PATH"] = SAFE_PATH
    try:
        request, config_path = parse_request(argv, env)
        request = replace(request, umask=job_umask)
        scope = job_scope(request.env.get(CLUSTER_ENV, ""), request.uid)
        spec = {"process": {"env": [f"{k}={v}" for k, v in request.env.items()]}}
        policy = policy_for(spec, request.container_id, scope)
    except ShimError as err:
        _say(f"cannot protect this job: {err}")
        return EXIT_RUNNER_FAILED
    if not policy.enabled:
        exec_unprotected(request)
    return _run_protected(request, policy, config_path, pipelines)


def exec_unprotected(request: JobRequest) -> NoReturn:
    """The job as Slurm would have run it: the user's identity, cwd and command."""
    try:
        os.umask(request.umask)
        if os.getuid() == 0:  # as the plugin runs us; by hand we already are the user
            os.setgroups(list(request.gids))
            os.setgid(request.gid)
            os.setuid(request.uid)
        os.chdir(request.cwd)
        os.execvpe(request.argv[0], list(request.argv), dict(request.env))
    except OSError as err:
        _say(f"cannot run {request.argv[0]}: {err.strerror}")
    os._exit(127)


def _run_protected(
    request: JobRequest, policy: Policy, config_path: str, pipelines: PipelinesFactory
) -> int:
    task_end, keeper_end = socket.socketpair()
    child = os.fork()
    if child == 0:  # pragma: no cover - the keeper's side runs in another process
        task_end.close()
        os.setsid()
        if os.fork() != 0:
            os._exit(0)
        os._exit(_keeper(request, policy, config_path, pipelines, keeper_end))
    keeper_end.close()
    os.waitpid(child, 0)
    return _task_process(task_end)


def _task_process(keeper: socket.socket) -> int:
    """Forward every signal to the keeper; exit with the status it reports."""

    def forward(sig: int, _frame: object) -> None:
        with contextlib.suppress(OSError):
            keeper.send(bytes([sig]))

    for sig in FORWARDED:
        signal.signal(sig, forward)
    data = b""
    while not data.endswith(b"\n"):
        chunk = keeper.recv(64)
        if not chunk:
            _say("the job's keeper process died without reporting the job's exit")
            return EXIT_RUNNER_FAILED
        data += chunk
    return int(data)


def _keeper(
    request: JobRequest,
    policy: Policy,
    config_path: str,
    pipelines: PipelinesFactory,
    front: socket.socket,
) -> int:
    import asyncio

    from .. import log as shim_log
    from .job_run import JobRun
    from .namespace import private_mounts

    try:
        shim_log.configure(None, debug=False)
        os.chdir("/")  # the job's cwd (often a network filesystem) is not ours to hold
        private_mounts()  # before any thread: a mount namespace is per thread
        # JobRun reports the job's status to the task process itself.
        job = JobRun(request, policy, front, pipelines, config_path=config_path)
        return asyncio.run(job.run())
    except BaseException as err:  # the task process must hear of it, whatever it is
        _say(f"cannot run job {request.name}: {err}")
        with contextlib.suppress(OSError):
            front.sendall(f"{EXIT_RUNNER_FAILED}\n".encode())
        return EXIT_RUNNER_FAILED


def _say(text: str) -> None:
    with contextlib.suppress(OSError):
        os.write(2, f"cedana: {text}\n".encode(errors="replace"))


__all__ = ["EXIT_RUNNER_FAILED", "job_scope", "main", "parse_request"]
