"""``cedana node install`` / ``uninstall``: the steps, in an order that keeps a node
working if any of them fails.

Every check that can refuse (config syntax and version, a conflicting runtime,
CRIU, the node config) runs before anything is written. containerd is restarted
only when its config changed (or a previous run changed it and did not get to
restart), and the CRI is asked afterwards whether the ``cedana`` handler answers.
"""

from __future__ import annotations

import glob
import json
import os
import re
import shutil
import subprocess
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

from . import config_blocks, runtimes, settings
from . import containerd_config as cc
from . import criu as criu_mod
from . import payload as payload_mod
from . import registration as reg
from .hostfs import HostRoot, InstallState, Managed, copy_tree, observe
from .report import NodeError, Outcome, Report

Verify = Literal["none", "handler", "pod"]
CONTAINERD_BINARIES = ("/usr/local/bin/containerd", "/usr/bin/containerd", "/bin/containerd")


@dataclass(frozen=True)
class Options:
    host_root: str = "/"
    payload: str | None = None  # a built payload; None: build one from this interpreter
    prefix: str = "/opt/cedana"
    bin_dir: str = "/usr/local/bin"
    containerd_config: str = "/etc/containerd/config.toml"
    containerd_bin: str | None = None  # host path; None: the first of CONTAINERD_BINARIES
    containerd_socket: str | None = None  # installer's view; None: from the config
    restart_command: str = "systemctl restart containerd"
    shim_config: str = reg.DEFAULT_SHIM_CONFIG
    default_runtime: bool = True  # make `cedana` the CRI's default runtime
    runc_binary: str | None = None  # the `cedana` handler's BinaryName; None: runc
    shim_settings: tuple[tuple[str, str], ...] = ()
    shim_config_file: str | None = None
    criu_source: str | None = None
    require_criu: bool = True
    # A docker config.json to install as REGISTRY_AUTH_PATH (0600) for node config
    # registry_auth_file.
    registry_auth_source: str | None = None
    # A directory of checkpoint key files (the chart's keys Secret, mounted) to install
    # in KEYS_DIR (0600 each) for signing_key, trusted_keys, encryption_keys and
    # decryption_keys.
    keys_source: str | None = None
    allow_dropin: bool = True
    verify: Verify = "pod"
    probe_image: str | None = None
    timeout: float = 120.0
    kubelet_timeout: str | None = None
    kubelet_config: str = "/var/lib/kubelet/config.yaml"
    kubelet_restart_command: str = "systemctl restart kubelet"
    force: bool = False
    log: Callable[[str], None] = field(default=lambda _msg: None, compare=False)


@dataclass
class Context:
    opts: Options
    host: HostRoot
    state: InstallState
    managed: Managed
    report: Report


def make_context(opts: Options, action: str) -> Context:
    if not os.path.isdir(opts.host_root):
        raise NodeError(f"--host-root {opts.host_root} is not a directory")
    host = HostRoot(opts.host_root)
    try:
        state = InstallState(host)
    except OSError as err:
        raise NodeError(str(err)) from None
    return Context(opts, host, state, Managed(host, state), Report(action))


# -- reading the node ------------------------------------------------------------------


def containerd_version(
    host: HostRoot, binary: str | None
) -> tuple[tuple[int, int, int] | None, str]:
    candidates = [binary] if binary else list(CONTAINERD_BINARIES)
    for path in candidates:
        if not os.path.isfile(host.path(path)):
            continue
        try:
            proc = host.run([path, "--version"], timeout=30)
        except (OSError, subprocess.SubprocessError) as err:
            return None, f"{path} --version failed: {err}"
        version = cc.parse_containerd_version(proc.stdout.decode(errors="replace"))
        if version is not None:
            return version, f"{path} is containerd {'.'.join(map(str, version))}"
        return None, f"{path} --version printed no version"
    if binary:
        raise NodeError(f"--containerd-bin {binary}: no such file under {host}")
    return None, "no containerd binary found; going by the config's version"


def read_host_file(host: HostRoot, host_path: str) -> bytes | None:
    try:
        with open(host.path(host_path), "rb") as f:
            return f.read()
    except FileNotFoundError:
        return None
    except IsADirectoryError:
        raise NodeError(f"{host.display(host_path)} is a directory, not a config file") from None


