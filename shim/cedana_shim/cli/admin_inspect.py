"""``cedana checkpoints inspect ID``: one checkpoint, everything its config records,
what was restored from it, and (``--verify``) whether its blobs or raw files are intact."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Mapping
from datetime import datetime
from typing import TYPE_CHECKING, Any

from cedana_shim import errors

from .admin_common import format_local, human_size, render_table, utcnow
from .admin_store import get_entry, list_item, open_store, raw_images_text, restore_with, write_json

if TYPE_CHECKING:
    from cedana_shim.checkpoint.store import Entry, RestoreRecords

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
        fields.append(("Raw", raw_images_text(entry)))
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
    restores = _restores(store.restore_records, entry)
    verify_error: str | None = None
    if args.verify:
        try:
            store.reader.verify(entry)
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
        write_json(doc)
    else:
        sys.stdout.write(inspect_text(entry, utcnow(), verify_error, args.verify, restores))
    if verify_error is not None:
        sys.stderr.write(f"cedana: checkpoint {entry.id} is damaged: {verify_error}\n")
        return 1
    return 0


def _restores(records: RestoreRecords, entry: Entry) -> list[dict[str, Any]]:
    """What was restored from ``entry``; unreadable records are said, not fatal."""
    try:
        return records.restores(entry.id)
    except (errors.ShimError, OSError) as err:
        sys.stderr.write(f"cedana: cannot read the restore records of {entry.id}: {err}\n")
        return []
