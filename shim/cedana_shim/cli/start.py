"""``containerd-shim-cedana-v2 start``: find or start the daemon for a pod.

Runs once per container with the bundle as cwd and must print only the
daemon's address on stdout. Containers of one pod (same
``io.kubernetes.cri.sandbox-id``) share one daemon: when its socket already
answers, the address is reused and no process is started. This path is hot, so
it imports nothing heavy (no ``json``, ``socket`` or ``re``): the daemon is the
warm fork server's spare (or forked by it), or forked by a child of this process
when no server answers (:func:`run_start`).
"""

from __future__ import annotations

import _socket
import errno
import os
import sys

from .args import ShimArgs, parse_args
from .fork_client import ForkServerUnavailable, answers, request_fork, spawn_server, unix_socket
from .paths import (
    SOCKET_PATH_LIMIT,
    code_fingerprint,
    ensure_private_dir,
    forkserver_socket_path,
    shim_socket_path,
)

TYPE_CHECKING = False
if TYPE_CHECKING:
    from typing import NoReturn

GROUP_ANNOTATIONS = ("io.containerd.runc.v2.group", "io.kubernetes.cri.sandbox-id")
PROBE_TIMEOUT = 0.1


class StartError(Exception):
    pass


class _Ambiguous:
    """The quick scan cannot tell: let the JSON parser decide."""


AMBIGUOUS = _Ambiguous()


def _plain_string_value(raw: bytes, key: str) -> str | _Ambiguous | None:
    """The value of ``"key": "..."`` in a JSON document, found without parsing it.

    Only a key that occurs once, with a string value free of escapes, is read this
    way; anything else is AMBIGUOUS and left to the JSON parser.
    """
    needle = b'"' + key.encode() + b'"'
    at = raw.find(needle)
    if at < 0:
        return None
    if raw.find(needle, at + 1) >= 0:
        return AMBIGUOUS
    rest = raw[at + len(needle) :].lstrip(b" \t\r\n")
    if not rest.startswith(b":"):
        return AMBIGUOUS
    rest = rest[1:].lstrip(b" \t\r\n")
    end = rest.find(b'"', 1)
    if not rest.startswith(b'"') or end < 0 or b"\\" in rest[:end]:
        return AMBIGUOUS
    return rest[1:end].decode("utf-8", "replace")


def grouping_key(bundle: str, container_id: str) -> str:
    try:
        with open(os.path.join(bundle, "config.json"), "rb") as f:
            raw = f.read()
    except OSError as err:
        raise StartError(f"read OCI spec of container {container_id}: {err}") from err
    for key in GROUP_ANNOTATIONS:
        value = _plain_string_value(raw, key)
        if isinstance(value, _Ambiguous):
            return _grouping_key_parsed(raw, container_id)
        if value:
            return value
    return container_id


def _grouping_key_parsed(raw: bytes, container_id: str) -> str:
    import json

    try:
        spec = json.loads(raw)
    except ValueError as err:
        raise StartError(f"OCI spec of container {container_id} is not JSON: {err}") from err
    annotations = spec.get("annotations") or {} if isinstance(spec, dict) else {}
    for key in GROUP_ANNOTATIONS:
        value = annotations.get(key)
        if isinstance(value, str) and value:
            return value
    return container_id


def listen(path: str) -> _socket.socket | None:
    """Bind the pod's socket; None when a live daemon already serves it."""
    if len(path) > SOCKET_PATH_LIMIT:
        raise StartError(f"socket path {path!r} longer than {SOCKET_PATH_LIMIT} bytes")
    ensure_private_dir(os.path.dirname(path))
    sock = unix_socket()
    try:
        try:
            sock.bind(path)
        except OSError as err:
            if err.errno != errno.EADDRINUSE:
                raise
            if answers(path, PROBE_TIMEOUT):
                sock.close()
                return None
            os.unlink(path)  # stale: its daemon is gone
            sock.bind(path)
        os.chmod(path, 0o600)
        sock.listen(_socket.SOMAXCONN)
    except BaseException:
        sock.close()
        raise
    return sock


def write_address(bundle: str, address: str) -> None:
    tmp = os.path.join(bundle, ".address.tmp")
    with open(tmp, "w") as f:
        f.write(address)
    os.rename(tmp, os.path.join(bundle, "address"))


def daemon_argv(args: ShimArgs) -> list[str]:
    argv = ["-namespace", args.namespace, "-id", args.id, "-address", args.address]
    if args.publish_binary:
        argv += ["-publish-binary", args.publish_binary]
    if args.debug:
        argv.append("-debug")
    return argv


