"""``cedana checkpoints ...``: list, remove, prune and repair what is in the store (inspect:
admin_inspect.py)."""

from __future__ import annotations

import argparse
import json
import os
import stat
import sys
from datetime import datetime
from typing import TYPE_CHECKING, Any

from cedana_shim import errors

from .admin_common import (
    ROOT_HINT,
    CliError,
    format_local,
    format_relative,
    human_size,
    is_root,
    parse_rfc3339,
    render_table,
    utcnow,
)

if TYPE_CHECKING:
    from cedana_shim.checkpoint.store import Entry, Reader, RepairReport, Store
    from cedana_shim.config import NodeConfig

DEFAULT_CONFIG = "/etc/cedana/shim.toml"


# -- opening the store -------------------------------------------------------------------


def node_config(args: argparse.Namespace) -> NodeConfig:
    """The node config (``--config``, env ``CEDANA_*``): the store's path and settings."""
    from cedana_shim.config import load_node_config

    return load_node_config(getattr(args, "config", None))


def store_path(args: argparse.Namespace, config: NodeConfig) -> str:
    """``--store``, else ``store_path`` of the node config."""
    explicit: str | None = getattr(args, "store", None)
    return os.path.abspath(explicit or config.store_path)


def open_store(args: argparse.Namespace, *, create: bool = False) -> Store:
    """The store, or a CliError that says what is wrong with it and what to do.

    Creates a missing store only with ``create`` (an import brings the node its first
    checkpoint, as a shim would): the other commands read or trim an existing one.
    """
    config = node_config(args)
    path = store_path(args, config)
    try:
        st = os.stat(path)
    except FileNotFoundError:
        if create:
            return _new_store(config, path)
        if getattr(args, "store", None):
            raise CliError(f"checkpoint store {path} does not exist (--store)") from None
        where = getattr(args, "config", None) or os.environ.get("CEDANA_CONFIG") or DEFAULT_CONFIG
        raise CliError(
            f"checkpoint store {path} does not exist: no checkpoint was taken on this node "
            f"yet, or the store is elsewhere (pass --store, or see store_path in {where} "
            "and env CEDANA_STORE_PATH)"
        ) from None
    except PermissionError:
        raise CliError(
            f"cannot access checkpoint store {path}: permission denied; {ROOT_HINT}"
        ) from None
    except OSError as err:
        raise CliError(f"cannot access checkpoint store {path}: {err.strerror}") from None
    if not stat.S_ISDIR(st.st_mode):
        raise CliError(f"checkpoint store {path} is not a directory")
    if not is_root() and st.st_uid != os.geteuid():
        raise CliError(
            f"checkpoint store {path} belongs to uid {st.st_uid} and holds process memory, "
            f"so only its owner may read it: {ROOT_HINT}"
        )
    return _new_store(config, path)


def _new_store(config: NodeConfig, path: str) -> Store:
    from cedana_shim.checkpoint.store import Store, StoreConfig

    try:
        return Store(StoreConfig.for_node(config, root=path))
    except errors.PermissionDenied as err:
        if isinstance(err.__cause__, PermissionError) and not is_root():
            raise CliError(f"{err}; {ROOT_HINT}") from None
        raise


def resolve_id(store: Store, text: str) -> str:
    """A full checkpoint id, or the one id that starts with ``text``."""
    from cedana_shim.checkpoint.store.layout import check_checkpoint_id

    if check_checkpoint_id(text) is None:
        return text
    matches = [e.id for e in store.catalog.list() if text and e.id.startswith(text)]
    if len(matches) == 1:
        return matches[0]
    if not matches:
        raise CliError(
            f"checkpoint {text}: not found in {store.root} "
            "(ids look like 20261129T183000Z-3f9a1c2b; a unique prefix will do)"
        )
    shown = ", ".join(matches[:5]) + (", ..." if len(matches) > 5 else "")
    raise CliError(f"checkpoint {text}: ambiguous, {len(matches)} ids start with it ({shown})")


