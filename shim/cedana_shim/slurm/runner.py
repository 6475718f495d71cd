"""``cedana-slurm-task``: the job runner the SPANK plugin execs in an opted-in task.

Contract with the plugin (it execs this as root in the task's own process, with an
environment of PATH and ``CEDANA_SLURM=1`` only)::

    cedana-slurm-task --job-id ID --step-id STEP --uid UID --gid GID [--gids G1,G2]
                      --cwd DIR [--config PATH] [--env-fd N] -- ARGV...

``--env-fd N``: the job's environment is read from fd N (NUL-separated
``KEY=VALUE``), so that the plugin can exec this root process with a clean
environment of its own (a user's LD_PRELOAD or PYTHONPATH must never reach it).
Without it (run by hand) the runner's own environment is the job's.

Exit status: the job's own (its exit code, or 128+signal when a signal ended it
or when it was checkpointed and stopped for that signal); 125 when the runner
could not run the job at all (the reason is on the job's stderr); 2 for a bad
command line.

Two processes, because Slurm signals a step by its process tree
(proctrack/linuxproc), its process group (proctrack/pgid) or its cgroup
(proctrack/cgroup), and the job must not get SIGTERM before its checkpoint is
durable:

* the *task process* (the one the plugin execs: the pid Slurm waits for, with the
  step's stdio) only forwards every signal it catches to the keeper and exits with
  the status the keeper reports (task_link.py; cli/slurm_task.py starts it);
* the *keeper* (:func:`run_keeper`) holds the container (the job's processes are its
  children) and runs :class:`~.job_run.JobRun`. It is forked by a warm template
  process (the fork server of kind ``slurm``, cli/forkserver.py) that already
  imported all of this, or, when none answers, double-forked by the task process
  itself; either way in a session of its own, outside the step's process tree, and
  in the root cgroups, outside the step's (cgroups.py). What Slurm set on the task
  (cgroup, rlimits, umask, OOM score, mount namespace) it reads from the task
  process, never from its own parent. When the task process dies (SIGKILL at the
  end of KillWait) the keeper abandons any checkpoint in progress (nothing of it
  becomes visible), kills the job and removes what it made.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import logging
import os
import pwd
import re
import socket
from collections.abc import Mapping, Sequence
from dataclasses import replace
from typing import TYPE_CHECKING, Final, NoReturn

from ..checkpoint.policy import Policy, policy_for
from ..errors import InvalidArgument, ShimError
from . import job_spec
from .job_spec import JobRequest
from .task_link import EXIT_RUNNER_FAILED, RUN_UNPROTECTED

if TYPE_CHECKING:
    from .job_run import PipelinesFactory

SAFE_PATH: Final = "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
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
    """Read from offset 0 (the task process and the keeper share the descriptor's
    offset), then closed."""
    try:
        try:
            chunks, offset = [], 0
            while chunk := os.pread(fd, 1 << 16, offset):
                chunks.append(chunk)
                offset += len(chunk)
            data = b"".join(chunks)
        except OSError as err:
            if err.errno != errno.ESPIPE:
                raise
            with os.fdopen(os.dup(fd), "rb") as f:  # a pipe: read once
                data = f.read()
        os.close(fd)
    except OSError as err:
        raise InvalidArgument(f"cannot read the job's environment from fd {fd}: {err}") from None
    env: dict[str, str] = {}
    for item in data.split(b"\0"):
        key, sep, value = item.decode(errors="surrogateescape").partition("=")
        if key and sep:
            env[key] = value
    return env


def job_scope(cluster: str, uid: int) -> str:
    """The scope of the job's labels (:func:`scope_name`): the user's own on this
    cluster. The user comes from the uid Slurm runs the job as, never from a variable
    the user sets."""
    try:
        user = pwd.getpwuid(uid).pw_name
    except KeyError:
        user = f"uid{uid}"
    return scope_name(cluster, user)


def scope_name(cluster: str, user: str) -> str:
    """``slurm-<cluster>-<user>``, or ``slurm--<n>-<cluster>-<user>`` (n: the cluster
    name's length) for a cluster name with a '-' in it; one scope per (cluster, user).

    The first form alone is ambiguous: ``hpc`` + ``lab-x`` and ``hpc-lab`` + ``x`` are
    both ``slurm-hpc-lab-x``. Without a '-' in the cluster name, the first '-' after
    ``slurm-`` ends it, so that form stays as it was (the checkpoints already stored
    keep their scope); the other starts ``slurm--``, which the first never does (a
    cluster name is not empty), and its length says where the cluster name ends.
    Both stay a DNS label, as a registry repository needs, when the names are.
    """
    for what, value in (("cluster name (SLURM_CLUSTER_NAME)", cluster), ("user name", user)):
        if not _NAME.fullmatch(value):
            raise InvalidArgument(
                f"{what} {value!r} cannot name a checkpoint scope: use 1-64 letters, "
                "digits, '.', '_' or '-'"
            )
    if "-" in cluster:
        return f"slurm--{len(cluster)}-{cluster}-{user}"
    return f"slurm-{cluster}-{user}"


def read_request(argv: Sequence[str], task_pid: int) -> tuple[JobRequest, str, Policy]:
    """The job step, the node config path and the job's checkpoint policy; ShimError
    says why the job cannot be protected."""
    request, config_path = parse_request(argv, {})
    try:
        facts = job_spec.task_facts(task_pid)
    except OSError as err:
        raise InvalidArgument(f"the job's task process {task_pid} is gone: {err}") from None
    # The job keeps the umask Slurm gave the task process; root's files do not.
    request = replace(request, umask=facts.umask, task_pid=task_pid)
    scope = job_scope(request.env.get(CLUSTER_ENV, ""), request.uid)
    spec = {"process": {"env": [f"{k}={v}" for k, v in request.env.items()]}}
    return request, config_path, policy_for(spec, request.container_id, scope)


def run_keeper(
    argv: Sequence[str], link: socket.socket, task_pid: int, pipelines: PipelinesFactory
) -> int:
    """The keeper of one job step (see the module docstring); its stdio are the
    step's. Reports to the task process over ``link`` and returns its own exit code."""
    os.umask(0o022)
    os.environ.clear()  # nothing of the caller's steers this root process or its tools
    os.environ["PATH"] = SAFE_PATH
    try:
        request, config_path, policy = read_request(argv, task_pid)
    except ShimError as err:
        _say(f"cannot protect this job: {err}")
        _report(link, EXIT_RUNNER_FAILED)
        return EXIT_RUNNER_FAILED
    if not policy.enabled:
        _report(link, RUN_UNPROTECTED.decode())
        return 0
    # Not the limits of whichever job's task started the warm template.
    stepd = job_spec.parent_of(task_pid)
    job_spec.take_rlimits_of(task_pid, *([stepd] if stepd > 1 else []))
    _all_descriptors()
    return _keeper(request, policy, config_path, pipelines, link)


def run_unprotected(argv: Sequence[str]) -> NoReturn:
    """In the task process, when the keeper said the job did not opt in."""
    try:
        request, _ = parse_request(argv, {})
    except ShimError as err:
        _say(f"cannot run this job: {err}")
        os._exit(EXIT_RUNNER_FAILED)
    exec_unprotected(request)


def exec_unprotected(request: JobRequest) -> NoReturn:
    """The job as Slurm would have run it: the user's identity, cwd and command."""
    try:
        if os.getuid() == 0:  # as the plugin runs us; by hand we already are the user
            os.setgroups(list(request.gids))
            os.setgid(request.gid)
            os.setuid(request.uid)
        os.chdir(request.cwd)
        os.execvpe(request.argv[0], list(request.argv), dict(request.env))
    except OSError as err:
        _say(f"cannot run {request.argv[0]}: {err.strerror}")
    os._exit(127)


def _keeper(
    request: JobRequest,
    policy: Policy,
    config_path: str,
    pipelines: PipelinesFactory,
    front: socket.socket,
) -> int:
    import asyncio

    from .. import log as shim_log
    from . import cgroups
    from .job_run import JobRun
    from .namespace import enter_mounts_of, private_mounts

    try:
        shim_log.configure(None, debug=False)
        # Out of the step's cgroups before anything else (a template did it already).
        moved = cgroups.leave_for_root()
        if moved:
            logging.getLogger(__name__).warning(
                "the keeper stays in some of the step's cgroups", extra={"error": moved}
            )
        # Before any thread: a mount namespace is per thread. The task's (Slurm's
        # job_container plugins give a job one of its own), then one of ours in it.
        enter_mounts_of(request.task_pid)
        os.chdir("/")  # the job's cwd (often a network filesystem) is not ours to hold
        private_mounts()
        # JobRun reports the job's status to the task process itself.
        job = JobRun(request, policy, front, pipelines, config_path=config_path)
        return asyncio.run(job.run())
    except BaseException as err:  # the task process must hear of it, whatever it is
        _say(f"cannot run job {request.name}: {err}")
        _report(front, EXIT_RUNNER_FAILED)
        return EXIT_RUNNER_FAILED


def _all_descriptors() -> None:
    """The keeper's soft limit of open files up to its hard one: what a job's low
    ``ulimit -n`` sets is the job's (its spec's rlimits), and this process needs room
    for the job's checkpoints and its control socket."""
    import resource

    with contextlib.suppress(OSError, ValueError):
        _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))


def _report(link: socket.socket, answer: int | str) -> None:
    with contextlib.suppress(OSError):
        link.setblocking(True)
        link.sendall(f"{answer}\n".encode())


def _say(text: str) -> None:
    with contextlib.suppress(OSError):
        os.write(2, f"cedana: {text}\n".encode(errors="replace"))


__all__ = [
    "EXIT_RUNNER_FAILED",
    "job_scope",
    "parse_request",
    "read_request",
    "run_keeper",
    "run_unprotected",
    "scope_name",
]