def _expand(host: HostRoot, pattern: str) -> list[str]:
    directory, name = os.path.split(pattern)
    if any(c in directory for c in "*?["):
        root = host.path("/")
        found = glob.glob(os.path.join(root, pattern.lstrip("/")))
        return sorted("/" + os.path.relpath(p, root) for p in found)
    real = host.path(directory)
    if not os.path.isdir(real):
        return []
    return sorted(
        os.path.join(directory, n)
        for n in os.listdir(real)
        if cc.go_match(name, n) and os.path.isfile(os.path.join(real, n))
    )


def read_snapshot(
    ctx: Context, version: tuple[int, int, int] | None
) -> tuple[cc.Snapshot, dict[str, Any]]:
    host = ctx.host
    path = ctx.opts.containerd_config
    main = cc.ConfigFile(path, read_host_file(host, path), host.display(path))
    parsed = cc.parse(main)
    previous = ctx.state.get("registration") or {}
    own = previous.get("target") if previous.get("mode") == "dropin" else None
    imported = []
    for pattern in cc.import_patterns(main, parsed, version):
        for path in _expand(host, pattern):
            if path != own and path != main.path:
                imported.append(cc.ConfigFile(path, read_host_file(host, path), host.display(path)))
    for file in imported:
        cc.parse(file)  # an invalid imported file is reported by its own name
    return cc.Snapshot(main, tuple(imported), version), parsed


def _shell(command: str, timeout: float) -> subprocess.CompletedProcess[bytes]:
    return subprocess.run(
        ["/bin/sh", "-c", command], capture_output=True, timeout=timeout, check=False
    )


REGISTRY_AUTH_PATH = "/etc/cedana/registry-auth.json"


def _registry_auth(opts: Options) -> bytes | None:
    """The registry credentials to install (a docker config.json, e.g. the chart's
    kubernetes.io/dockerconfigjson Secret), checked before anything is written."""
    if opts.registry_auth_source is None:
        return None
    try:
        with open(opts.registry_auth_source, "rb") as f:
            data = f.read(1 << 20)
        parsed = json.loads(data)
    except (OSError, ValueError) as err:
        raise NodeError(
            f"--registry-auth-source {opts.registry_auth_source}: not a readable docker "
            f"config.json ({err})"
        ) from None
    if not isinstance(parsed, dict) or not isinstance(parsed.get("auths"), dict):
        raise NodeError(
            f'--registry-auth-source {opts.registry_auth_source}: no "auths" object (a '
            "docker config.json, as in a kubernetes.io/dockerconfigjson Secret's "
            ".dockerconfigjson key)"
        )
    return data


KEYS_DIR = "/etc/cedana/keys"
_KEY_NAME_RE = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")
_MAX_KEY_BYTES = 64 << 10


def _keys(opts: Options) -> dict[str, bytes]:
    """The key files to install (name -> content), read before anything is written.
    A Secret's mount holds each key as a link into its ``..data`` directory: names
    starting with a dot are the Secret's bookkeeping, not keys."""
    if opts.keys_source is None:
        return {}
    try:
        names = sorted(n for n in os.listdir(opts.keys_source) if not n.startswith("."))
    except OSError as err:
        raise NodeError(f"--keys-source {opts.keys_source}: {err.strerror}") from None
    found: dict[str, bytes] = {}
    for name in names:
        path = os.path.join(opts.keys_source, name)
        if not _KEY_NAME_RE.fullmatch(name):
            raise NodeError(f"--keys-source {opts.keys_source}: {name!r} is not a key file name")
        try:
            with open(path, "rb") as f:
                data = f.read(_MAX_KEY_BYTES + 1)
        except OSError as err:
            raise NodeError(f"--keys-source: {path}: {err.strerror}") from None
        if len(data) > _MAX_KEY_BYTES or b"-----BEGIN " not in data:
            raise NodeError(f"--keys-source: {path} is not a PEM key file")
        found[name] = data
    return found


def _node_config(ctx: Context) -> bytes | None:
    """The node config to write, or None to leave the host's as it is."""
    opts = ctx.opts
    if opts.shim_config_file:
        with open(opts.shim_config_file, "rb") as f:
            data = f.read()
        origin = opts.shim_config_file
    elif opts.shim_settings:
        data = settings.render_node_config(opts.shim_settings)
        origin = "--set " + " ".join(f"{k}={v}" for k, v in opts.shim_settings)
    elif (
        os.path.exists(ctx.host.path(opts.shim_config)) and opts.shim_config not in ctx.state.files
    ):
        return None  # the node's own config: not ours to replace
    else:
        # The shim reads this file: a missing one fails every opted-in container.
        data = settings.render_node_config(())
        origin = "default node config"
    settings.validate_node_config(data, origin)
    return data


