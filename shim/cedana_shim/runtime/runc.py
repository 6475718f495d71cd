"""The runc driver: one coroutine per runc verb, modelled on go-runc.

Every invocation goes through the daemon's :class:`~cedana_shim.runtime.reaper.Reaper`
(never asyncio's child watcher, which would race it for the exit status). runc's
own stdout/stderr are captured in memfds rather than pipes: a container that
inherits a pipe would keep it open forever and a reader would never see EOF,
while a memfd is simply read after runc exits. The container's stdio for
``create``/``exec``/``restore`` is handed to runc as its own stdin/stdout/stderr,
because a detached runc passes its stdio through to the container.

On failure a :class:`RuncError` subclass is raised whose errors.py class is
decided here, and only here, by matching runc's message (containerd's
``runtimeError``/``checkKillError``).

``restore`` runs runc in a process group of its own, recorded in the bundle, so
that a restore can be stopped whole, by this driver or by ``delete`` after the
daemon died (:mod:`.pgroup`). A lazy restore (``RestoreOpts.lazy_pages``) starts
CRIU's lazy-pages daemon first and runc joins the daemon's group (:mod:`.lazy_pages`).

Longer than our usual module: the verbs share one invocation path (``_run``),
error classification and the option dataclasses, and splitting them apart would
spread that one contract over several files.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import os
import re
import signal
import subprocess
import time
from collections.abc import Awaitable
from dataclasses import dataclass
from typing import Any, Final, TypeVar

from cedana_shim import errors
from cedana_shim.bundle_state import clear_criu_group, criu_root, mark_criu_group
from cedana_shim.runtime import cgroup_root, criu_log
from cedana_shim.runtime.lazy_pages import PagesDaemon
from cedana_shim.runtime.pgroup import kill_criu_group, start_time
from cedana_shim.runtime.reaper import KILL_GRACE_SECONDS, Child, Reaper
from cedana_shim.runtime.unmount import unmount_all

__all__ = [
    "CGROUP_MODES",
    "CheckpointOpts",
    "CreateOpts",
    "ExecOpts",
    "RestoreOpts",
    "Runc",
    "RuncAlreadyExists",
    "RuncError",
    "RuncFailedPrecondition",
    "RuncNotFound",
    "RuncUnknown",
    "Stdio",
    "classify",
    "read_pid_file",
]

logger = logging.getLogger(__name__)
T = TypeVar("T")

CGROUP_MODES: Final = frozenset({"soft", "full", "strict", "ignore"})
# How long an abandoned restore's processes may take to die once SIGKILLed.
GROUP_KILL_TIMEOUT: Final = 5.0
# Only the tail of a log is searched: a runaway --debug log must not be read whole.
_LOG_READ_LIMIT: Final = 1 << 20

_KILL_GONE = re.compile(
    r"not running|no such process|process already finished|\bESRCH\b", re.IGNORECASE
)
# "container <id> not found", not exec's "executable file not found in $PATH".
_NOT_FOUND = re.compile(r"does not exist|container \S+ not found", re.IGNORECASE)
_ALREADY_EXISTS = re.compile(r"already exists", re.IGNORECASE)
# runc's state-guard messages ("container not running", "container not paused",
# "Container cannot be checkpointed in stopped state", "cannot exec in a stopped
# state"): the request is valid, the container is just not in a state for it.
_WRONG_STATE = re.compile(
    r"not running|not paused|cannot be checkpointed in|stopped (?:state|container)"
    r"|paused container",
    re.IGNORECASE,
)


class RuncError(errors.ShimError):
    """runc exited non-zero. Raised only as one of the classified subclasses."""

    def __init__(self, verb: str, exit_status: int, message: str) -> None:
        super().__init__(f"runc {verb} failed (exit status {exit_status}): {message}")
        self.verb = verb
        self.exit_status = exit_status
        self.message = message


class RuncNotFound(RuncError, errors.NotFound):
    pass


class RuncAlreadyExists(RuncError, errors.AlreadyExists):
    pass


class RuncFailedPrecondition(RuncError, errors.FailedPrecondition):
    pass


class RuncUnknown(RuncError, errors.Unknown):
    pass


def classify(verb: str, exit_status: int, message: str) -> RuncError:
    """The error to raise for a failed ``runc <verb>`` that said ``message``."""
    if verb == "kill" and _KILL_GONE.search(message):
        return RuncNotFound(verb, exit_status, message)
    if _NOT_FOUND.search(message):
        return RuncNotFound(verb, exit_status, message)
    if _ALREADY_EXISTS.search(message):
        return RuncAlreadyExists(verb, exit_status, message)
    if _WRONG_STATE.search(message):
        return RuncFailedPrecondition(verb, exit_status, message)
    return RuncUnknown(verb, exit_status, message)


@dataclass(frozen=True, slots=True)
class Stdio:
    """The fds a detached, non-terminal container inherits; ``None`` is /dev/null.

    The caller keeps ownership and closes its copies after the call returns.
    """

    stdin: int | None = None
    stdout: int | None = None
    stderr: int | None = None


def _abs(path: str | None) -> str | None:
    return os.path.abspath(path) if path else None


def _argv(*flags: tuple[str, str | int | bool | tuple[str, ...] | None]) -> list[str]:
    """``(flag, value)`` pairs in order: ``True`` is a bare flag, a tuple repeats
    the flag per element, ``None``/``False``/empty add nothing."""
    out: list[str] = []
    for flag, value in flags:
        if value is True:
            out.append(flag)
        elif isinstance(value, tuple):
            for item in value:
                out += [flag, item]
        elif value is not None and value is not False and value != "":
            out += [flag, str(value)]
    return out


@dataclass(frozen=True, slots=True)
class CreateOpts:
    bundle: str
    pid_file: str | None = None
    console_socket: str | None = None
    no_pivot: bool = False
    no_new_keyring: bool = False
    stdio: Stdio | None = None

    def args(self) -> list[str]:
        return _argv(
            ("--bundle", _abs(self.bundle)),
            ("--pid-file", _abs(self.pid_file)),
            ("--console-socket", self.console_socket),
            ("--no-pivot", self.no_pivot),
            ("--no-new-keyring", self.no_new_keyring),
        )


@dataclass(frozen=True, slots=True)
class ExecOpts:
    """``process_spec_json`` is an OCI ``specs.Process`` (containerd's exec spec value)."""

    process_spec_json: bytes
    pid_file: str | None = None
    console_socket: str | None = None
    # With detach=False the call returns only when the process exits, and a
    # non-zero exit of the process is reported as a RuncError.
    detach: bool = True
    stdio: Stdio | None = None

    def __post_init__(self) -> None:
        if not self.process_spec_json.strip():
            raise errors.InvalidArgument("exec needs a process spec")

    def args(self, process_file: str) -> list[str]:
        return _argv(
            ("--process", process_file),
            ("--console-socket", self.console_socket),
            ("--detach", self.detach),
            ("--pid-file", _abs(self.pid_file)),
        )


def _check_criu_common(
    mode: str | None, empty_ns: tuple[str, ...], status_fd: int | None, lazy: bool
) -> None:
    if mode is not None and mode not in CGROUP_MODES:
        raise errors.InvalidArgument(f"unknown cgroups mode {mode!r}")
    if any(not ns or ns.startswith("-") for ns in empty_ns):
        raise errors.InvalidArgument(f"bad empty namespace list {empty_ns!r}")
    if status_fd is not None and not lazy:
        raise errors.InvalidArgument("status_fd is only meaningful with lazy_pages")


@dataclass(frozen=True, slots=True, kw_only=True)
class CheckpointOpts:
    image_path: str
    work_path: str | None = None
    parent_path: str | None = None
    leave_running: bool = False
    tcp_established: bool = False
    ext_unix_sk: bool = False
    shell_job: bool = False
    file_locks: bool = False
    empty_ns: tuple[str, ...] = ()
    page_server: str | None = None
    manage_cgroups_mode: str | None = None
    lazy_pages: bool = False
    # Passed to runc under its own number (the reaper keeps fd numbers).
    status_fd: int | None = None
    pre_dump: bool = False
    auto_dedup: bool = False

    def __post_init__(self) -> None:
        if not self.image_path:
            raise errors.InvalidArgument("checkpoint needs an image path")
        _check_criu_common(self.manage_cgroups_mode, self.empty_ns, self.status_fd, self.lazy_pages)

    def args(self) -> list[str]:
        return _argv(
            ("--image-path", _abs(self.image_path)),
            ("--work-path", _abs(self.work_path)),
            ("--leave-running", self.leave_running),
            ("--tcp-established", self.tcp_established),
            ("--ext-unix-sk", self.ext_unix_sk),
            ("--shell-job", self.shell_job),
            ("--file-locks", self.file_locks),
            ("--empty-ns", self.empty_ns),
            ("--parent-path", self.parent_path),
            ("--page-server", self.page_server),
            ("--manage-cgroups-mode", self.manage_cgroups_mode),
            ("--lazy-pages", self.lazy_pages),
            ("--status-fd", self.status_fd),
            ("--pre-dump", self.pre_dump),
            ("--auto-dedup", self.auto_dedup),
        )


@dataclass(frozen=True, slots=True, kw_only=True)
class RestoreOpts:
    """``runc restore``. There is no ``parent_path``: runc restore has no such flag
    (a pre-dump parent is found through the image's ``parent`` link)."""

    bundle: str
    image_path: str
    work_path: str | None = None
    pid_file: str | None = None
    console_socket: str | None = None
    detach: bool = True
    no_subreaper: bool = True
    no_pivot: bool = False
    tcp_established: bool = False
    ext_unix_sk: bool = False
    shell_job: bool = False
    file_locks: bool = False
    empty_ns: tuple[str, ...] = ()
    manage_cgroups_mode: str | None = None
    lazy_pages: bool = False
    # With lazy_pages: (the daemon's end, the server's end) of a connection to the
    # page server the lazy-pages daemon asks; not runc's option, the daemon's (see
    # lazy_pages.PagesDaemon.start).
    lazy_page_server: tuple[int, int] | None = None
    auto_dedup: bool = False
    lsm_profile: str | None = None
    stdio: Stdio | None = None

    def __post_init__(self) -> None:
        if not self.image_path:
            raise errors.InvalidArgument("restore needs an image path")
        _check_criu_common(self.manage_cgroups_mode, self.empty_ns, None, self.lazy_pages)

    def args(self) -> list[str]:
        return _argv(
            ("--image-path", _abs(self.image_path)),
            ("--work-path", _abs(self.work_path)),
            ("--tcp-established", self.tcp_established),
            ("--ext-unix-sk", self.ext_unix_sk),
            ("--shell-job", self.shell_job),
            ("--file-locks", self.file_locks),
            ("--empty-ns", self.empty_ns),
            ("--manage-cgroups-mode", self.manage_cgroups_mode),
            ("--lazy-pages", self.lazy_pages),
            ("--auto-dedup", self.auto_dedup),
            ("--lsm-profile", self.lsm_profile),
            ("--detach", self.detach),
            ("--pid-file", _abs(self.pid_file)),
            ("--console-socket", self.console_socket),
            ("--no-pivot", self.no_pivot),
            ("--no-subreaper", self.no_subreaper),
            ("--bundle", _abs(self.bundle)),
        )


def read_pid_file(path: str) -> int:
    """The pid runc wrote with ``--pid-file``."""
    try:
        with open(path, "rb") as f:
            return int(f.read().strip())
    except FileNotFoundError as err:
        raise errors.NotFound(f"pid file {path} does not exist") from err
    except ValueError as err:
        raise errors.Internal(f"pid file {path} holds no pid") from err


def _stat_key(path: str) -> tuple[int, int, int] | None:
    try:
        st = os.stat(path)
    except OSError:
        return None
    return (st.st_ino, st.st_mtime_ns, st.st_size)


@dataclass(frozen=True, slots=True)
class _CriuLog:
    source: str  # the log CRIU writes in its work (or image) dir
    # Where a copy is kept, since the work dir is often deleted: a directory of
    # bounded copies (:func:`.criu_log.keep`) that outlives the container, else
    # this one file (in the bundle, deleted with it).
    keep_in: str | None
    copy_to: str | None
    # The log as it was before the call: one left by an earlier run is not news.
    before: tuple[int, int, int] | None


class Runc:
    """A runc binary plus the global flags every call shares."""

    def __init__(
        self,
        *,
        reaper: Reaper,
        root: str,
        log_path: str | None = None,
        binary: str = "runc",
        systemd_cgroup: bool = False,
        debug: bool = False,
        criu: str | None = None,
        kill_grace: float = KILL_GRACE_SECONDS,
    ) -> None:
        self.reaper = reaper
        self.binary = binary
        self.root = root
        self.log_path = log_path
        self.systemd_cgroup = systemd_cgroup
        self.debug = debug
        self.criu = criu
        self.kill_grace = kill_grace

    def global_args(self) -> list[str]:
        out = ["--root", self.root]
        if self.log_path:
            # Always JSON: errors are parsed from this file.
            out += ["--log", self.log_path, "--log-format", "json"]
        if self.systemd_cgroup:
            out.append("--systemd-cgroup")
        if self.criu:
            out += ["--criu", self.criu]
        if self.debug:
            out.append("--debug")
        return out

    async def create(self, id: str, opts: CreateOpts) -> None:
        await self._run("create", id, [*opts.args(), id], inherit=_inherit(opts))

    async def start(self, id: str) -> None:
        await self._run("start", id, [id])

    async def run(self, id: str, opts: CreateOpts) -> None:
        """``runc run --detach``: create and start in one runc process, for a caller
        with nothing to do in between (one Go start fewer; a Slurm job's launch)."""
        await self._run("run", id, ["--detach", *opts.args(), id], inherit=_inherit(opts))

    async def exec(self, id: str, opts: ExecOpts) -> None:
        import tempfile

        fd, path = tempfile.mkstemp(
            prefix="runc-process", suffix=".json", dir=os.environ.get("XDG_RUNTIME_DIR") or None
        )
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(opts.process_spec_json)
            await self._run("exec", id, [*opts.args(path), id], inherit=_inherit(opts))
        finally:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)

    async def kill(self, id: str, signal: int, *, all: bool = False) -> None:
        await self._run("kill", id, [*(["--all"] if all else []), id, str(int(signal))])

    async def delete(self, id: str, *, force: bool = False) -> None:
        """``runc delete``; a container that does not exist is already deleted."""
        try:
            await self._run("delete", id, [*(["--force"] if force else []), id])
        except RuncNotFound as err:
            logger.debug("runc delete: %s", err.message, extra={"container_id": id})

    async def discard(self, id: str) -> None:
        """Kill every process of ``id`` and delete it, whatever a failed or abandoned
        start left of it; nothing left is no error."""
        with contextlib.suppress(errors.ShimError):
            await self.kill(id, signal.SIGKILL, all=True)
        with contextlib.suppress(errors.ShimError, OSError):
            await self.delete(id, force=True)

    async def pause(self, id: str) -> None:
        await self._run("pause", id, [id])

    async def resume(self, id: str) -> None:
        await self._run("resume", id, [id])

    async def ps(self, id: str) -> list[int]:
        out = await self._run("ps", id, ["--format", "json", id])
        pids = _parse_json("ps", out)
        if pids is None:  # runc marshals an empty Go slice as null
            return []
        if not isinstance(pids, list) or not all(
            isinstance(p, int) and not isinstance(p, bool) for p in pids
        ):
            raise errors.Internal(f"runc ps printed {out[:200]!r}, not a list of pids")
        return pids

    async def update(self, id: str, resources_json: bytes) -> None:
        await self._run("update", id, ["--resources", "-", id], stdin_data=resources_json)

    async def state(self, id: str) -> dict[str, Any]:
        out = await self._run("state", id, [id])
        state = _parse_json("state", out)
        if not isinstance(state, dict):
            raise errors.Internal(f"runc state printed {out[:200]!r}, not an object")
        return state

    async def checkpoint(
        self, id: str, opts: CheckpointOpts, *, keep_log_in: str | None = None
    ) -> None:
        """``runc checkpoint``; with a bundle (the runc log's dir) in a process group of
        its own, recorded there while it runs, as a restore is: CRIU outlives a killed
        runc and, holding the container's tasks, keeps them from dying. Cancelled, runc
        gets SIGTERM (CRIU then undoes the dump at its next step) and ``kill_grace``;
        whatever of the group is left, CRIU stuck in a step included, is SIGKILLed.

        A failure names CRIU's first error line and a copy of its log, kept in
        ``keep_log_in`` (else in the bundle)."""
        bundle = os.path.dirname(self.log_path) if self.log_path else None
        source = os.path.join(opts.work_path or opts.image_path, "dump.log")
        copy_to = os.path.join(bundle, "criu-dump.log") if bundle else None
        log = _CriuLog(source, keep_log_in, copy_to, _stat_key(source))
        pass_fds = () if opts.status_fd is None else (opts.status_fd,)
        try:
            await self._run(
                "checkpoint",
                id,
                [*opts.args(), id],
                pass_fds=pass_fds,
                criu_log=log,
                group_bundle=bundle,
            )
        finally:
            if bundle:
                clear_criu_group(bundle)

    async def restore(
        self, id: str, opts: RestoreOpts, *, keep_log_in: str | None = None
    ) -> PagesDaemon | None:
        """``runc restore`` in a process group of its own (runc, CRIU and CRIU's action
        scripts), recorded in the bundle while it runs (see :mod:`.pgroup`): if this
        daemon dies, ``delete`` stops the restore instead of letting it finish outside
        containerd. Cancelled, the group and every task CRIU restored are SIGKILLed at
        once (``kill_grace`` does not apply: runc ignores SIGTERM while it restores).

        With ``opts.lazy_pages`` the group is that of a ``criu lazy-pages`` daemon
        started first (:mod:`.lazy_pages`); it is returned once runc is done and the
        tasks run, still bringing their memory in: the caller awaits its ``wait()``
        (or ``abandon()``) before it calls the restore done. LazyPagesFailed when the
        daemon cannot start or died under runc. CRIU's log of a failure is kept as for
        a checkpoint."""
        source = os.path.join(opts.work_path or opts.image_path, "restore.log")
        copy_to = os.path.join(opts.bundle, "criu-restore.log")
        log = _CriuLog(source, keep_log_in, copy_to, _stat_key(source))
        daemon = None
        if opts.lazy_pages:
            daemon = await PagesDaemon.start(
                self.reaper,
                criu=self.criu or "criu",
                image_dir=opts.image_path,
                work_dir=opts.work_path or opts.image_path,
                container_id=id,
                bundle=opts.bundle,
                env=_child_env(),
                page_server=opts.lazy_page_server,
            )
        running = self._run(
            "restore",
            id,
            [*opts.args(), id],
            inherit=_inherit(opts),
            criu_log=log,
            group_bundle=opts.bundle,
            group=None if daemon is None else daemon.group,
            env=self._restore_env(id, opts.bundle),
        )
        try:
            if daemon is None:
                await running
            else:
                await _beside(daemon, running)
        except BaseException as failure:
            cause: BaseException | None = None
            if daemon is not None:
                died = daemon.exit_status()  # on its own, before anything of ours killed it
                await _to_completion(daemon.abandon())
                if died and isinstance(failure, RuncError):
                    cause = daemon.failed(f"exited with status {died} under runc restore")
            # A runc that was killed never unmounted the rootfs it bound for CRIU (a
            # `runc delete` would then remove the state dir through that mount), nor
            # did a killed CRIU unmount its cgroup yard in the work dir.
            for leftover in (criu_root(self.root, id), opts.work_path or opts.image_path):
                unmounted = await _to_completion(asyncio.to_thread(unmount_all, leftover))
                if not unmounted.cancelled() and unmounted.exception() is not None:
                    logger.error(
                        "cannot unmount what runc restore left under %s (container %s): %s",
                        leftover,
                        id,
                        unmounted.exception(),
                        extra={"container_id": id},
                    )
            if cause is not None:
                raise cause from failure
            raise
        finally:
            if daemon is None:
                clear_criu_group(opts.bundle)  # else the daemon's to clear, once it exits
        if daemon is not None:
            daemon.resumed(lambda: self._kill_restored(id))
        return daemon

    def _restore_env(self, id: str, bundle: str) -> dict[str, str]:
        """runc's environment for a restore; on a cgroup v2 node it names the CRIU
        config with the new container's cgroup as CRIU's root (:mod:`.cgroup_root`)."""
        env = _child_env()
        if not cgroup_root.unified():
            return env
        try:
            with open(os.path.join(bundle, "config.json"), "rb") as f:
                spec = json.load(f)
            cgroup = cgroup_root.container_cgroup(
                spec, id, systemd=self.systemd_cgroup, own_cgroup=cgroup_root.own_cgroup()
            )
        except (OSError, ValueError) as err:
            # A spec runc cannot read or whose cgroupsPath it refuses: runc says so.
            logger.debug("restore %s: no cgroup root for CRIU: %s", id, err)
            return env
        try:
            env["CRIU_CONFIG_FILE"] = cgroup_root.write_config(bundle, cgroup)
        except OSError as err:
            raise errors.Internal(
                f"container {id}: cannot write the CRIU config naming its cgroup: {err}"
            ) from err
        return env

    async def _kill_restored(self, id: str) -> None:
        with contextlib.suppress(RuncNotFound):
            await self.kill(id, signal.SIGKILL, all=True)

    async def _run(
        self,
        verb: str,
        id: str,
        args: list[str],
        *,
        inherit: Stdio | None = None,
        stdin_data: bytes | None = None,
        pass_fds: tuple[int, ...] = (),
        criu_log: _CriuLog | None = None,
        group_bundle: str | None = None,
        group: tuple[int, int] | None = None,
        env: dict[str, str] | None = None,
    ) -> bytes:
        """Run ``runc <global flags> <verb> <args>``; runc's stdout, or a RuncError.

        With ``inherit`` the container gets those fds and runc's own output is
        not captured (it is the container's); otherwise stdout and stderr go to
        memfds. With ``group_bundle`` runc leads a process group of its own, which
        is recorded in that bundle while runc runs (the caller clears the record), or
        with ``group`` (pgid, leader start time) joins that one, recorded already.
        """
        argv = [self.binary, *self.global_args(), verb, *args]
        env = _child_env() if env is None else env
        log_offset = self._log_size()
        own: list[int] = []
        out_fd: int | None = None
        err_fd: int | None = None
        try:
            if inherit is not None:
                stdin = _or_devnull(inherit.stdin)
                stdout = _or_devnull(inherit.stdout)
                stderr = _or_devnull(inherit.stderr)
            else:
                stdin = subprocess.DEVNULL
                out_fd = _memfd("runc-stdout", own)
                err_fd = _memfd("runc-stderr", own)
                stdout, stderr = out_fd, err_fd
            if stdin_data is not None:
                stdin = _memfd("runc-stdin", own)
                os.write(stdin, stdin_data)
                os.lseek(stdin, 0, os.SEEK_SET)
            started = time.monotonic()
            try:
                child = self.reaper.spawn(
                    argv,
                    stdin=stdin,
                    stdout=stdout,
                    stderr=stderr,
                    pass_fds=pass_fds,
                    env=env,
                    process_group=_process_group(group_bundle, group),
                )
            except OSError as err:
                raise errors.Internal(f"cannot run {self.binary} {verb}: {err}") from err
            pgid, leader_start = group or (child.pid, None)
            if group_bundle is not None and group is None:
                leader_start = _record_group(group_bundle, child.pid, verb, id)
            try:
                ex = await child.wait()
            except asyncio.CancelledError:
                if leader_start is None or verb == "checkpoint":
                    await self._reap_cancelled(child, verb, id)
                if leader_start is not None:
                    await self._kill_cancelled_group(child, verb, id, pgid, leader_start)
                raise
            elapsed = time.monotonic() - started
            logger.debug(
                "runc %s %s: exit status %d in %.3fs",
                verb,
                id,
                ex.status,
                elapsed,
                extra={
                    "runc_verb": verb,
                    "container_id": id,
                    "exit_status": ex.status,
                    "duration_s": elapsed,
                },
            )
            out = _read_memfd(out_fd) if out_fd is not None else b""
            if ex.status == 0:
                return out
            err_text = _read_memfd(err_fd).decode(errors="replace") if err_fd is not None else ""
        finally:
            for fd in own:
                os.close(fd)
        message = self._last_log_error(log_offset) or err_text.strip() or f"exit status {ex.status}"
        if criu_log is not None:
            message = _criu_reason(message, criu_log, id)
        raise classify(verb, ex.status, message)

    async def _kill_cancelled_group(
        self, child: Child, verb: str, id: str, pgid: int, leader_start: int
    ) -> None:
        """runc's group (CRIU, its scripts) and what CRIU restored, at once: a restoring
        runc ignores SIGTERM, and CRIU's death leaves the restored tasks stuck. Waits for
        runc's exit even if cancelled again."""
        logger.warning(
            "runc %s %s cancelled; killing what is left of process group %d",
            verb,
            id,
            pgid,
            extra={"runc_verb": verb, "container_id": id},
        )
        killed = await _to_completion(
            asyncio.to_thread(kill_criu_group, pgid, leader_start, GROUP_KILL_TIMEOUT)
        )
        if killed.cancelled() or killed.exception() is not None or not killed.result():
            logger.error(
                "runc %s %s: process group %d still alive %gs after SIGKILL",
                verb,
                id,
                pgid,
                GROUP_KILL_TIMEOUT,
                extra={"runc_verb": verb, "container_id": id},
            )
        await _to_completion(child.wait())

    async def _reap_cancelled(self, child: Child, verb: str, id: str) -> None:
        """SIGTERM, grace, SIGKILL, and wait for the exit even if cancelled again."""
        logger.warning(
            "runc %s %s cancelled; terminating pid %d",
            verb,
            id,
            child.pid,
            extra={"runc_verb": verb, "container_id": id},
        )
        cleanup = await _to_completion(child.terminate(self.kill_grace))
        if not cleanup.cancelled() and cleanup.exception() is not None:
            logger.error("terminating runc %s %s failed: %s", verb, id, cleanup.exception())

    def _log_size(self) -> int:
        if not self.log_path:
            return 0
        try:
            return os.stat(self.log_path).st_size
        except FileNotFoundError:
            return 0

    def _last_log_error(self, offset: int) -> str:
        """The message of the last error-level line runc logged since ``offset``.

        Another call running at the same time on the same log can add lines in
        the window too; what is certain is that nothing older is reported.
        """
        if not self.log_path:
            return ""
        try:
            with open(self.log_path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                if size < offset:  # truncated by someone else: all of it is new
                    offset = 0
                f.seek(max(offset, size - _LOG_READ_LIMIT))
                data = f.read()
        except OSError:
            return ""
        for line in reversed(data.splitlines()):
            try:
                entry = json.loads(line)
            except ValueError:
                continue
            if isinstance(entry, dict) and entry.get("level") == "error":
                return str(entry.get("msg", "")).strip()
        return ""


async def _to_completion(work: Awaitable[T]) -> asyncio.Future[T]:
    """Await ``work`` to its end even if cancelled meanwhile; its finished future."""
    done = asyncio.ensure_future(work)
    while not done.done():
        with contextlib.suppress(asyncio.CancelledError):
            await asyncio.shield(done)
    return done


async def _beside(daemon: PagesDaemon, running: Awaitable[bytes]) -> None:
    """``runc restore`` while the lazy-pages daemon serves it. A daemon that fails first
    leaves CRIU's failure path stuck (seen with CRIU 4.2: it waits forever for tasks
    that run on regardless), so runc's group (CRIU and the tasks under it) is killed at
    once and the daemon named as the cause."""
    restoring = asyncio.ensure_future(running)
    exited = asyncio.ensure_future(daemon.child.wait())
    try:
        await asyncio.wait([restoring, exited], return_when=asyncio.FIRST_COMPLETED)
        status = exited.result().status if exited.done() else 0
        if restoring.done() or status == 0:  # exit 0: all in already, runc yet to return
            await restoring
            return
    except BaseException:
        restoring.cancel()
        await _to_completion(restoring)
        raise
    finally:
        exited.cancel()
    restoring.cancel()
    await _to_completion(restoring)
    raise daemon.failed(f"exited with status {status} during the restore")


def _record_group(bundle: str, pid: int, verb: str, id: str) -> int | None:
    """Record runc's process group in the bundle for ``delete`` (see :mod:`.pgroup`);
    the group leader's start time, None if it cannot be read."""
    leader_start = start_time(pid)
    if leader_start is None:
        return None
    try:
        mark_criu_group(bundle, pid, leader_start)
    except OSError as err:
        # The restore itself can go on: only a daemon crash during it would leak it.
        logger.warning(
            "runc %s %s: cannot record its process group in %s: %s",
            verb,
            id,
            bundle,
            err,
            extra={"runc_verb": verb, "container_id": id},
        )
    return leader_start


def _child_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k != "NOTIFY_SOCKET"}


