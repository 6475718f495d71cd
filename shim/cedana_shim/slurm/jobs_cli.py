"""``cedana slurm checkpoint|restore|jobs``: the job side of ``cedana slurm``.

* ``checkpoint JOBID``: asks the job's runner on this node (its control socket)
  for a checkpoint now; the job runs on. Root or the job's owner.
* ``restore CHECKPOINT -- SBATCH_ARGS...``: submits the batch job again, starting
  from that checkpoint: ``sbatch`` with ``CEDANA_ENABLE=1`` and
  ``CEDANA_RESTORE=<id>`` exported (restore by hand, as on Kubernetes), as the
  calling user; the checkpoint must be one of that user's (labels are scoped per
  user and cluster).
* ``jobs``: the protected job steps running on this node (root).

Errors are ``cedana_shim.errors`` classes, printed by the admin CLI.
"""

from __future__ import annotations

import argparse
import json
import pwd
import re
import shutil
import subprocess
import sys
from collections.abc import Sequence
from typing import Any, Final

from .. import errors
from . import control

_JOB_ID: Final = re.compile(r"[0-9]{1,10}")
_STEP: Final = re.compile(r"[A-Za-z0-9_]{1,32}")
_SUBMITTED: Final = re.compile(rb"(?:Submitted batch job )?([0-9]+)")


def register_job_commands(subparsers: Any) -> None:
    """Add ``checkpoint``, ``restore`` and ``jobs`` to ``cedana slurm``'s subparsers."""
    p = subparsers.add_parser(
        "checkpoint",
        help="checkpoint a running protected job now (it keeps running)",
        description="Checkpoint job JOBID, running on this node, now; the job keeps "
        "running. Root, or the job's owner.",
    )
    p.add_argument("job_id", metavar="JOBID")
    p.add_argument("--step", default="batch", help="the job step (default %(default)s)")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(handler=cmd_checkpoint)

    p = subparsers.add_parser(
        "restore",
        help="submit a batch job that starts from a checkpoint",
        description="Submit a batch job (sbatch, as you) that starts from CHECKPOINT "
        "(an id as `cedana checkpoints list` shows it, or a unique prefix) instead of "
        "from the top. Everything after -- goes to sbatch: the script and its options. "
        "An --export given there keeps its variables; the script's own #SBATCH "
        "--export line is overridden by the command line, as sbatch does.",
        epilog="example:\n  cedana slurm restore 20261129T183000Z-3f9a1c2b -- -p low victim.sh",
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("checkpoint", metavar="CHECKPOINT")
    p.add_argument("sbatch_args", nargs=argparse.REMAINDER, metavar="-- SBATCH_ARGS")
    p.add_argument("--json", action="store_true", help="print the result as JSON")
    p.set_defaults(handler=cmd_restore)

    p = subparsers.add_parser("jobs", help="list the protected job steps on this node (root)")
    p.add_argument("--json", action="store_true", help="print the list as JSON")
    p.set_defaults(handler=cmd_jobs)


def cmd_checkpoint(args: argparse.Namespace, base: str = control.SOCKET_DIR) -> int:
    if not _JOB_ID.fullmatch(args.job_id):
        raise errors.InvalidArgument(f"job id {args.job_id!r} is not a Slurm job number")
    if not _STEP.fullmatch(args.step):
        raise errors.InvalidArgument(f"step {args.step!r} is not a Slurm step name")
    name = f"{args.job_id}.{args.step}"
    path = control.socket_path(name, base)
    try:
        reply = control.request(path, {"op": "checkpoint"})
    except errors.NotFound:
        raise errors.NotFound(
            f"job {name} has no cedana runner on this node: run this on the node the job "
            "runs on (squeue -j JOBID -o %N), for a job that opted in with CEDANA_ENABLE=1 "
            "or CEDANA_CHECKPOINT=<label>"
        ) from None
    if args.json:
        print(json.dumps(reply, indent=2))
    else:
        print(
            f"checkpoint {reply['checkpoint']} of job {name} committed "
            f"(label {reply['label']}, {reply['size']} bytes)"
        )
    return 0


def sbatch_command(sbatch: str, checkpoint: str, args: Sequence[str]) -> list[str]:
    """sbatch with the restore variables exported: merged into an --export the caller
    gave, else ``--export=ALL,...`` first."""
    from ..checkpoint.policy import validate_restore_ref

    ref = validate_restore_ref(checkpoint, "the command line")
    ours = f"CEDANA_ENABLE=1,CEDANA_RESTORE={ref}"
    rest = list(args)
    if rest[:1] == ["--"]:
        rest = rest[1:]
    if not rest:
        raise errors.InvalidArgument(
            "no batch script to submit: give sbatch's arguments after --, e.g. "
            f"cedana slurm restore {ref} -- victim.sh"
        )
    for i, arg in enumerate(rest):
        if arg.startswith("--export="):
            rest[i] = f"{arg},{ours}"
            return [sbatch, *rest]
        if arg == "--export" and i + 1 < len(rest):
            rest[i + 1] = f"{rest[i + 1]},{ours}"
            return [sbatch, *rest]
    return [sbatch, f"--export=ALL,{ours}", *rest]


def cmd_restore(args: argparse.Namespace) -> int:
    sbatch = shutil.which("sbatch")
    if sbatch is None:
        raise errors.NotFound("sbatch is not on PATH: run this where Slurm's commands are")
    argv = sbatch_command(sbatch, args.checkpoint, args.sbatch_args)
    done = subprocess.run(argv, stdout=subprocess.PIPE, check=False)
    if done.returncode != 0:
        raise errors.FailedPrecondition(
            f"sbatch refused the job (exit status {done.returncode}); its message is above"
        )
    match = _SUBMITTED.search(done.stdout)
    job_id = match.group(1).decode() if match else ""
    if args.json:
        print(json.dumps({"checkpoint": args.checkpoint, "job": job_id, "command": argv}))
    else:
        sys.stdout.write(done.stdout.decode(errors="replace"))
        print(f"job {job_id or '?'} starts from checkpoint {args.checkpoint}")
    return 0


def protected_jobs(base: str = control.SOCKET_DIR) -> list[dict[str, Any]]:
    """The status of each runner on this node that answers (a socket left by a runner
    that died is skipped)."""
    jobs = []
    for path in control.list_sockets(base):
        try:
            jobs.append(control.request(path, {"op": "status"}, timeout=5.0))
        except errors.ShimError:
            continue
    return jobs


def cmd_jobs(args: argparse.Namespace, base: str = control.SOCKET_DIR) -> int:
    jobs = protected_jobs(base)
    if args.json:
        print(json.dumps(jobs, indent=2))
        return 0
    if not jobs:
        print("no protected jobs on this node")
        return 0
    for j in jobs:
        print(
            f"{j.get('job')}.{j.get('step')}  user={_user(j.get('uid'))}  "
            f"label={j.get('label', '')}  mode={j.get('mode', '')}  "
            f"state={j.get('state', '')}  pid={j.get('pid', '')}"
        )
    return 0


def _user(uid: object) -> str:
    if not isinstance(uid, int):
        return "?"
    try:
        return pwd.getpwuid(uid).pw_name
    except KeyError:
        return str(uid)


__all__ = [
    "cmd_checkpoint",
    "cmd_jobs",
    "cmd_restore",
    "protected_jobs",
    "register_job_commands",
    "sbatch_command",
]