# -- install ---------------------------------------------------------------------------


def install(opts: Options) -> Report:
    ctx = make_context(opts, "install")
    try:
        _install(ctx)
    except (NodeError, cc.ConfigError, payload_mod.PayloadError, settings.SettingsError) as err:
        ctx.report.fail(str(err))
    return ctx.report


def _install(ctx: Context) -> None:
    opts, host, report = ctx.opts, ctx.host, ctx.report
    # Preflight: nothing is written until all of these pass.
    version, detail = containerd_version(host, opts.containerd_bin)
    report.add("containerd", "ok", detail)
    snapshot, main_parsed = read_snapshot(ctx, version)
    wanted = cc.Wanted(
        opts.shim_config,
        f"{opts.bin_dir}/{reg.SHIM_BINARY}",
        opts.default_runtime,
        opts.runc_binary,
    )
    plan = cc.plan_registration(snapshot, wanted, allow_dropin=opts.allow_dropin)
    runtimes.check_runc_binary(host, opts.runc_binary)
    runtimes.check_default_takeover(plan, opts.runc_binary)
    node_config = _node_config(ctx)
    criu_check = criu_mod.check(host)
    if not criu_check.ok and opts.criu_source is None and opts.require_criu:
        raise NodeError(f"{criu_check.problem}. {criu_mod.HOW_TO_GET}")
    criu_detail = criu_check.describe()
    if criu_check.ok and opts.require_criu:
        criu_detail = criu_mod.probe_sockets(host, criu_check)
    registry_auth = _registry_auth(opts)
    keys = _keys(opts)
    if opts.criu_source is not None and not criu_check.ok:
        out = subprocess.run(
            [opts.criu_source, "--version"], capture_output=True, timeout=30, check=False
        )
        got = criu_mod.parse_version((out.stdout + out.stderr).decode(errors="replace"))
        if got is None or got[:2] < criu_mod.MINIMUM:
            raise NodeError(f"--criu-source {opts.criu_source} is not a CRIU >= 4.1 ({got})")
    kubelet_new = None
    if opts.kubelet_timeout:
        current = read_host_file(host, opts.kubelet_config)
        if current is None:
            raise NodeError(
                f"{host.display(opts.kubelet_config)} does not exist (--kubelet-config)"
            )
        kubelet_new = settings.set_kubelet_timeout(
            current.decode(), opts.kubelet_timeout, opts.kubelet_config
        ).encode()

    ctx.state.save()
    _install_env(ctx)
    for name in payload_mod.LAUNCHERS:
        link = f"{opts.bin_dir}/{name}"
        target = settings.relpath_link(f"{opts.prefix}/bin/{name}", link)
        changed = ctx.managed.put_symlink(link, target)
        report.add(f"launcher {name}", "changed" if changed else "unchanged", f"{link} -> {target}")
    if node_config is not None:
        changed = ctx.managed.put_file(opts.shim_config, node_config, 0o644)
        report.add("node config", "changed" if changed else "unchanged", opts.shim_config)
    else:
        report.add("node config", "unchanged", f"{opts.shim_config} (the node's own, kept)")
    if registry_auth is not None:
        changed = ctx.managed.put_file(REGISTRY_AUTH_PATH, registry_auth, 0o600)
        report.add(
            "registry credentials", "changed" if changed else "unchanged", REGISTRY_AUTH_PATH
        )
    for name, data in keys.items():
        path = f"{KEYS_DIR}/{name}"
        changed = ctx.managed.put_file(path, data, 0o600)
        report.add(f"key {name}", "changed" if changed else "unchanged", path)
    if criu_check.ok:
        report.add("criu", "ok", criu_detail)
    elif opts.criu_source is not None:
        with open(opts.criu_source, "rb") as f:
            changed = ctx.managed.put_file(criu_mod.INSTALL_PATH, f.read(), 0o755)
        report.add(
            "criu",
            "changed" if changed else "unchanged",
            f"{opts.criu_source} -> {criu_mod.INSTALL_PATH}",
        )
    else:
        report.add("criu", "warning", f"{criu_check.problem} (--skip-criu-check)")

    registration_changed = _apply_registration(ctx, plan)
    restart_needed = registration_changed or bool(ctx.state.get("restart_pending"))
    if restart_needed:
        restart_containerd(ctx)
    if opts.verify != "none":
        _verify(ctx, main_parsed, restarted=restart_needed)
    if kubelet_new is not None:
        if ctx.managed.put_file(opts.kubelet_config, kubelet_new):
            report.add("kubelet", "changed", f"runtimeRequestTimeout: {opts.kubelet_timeout}")
            run_restart(opts.kubelet_restart_command, "kubelet", opts.timeout)
        else:
            report.add("kubelet", "unchanged", f"runtimeRequestTimeout: {opts.kubelet_timeout}")