def _process_group(group_bundle: str | None, group: tuple[int, int] | None) -> int | None:
    """Popen's process_group: none of its own, a new one (0), or the one to join."""
    if group is not None:
        return group[0]
    return None if group_bundle is None else 0


def _inherit(opts: CreateOpts | ExecOpts | RestoreOpts) -> Stdio | None:
    if opts.stdio is not None:
        return opts.stdio
    # With a terminal the container's stdio is the pty, so runc's own output can
    # be captured; without one the container would inherit the capture files.
    return None if opts.console_socket else Stdio()


def _or_devnull(fd: int | None) -> int:
    return subprocess.DEVNULL if fd is None else fd


def _memfd(name: str, own: list[int]) -> int:
    fd = os.memfd_create(name, os.MFD_CLOEXEC)
    own.append(fd)
    return fd


def _read_memfd(fd: int) -> bytes:
    return os.pread(fd, os.fstat(fd).st_size, 0)


def _parse_json(verb: str, out: bytes) -> Any:
    try:
        return json.loads(out)
    except ValueError as err:
        raise errors.Internal(f"runc {verb} printed {out[:200]!r}, not JSON") from err


CRIU_LOG_TAIL_LINES = 40
CRIU_LOG_TAIL_BYTES = 16 << 10
# What runc says of every CRIU failure, whatever CRIU's reason (some versions add the
# log's path).
_CRIU_FAILED = re.compile(r"criu failed: type \w+ errno \d+\b")


