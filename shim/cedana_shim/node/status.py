"""``cedana node status``: what is installed, and does the handler answer now."""

from __future__ import annotations

import os
from typing import Any

from . import config_blocks
from . import containerd_config as cc
from . import criu as criu_mod
from . import payload as payload_mod
from .hostfs import STATE_FILE, HostRoot, InstallState
from .installer import Options, containerd_version, socket_path
from .report import NodeError


def status(opts: Options, *, check_cri: bool = True) -> dict[str, Any]:
    """Facts about the node; ``ok`` is true when the environment, the launchers and
    the registration are in place and (with ``check_cri``) CRI lists the handler."""
    host = HostRoot(opts.host_root)
    try:
        state = InstallState(host)
    except OSError as err:
        raise NodeError(str(err)) from None
    out: dict[str, Any] = {"host_root": host.root, "installed": state.exists}
    problems: list[str] = []

    manifest = payload_mod.Manifest.load(host.path(opts.prefix))
    out["environment"] = {"path": opts.prefix, **(manifest.to_json() if manifest else {})}
    if manifest is None:
        problems.append(f"no cedana payload at {opts.prefix}")

    launchers = {}
    for name in payload_mod.LAUNCHERS:
        link = f"{opts.bin_dir}/{name}"
        real = host.path(link)
        launchers[name] = {"path": link, "ok": os.path.isfile(real) and os.access(real, os.X_OK)}
        if not launchers[name]["ok"]:
            problems.append(f"{link} missing or broken")
    out["launchers"] = launchers

    criu = criu_mod.check(host)
    out["criu"] = {
        "path": criu.path,
        "version": criu.version,
        "ok": criu.ok,
        "problem": criu.problem,
    }

    version, detail = containerd_version(host, opts.containerd_bin)
    out["containerd"] = {
        "version": ".".join(map(str, version)) if version else None,
        "detail": detail,
    }
    main = cc.ConfigFile(opts.containerd_config, _read(host.path(opts.containerd_config)))
    try:
        main_parsed = cc.parse(main)
    except cc.ConfigError as err:
        problems.append(str(err))
        main_parsed = {}
    registration = state.get("registration") or {}
    target = registration.get("target")
    present = isinstance(target, str) and os.path.exists(host.path(target))
    if isinstance(target, str) and registration.get("mode") in ("edit", "create"):
        data = _read(host.path(target)) or b""
        present = config_blocks.has_block(data.decode(errors="replace"))
    out["registration"] = {**registration, "present": present}
    if not present:
        problems.append("the cedana runtime is not registered in containerd's config")
    out["node_config"] = {
        "path": opts.shim_config,
        "exists": os.path.exists(host.path(opts.shim_config)),
    }
    out["restart_pending"] = bool(state.get("restart_pending"))

    if check_cri:
        from .cri import CriClient, CriError

        sock = socket_path(host, opts.containerd_socket, main_parsed)
        try:
            with CriClient(sock) as client:
                st = client.status()
            out["handler"] = {
                "socket": sock,
                "answering": st.answering,
                "registered": st.registered,
                "runtime_type": st.runtime_type,
                "runtime_path": st.runtime_path,
                "default_runtime": st.default_runtime,
                "detail": st.detail,
            }
            if not st.registered:
                problems.append(f"CRI at {sock}: {st.detail}")
        except CriError as err:
            out["handler"] = {
                "socket": sock,
                "answering": False,
                "registered": False,
                "detail": str(err),
            }
            problems.append(str(err))
    out["state_file"] = STATE_FILE
    out["problems"] = problems
    out["ok"] = state.exists and not problems
    return out


def _read(path: str) -> bytes | None:
    try:
        with open(path, "rb") as f:
            return f.read()
    except (FileNotFoundError, IsADirectoryError):
        return None


def render(info: dict[str, Any]) -> str:
    env = info["environment"]
    lines = [
        f"installed:     {'yes' if info['installed'] else 'no'} (host root {info['host_root']})",
        f"environment:   {env['path']}"
        + (
            f" cedana-shim {env['version']}, Python {env['python']}"
            if "version" in env
            else " (none)"
        ),
    ]
    for name, launcher in info["launchers"].items():
        lines.append(
            f"launcher:      {launcher['path']} {'ok' if launcher['ok'] else 'MISSING'} ({name})"
        )
    criu = info["criu"]
    lines.append(f"criu:          {criu['path'] or '-'} {'ok' if criu['ok'] else criu['problem']}")
    lines.append(f"containerd:    {info['containerd']['detail']}")
    reg = info["registration"]
    if reg.get("target"):
        lines.append(
            f"registration:  {reg.get('mode')} {reg['target']} (config version "
            f"{reg.get('config_version')}) {'present' if reg['present'] else 'MISSING'}"
        )
        if reg.get("default_runtime"):
            lines.append(
                f"default:       {reg['default_runtime']} runtime for pods without "
                f"runtimeClassName (before install: {reg.get('previous_default', 'runc')})"
            )
        if reg.get("runtime_path"):
            lines.append(
                f"shim:          {reg['runtime_path']} (runtime_path of the io.containerd.runc.v2 "
                "runtime cedana)"
            )
        runc = reg.get("runc_binary") or "runc"
        lines.append(f"runc binary:   {runc}")
        nvidia = reg.get("nvidia_binary")
        if nvidia is not None:
            gpu = "get" if nvidia == reg.get("runc_binary") else "do NOT get"
            lines.append(
                f"nvidia:        the node's nvidia runtime runs {nvidia or 'runc'}; GPU pods "
                f"with runtimeClassName cedana {gpu} its device injection"
            )
    else:
        lines.append("registration:  none")
    nc = info["node_config"]
    lines.append(f"node config:   {nc['path']} {'exists' if nc['exists'] else 'missing'}")
    if "handler" in info:
        h = info["handler"]
        lines.append(
            f"handler:       {'answers' if h['registered'] else 'NOT answering'}: {h['detail']}"
        )
        if h.get("default_runtime"):
            lines.append(f"CRI default:   {h['default_runtime']} (what containerd runs now)")
    for problem in info["problems"]:
        lines.append(f"problem:       {problem}")
    lines.append("status: ok" if info["ok"] else "status: NOT ok")
    return "\n".join(lines)
