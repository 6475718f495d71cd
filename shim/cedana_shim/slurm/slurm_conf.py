"""Slurm's configuration as Slurm's own programs find and read it.

``locate_slurm_conf`` follows Slurm's order: ``--slurm-conf``, else ``SLURM_CONF``,
else the path the installed Slurm was built with (``scontrol show config`` prints it
as ``SLURM_CONF``; without a reachable controller the usual build defaults).
``parse_slurm_conf`` reads the simple ``Key=Value`` settings (keys are
case-insensitive, ``#`` starts a comment, ``Include`` pulls in another file);
``plugstack_path`` is ``PlugStackConfig`` or ``plugstack.conf`` beside slurm.conf.
``plan_plugstack`` decides where our one SPANK line goes: into a file of our own
when plugstack.conf already includes a directory (Debian ships
``include /etc/slurm/plugstack.conf.d/*.conf``), otherwise appended to
plugstack.conf itself: whatever changes Slurm's own files least.
"""

from __future__ import annotations

import fnmatch
import glob
import os
import shlex
import subprocess
from collections.abc import Mapping
from dataclasses import dataclass

from cedana_shim import errors

# Where a Slurm build looks when SLURM_CONF is unset and no controller answers:
# Debian/Ubuntu and most packages, Debian before bookworm, a plain source build.
BUILD_DEFAULTS = (
    "/etc/slurm/slurm.conf",
    "/etc/slurm-llnl/slurm.conf",
    "/usr/local/etc/slurm.conf",
)
DROPIN_NAME = "cedana.conf"
# Lines whose settings describe one node/partition record, not the cluster.
_RECORD_KEYS = frozenset(
    {"nodename", "partitionname", "nodeset", "downnodes", "frontendname", "switchname"}
)
_MAX_INCLUDE_DEPTH = 8


def locate_slurm_conf(
    explicit: str | None, environ: Mapping[str, str], scontrol: str = "scontrol"
) -> str:
    """The slurm.conf Slurm's commands on this node read; FailedPrecondition if none."""
    if explicit:
        if not os.path.isfile(explicit):
            raise errors.NotFound(f"--slurm-conf {explicit}: no such file")
        return os.path.abspath(explicit)
    from_env = environ.get("SLURM_CONF")
    if from_env:
        if not os.path.isfile(from_env):
            raise errors.NotFound(f"SLURM_CONF={from_env}: no such file")
        return os.path.abspath(from_env)
    reported = _scontrol_slurm_conf(scontrol)
    for candidate in ([reported] if reported else []) + list(BUILD_DEFAULTS):
        if os.path.isfile(candidate):
            return candidate
    raise errors.FailedPrecondition(
        "Slurm is not configured on this node: no slurm.conf in SLURM_CONF, from "
        f"`scontrol show config` or at {', '.join(BUILD_DEFAULTS)}; install Slurm first, "
        "or pass --slurm-conf PATH (a configless node: the controller's slurm.conf)"
    )


def _scontrol_slurm_conf(scontrol: str) -> str | None:
    try:
        done = subprocess.run(
            [scontrol, "show", "config"], capture_output=True, text=True, timeout=10, check=False
        )
    except (OSError, subprocess.SubprocessError):
        return None
    for line in done.stdout.splitlines():
        key, sep, value = line.partition("=")
        if sep and key.strip() == "SLURM_CONF" and value.strip().startswith("/"):
            return value.strip()
    return None


def parse_slurm_conf_text(text: str) -> tuple[dict[str, str], list[str]]:
    """Settings (lower-case key -> value, the last one wins as in Slurm) and the
    ``Include`` targets, in order, of one file's text."""
    settings: dict[str, str] = {}
    includes: list[str] = []
    for raw in text.splitlines():
        line = raw.split("#", 1)[0].strip()
        if not line:
            continue
        head, _, rest = line.partition(" ")
        if head.lower() == "include" and rest.strip():
            includes.append(rest.strip())
            continue
        try:
            tokens = shlex.split(line)
        except ValueError:
            continue  # an unbalanced quote: Slurm rejects the line too
        pairs = [t.partition("=") for t in tokens]
        if not pairs or not pairs[0][1] or pairs[0][0].lower() in _RECORD_KEYS:
            continue
        for key, sep, value in pairs:
            if sep and key:
                settings[key.lower()] = value
    return settings, includes


