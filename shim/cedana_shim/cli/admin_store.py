"""``cedana checkpoints ...``: list, inspect, remove, prune and repair what is in the store."""

from __future__ import annotations

import argparse
import json
import os
import stat
import sys
from collections.abc import Mapping
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
    from cedana_shim.checkpoint.store import Entry, RepairReport, Store

# Keys of the checkpoint config that `inspect` shows in their own sections; any
# other key is printed under "Other metadata" so nothing is ever hidden.
_SHOWN_KEYS = frozenset(
    {
        "id", "scope", "label", "created", "sizes", "layers", "metadataVersion", "reason",
        "namespace", "containerdNamespace", "containerId", "pod", "container", "image",
        "node", "versions", "network", "terminal", "mounts", "timings", "rootfs_diff",
        "imageDigest",
    }
)  # fmt: skip
_VERSION_ORDER = ("shim", "runc", "criu", "kernel", "arch")
_STATES = {
    "raw": "raw (uncompressed, compaction pending)",
    "compacted": "compacted (tar+zstd blobs)",
}
DEFAULT_CONFIG = "/etc/cedana/shim.toml"


# -- opening the store -------------------------------------------------------------------


def store_path(args: argparse.Namespace) -> str:
    """``--store``, else ``store_path`` of the node config (``--config``, env ``CEDANA_*``)."""
    explicit: str | None = getattr(args, "store", None)
    if explicit:
        return os.path.abspath(explicit)
    from cedana_shim.config import load_node_config

    return os.path.abspath(load_node_config(getattr(args, "config", None)).store_path)


