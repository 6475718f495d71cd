"""``cedana checkpoint CONTAINER``: an on-demand checkpoint through the container's shim.

The shim that runs a container serves ``cedana.shim.v1.Checkpoint`` on the same
ttrpc socket as containerd's Task API; its address is in the task's bundle
(``<state>/io.containerd.runtime.v2.task/<namespace>/<id>/address``, or the
``bootstrap.json`` of containerd 2.x). Nothing goes through containerd itself.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Final, TextIO

from cedana_shim import errors

from .admin_common import ROOT_HINT, CliError, format_elapsed, human_size, is_root, render_progress

if TYPE_CHECKING:
    from cedana_shim.api.cedana.v1.cedana_pb2 import CheckpointResponse

DEFAULT_STATE_DIR: Final = "/run/containerd"
TASK_STATE_SUBDIR: Final = "io.containerd.runtime.v2.task"
SERVICE: Final = "cedana.shim.v1.Checkpoint"
METHOD: Final = "Checkpoint"
REDRAW_S: Final = 0.1
# containerd's identifier rule (namespaces and container ids alike).
_IDENTIFIER: Final = re.compile(r"[A-Za-z0-9]+(?:[._-][A-Za-z0-9]+)*")


@dataclass(frozen=True)
class Bundle:
    namespace: str
    container_id: str
    path: str


def _check_identifier(what: str, value: str) -> None:
    if len(value) > 76 or not _IDENTIFIER.fullmatch(value):
        raise CliError(
            f"{value!r} is not a valid {what} (letters and digits, separated by single "
            "'.', '_' or '-')"
        )


def find_bundle(state_dir: str, container_id: str, namespace: str | None = None) -> Bundle:
    """The bundle of the container's task, searching every containerd namespace
    when ``namespace`` is None. Errors say where they looked."""
    _check_identifier("container id", container_id)
    if namespace is not None:
        _check_identifier("containerd namespace", namespace)
    tasks = os.path.join(os.path.abspath(state_dir), TASK_STATE_SUBDIR)
    try:
        namespaces = sorted(n for n in os.listdir(tasks) if os.path.isdir(os.path.join(tasks, n)))
    except FileNotFoundError:
        raise CliError(
            f"no containerd task state in {tasks}: is containerd running, and is "
            f"{state_dir} its state directory (`state` in its config.toml)? "
            "Pass --containerd-state DIR"
        ) from None
    except PermissionError:
        raise CliError(f"cannot read containerd's task state in {tasks}: {ROOT_HINT}") from None
    searched = [namespace] if namespace is not None else namespaces
    found = [
        Bundle(ns, container_id, path)
        for ns in searched
        if os.path.isdir(path := os.path.join(tasks, ns, container_id))
    ]
    if len(found) == 1:
        return found[0]
    if found:
        listed = ", ".join(b.namespace for b in found)
        raise CliError(
            f"container {container_id} has tasks in several containerd namespaces "
            f"({listed}): pass --namespace"
        )
    if namespace is not None:
        where = os.path.join(tasks, namespace, container_id)
        others = f" (namespaces with tasks: {', '.join(namespaces)})" if namespaces else ""
        raise CliError(f"container {container_id}: no running task, looked for {where}{others}")
    if not namespaces:
        raise CliError(
            f"container {container_id}: no running task, and no task at all under {tasks}"
        )
    raise CliError(
        f"container {container_id}: no running task in any containerd namespace, looked for "
        f"{os.path.join(tasks, '<namespace>', container_id)} in {', '.join(namespaces)}"
    )


def shim_address(bundle: Bundle) -> str:
    """The shim's ttrpc address from the bundle's ``address`` (or ``bootstrap.json``)."""
    address = ""
    try:
        with open(os.path.join(bundle.path, "address")) as f:
            address = f.read(4096).strip()
    except FileNotFoundError:
        pass
    except PermissionError:
        raise CliError(f"cannot read {bundle.path}/address: {ROOT_HINT}") from None
    if not address:
        try:
            with open(os.path.join(bundle.path, "bootstrap.json")) as f:
                address = str(json.load(f).get("address") or "")
        except (OSError, ValueError, AttributeError):
            pass
    if not address:
        raise CliError(
            f"container {bundle.container_id} (containerd namespace {bundle.namespace}): "
            f"{bundle.path} has no shim address; is its task still starting or being deleted?"
        )
    return address


# -- progress ----------------------------------------------------------------------------


class Progress:
    """The one-line spinner, redrawn in place on a terminal."""

    def __init__(
        self,
        stream: TextIO,
        what: str,
        *,
        ascii: bool = False,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.stream = stream
        self.what = what
        self.ascii = ascii
        self.clock = clock
        self.started = clock()
        self.tick = 0

    def elapsed(self) -> float:
        return self.clock() - self.started

    def _width(self) -> int:
        try:
            return os.get_terminal_size(self.stream.fileno()).columns or 80
        except (OSError, ValueError, AttributeError):
            return 80

    def draw(self) -> None:
        line = render_progress(
            self.what, self.elapsed(), self.tick, self._width(), ascii=self.ascii
        )
        self.stream.write(f"\r{line}\x1b[K")
        self.stream.flush()
        self.tick += 1

    def clear(self) -> None:
        self.stream.write("\r\x1b[K")
        self.stream.flush()


def wants_progress(stream: TextIO, json_output: bool) -> bool:
    try:
        tty = stream.isatty()
    except (ValueError, AttributeError):
        tty = False
    return tty and not json_output and os.environ.get("TERM") != "dumb"


# -- the call --------------------------------------------------------------------------------


async def request_checkpoint(
    address: str,
    container_id: str,
    *,
    leave_running: bool,
    timeout: float | None,
    progress: Progress | None,
) -> CheckpointResponse:
    import asyncio

    from cedana_shim.api.cedana.v1 import cedana_pb2
    from cedana_shim.ttrpc.client import Client

    async def call() -> CheckpointResponse:
        async with await Client.connect(address) as client:
            return await client.call(
                SERVICE,
                METHOD,
                cedana_pb2.CheckpointRequest(
                    container_id=container_id, leave_running=leave_running
                ),
                cedana_pb2.CheckpointResponse,
                timeout=timeout,
            )

    if progress is None:
        return await call()
    task = asyncio.create_task(call())
    try:
        while True:
            progress.draw()
            done, _ = await asyncio.wait({task}, timeout=REDRAW_S)
            if done:
                return task.result()
    finally:
        if not task.done():
            task.cancel()
            await asyncio.wait({task})


def _explain(
    err: errors.ShimError, bundle: Bundle, address: str, timeout: float | None
) -> Exception:
    cid = bundle.container_id
    if isinstance(err, errors.Unavailable):
        hint = f"; {ROOT_HINT}" if "Permission denied" in str(err) and not is_root() else ""
        return CliError(f"cannot reach the shim of container {cid} at {address}: {err}{hint}")
    if isinstance(err, errors.Unimplemented):
        return CliError(
            f"the shim of container {cid} ({address}) does not serve {SERVICE}: is the "
            f"container running under the `cedana` handler? ({err})"
        )
    if isinstance(err, errors.DeadlineExceeded) and timeout is not None:
        return CliError(
            f"checkpoint of container {cid} did not finish within {timeout:g}s (--timeout); "
            "the shim was given the same deadline and abandons it"
        )
    if isinstance(err, (errors.FailedPrecondition, errors.NotFound, errors.InvalidArgument)):
        return err  # the shim's message names the container and says what to do
    return CliError(f"checkpoint of container {cid} failed: {err}")


def cmd_checkpoint(args: argparse.Namespace) -> int:
    import asyncio

    bundle = find_bundle(args.containerd_state, args.container_id, args.namespace)
    address = shim_address(bundle)
    progress: Progress | None = None
    if wants_progress(sys.stdout, args.json):
        mode = "leave running" if args.leave_running else "stop"
        utf8 = (sys.stdout.encoding or "").lower().replace("-", "") == "utf8"
        progress = Progress(
            sys.stdout, f"checkpointing container {bundle.container_id} ({mode})", ascii=not utf8
        )
    started = time.monotonic()
    try:
        response = asyncio.run(
            request_checkpoint(
                address,
                bundle.container_id,
                leave_running=args.leave_running,
                timeout=args.timeout,
                progress=progress,
            )
        )
    except errors.ShimError as err:
        raise _explain(err, bundle, address, args.timeout) from None
    finally:
        if progress is not None:
            progress.clear()
    elapsed = time.monotonic() - started
    if args.json:
        doc = {
            "id": response.checkpoint_id,
            "namespace": response.scope,
            "label": response.label,
            "containerId": bundle.container_id,
            "containerdNamespace": bundle.namespace,
            "size": response.size,
            "leaveRunning": args.leave_running,
            "elapsedSeconds": round(elapsed, 3),
        }
        sys.stdout.write(json.dumps(doc, indent=2) + "\n")
        return 0
    if progress is not None:
        mark = "done:" if progress.ascii else "✓"
        after = "left running" if args.leave_running else "stopped"
        sys.stdout.write(
            f"{mark} checkpointed container {bundle.container_id} in {format_elapsed(elapsed)} "
            f"(label {response.label}, namespace {response.scope}, "
            f"{human_size(response.size)}); container {after}\n"
        )
    sys.stdout.write(f"{response.checkpoint_id}\n")
    return 0