def _install_env(ctx: Context) -> None:
    opts, host, report = ctx.opts, ctx.host, ctx.report
    dst = host.path(opts.prefix, follow_last=False)
    current = payload_mod.Manifest.load(dst)
    if os.path.lexists(dst) and current is None and not ctx.state.get("env"):
        raise NodeError(
            f"{host.display(opts.prefix)} exists and is not a cedana payload: move it away "
            "(or pass --prefix) and run the install again"
        )
    if opts.payload and os.path.realpath(opts.payload) == os.path.realpath(dst):
        if current is None:
            raise NodeError(f"--payload {opts.payload} has no {payload_mod.MANIFEST}")
        manifest = current
        staging = None
    else:
        staging = f"{dst}.cedana-new"
        shutil.rmtree(staging, ignore_errors=True)
        ctx.managed.ensure_dir(os.path.dirname(opts.prefix))
        if opts.payload:
            given = payload_mod.Manifest.load(opts.payload)
            if given is None:
                raise NodeError(
                    f"--payload {opts.payload} has no {payload_mod.MANIFEST}: build one with "
                    "`cedana node bundle DIR`"
                )
            manifest = given
            if current is None or current.digest != manifest.digest:
                copy_tree(opts.payload, staging)
        elif current is not None and current.source and current.source == payload_mod.source_id():
            manifest = current  # built from this very environment: nothing to rebuild
        else:
            opts.log("building the payload from this Python")
            manifest = payload_mod.build(staging)
    if ctx.state.get("env") is None:
        ctx.state.set("env", {"path": opts.prefix, "existed": current is not None})
        ctx.state.save()
    if staging is not None and (current is None or current.digest != manifest.digest):
        # Proven on the host before it replaces anything containerd may run.
        _check_env_runs(ctx, manifest, f"{opts.prefix}.cedana-new")
        old = f"{dst}.cedana-old"
        shutil.rmtree(old, ignore_errors=True)
        if os.path.lexists(dst):
            os.rename(dst, old)
        os.rename(staging, dst)
        shutil.rmtree(old, ignore_errors=True)
        outcome: Outcome = "changed"
    else:
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)
        outcome = "unchanged"
        _check_env_runs(ctx, manifest, opts.prefix)
    notes = f"; {'; '.join(manifest.notes)}" if manifest.notes else ""
    report.add(
        "environment",
        outcome,
        f"{opts.prefix}: cedana-shim {manifest.version}, Python {manifest.python}{notes}",
    )


def _check_env_runs(ctx: Context, manifest: payload_mod.Manifest, prefix: str) -> None:
    pyver = ".".join(manifest.python.split(".")[:2])
    interpreter = f"{prefix}/bin/python{pyver}"
    code = "import cedana_shim.cli.shim_main, google.protobuf, zstandard"
    proc = ctx.host.run([interpreter, "-I", "-c", code], timeout=120)
    if proc.returncode != 0:
        raise NodeError(
            f"{ctx.host.display(interpreter)} cannot run cedana-shim on this host (exit "
            f"{proc.returncode}): {proc.stderr.decode(errors='replace').strip()[-1500:]}; "
            "the payload's Python must suit the host's C library"
        )


