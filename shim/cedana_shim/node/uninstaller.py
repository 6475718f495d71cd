"""``cedana node uninstall``: put back every file install changed, byte for byte.

A file changed since install is not clobbered: an edited containerd config loses only
the marked cedana block, anything else is left as it is, and the backup of what was
there before install is kept (and named in the report).
"""

from __future__ import annotations

import contextlib
import os
import shutil
import time
from typing import Any

from . import containerd_config as cc
from .hostfs import STATE_DIR
from .installer import (
    Context,
    Options,
    make_context,
    read_host_file,
    restart_containerd,
    run_restart,
    socket_path,
    undo_registration,
)
from .report import NodeError, Report


def uninstall(opts: Options) -> Report:
    ctx = make_context(opts, "uninstall")
    try:
        _uninstall(ctx)
    except (NodeError, cc.ConfigError) as err:
        ctx.report.fail(str(err))
    return ctx.report


def _uninstall(ctx: Context) -> None:
    opts, host, state, report = ctx.opts, ctx.host, ctx.state, ctx.report
    if not state.exists:
        report.add("state", "unchanged", f"nothing installed ({host.display(STATE_DIR)} is absent)")
        return
    main_parsed = cc.parse(
        cc.ConfigFile(opts.containerd_config, read_host_file(host, opts.containerd_config))
    )
    if opts.verify != "none" and not opts.force:
        _refuse_if_pods(ctx, main_parsed)
    registration = state.get("registration") or {}
    changed = undo_registration(ctx, registration) if registration else False
    state.set("registration", None)
    state.save()
    if changed or state.get("restart_pending"):
        restart_containerd(ctx)
        if opts.verify != "none":
            _wait_cri(ctx, main_parsed)
    kubelet_restored = False
    for path in list(state.files):
        if ctx.managed.unchanged_since_install(path):
            outcome = ctx.managed.restore(path)
            report.add(path, "changed", outcome)
            kubelet_restored |= path == opts.kubelet_config
        else:
            backup = state.files[path]["prior"].get("backup")
            ctx.managed.forget(path, keep_backup=True)
            report.add(path, "warning", f"changed since install: left as it is (backup: {backup})")
    if kubelet_restored:
        run_restart(opts.kubelet_restart_command, "kubelet", opts.timeout)
    env = state.get("env")
    if env and not env.get("existed"):
        dst = host.path(env["path"], follow_last=False)
        if os.path.lexists(dst):
            shutil.rmtree(dst)
            report.add("environment", "changed", f"{env['path']} removed")
    left = ctx.managed.remove_created_dirs()
    _remove_state(ctx, keep=bool(left))


def _refuse_if_pods(ctx: Context, main_parsed: dict[str, Any]) -> None:
    from .cri import CriClient, CriError

    sock = socket_path(ctx.host, ctx.opts.containerd_socket, main_parsed)
    if not os.path.exists(sock):
        return  # containerd is not running: no pod can be using the runtime
    try:
        with CriClient(sock) as client:
            pods = client.cedana_pods()
    except (CriError, Exception) as err:  # grpc errors: containerd down or not CRI
        ctx.report.add("pods", "warning", f"could not list pods at {sock}: {err}")
        return
    if pods:
        raise NodeError(
            f"{len(pods)} pod(s) still run with the cedana runtime ({', '.join(pods[:5])}): "
            "drain the node (or delete them) first, or pass --force"
        )


def _wait_cri(ctx: Context, main_parsed: dict[str, Any]) -> None:
    from .cri import CriClient, CriError

    sock = socket_path(ctx.host, ctx.opts.containerd_socket, main_parsed)
    deadline = time.monotonic() + ctx.opts.timeout
    try:
        with CriClient(sock) as client:
            while not (status := client.status()).answering:
                if time.monotonic() > deadline:
                    raise NodeError(f"containerd at {sock} did not come back: {status.detail}")
                time.sleep(0.2)
    except CriError as err:
        raise NodeError(f"CRI check at {sock}: {err}") from None
    ctx.report.add("containerd", "ok", "answers again after the restart")


def _remove_state(ctx: Context, *, keep: bool) -> None:
    state = ctx.state
    if keep or state.files:
        state.save()
        return
    backups = state.backup_dir()
    if os.path.isdir(backups) and not os.listdir(backups):
        os.rmdir(backups)
    if os.path.isdir(backups):
        state.save()  # backups of files changed since install are kept, and said where
        return
    with contextlib.suppress(FileNotFoundError):
        os.unlink(state.file)
    for d in dict.fromkeys([STATE_DIR, *state.get("state_dirs", [])]):
        with contextlib.suppress(OSError):
            os.rmdir(ctx.host.path(d, follow_last=False))
    ctx.report.add("state", "changed", f"{STATE_DIR} removed")