def parse_slurm_conf(path: str) -> dict[str, str]:
    """The settings of ``path`` with its ``Include`` files (relative to its directory)."""
    settings: dict[str, str] = {}
    _read_into(path, settings, 0)
    return settings


def _read_into(path: str, settings: dict[str, str], depth: int) -> None:
    with open(path, encoding="utf-8", errors="replace") as f:
        own, includes = parse_slurm_conf_text(f.read())
    settings.update(own)
    if depth >= _MAX_INCLUDE_DEPTH:
        return
    for target in includes:
        pattern = target if target.startswith("/") else os.path.join(os.path.dirname(path), target)
        for included in sorted(glob.glob(pattern)):
            if os.path.isfile(included):
                _read_into(included, settings, depth + 1)


def plugstack_path(slurm_conf: str, settings: Mapping[str, str]) -> str:
    configured = settings.get("plugstackconfig", "")
    if configured:
        if configured.startswith("/"):
            return configured
        return os.path.join(os.path.dirname(slurm_conf), configured)
    return os.path.join(os.path.dirname(slurm_conf), "plugstack.conf")


def is_configless(settings: Mapping[str, str]) -> bool:
    params = settings.get("slurmctldparameters", "").lower().split(",")
    return "enable_configless" in params


def spank_line(plugin: str, runner: str, shim_config: str | None = None) -> str:
    """Our one plugstack line: ``optional``, so a node without the plugin file (a
    login node sharing the config) runs jobs as before, silently. ``config=`` names
    the node config the runner reads (default: the runner's own default)."""
    line = f"optional {plugin} runner={runner}"
    return f"{line} config={shim_config}" if shim_config else line


@dataclass(frozen=True)
class PlugstackPlan:
    """Where our line goes: ``dropin`` (a file of our own that plugstack.conf
    already includes) or ``append`` (one line at the end of plugstack.conf)."""

    kind: str
    path: str


def plan_plugstack(plugstack: str, text: str | None) -> PlugstackPlan:
    """``text``: plugstack.conf's content, None when it does not exist."""
    base = os.path.dirname(plugstack)
    for pattern in include_patterns(text or ""):
        full = pattern if pattern.startswith("/") else os.path.join(base, pattern)
        directory = os.path.dirname(full)
        candidate = os.path.join(directory, DROPIN_NAME)
        if glob.has_magic(directory) or not os.path.isdir(directory):
            continue
        if fnmatch.fnmatchcase(candidate, full):
            return PlugstackPlan("dropin", candidate)
    return PlugstackPlan("append", plugstack)


def include_patterns(text: str) -> list[str]:
    """The ``include`` targets of a plugstack.conf, as SPANK parses its lines."""
    patterns = []
    for raw in text.splitlines():
        words = raw.split("#", 1)[0].split()
        if len(words) >= 2 and words[0] == "include":
            patterns.append(words[1])
    return patterns


def with_line(text: str, line: str) -> str:
    """``text`` with ``line`` appended as a line of its own (the text is kept as is)."""
    if not text or text.endswith("\n"):
        return f"{text}{line}\n"
    return f"{text}\n{line}\n"


def without_line(text: str, line: str) -> str:
    """``text`` without the lines equal to ``line`` (everything else byte for byte)."""
    return "".join(kept for kept in text.splitlines(keepends=True) if kept.rstrip("\n") != line)


def has_plugin_line(text: str, plugin: str) -> bool:
    for raw in text.splitlines():
        words = raw.split("#", 1)[0].split()
        if len(words) >= 2 and words[0] in ("optional", "required") and words[1] == plugin:
            return True
    return False