def get_entry(store: Store, text: str) -> Entry:
    checkpoint_id = resolve_id(store, text)
    try:
        return store.catalog.get(checkpoint_id)
    except errors.NotFound:
        raise CliError(f"checkpoint {checkpoint_id}: not found in {store.root}") from None


def write_json(value: Any) -> None:
    sys.stdout.write(json.dumps(value, indent=2, sort_keys=False) + "\n")


# -- list ------------------------------------------------------------------------------------


def list_item(entry: Entry, damage: str | None = None) -> dict[str, Any]:
    """One item of ``cedana checkpoints list --json`` (DESIGN.md "Contract").

    ``damage``: what a cheap check found (see quick_damage), if not entry.damage.
    """
    meta = entry.metadata
    item: dict[str, Any] = {
        "id": entry.id,
        "namespace": entry.scope,
        "label": entry.label,
        "container": meta.get("container"),
        "created": entry.created,
        "size": entry.size,
    }
    for key, value in entry.to_json().items():
        item.setdefault(key, value)
    if damage is not None:
        item["damage"] = damage
    for key in ("containerId", "containerdNamespace", "pod", "image", "reason"):
        item.setdefault(key, meta.get(key))
    item["restoreWith"] = restore_with(entry.id)
    return item


def restore_with(checkpoint_id: str) -> dict[str, str]:
    """How to start a container from this checkpoint (restore by hand): the env
    setting, the line for a pod spec's ``env:``, and the annotation form."""
    from cedana_shim.checkpoint.policy import ANN_RESTORE, ENV_RESTORE

    return {
        "env": f"{ENV_RESTORE}={checkpoint_id}",
        "podSpec": f'- {{name: {ENV_RESTORE}, value: "{checkpoint_id}"}}',
        "annotation": f'{ANN_RESTORE}: "{checkpoint_id}"',
    }


def quick_damage(reader: Reader, entry: Entry) -> str | None:
    """What is known cheaply to be wrong with ``entry``: an unreadable manifest or
    config, a blob or raw file missing or of the wrong size (no hashing)."""
    if entry.damage is not None:
        return entry.damage
    try:
        reader.verify(entry, deep=False)
    except errors.DataLoss as err:
        return str(err)
    return None


def _status(entry: Entry, damage: str | None) -> str:
    if damage is None:
        return "-"
    for prefix in (f"checkpoint {entry.id} is damaged: ", f"checkpoint {entry.id}: "):
        damage = damage.removeprefix(prefix)
    return "damaged: " + damage


def _raw(entry: Entry) -> str:
    return human_size(entry.raw_bytes) if entry.raw_bytes else "-"


def raw_images_text(entry: Entry) -> str:
    if not entry.raw_bytes:
        return "-"
    what = "its files" if entry.state == "raw" else "raw-image cache for fast restores"
    return f"{human_size(entry.raw_bytes)} ({entry.raw_bytes} bytes) kept: {what}"


def list_table(entries: list[tuple[Entry, str | None]], now: datetime) -> str:
    headers = (
        "ID", "NAMESPACE", "LABEL", "CONTAINER", "CREATED", "SIZE", "RAW",
        "RESTORE WITH", "STATE", "STATUS",
    )  # fmt: skip
    rows = [
        (
            e.id,
            e.scope,
            e.label,
            str(e.metadata.get("container") or "-"),
            format_local(e.created, now),
            human_size(e.size),
            _raw(e),
            "-" if damage else restore_with(e.id)["env"],
            e.state if e.damage is None else "-",
            _status(e, damage),
        )
        for e, damage in entries
    ]
    return render_table(headers, rows)