def open_store(args: argparse.Namespace) -> Store:
    """The store, or a CliError that says what is wrong with it and what to do.

    Never creates a store: every command here only reads or trims an existing one.
    """
    path = store_path(args)
    try:
        st = os.stat(path)
    except FileNotFoundError:
        if getattr(args, "store", None):
            raise CliError(f"checkpoint store {path} does not exist (--store)") from None
        config = getattr(args, "config", None) or os.environ.get("CEDANA_CONFIG") or DEFAULT_CONFIG
        raise CliError(
            f"checkpoint store {path} does not exist: no checkpoint was taken on this node "
            f"yet, or the store is elsewhere (pass --store, or see store_path in {config} "
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
    from cedana_shim.checkpoint.store import Store, StoreConfig

    try:
        return Store(StoreConfig(root=path))
    except errors.PermissionDenied as err:
        if isinstance(err.__cause__, PermissionError) and not is_root():
            raise CliError(f"{err}; {ROOT_HINT}") from None
        raise


def resolve_id(store: Store, text: str) -> str:
    """A full checkpoint id, or the one id that starts with ``text``."""
    from cedana_shim.checkpoint.store.layout import check_checkpoint_id

    if check_checkpoint_id(text) is None:
        return text
    matches = [e.id for e in store.list() if text and e.id.startswith(text)]
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
        return store.get(checkpoint_id)
    except errors.NotFound:
        raise CliError(f"checkpoint {checkpoint_id}: not found in {store.root}") from None


def _write_json(value: Any) -> None:
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


def quick_damage(store: Store, entry: Entry) -> str | None:
    """What is known cheaply to be wrong with ``entry``: an unreadable manifest or
    config, a blob or raw file missing or of the wrong size (no hashing)."""
    if entry.damage is not None:
        return entry.damage
    try:
        store.verify(entry, deep=False)
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


def _raw_images(entry: Entry) -> str:
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
    entries = store.list(scope=args.namespace, label=args.label)
    if args.quiet:
        sys.stdout.write("".join(f"{e.id}\n" for e in entries))
        return 0
    checked = [(e, quick_damage(store, e)) for e in entries]
    if args.json:
        _write_json([list_item(e, damage) for e, damage in checked])
    elif not entries:
        where = ", ".join(
            f"{k} {v}" for k, v in (("namespace", args.namespace), ("label", args.label)) if v
        )
        sys.stderr.write(f"No checkpoints in {store.root}{f' ({where})' if where else ''}.\n")
    else:
        sys.stdout.write(list_table(checked, utcnow()))
    return 0


# -- inspect ---------------------------------------------------------------------------------


def _criu_stats_text(stats: Mapping[str, Any]) -> str:
    """CRIU's dump statistics (runtime.criu_stats), seconds first, then page counts."""
    times = [f"{k.removesuffix('_s')} {_text(v)} s" for k, v in stats.items() if k.endswith("_s")]
    pages = [f"{k.replace('_', ' ')} {_text(v)}" for k, v in stats.items() if k.startswith("pages")]
    return ", ".join(times + pages)


def _text(value: Any) -> str:
    if value is None or value == "":
        return "-"
    return value if isinstance(value, str) else json.dumps(value)


def _lines_versions(versions: Any) -> list[str]:
    if not isinstance(versions, Mapping) or not versions:
        return []
    keys = [k for k in _VERSION_ORDER if k in versions] + sorted(
        k for k in versions if k not in _VERSION_ORDER
    )
    width = max(len(str(k)) for k in keys)
    return ["Versions:"] + [f"  {str(k).ljust(width)}  {_text(versions[k])}" for k in keys]


def _lines_network(network: Any) -> list[str]:
    if not isinstance(network, Mapping):
        return []
    out = ["Network:"]
    addresses = [a for a in network.get("addresses") or [] if isinstance(a, Mapping)]
    routes = [r for r in network.get("routes") or [] if isinstance(r, Mapping)]
    if not addresses and not routes:
        return ["Network:    -"]
    for a in addresses:
        out.append(
            f"  address  {_text(a.get('interface'))}  "
            f"{a.get('address')}/{a.get('prefixlen')} ({a.get('family')})"
        )
    for r in routes:
        via = f" via {r.get('gateway')}" if r.get("gateway") else ""
        out.append(f"  route    {_text(r.get('destination'))}{via} dev {_text(r.get('interface'))}")
    return out


def _lines_layers(entry: Entry) -> list[str]:
    if not entry.layers:
        return ["Layers:     -"]
    rows = [
        (x.name, human_size(x.size), human_size(x.raw_size), x.media_type) for x in entry.layers
    ]
    table = render_table(("NAME", "STORED", "RAW", "MEDIA TYPE"), rows)
    return ["Layers:"] + ["  " + line for line in table.splitlines()]


def _task(meta: Mapping[str, Any]) -> str:
    task = _text(meta.get("containerId"))
    if meta.get("containerdNamespace"):
        task += f" (containerd namespace {_text(meta.get('containerdNamespace'))})"
    return task


def _fields(entry: Entry, now: datetime) -> list[tuple[str, str]]:
    """The fields `inspect` shows first, each on its own line."""
    meta = entry.metadata
    raw = sum(x.raw_size for x in entry.layers)
    fields: list[tuple[str, str]] = [
        ("ID", entry.id),
        ("Namespace", entry.scope),
        ("Label", entry.label),
        ("Created", f"{format_local(entry.created, now, seconds=True)}  [{entry.created}]"),
        ("Reason", _text(meta.get("reason"))),
        ("Pod", _text(meta.get("pod"))),
        ("Container", _text(meta.get("container"))),
        (
            "Image",
            _text(meta.get("image"))
            + (f" ({meta['imageDigest']})" if meta.get("imageDigest") else ""),
        ),
        ("Task", _task(meta)),
        ("Node", _text(meta.get("node"))),
        ("Size", f"{human_size(entry.size)} stored ({entry.size} bytes), {human_size(raw)} raw"),
        ("Manifest", entry.manifest_digest),
        ("Status", "damaged: " + entry.damage if entry.damage else "committed"),
    ]
    if entry.damage is None:
        fields.append(("State", _STATES[entry.state]))
        fields.append(("Raw", _raw_images(entry)))
    return fields


def _lines_restores(entry: Entry, restores: list[dict[str, Any]], now: datetime) -> list[str]:
    lines = ["Restore with:", f"  {restore_with(entry.id)['podSpec']}"]
    if not restores:
        return [*lines, "Restored:   never (on this node)"]
    rows = [
        (
            format_local(str(r.get("restoredAt") or ""), now, seconds=True)
            if r.get("restoredAt")
            else "-",
            _text(r.get("namespace")),
            _text(r.get("pod")),
            _text(r.get("container")),
            _text(r.get("containerId")),
            _text(r.get("node")),
            "by hand" if r.get("byHand") else "label",
        )
        for r in restores
    ]
    table = render_table(("RESTORED", "NAMESPACE", "POD", "CONTAINER", "TASK", "NODE", "HOW"), rows)
    return [*lines, f"Restored:   {len(restores)} time(s)"] + ["  " + x for x in table.splitlines()]


def inspect_text(
    entry: Entry,
    now: datetime,
    verify_error: str | None,
    verified: bool,
    restores: list[dict[str, Any]] | None = None,
) -> str:
    meta = entry.metadata
    fields = _fields(entry, now)
    if "terminal" in meta:
        fields.append(("Terminal", "yes" if meta.get("terminal") else "no"))
    timings = meta.get("timings")
    if isinstance(timings, Mapping) and timings:
        plain = {k: v for k, v in timings.items() if k != "criu"}
        if plain:
            fields.append(("Timings", ", ".join(f"{k} {_text(v)}" for k, v in plain.items())))
        criu = timings.get("criu")
        if isinstance(criu, Mapping) and criu:
            fields.append(("CRIU dump", _criu_stats_text(criu)))
    diff = meta.get("rootfs_diff")
    if isinstance(diff, Mapping):
        fields.append(
            (
                "Rootfs diff",
                f"{_text(diff.get('files'))} files, {_text(diff.get('deletions'))} deletions, "
                f"{human_size(int(diff.get('bytes') or 0))}",
            )
        )
    mounts = meta.get("mounts")
    if isinstance(mounts, list) and mounts:
        fields.append(("Mounts", ", ".join(str(m) for m in mounts)))
    width = max(len(k) for k, _ in fields) + 2
    verify_key = "Verify:".ljust(width)
    lines = [f"{(k + ':').ljust(width)}{v}" for k, v in fields]
    lines += _lines_layers(entry)
    lines += _lines_versions(meta.get("versions"))
    lines += _lines_network(meta.get("network"))
    lines += _lines_restores(entry, restores or [], now)
    others = sorted(k for k in meta if k not in _SHOWN_KEYS)
    if others:
        lines.append("Other metadata:")
        lines += [f"  {k}: {json.dumps(meta[k], sort_keys=True)}" for k in others]
    if verified:
        lines.append(
            f"{verify_key}FAILED: {verify_error}"
            if verify_error
            else f"{verify_key}OK (manifest, config and {_what_verified(entry)})"
        )
    return "\n".join(lines) + "\n"


def _what_verified(entry: Entry) -> str:
    if entry.state == "raw":
        return f"{len(entry.layers)} raw layer(s): every file's size and CRC-32 intact"
    return f"{len(entry.layers)} layer blob(s) intact"


def cmd_inspect(args: argparse.Namespace) -> int:
    store = open_store(args)
    entry = get_entry(store, args.id)
    restores = _restores(store, entry)
    verify_error: str | None = None
    if args.verify:
        try:
            store.verify(entry)
        except errors.DataLoss as err:
            verify_error = str(err)
    if args.json:
        doc = {
            **list_item(entry),
            "manifestDigest": entry.manifest_digest,
            "metadata": dict(entry.metadata),
            "restores": restores,
        }
        if args.verify:
            doc["verify"] = {"ok": verify_error is None, "error": verify_error}
        _write_json(doc)
    else:
        sys.stdout.write(inspect_text(entry, utcnow(), verify_error, args.verify, restores))
    if verify_error is not None:
        sys.stderr.write(f"cedana: checkpoint {entry.id} is damaged: {verify_error}\n")
        return 1
    return 0


def _restores(store: Store, entry: Entry) -> list[dict[str, Any]]:
    """What was restored from ``entry``; unreadable records are said, not fatal."""
    try:
        return store.restores(entry.id)
    except (errors.ShimError, OSError) as err:
        sys.stderr.write(f"cedana: cannot read the restore records of {entry.id}: {err}\n")
        return []


# -- rm and prune ----------------------------------------------------------------------------


def cmd_rm(args: argparse.Namespace) -> int:
    store = open_store(args)
    status = 0
    for text in args.ids:
        try:
            checkpoint_id = resolve_id(store, text)
            store.remove(checkpoint_id)
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
    before = {e.id: e for e in store.list(scope=args.namespace, label=args.label)}
    removed = store.prune(scope=args.namespace, label=args.label, keep=args.keep)
    freed = store.gc() if args.gc else None
    if args.json:
        gone = [list_item(before[i]) if i in before else {"id": i} for i in removed]
        _write_json({"removed": gone, "gcFreedBytes": freed})
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
    report = store.repair()
    if not report.rebuilt and store.last_repair is not None:
        report = store.last_repair  # a missing index is rebuilt as the store opens
    if args.json:
        _write_json(report.to_json())
    else:
        sys.stdout.write(repair_text(report))
    return 0
