"""``cedana checkpoints list --remote | push | pull | sync``: the registry every node shares.

The registry comes from the node config (``registry`` and the ``registry_*`` keys);
the local store from ``--store`` or ``store_path``. Push and pull draw a progress bar
(bytes, MB/s) on stderr when it is a terminal, and print nothing while they run
otherwise. Imports stay light: the registry client is loaded by the command that runs.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

from .admin_common import CliError, format_local, human_size, render_table, render_transfer, utcnow

if TYPE_CHECKING:
    from cedana_shim.checkpoint.delivery import Delivery
    from cedana_shim.checkpoint.remote import RemoteCheckpoint, RemoteStore, SyncResult

__all__ = ["cmd_list_remote", "cmd_pull", "cmd_push", "cmd_sync", "register"]

_REFRESH_S = 0.1


def register(
    sub: argparse._SubParsersAction,  # type: ignore[type-arg]
    common: argparse.ArgumentParser,
    formatter: type[argparse.HelpFormatter],
) -> None:
    """Add ``--remote`` to ``checkpoints list`` and the push, pull and sync subcommands."""
    sub.choices["list"].add_argument(
        "--remote",
        action="store_true",
        help="list what the registry holds (node config `registry`) instead of this store",
    )
    push = sub.add_parser(
        "push",
        parents=[common],
        formatter_class=formatter,
        help="push a checkpoint to the registry",
        description=(
            "Push a checkpoint of this node's store to the registry of the node config\n"
            "(compacting it first if it is still raw). Only what the registry lacks is\n"
            "sent: chunks an earlier checkpoint pushed are not, and an interrupted push\n"
            "resumes. Prints the checkpoint's tag in the registry."
        ),
        epilog="example:\n  cedana checkpoints push 20261129T183000Z-3f9a1c2b",
    )
    push.add_argument("id", metavar="ID", help="checkpoint id (or a unique prefix)")
    push.add_argument("--json", action="store_true", help="print the result as a JSON object")
    push.set_defaults(handler=_lazy("cmd_push"))
    pull = sub.add_parser(
        "pull",
        parents=[common],
        formatter_class=formatter,
        help="pull a checkpoint from the registry into this store",
        description=(
            "Pull a checkpoint from the registry into this node's store, verified blob by\n"
            "blob (sha256) before it becomes visible; chunks the store already holds are\n"
            "not downloaded. REF is NAMESPACE/TAG as `list --remote` shows it, or a\n"
            "checkpoint id (searched in --namespace, else in the namespaces this store\n"
            "has checkpoints of)."
        ),
        epilog=(
            "examples:\n"
            "  cedana checkpoints pull team-a/c.trainer.20261129T183000123456Z.3f9a1c2b.1a2b3c4d\n"
            "  cedana checkpoints pull 20261129T183000Z-3f9a1c2b --namespace team-a"
        ),
    )
    pull.add_argument("ref", metavar="REF", help="NAMESPACE/TAG, or a checkpoint id")
    pull.add_argument("-n", "--namespace", metavar="NS", help="where to look for an id")
    pull.add_argument("--json", action="store_true", help="print the pulled checkpoint as JSON")
    pull.set_defaults(handler=_lazy("cmd_pull"))
    sy = sub.add_parser(
        "sync",
        parents=[common],
        formatter_class=formatter,
        help="push the checkpoints still waiting for the registry",
        description=(
            "Push every checkpoint of the outbox (committed here, not yet in the registry:\n"
            "it was down, or the shim was killed first). A push another process is doing\n"
            "is left to it (busy). Exits 1 if a push failed; it stays pending."
        ),
    )
    sy.add_argument("--json", action="store_true", help="print what happened as JSON")
    sy.set_defaults(handler=_lazy("cmd_sync"))


def _lazy(name: str) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        fn: Callable[[argparse.Namespace], int] = globals()[name]
        return fn(args)

    return run


# -- opening the registry --------------------------------------------------------------------


def open_delivery(args: argparse.Namespace) -> Delivery:
    """The node's store and its registry, or a CliError that says how to configure one."""
    from cedana_shim.checkpoint.delivery import Delivery
    from cedana_shim.config import DEFAULT_PATH

    from .admin_store import node_config, open_store

    config = node_config(args)
    if not config.registry:
        where = getattr(args, "config", None) or os.environ.get("CEDANA_CONFIG") or DEFAULT_PATH
        raise CliError(
            f'no registry configured: set `registry = "host[:port]/prefix"` in {where} '
            "(or env CEDANA_REGISTRY)"
        )
    return Delivery(open_store(args), config, platform.node())


def open_remote(args: argparse.Namespace) -> RemoteStore:
    """The remote store of the node config, or a CliError that says how to configure one."""
    return open_delivery(args).remote()


def write_json(value: Any) -> None:
    sys.stdout.write(json.dumps(value, indent=2) + "\n")


class _Bar:
    """A progress bar on stderr when it is a terminal; nothing otherwise."""

    def __init__(self, what: str) -> None:
        self._what = what
        self._shown = sys.stderr.isatty()
        self._start = time.monotonic()
        self._last = 0.0
        self._lock = threading.Lock()

    def __call__(self, done: int, total: int) -> None:
        if not self._shown:
            return
        now = time.monotonic()
        with self._lock:
            if now - self._last < _REFRESH_S and done < total:
                return
            self._last = now
            width = shutil.get_terminal_size().columns
            line = render_transfer(self._what, done, total, now - self._start, width)
            sys.stderr.write("\r\x1b[K" + line)
            sys.stderr.flush()

    def close(self) -> None:
        if self._shown and self._last:
            sys.stderr.write("\n")
            sys.stderr.flush()