def cmd_list(args: argparse.Namespace) -> int:
    if getattr(args, "remote", False):
        from .admin_remote import cmd_list_remote

        return cmd_list_remote(args)
    store = open_store(args)
    entries = store.catalog.list(scope=args.namespace, label=args.label)
    if args.quiet:
        sys.stdout.write("".join(f"{e.id}\n" for e in entries))
        return 0
    checked = [(e, quick_damage(store.reader, e)) for e in entries]
    if args.json:
        write_json([list_item(e, damage) for e, damage in checked])
    elif not entries:
        where = ", ".join(
            f"{k} {v}" for k, v in (("namespace", args.namespace), ("label", args.label)) if v
        )
        sys.stderr.write(f"No checkpoints in {store.root}{f' ({where})' if where else ''}.\n")
    else:
        sys.stdout.write(list_table(checked, utcnow()))
    return 0


# -- inspect ---------------------------------------------------------------------------------


# -- rm and prune ----------------------------------------------------------------------------


def cmd_rm(args: argparse.Namespace) -> int:
    store = open_store(args)
    status = 0
    for text in args.ids:
        try:
            checkpoint_id = resolve_id(store, text)
            store.maintenance.remove(checkpoint_id)
        except CliError as err:
            sys.stderr.write(f"cedana: {err}\n")
            status = 1
        except errors.NotFound:
            sys.stderr.write(f"cedana: checkpoint {text}: not found in {store.root}\n")
            status = 1
        else:
            sys.stdout.write(f"{checkpoint_id}\n")
    return status


def cmd_prune(args: argparse.Namespace) -> int:
    store = open_store(args)
    before = {e.id: e for e in store.catalog.list(scope=args.namespace, label=args.label)}
    removed = store.maintenance.prune(scope=args.namespace, label=args.label, keep=args.keep)
    freed = store.maintenance.gc() if args.gc else None
    if args.json:
        gone = [list_item(before[i]) if i in before else {"id": i} for i in removed]
        write_json({"removed": gone, "gcFreedBytes": freed})
        return 0
    now = utcnow()
    for checkpoint_id in removed:
        entry = before.get(checkpoint_id)
        what = ""
        if entry is not None:
            when = parse_rfc3339(entry.created)
            age = format_relative(when, now) if when is not None else entry.created
            what = f" ({entry.scope}/{entry.label}, created {age}, {human_size(entry.size)})"
        sys.stdout.write(f"removed {checkpoint_id}{what}\n")
    if args.namespace is not None and args.label is not None:
        scope = f"{args.namespace}/{args.label}"
    elif args.namespace is not None:
        scope = f"each label in namespace {args.namespace}"
    elif args.label is not None:
        scope = f"label {args.label} in each namespace"
    else:
        scope = "each namespace/label"
    noun = "checkpoint" if len(removed) == 1 else "checkpoints"
    sys.stdout.write(f"pruned {len(removed)} {noun}, kept the newest {args.keep} of {scope}\n")
    if freed is not None:
        sys.stdout.write(
            f"gc: freed {human_size(freed)} ({freed} bytes) of unreferenced blobs and stale files\n"
        )
    return 0


# -- repair ----------------------------------------------------------------------------------


def repair_text(report: RepairReport) -> str:
    if not report.rebuilt:
        return f"{report.index_path} is intact: nothing to repair\n"
    lines = [f"rebuilt {report.index_path} ({report.reason})"]
    if report.damaged_copy is not None:
        lines.append(f"the damaged index was kept as {report.damaged_copy}")
    lines += [f"recovered {cid} ({state})" for cid, state in report.recovered]
    lines += [f"dropped {what}: {why}" for what, why in report.dropped]
    noun = "checkpoint" if len(report.recovered) == 1 else "checkpoints"
    lines.append(f"recovered {len(report.recovered)} {noun}, dropped {len(report.dropped)}")
    return "\n".join(lines) + "\n"


def cmd_repair(args: argparse.Namespace) -> int:
    """Rebuild index.json from the blobs and raw files if it is missing or damaged."""
    store = open_store(args)
    report = store.maintenance.repair()
    if not report.rebuilt and store.catalog.last_repair is not None:
        report = store.catalog.last_repair  # a missing index is rebuilt as the store opens
    if args.json:
        write_json(report.to_json())
    else:
        sys.stdout.write(repair_text(report))
    return 0
