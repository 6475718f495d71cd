"""``cedana checkpoints export | import``: Kubernetes checkpoint archives (KEP-2008).

Export writes a stored checkpoint in the archive format the kubelet, ``crictl checkpoint``,
CRI-O and Podman write and ``checkpointctl`` reads; import turns such an archive into a
checkpoint of one namespace, restorable with ``CEDANA_RESTORE`` (checkpoint/cri_archive).
Steps are shown on stderr when it is a terminal.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Callable

from .admin_common import CliError, human_size

__all__ = ["cmd_export", "cmd_import", "register"]


def register(
    sub: argparse._SubParsersAction,  # type: ignore[type-arg]
    common: argparse.ArgumentParser,
    formatter: type[argparse.HelpFormatter],
) -> None:
    exp = sub.add_parser(
        "export",
        parents=[common],
        formatter_class=formatter,
        help="write a checkpoint as a Kubernetes checkpoint archive",
        description=(
            "Write a checkpoint as the archive kubelet's checkpoint API, `crictl checkpoint\n"
            "--export`, CRI-O and Podman write (checkpoint/ with CRIU's images, config.dump,\n"
            "spec.dump, status.dump, stats-dump, dump.log, rootfs-diff.tar, deleted.files):\n"
            "`checkpointctl show` and `checkpointctl inspect` read it. The file (mode 0600:\n"
            "it holds the process's memory) appears only once complete. --image pushes it\n"
            "instead as a one-layer checkpoint image (org.criu.checkpoint.* annotations) to\n"
            "the registry of the node config, with its credentials and CA."
        ),
        epilog=(
            "examples:\n  cedana checkpoints export 20261129T183000Z-3f9a1c2b -o counter.tar\n"
            "  cedana checkpoints export 20261129T183000Z-3f9a1c2b "
            "--image registry.example:5000/forensics/counter:v1"
        ),
    )
    exp.add_argument("id", metavar="ID", help="checkpoint id (or a unique prefix)")
    where = exp.add_mutually_exclusive_group(required=True)
    where.add_argument("-o", "--output", metavar="FILE", help="the archive to write")
    where.add_argument(
        "--image", metavar="REF", help="push as image host[:port]/repository[:tag] instead"
    )
    exp.add_argument("--json", action="store_true", help="print the result as a JSON object")
    exp.set_defaults(handler=_lazy("cmd_export"))
    imp = sub.add_parser(
        "import",
        parents=[common],
        formatter_class=formatter,
        help="turn a Kubernetes checkpoint archive into a checkpoint of a namespace",
        description=(
            "Import a checkpoint archive (kubelet's checkpoint API, `crictl checkpoint\n"
            "--export`, CRI-O, Podman, or `cedana checkpoints export`; plain, gzip or zstd)\n"
            "as a checkpoint of NAMESPACE under LABEL, and print its id: a new container of\n"
            "that namespace starts from it with CEDANA_RESTORE=<id>. The archive is checked\n"
            "like a registry pull (sizes, names, links, devices, nesting) and its CRIU images\n"
            "before the checkpoint is listed; a refused archive leaves nothing behind."
        ),
        epilog=(
            "example:\n  cedana checkpoints import checkpoint-counter.tar --namespace team-a "
            "--label counter"
        ),
    )
    imp.add_argument("archive", metavar="FILE", help="the checkpoint archive")
    imp.add_argument(
        "-n", "--namespace", metavar="NS", required=True, help="the namespace (label scope)"
    )
    imp.add_argument("-l", "--label", metavar="L", required=True, help="the label")
    imp.add_argument("--json", action="store_true", help="print the result as a JSON object")
    imp.set_defaults(handler=_lazy("cmd_import"))


def _lazy(name: str) -> Callable[[argparse.Namespace], int]:
    def run(args: argparse.Namespace) -> int:
        fn: Callable[[argparse.Namespace], int] = globals()[name]
        return fn(args)

    return run


def _steps(what: str) -> Callable[[str], None] | None:
    if not sys.stderr.isatty():
        return None

    def say(step: str) -> None:
        sys.stderr.write(f"cedana: {what}: {step}\n")

    return say


def cmd_export(args: argparse.Namespace) -> int:
    from cedana_shim import errors
    from cedana_shim.checkpoint.cri_archive.export import export_archive

    from .admin_store import get_entry, open_store

    store = open_store(args)
    entry = get_entry(store, args.id)
    say = _steps(f"exporting {entry.id}")
    target = args.output or os.path.join(store.reader.spool_dir(), f"{entry.id}.image.tar")
    try:
        done = export_archive(store, entry, target, say)
        if args.image:
            from cedana_shim.checkpoint.cri_archive.oci_image import push_image

            from .admin_store import node_config

            if say is not None:
                say(f"pushing {args.image}")
            try:
                digest = push_image(node_config(args), args.image, entry, done.path)
            finally:
                os.unlink(done.path)
    except OSError as err:
        raise CliError(f"exporting checkpoint {entry.id} to {target}: {err}") from None
    except errors.ShimError as err:
        raise CliError(f"exporting checkpoint {entry.id}: {err}") from None
    doc: dict[str, object] = {"id": entry.id, "size": done.size, "images": done.images}
    if args.image:
        doc.update(image=args.image, digest=digest)
        line = f"{args.image}@{digest} ({human_size(done.size)}, {done.images} CRIU images)"
    else:
        doc.update(archive=done.path)
        line = f"{done.path} ({human_size(done.size)}, {done.images} CRIU images)"
    sys.stdout.write(json.dumps(doc, indent=2) + "\n" if args.json else line + "\n")
    return 0


def cmd_import(args: argparse.Namespace) -> int:
    from cedana_shim import errors
    from cedana_shim.checkpoint.cri_archive.importer import import_archive

    from .admin_store import open_store, restore_with

    store = open_store(args, create=True)
    name = os.path.basename(args.archive)
    try:
        entry = import_archive(
            store,
            args.archive,
            scope=args.namespace,
            label=args.label,
            progress=_steps(f"importing {name}"),
        )
    except OSError as err:
        raise CliError(f"importing {args.archive}: {err}; nothing was imported") from None
    except errors.ShimError as err:
        raise CliError(str(err)) from None
    if args.json:
        doc = {
            "id": entry.id,
            "namespace": entry.scope,
            "label": entry.label,
            "size": entry.size,
            "imported": entry.metadata.get("imported"),
            "restoreWith": restore_with(entry.id),
        }
        sys.stdout.write(json.dumps(doc, indent=2) + "\n")
    else:
        sys.stdout.write(f"{entry.id}\n")
    return 0