def _criu_reason(message: str, log: _CriuLog, id: str) -> str:
    """runc's ``message`` with CRIU's own reason (its first error line) in place of
    runc's ``criu failed: type NOTIFY errno 0``, and the kept copy of CRIU's log in
    place of the one runc names (in the work dir, which the caller usually deletes)."""
    said = message.split("\n", 1)[0]
    now = _stat_key(log.source)
    if now is None or now == log.before:  # CRIU never ran, e.g. runc refused first
        return said
    reason = criu_log.first_error(log.source)
    if reason:
        said = f"criu: {reason}" if _CRIU_FAILED.match(said) else f"{said}; criu: {reason}"
    return f"{said}; criu log: {_keep_criu_log(log, id)}"


def _keep_criu_log(log: _CriuLog, id: str) -> str:
    """Keep a copy of CRIU's log; its path (the source's when no copy could be made).
    Its last lines also go to the shim's own log (containerd's log)."""
    import shutil

    kept = log.source
    try:
        if log.keep_in:
            kept = criu_log.keep(log.source, log.keep_in, f"{id}-{os.path.basename(log.source)}")
        elif log.copy_to:
            shutil.copyfile(log.source, log.copy_to)
            kept = log.copy_to
    except OSError as err:
        logger.warning("cannot keep a copy of %s: %s", log.source, err, extra={"container": id})
    try:
        with open(kept, "rb") as f:
            f.seek(max(0, os.fstat(f.fileno()).st_size - CRIU_LOG_TAIL_BYTES))
            tail = f.read().decode(errors="replace").splitlines()[-CRIU_LOG_TAIL_LINES:]
    except OSError:
        return kept
    logger.error("criu failed", extra={"container": id, "criu_log": kept, "criu_log_tail": tail})
    return kept
