"""``cedana slurm install|uninstall|status``: Slurm's side of a node.

worker: builds the SPANK plugin from the packaged C source against the node's
``<slurm/spank.h>``, installs it under ``PREFIX/slurm/`` and adds one ``optional``
line to plugstack.conf (a drop-in file when plugstack.conf includes a directory).
slurmstepd reads plugstack.conf afresh for every step it launches, so the next job
sees the plugin: no restart, no ``scontrol reconfigure``.
controller: SPANK plugins run on compute nodes and in srun/sbatch, never in
slurmctld; nothing is needed, except on a configless cluster
(``SlurmctldParameters=enable_configless``), where slurmd takes plugstack.conf from
the controller: there the line goes into the controller's plugstack.conf and
``scontrol reconfigure`` hands it out.
login: nothing; the plugin only acts in slurmstepd, and an ``optional`` line whose
file is absent is skipped silently by sbatch/srun.

A node may have several roles (a one-node cluster is controller and worker): each
``--node-role`` adds one, given together or in installs one after the other, in any
order; the node gets what each of its roles needs. ``uninstall`` removes them all.

Every file touched is recorded (with a byte-exact backup, mode and owner) in
``PREFIX/slurm/state/install.json`` (root only) by the node installer's ``Managed``
files, so ``uninstall`` gives each back exactly and removes our own files.
"""

from __future__ import annotations

import contextlib
import importlib.resources
import json
import os
import shutil
import stat
import subprocess
import sys
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from cedana_shim import errors
from cedana_shim.node.hostfs import HostRoot, InstallState, Managed, atomic_write

from . import slurm_conf as sc

ROLES = ("controller", "worker", "login")
DEFAULT_PREFIX = "/usr/local/lib/cedana"
RUNNER_NAME = "cedana-slurm-task"
PLUGIN_NAME = "cedana_spank.so"


@dataclass(frozen=True)
class Options:
    roles: tuple[str, ...] = ("worker",)
    slurm_conf: str | None = None
    prefix: str = DEFAULT_PREFIX
    runner: str | None = None
    shim_config: str | None = None
    include_dir: str = "/usr/include"
    cc: str = "gcc"
    scontrol: str = "scontrol"
    environ: Mapping[str, str] = field(default_factory=lambda: dict(os.environ))

    @property
    def plugin(self) -> str:
        return os.path.join(self.prefix, "slurm", PLUGIN_NAME)

    @property
    def state_file(self) -> str:
        return os.path.join(self.prefix, "slurm", "state", "install.json")


class _State(InstallState):
    """The node installer's install state, kept in the Slurm install's own file."""

    def __init__(self, path: str) -> None:
        self.host = HostRoot("/")
        self.file = path
        self.data = {"version": 1, "files": {}, "dirs": []}
        if os.path.exists(path):
            try:
                with open(path) as f:
                    self.data = json.load(f)
            except (OSError, ValueError) as err:
                raise errors.DataLoss(
                    f"{path}: install state unreadable ({err}); move it away to start over"
                ) from err

    def save(self) -> None:
        os.makedirs(os.path.dirname(self.file), mode=0o700, exist_ok=True)
        atomic_write(self.file, json.dumps(self.data, indent=2, sort_keys=True).encode(), 0o600)


@dataclass
class Report:
    action: str
    roles: list[str]
    slurm_conf: str
    plugstack: str
    changed: list[str] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    def to_json(self) -> dict[str, Any]:
        return {**vars(self), "role": role_name(self.roles)}

    def render(self) -> str:
        lines = [f"slurm.conf: {self.slurm_conf}", f"plugstack.conf: {self.plugstack}"]
        lines += [f"changed: {path}" for path in self.changed] or ["nothing to change"]
        lines += [f"note: {note}" for note in self.notes]
        return "\n".join(lines)


def _require_root() -> None:
    if os.geteuid() != 0:
        raise errors.PermissionDenied("this changes Slurm's configuration: run it as root")


def _slurm(opts: Options) -> tuple[str, dict[str, str], str]:
    conf = sc.locate_slurm_conf(opts.slurm_conf, opts.environ, opts.scontrol)
    settings = sc.parse_slurm_conf(conf)
    return conf, settings, sc.plugstack_path(conf, settings)


def role_name(roles: list[str]) -> str | None:
    """``controller+worker``: the roles as one word (None: not installed)."""
    return "+".join(roles) or None


