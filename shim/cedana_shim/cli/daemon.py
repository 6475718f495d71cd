"""The shim daemon: serves containerd.task.v2.Task on the socket from ``start``.

Everything it needs is imported at module level on purpose: the warm fork
server imports this module once and every forked daemon starts with it loaded.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import os
import signal
import socket

from .. import log as shim_log
from ..api.containerd.task.v2 import shim_pb2 as shim_pb
from ..api.ttrpc.request_pb2 import Request
from ..errors import ShimError
from ..lifecycle.checkpoint_manager import CheckpointManager
from ..runtime.containerd_images import ContainerdImages, target_digest_in_child
from ..runtime.reaper import Reaper, set_child_subreaper
from ..task.events import Publisher
from ..task.oom import OomWatcher
from ..task.options import decode_start_stdin, parse_runtime_options
from ..task.runc_factory import bundle_runc
from ..task.service import CEDANA_SERVICE_NAME, SERVICE_NAME, TaskService
from ..ttrpc.server import Server
from .args import ShimArgs
from .wiring import NodePipelines

log = logging.getLogger(__name__)

LISTENER_FD = 3
SHUTDOWN_GRACE = 2.0
COMPACT_DRAIN_TIMEOUT = 600.0  # a stopped container's checkpoint may still be compressing


# Computed once, in the fork server: see _ShimLoop.
_VALID_SIGNALS = frozenset(signal.valid_signals())


class _ShimLoop(asyncio.SelectorEventLoop):
    """The event loop, but for one private check. asyncio tests every signal number
    given to add_signal_handler / remove_signal_handler against
    ``signal.valid_signals()``, which builds a set of 65 ``Signals`` members on each
    call (~0.25 ms; a daemon makes six: SIGCHLD, SIGTERM, SIGINT and their removal).
    Where asyncio has no such check the override is simply never called."""

    def _check_signal(self, sig: int) -> None:
        if not isinstance(sig, int):
            raise TypeError(f"sig must be an int, not {sig!r}")
        if sig not in _VALID_SIGNALS:
            raise ValueError(f"invalid signal number {sig}")


def prepare_daemon() -> asyncio.Runner:
    """What a spare (cli/spare.py) does for its daemon-to-be: the event loop, run
    once, with the thread its ``to_thread`` calls use (the loop's default executor)
    started, and a rehearsal of what every daemon does first."""
    runner = asyncio.Runner(loop_factory=_ShimLoop)
    runner.run(asyncio.to_thread(int))
    _rehearse()
    return runner


def _rehearse() -> None:
    """The first use of each costs a daemon the copy-on-write faults of the server's
    memory it touches (~2 ms here: setting up logs and formatting a line, decoding a
    request, parsing a spec); once done, in the spare, the daemon's own are cheap."""
    shim_log.configure(None, debug=True)
    record = logging.makeLogRecord(
        {"name": __name__, "msg": "spare %s", "args": ("ready",), "levelname": "INFO",
         "levelno": logging.INFO, "container": "spare"}
    )  # fmt: skip
    shim_log.JsonFormatter({"namespace": "spare"}).format(record)
    payload = shim_pb.CreateTaskRequest(id="spare", bundle="/").SerializeToString()
    wire = Request(service=SERVICE_NAME, method="Create", payload=payload).SerializeToString()
    shim_pb.CreateTaskRequest.FromString(Request.FromString(wire).payload)
    json.loads('{"ociVersion": "1.0.2", "annotations": {"spare": "ready"}}')


def run_daemon(args: ShimArgs, start_stdin: bytes, runner: asyncio.Runner | None = None) -> int:
    with runner or asyncio.Runner(loop_factory=_ShimLoop) as running:
        return running.run(_serve(args, start_stdin))


def _listener(args: ShimArgs) -> socket.socket:
    if args.socket:  # started by hand: bind the socket ourselves
        path = args.socket.removeprefix("unix://")
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        sock.bind(path)
        os.chmod(path, 0o600)
        sock.listen(socket.SOMAXCONN)
        return sock
    return socket.socket(fileno=LISTENER_FD)


def _join_shim_cgroup(path: str) -> None:
    """Honour runc Options.shim_cgroup: move this daemon into that cgroup."""
    pid = str(os.getpid())
    root = "/sys/fs/cgroup"
    if os.path.exists(os.path.join(root, "cgroup.controllers")):
        targets = [os.path.join(root, path.lstrip("/"), "cgroup.procs")]
    else:
        targets = [
            os.path.join(root, controller, path.lstrip("/"), "cgroup.procs")
            for controller in os.listdir(root)
        ]
    for target in targets:
        try:
            with open(target, "w") as f:
                f.write(pid)
        except OSError as err:
            log.warning("cannot join shim cgroup", extra={"cgroup": target, "error": str(err)})


async def _serve(args: ShimArgs, start_stdin: bytes) -> int:
    log_fd = shim_log.open_log_fifo(os.getcwd())
    if log_fd is not None:
        os.dup2(log_fd, 2)  # a stray traceback lands in containerd's log too
    shim_log.configure(log_fd, debug=args.debug, static={"namespace": args.namespace})
    set_child_subreaper()
    loop = asyncio.get_running_loop()
    reaper = Reaper(loop)
    reaper.install()
    pipelines = NodePipelines(reaper)
    try:
        # Lines logged after containerd stopped reading this shim's log (a compaction
        # after the last task was deleted) still land somewhere.
        shim_log.add_node_log(pipelines.config("").log_file)
    except ShimError as err:
        log.warning("node config unreadable: no node log file", extra={"error": str(err)})
    try:
        options = parse_runtime_options(decode_start_stdin(start_stdin, args.id))
        if options.shim_cgroup:
            _join_shim_cgroup(options.shim_cgroup)
    except Exception as err:
        log.warning("ignoring start options", extra={"error": str(err)})

    ttrpc_address = os.environ.get("TTRPC_ADDRESS") or f"{args.address}.ttrpc"
    publisher = Publisher(ttrpc_address, args.namespace)
    publisher.start()
    stop = asyncio.Event()
    # The composition root: everything the service uses is built here, once.
    images = ContainerdImages(args.address, args.namespace)
    checkpoints = CheckpointManager(
        publisher, pipelines, functools.partial(target_digest_in_child, images, reaper)
    )
    async with OomWatcher(lambda container_id: service.publish_oom(container_id)) as oom:
        service = TaskService(
            args.namespace,
            publisher,
            reaper,
            checkpoints=checkpoints,
            # runc without --debug even when containerd runs the shim with -debug, as
            # containerd's runc shim: runc opens its log O_SYNC, and its debug lines
            # cost a synchronous write each (~40 ms a `runc create` on ext4).
            runc_factory=bundle_runc(reaper),
            oom=oom,
            on_shutdown=stop.set,
        )
        server = Server(
            {SERVICE_NAME: service.methods(), CEDANA_SERVICE_NAME: service.cedana_methods()}
        )
        listener = _listener(args)
        socket_path = listener.getsockname()
        for sig in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(sig, stop.set)
        serving = loop.create_task(server.serve_socket(listener))
        log.info("shim started", extra={"pid": os.getpid(), "socket": socket_path})
        await stop.wait()
        server.close()
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(server.wait_closed(), SHUTDOWN_GRACE)
        serving.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await serving
        await checkpoints.drain(COMPACT_DRAIN_TIMEOUT)
    if isinstance(socket_path, str) and socket_path:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(socket_path)
    await publisher.close()
    reaper.close()
    log.info("shim exiting", extra={"pid": os.getpid()})
    return 0