def fork_daemon(listener: _socket.socket, argv: list[str], stdin: bytes) -> int:
    """The cold path: fork the daemon from this process."""
    pid = os.fork()
    if pid:
        return pid
    from .forkserver import run_forked_daemon

    fd = os.dup(listener.fileno())
    listener.close()
    run_forked_daemon(fd, os.getcwd(), dict(os.environ), parse_args(argv), stdin)


def request_daemon(listener: _socket.socket, args: ShimArgs, stdin: bytes) -> int | None:
    """The daemon's pid, from the warm fork server (its spare answers in about a
    millisecond); None when no server answers (one is then started for the next
    container) or CEDANA_FORKSERVER=0."""
    if os.environ.get("CEDANA_FORKSERVER", "1") == "0":
        return None
    server = forkserver_socket_path(code_fingerprint())
    try:
        return request_fork(
            server, [listener.fileno()], daemon_argv(args), os.getcwd(), os.environ, stdin
        )
    except ForkServerUnavailable:
        spawn_server(server)
        return None


def containerd_oom_score() -> int | None:
    """The oom_score_adj of containerd, our parent (None where it cannot be read)."""
    try:
        with open(f"/proc/{os.getppid()}/oom_score_adj") as f:
            return int(f.read().strip())
    except (OSError, ValueError):
        return None


def adjust_oom_score(pid: int, containerd_score: int | None) -> None:
    """Daemon one point more killable than containerd, as the runc shim does."""
    if containerd_score is None:
        return
    try:
        with open(f"/proc/{pid}/oom_score_adj", "w") as f:
            f.write(str(min(containerd_score + 1, 1000)))
    except OSError:
        pass  # this VM refuses some values; the daemon keeps the inherited score


def report_failure(bundle: str, container_id: str, err: BaseException) -> None:
    """containerd no longer reads this process's stderr: the reason goes to its log
    (the bundle's log FIFO, as the daemon's lines do)."""
    import json

    from ..log import open_log_fifo

    fd = open_log_fifo(bundle)
    if fd is None:
        return
    line = json.dumps(
        {
            "level": "error",
            "msg": f"cedana shim start: cannot start the shim daemon: {err}",
            "container": container_id,
        }
    )
    try:
        os.write(fd, line.encode() + b"\n")
    except OSError:
        pass
    finally:
        os.close(fd)


def run_start(args: ShimArgs, stdin: bytes) -> int:
    """Print the pod's daemon address, starting the daemon when none serves it.

    The warm fork server hands the pod's listener to its spare (or forks for it) and
    answers at once; then the address is printed. Without a server the daemon is
    forked here, cold, which takes its imports (~80 ms): containerd waits for this
    process to exit and then connects at once, and the socket is already listening,
    so the address is printed first and a helper child forks the daemon
    (``_cold_start``) while containerd's connection and first request wait in the
    backlog.
    """
    if not args.namespace or not args.id:
        raise StartError("start needs -namespace and -id")
    bundle = os.getcwd()
    group = grouping_key(bundle, args.id)
    path = args.socket or shim_socket_path(args.address, args.namespace, group)
    address = "unix://" + path
    listener = listen(path)
    if listener is None:
        write_address(bundle, address)
        sys.stdout.write(address)
        return 0
    helper = -1
    try:
        write_address(bundle, address)
        score = containerd_oom_score()
        pid = request_daemon(listener, args, stdin)
        if pid is not None:
            adjust_oom_score(pid, score)
        else:
            sys.stdout.write(address)
            sys.stdout.flush()
            helper = os.fork()
    except BaseException:
        os.unlink(path)
        raise
    finally:
        if helper != 0:
            listener.close()  # the daemon or the helper has its own
    if helper == 0:
        _cold_start(listener, path, args, stdin, score)  # never returns
    if pid is not None:
        sys.stdout.write(address)
    return 0


def _cold_start(
    listener: _socket.socket, path: str, args: ShimArgs, stdin: bytes, score: int | None
) -> NoReturn:
    """In the helper: fork the daemon with ``listener``, then exit. It lets go of
    containerd's pipes first (containerd reads the answer until their EOF). A daemon
    that cannot be started leaves no socket: containerd's connection and requests then
    fail, and the reason is in containerd's log."""
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    os.close(devnull)
    code = 0
    try:
        adjust_oom_score(fork_daemon(listener, daemon_argv(args), stdin), score)
    except BaseException as err:
        code = 1
        try:
            os.unlink(path)
            report_failure(os.getcwd(), args.id, err)
        except BaseException:
            pass  # nothing is left to tell
    finally:
        os._exit(code)