def _roles(state: _State) -> list[str]:
    """The roles installed (an install record of one role says ``role``)."""
    roles = state.get("roles")
    if roles is None:
        roles = [state.get("role")] if state.get("role") else []
    return [r for r in ROLES if r in roles]


def install(opts: Options) -> Report:
    for role in opts.roles:
        if role not in ROLES:
            raise errors.InvalidArgument(f"--node-role {role}: one of {', '.join(ROLES)}")
    _require_root()
    conf, settings, plugstack = _slurm(opts)
    state = _State(opts.state_file)
    roles = [r for r in ROLES if r in opts.roles or r in _roles(state)]
    report = Report("install", roles, conf, plugstack)
    managed = Managed(state.host, state)
    configless = sc.is_configless(settings)
    wants_line = "worker" in roles or ("controller" in roles and configless)
    runner = resolve_runner(opts.runner, opts.environ) if wants_line else None
    plugin = build_plugin(opts.include_dir, opts.cc) if "worker" in roles else None
    managed.ensure_dir(os.path.dirname(opts.plugin))
    state.data.pop("role", None)
    state.set("roles", roles)
    state.set("slurm_conf", conf)
    state.set("plugstack", plugstack)
    state.save()
    if plugin is not None and managed.put_file(opts.plugin, plugin, 0o755):
        report.changed.append(opts.plugin)
    if runner is not None:
        line = sc.spank_line(opts.plugin, runner, opts.shim_config)
        target, changed = _put_line(managed, plugstack, line, state.get("line"))
        state.set("line", line)
        state.set("line_file", target)
        state.save()
        if changed:
            report.changed.append(target)
    if "controller" in roles and configless and report.changed:
        _reconfigure(opts, report)
    elif runner is None:
        report.notes.append(
            f"a {role_name(roles)} needs no Slurm change: the plugin runs only in slurmstepd "
            "on workers"
        )
    return report


def _put_line(
    managed: Managed, plugstack: str, line: str, old_line: str | None
) -> tuple[str, bool]:
    """Put our line in place; returns the file that holds it and whether it changed."""
    current = _read(plugstack)
    plan = sc.plan_plugstack(plugstack, current)
    if plan.kind == "dropin":
        return plan.path, managed.put_file(plan.path, f"{line}\n".encode(), 0o644)
    text = current or ""
    if old_line and old_line != line:
        text = sc.without_line(text, old_line)
    if line not in text.splitlines():
        text = sc.with_line(text, line)
    return plugstack, managed.put_file(plugstack, text.encode())


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="utf-8", errors="surrogateescape") as f:
            return f.read()
    except FileNotFoundError:
        return None


def _reconfigure(opts: Options, report: Report) -> None:
    env = {**opts.environ, "SLURM_CONF": report.slurm_conf}
    done = subprocess.run(
        [opts.scontrol, "reconfigure"], capture_output=True, text=True, env=env, check=False
    )
    if done.returncode == 0:
        report.notes.append("scontrol reconfigure: the configless nodes get the new plugstack.conf")
    else:
        report.notes.append(
            "scontrol reconfigure failed "
            f"({done.stderr.strip() or done.returncode}): run it once slurmctld is up"
        )


def resolve_runner(explicit: str | None, environ: Mapping[str, str]) -> str:
    """The runner the plugin will exec as root: a root-owned executable nobody else
    may write (the plugin checks the same before every exec)."""
    if explicit:
        runner = os.path.abspath(explicit)
    else:
        search = os.pathsep.join([os.path.dirname(sys.executable), environ.get("PATH", "")])
        found = shutil.which(RUNNER_NAME, path=search)
        if found is None:
            raise errors.FailedPrecondition(
                f"the job runner {RUNNER_NAME} is not installed beside this cedana or on "
                "PATH: install cedana-shim on this node, or pass --runner PATH"
            )
        runner = os.path.abspath(found)
    try:
        st = os.stat(runner)
    except FileNotFoundError:
        raise errors.NotFound(f"--runner {runner}: no such file") from None
    if (
        not stat.S_ISREG(st.st_mode)
        or st.st_uid != 0
        or st.st_mode & (stat.S_IWGRP | stat.S_IWOTH)
        or not st.st_mode & stat.S_IXUSR
    ):
        raise errors.FailedPrecondition(
            f"runner {runner} must be a root-owned executable that only root may write "
            "(it runs as root for every opted-in job)"
        )
    return runner


