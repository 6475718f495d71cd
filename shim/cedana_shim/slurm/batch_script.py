"""Slurm's copy of a batch step's script, for a restore into another job.

slurmd writes a batch job's script to ``<SlurmdSpoolDir>/job<id:05d>/slurm_script``
and runs it; a shell that does not ``exec`` its program keeps that file open (bash
reads its script as it goes, fd 255), and CRIU restores the open file by its path.
A requeued job (same id) finds the path again; a new job (``cedana slurm restore``)
does not: the old job's directory went with it. :class:`BatchScript` puts the new
job's copy of the script at the old path for the restore, and removes it when the
job ends. CRIU checks the file's size, so a different script fails the restore
(the checkpoint is passed over) instead of being read from the old offset.
"""

from __future__ import annotations

import contextlib
import logging
import os
import stat
from typing import Final

from .job_spec import batch_job_of

log = logging.getLogger(__name__)

SCRIPT_NAME: Final = "slurm_script"


def job_dir_name(job_id: int) -> str:
    """slurmd's name for a job's spool directory."""
    return f"job{job_id:05d}"


class BatchScript:
    """The script of one batch step (``argv[0]``, when it is slurmd's copy)."""

    def __init__(self, job_id: str, step_id: str, argv: tuple[str, ...]) -> None:
        self._path = ""
        if step_id == "batch" and argv and job_id.isdigit():
            path = argv[0]
            job_dir = os.path.dirname(path)
            if os.path.basename(path) == SCRIPT_NAME and os.path.basename(job_dir) == job_dir_name(
                int(job_id)
            ):
                self._path = path
        self._staged: list[str] = []  # what stage_for made, in the order it was made

    def stage_for(self, checkpointed_container: str) -> None:
        """Before a restore of a checkpoint taken of ``checkpointed_container``:
        where that was another job's batch step, its script's path exists again
        (this job's copy of the script), unless something is there already. Each
        candidate of a restore may come from another job: each gets its path."""
        old_job = batch_job_of(checkpointed_container)
        if not self._path or old_job is None:
            return
        job_dir = os.path.dirname(self._path)
        old_dir = os.path.join(os.path.dirname(job_dir), job_dir_name(old_job))
        if old_dir == job_dir or os.path.lexists(old_dir):
            return  # a requeue of the same job, or the old job's own files
        try:
            self._copy_to(old_dir)
        except OSError as err:
            log.warning(
                "cannot put the job's script where the checkpointed job had it",
                extra={"path": old_dir, "error": str(err)},
            )
            return  # what it made is removed with the rest when the job ends
        log.info(
            "the checkpointed job's script path holds this job's script", extra={"path": old_dir}
        )

    def _copy_to(self, old_dir: str) -> None:
        # Read through a descriptor that is not a link's: the job's owner may own the
        # directory it is in. The directory gets its owner and mode last, once the
        # script is in it.
        src = os.open(self._path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            script = os.fstat(src)
            if not stat.S_ISREG(script.st_mode):
                raise OSError(f"{self._path} is not a regular file")
            job_dir = os.stat(os.path.dirname(self._path))
            os.mkdir(old_dir, 0o700)
            self._staged.append(old_dir)
            old_script = os.path.join(old_dir, SCRIPT_NAME)
            dest = os.open(
                old_script,
                os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC,
                0o600,
            )
            self._staged.append(old_script)
            try:
                while chunk := os.read(src, 1 << 16):
                    view = memoryview(chunk)
                    while view:
                        view = view[os.write(dest, view) :]
                os.fchown(dest, script.st_uid, script.st_gid)
                os.fchmod(dest, script.st_mode & 0o7777)
            finally:
                os.close(dest)
            os.chown(old_dir, job_dir.st_uid, job_dir.st_gid)
            os.chmod(old_dir, job_dir.st_mode & 0o7777)
        finally:
            os.close(src)

    def remove_staged(self) -> None:
        """Remove what :meth:`stage_for` made (never anything else in the spool)."""
        for path in reversed(self._staged):
            with contextlib.suppress(OSError):
                if os.path.isdir(path) and not os.path.islink(path):
                    os.rmdir(path)
                else:
                    os.unlink(path)
        self._staged = []


__all__ = ["BatchScript"]