# -- list --remote ---------------------------------------------------------------------------


def _table(found: list[RemoteCheckpoint]) -> str:
    now = utcnow()
    rows = [
        (
            r.checkpoint_id,
            r.scope,
            r.label or "-",
            format_local(r.created, now),
            r.node or f"#{r.node_hash}",
            "committed" if r.complete else "pushing",
            r.ref,
        )
        for r in found
    ]
    return render_table(("ID", "NAMESPACE", "LABEL", "CREATED", "NODE", "STATUS", "REF"), rows)


def cmd_list_remote(args: argparse.Namespace) -> int:
    remote = open_remote(args)
    found = [r for r in remote.list(args.namespace) if args.label is None or r.label == args.label]
    if args.quiet:
        sys.stdout.write("".join(f"{r.ref}\n" for r in found))
    elif args.json:
        from .admin_store import restore_with

        write_json(
            [
                {
                    **r.to_json(),
                    "restoreWith": restore_with(r.checkpoint_id) if r.complete else None,
                }
                for r in found
            ]
        )
    elif not found:
        where = f"namespace {args.namespace}" if args.namespace else "this store's namespaces"
        sys.stderr.write(f"No checkpoints in registry {remote.client.host} ({where}).\n")
    else:
        sys.stdout.write(_table(found))
    return 0


# -- push and pull -----------------------------------------------------------------------------


def cmd_push(args: argparse.Namespace) -> int:
    from .admin_store import resolve_id

    remote = open_remote(args)
    checkpoint_id = resolve_id(remote.store, args.id)
    bar = _Bar(f"pushing {checkpoint_id}")
    try:
        pushed = remote.push(checkpoint_id, bar)
    finally:
        bar.close()
    if args.json:
        write_json({**pushed.to_json(), "registry": remote.client.host})
    else:
        sys.stdout.write(f"{remote.client.host}/{pushed.repository}:{pushed.tag}\n")
    return 0


def _find(remote: RemoteStore, args: argparse.Namespace) -> RemoteCheckpoint:
    from cedana_shim.checkpoint.remote import RemoteCheckpoint
    from cedana_shim.checkpoint.remote.tags import parse_tag
    from cedana_shim.checkpoint.store.layout import check_checkpoint_id

    text: str = args.ref
    if "/" in text:
        scope, _, tag_text = text.partition("/")
        tag = parse_tag(tag_text)
        if tag is None or tag.pending:
            raise CliError(
                f"{text}: {tag_text!r} is not a checkpoint tag (see `cedana checkpoints list "
                "--remote`)"
            )
        return RemoteCheckpoint(
            repository=remote.client.repository_for(scope),
            tag=tag.tag,
            checkpoint_id=tag.checkpoint_id,
            scope=scope,
            label=tag.label or "",
            created=tag.created_text,
            node="",
            complete=True,
            node_hash=tag.node_hash,
        )
    if check_checkpoint_id(text) is not None:
        raise CliError(
            f"{text}: give NAMESPACE/TAG or a whole checkpoint id (e.g. 20261129T183000Z-3f9a1c2b)"
        )
    matches = [r for r in remote.list(args.namespace) if r.complete and r.checkpoint_id == text]
    if not matches:
        where = f"namespace {args.namespace}" if args.namespace else "this store's namespaces"
        raise CliError(
            f"checkpoint {text}: not in registry {remote.client.host} ({where}); "
            "pass --namespace NS to look elsewhere"
        )
    return matches[0]


def cmd_pull(args: argparse.Namespace) -> int:
    from .admin_store import list_item

    remote = open_remote(args)
    found = _find(remote, args)
    bar = _Bar(f"pulling {found.checkpoint_id}")
    try:
        entry = remote.pull(found, bar)
    finally:
        bar.close()
    if args.json:
        write_json(list_item(entry))
    else:
        sys.stdout.write(
            f"{entry.id}  ({entry.scope}/{entry.label}, {human_size(entry.size)}) "
            f"in {remote.store.root}\n"
        )
    return 0


# -- sync --------------------------------------------------------------------------------------


def _sync_json(result: SyncResult, pending: list[str]) -> dict[str, Any]:
    return {
        "pushed": result.pushed,
        "failed": [{"id": cid, "error": why} for cid, why in result.failed],
        "busy": result.busy,
        "pending": pending,
    }


def cmd_sync(args: argparse.Namespace) -> int:
    delivery = open_delivery(args)
    remote = delivery.remote()
    bars: dict[str, _Bar] = {}

    def progress(checkpoint_id: str, done: int, total: int) -> None:
        if checkpoint_id not in bars:
            for bar in bars.values():
                bar.close()
            bars.clear()
            bars[checkpoint_id] = _Bar(f"pushing {checkpoint_id}")
        bars[checkpoint_id](done, total)

    try:
        result = delivery.push(progress=progress)
    finally:
        for bar in bars.values():
            bar.close()
    pending = delivery.outbox().pending()
    if args.json:
        write_json(_sync_json(result, pending))
    else:
        lines = [f"pushed {cid}" for cid in result.pushed]
        lines += [f"busy   {cid} (another process is pushing it)" for cid in result.busy]
        lines += [f"failed {cid}: {why}" for cid, why in result.failed]
        noun = "push" if len(pending) == 1 else "pushes"
        lines.append(f"{len(pending)} {noun} pending for registry {remote.client.host}")
        sys.stdout.write("\n".join(lines) + "\n")
    for cid, why in result.failed:
        sys.stderr.write(f"cedana: push of checkpoint {cid} failed (still pending): {why}\n")
    return 1 if result.failed else 0