def build_plugin(include_dir: str, cc: str) -> bytes:
    """Compile the packaged plugin source against this node's Slurm headers."""
    header = os.path.join(include_dir, "slurm", "spank.h")
    if not os.path.isfile(header):
        raise errors.FailedPrecondition(
            f"{header} is missing: install Slurm's development headers (Debian/Ubuntu: "
            "apt-get install libslurm-dev; RHEL: slurm-devel) to build the SPANK plugin"
        )
    compiler = shutil.which(cc)
    if compiler is None:
        raise errors.FailedPrecondition(
            f"C compiler {cc} not found: install gcc to build the SPANK plugin"
        )
    source = importlib.resources.files(__package__).joinpath("spank", "cedana_spank.c")
    with tempfile.TemporaryDirectory(prefix="cedana-spank-") as tmp:
        src = os.path.join(tmp, "cedana_spank.c")
        out = os.path.join(tmp, PLUGIN_NAME)
        with open(src, "wb") as f:
            f.write(source.read_bytes())
        argv = [compiler, "-shared", "-fPIC", "-O2", "-Wall", f"-I{include_dir}", "-o", out, src]
        done = subprocess.run(argv, capture_output=True, text=True, check=False)
        if done.returncode != 0:
            raise errors.FailedPrecondition(
                f"building the SPANK plugin against {include_dir}/slurm failed:\n"
                f"{done.stderr.strip()}"
            )
        with open(out, "rb") as f:
            return f.read()


def uninstall(opts: Options) -> Report:
    _require_root()
    state = _State(opts.state_file)
    conf = state.get("slurm_conf") or ""
    report = Report("uninstall", _roles(state), conf, state.get("plugstack") or "")
    if not os.path.exists(opts.state_file):
        report.notes.append(f"nothing installed under {opts.prefix}")
        return report
    managed = Managed(state.host, state)
    line = state.get("line")
    for path in list(state.files):
        if managed.unchanged_since_install(path):
            managed.restore(path)
        else:
            # Someone edited it since: take out only our line, keep their change.
            text = _read(path)
            if text is not None and line:
                mode = stat.S_IMODE(os.stat(path).st_mode)
                atomic_write(path, sc.without_line(text, line).encode(), mode)
            managed.forget(path)
            report.notes.append(f"{path} changed since install: removed only our line")
        report.changed.append(path)
    _remove_state(opts.state_file)
    managed.remove_created_dirs()
    return report


def _remove_state(state_file: str) -> None:
    state_dir = os.path.dirname(state_file)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(state_file)
    with contextlib.suppress(FileNotFoundError):
        shutil.rmtree(os.path.join(state_dir, "backups"))
    with contextlib.suppress(FileNotFoundError, OSError):
        os.rmdir(state_dir)


def status(opts: Options) -> dict[str, Any]:
    state = _State(opts.state_file) if os.access(opts.state_file, os.R_OK) else None
    conf, _, plugstack = _slurm(opts)
    roles = _roles(state) if state else []
    line_file = state.get("line_file") if state else None
    line = state.get("line") if state else None
    info: dict[str, Any] = {
        "installed": state is not None,
        "role": role_name(roles),
        "roles": roles,
        "slurm_conf": conf,
        "plugstack": plugstack,
        "line": line,
        "line_present": bool(line) and line in (_read(line_file or plugstack) or "").splitlines(),
        "plugin": opts.plugin if os.path.isfile(opts.plugin) else None,
        "problems": [],
    }
    if "worker" in roles:
        if info["plugin"] is None:
            info["problems"].append(f"{opts.plugin} is missing: run install again")
        if not info["line_present"]:
            info["problems"].append("the plugstack.conf line is missing: run install again")
        runner = line.split("runner=", 1)[1] if line and "runner=" in line else ""
        if runner and not os.access(runner, os.X_OK):
            info["problems"].append(f"runner {runner} is missing: reinstall cedana-shim")
    info["ok"] = state is not None and not info["problems"]
    return info


def render_status(info: Mapping[str, Any]) -> str:
    if not info["installed"]:
        return f"not installed (slurm.conf {info['slurm_conf']})"
    lines = [
        f"role: {info['role']}",
        f"slurm.conf: {info['slurm_conf']}",
        f"plugstack.conf: {info['plugstack']}",
        f"plugin: {info['plugin'] or '-'}",
        f"line: {info['line'] or '-'} ({'present' if info['line_present'] else 'absent'})",
    ]
    lines += [f"problem: {p}" for p in info["problems"]]
    return "\n".join(lines)