def _apply_registration(ctx: Context, plan: cc.Plan) -> bool:
    previous = ctx.state.get("registration") or {}
    changed = False
    if previous and previous.get("target") != plan.target:
        changed |= undo_registration(ctx, previous)
    if plan.content is not None:
        if plan.mode == "dropin":
            ctx.managed.ensure_dir(os.path.dirname(plan.target))
        changed |= ctx.managed.put_file(plan.target, plan.content)
    ctx.state.set(
        "registration",
        {
            "mode": plan.mode,
            "target": plan.target,
            "config_version": plan.config_version,
            "default_runtime": reg.HANDLER if plan.default_runtime else plan.previous_default,
            "previous_default": plan.previous_default,
            "runc_binary": ctx.opts.runc_binary or "",
            "nvidia_binary": plan.nvidia_binary,
            "systemd_cgroup": plan.systemd_cgroup and not plan.systemd_cgroup_lost,
            "runtime_path": plan.shim_path,
        },
    )
    if changed:
        ctx.state.set("restart_pending", True)
    ctx.state.save()
    why = "; ".join(plan.reasons)
    ctx.report.add(
        f"registration ({plan.mode})",
        "changed" if changed else "unchanged",
        f"{plan.target} (config version {plan.config_version}){': ' + why if why else ''}",
    )
    runtimes.report(ctx.report, plan, ctx.opts.runc_binary, changed=changed)
    return changed


def undo_registration(ctx: Context, record: dict[str, Any]) -> bool:
    """Take back the registration a previous install made; True if a file changed."""
    target = record.get("target")
    if record.get("mode") == "present" or not target or target not in ctx.state.files:
        return False
    if ctx.managed.unchanged_since_install(target):
        ctx.managed.restore(target)
        ctx.report.add("registration", "changed", f"{target}: restored as it was before install")
        return True
    real = ctx.host.path(target, follow_last=False)
    now = observe(real)
    if record.get("mode") in ("edit", "create") and now.kind == "file":
        stripped = config_blocks.restore_edited(now.data)
        backup = ctx.state.files[target]["prior"].get("backup")
        if stripped != now.data:
            ctx.managed.forget(target, keep_backup=True)
            with open(real, "wb") as f:
                f.write(stripped)
            ctx.report.add(
                "registration",
                "warning",
                f"{target} changed since install: removed only the cedana block "
                f"(the file as it was before install: {backup})",
            )
            return True
    ctx.managed.forget(target, keep_backup=True)
    ctx.report.add("registration", "warning", f"{target} changed since install: left as it is")
    return False


def run_restart(command: str, what: str, timeout: float) -> None:
    try:
        proc = _shell(command, timeout)
    except subprocess.TimeoutExpired:
        raise NodeError(f"restarting {what}: `{command}` took over {timeout:.0f}s") from None
    if proc.returncode != 0:
        raise NodeError(
            f"restarting {what}: `{command}` exited {proc.returncode}: "
            f"{(proc.stderr or proc.stdout).decode(errors='replace').strip()[-1500:]} "
            "(the config change is in place; fix the command and run install again)"
        )


def restart_containerd(ctx: Context) -> None:
    ctx.state.set("restart_pending", True)
    ctx.state.save()
    run_restart(ctx.opts.restart_command, "containerd", ctx.opts.timeout)
    ctx.report.restarted = True
    ctx.report.add("containerd restart", "changed", f"`{ctx.opts.restart_command}`")
    if ctx.opts.verify == "none":
        ctx.state.set("restart_pending", False)
        ctx.state.save()


def socket_path(host: HostRoot, explicit: str | None, main_parsed: dict[str, Any]) -> str:
    return explicit or host.path(settings.default_containerd_socket(main_parsed))


def _verify(ctx: Context, main_parsed: dict[str, Any], *, restarted: bool) -> None:
    from .cri import CriClient, CriError

    opts = ctx.opts
    sock = socket_path(ctx.host, opts.containerd_socket, main_parsed)
    try:
        with CriClient(sock) as client:
            status = client.wait_registered(opts.timeout if restarted else 5)
            if not status.registered and not restarted:
                # The config on disk has the handler but containerd runs an older one.
                restart_containerd(ctx)
                status = client.wait_registered(opts.timeout)
            if not status.registered:
                raise NodeError(
                    f"containerd at {sock}: {status.detail}; its log says why "
                    "(e.g. `journalctl -u containerd`)"
                )
            ctx.state.set("restart_pending", False)
            ctx.state.save()
            ctx.report.add("handler", "ok", status.detail)
            if opts.verify == "pod":
                image = (
                    opts.probe_image or status.sandbox_image or settings.sandbox_image(main_parsed)
                )
                ctx.report.add("probe pod", "ok", client.probe_pod(image))
    except CriError as err:
        raise NodeError(f"CRI check at {sock}: {err}") from None


def settings_from(pairs: Sequence[str]) -> tuple[tuple[str, str], ...]:
    return tuple(settings.parse_setting(p) for p in pairs)
