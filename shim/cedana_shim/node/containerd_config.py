"""Where and how to register the ``cedana`` runtime in a node's containerd config.

Pure: the caller reads the files (``Snapshot``) and writes what the returned ``Plan``
says. The rules come from how containerd really loads its config (verified against
1.6.20, 1.7.24 and 2.1.9 by the integration tests):

- config ``version = 2`` (containerd 1.6/1.7, also read by 2.x) keeps the CRI runtimes
  under ``plugins."io.containerd.grpc.v1.cri"``; ``version = 3`` (2.x only) under
  ``plugins.'io.containerd.cri.v1.runtime'``. A file without ``version`` is the
  removed version 1 and is refused with a pointer to the fix.
- ``imports`` globs are loaded after the main file, each glob sorted by name, and
  relative ones are relative to the main file's directory.
- containerd 2.x merges imported tables key by key, so a drop-in is always safe.
  containerd 1.x REPLACES a whole plugin table with the imported one: a drop-in that
  only adds a runtime erases the node's other CRI settings (sandbox image, runc
  options...) whenever some earlier file configures the CRI plugin. There the
  runtime tables go into the last file that configures the CRI plugin instead, as a
  marked block appended to it (removable without touching anything else).
"""

from __future__ import annotations

import fnmatch
import posixpath
import re
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Final, Literal

from . import registration as reg

BLOCK_BEGIN: Final = (
    "# >>> cedana-shim: added by `cedana node install`; `cedana node uninstall` removes it"
)
BLOCK_END: Final = "# <<< cedana-shim"
_BLOCK_RE = re.compile(
    r"\n?" + re.escape(BLOCK_BEGIN) + r"\n.*?^" + re.escape(BLOCK_END) + r"\n?",
    re.DOTALL | re.MULTILINE,
)
DROPIN_NAMES: Final = ("99-cedana.toml", "cedana.toml", "99-cedana.conf", "cedana.conf", "cedana")
_VERSION_RE = re.compile(r"\bv?(\d+)\.(\d+)\.(\d+)")


class ConfigError(Exception):
    """A config file that cannot be used as it is; the message names the file and
    what to do. Nothing has been changed when this is raised."""


@dataclass(frozen=True)
class ConfigFile:
    path: str  # as containerd sees it (a host path)
    data: bytes | None  # None: the file does not exist
    shown: str = ""  # the name errors use (the installer's view of the path)

    @property
    def name(self) -> str:
        return self.shown or self.path


@dataclass(frozen=True)
class Snapshot:
    """The config files containerd would load, read by the caller."""

    main: ConfigFile
    # Every file the imports globs match now, in containerd's load order, minus the
    # drop-in a previous install wrote (that one is ours to rewrite).
    imported: tuple[ConfigFile, ...] = ()
    containerd_version: tuple[int, int, int] | None = None


Mode = Literal["dropin", "edit", "create", "present"]


@dataclass(frozen=True)
class Plan:
    mode: Mode
    config_version: int
    target: str  # the file written (or, for "present", the file that already registers it)
    content: bytes | None  # the target's new content; None for "present"
    reasons: tuple[str, ...] = field(default=())


def parse_containerd_version(text: str) -> tuple[int, int, int] | None:
    """``containerd github.com/containerd/containerd/v2 2.1.9+unknown`` -> (2, 1, 9)."""
    for word in text.split()[2:] or text.split():
        m = _VERSION_RE.match(word)
        if m:
            return int(m[1]), int(m[2]), int(m[3])
    return None


def parse(file: ConfigFile) -> dict[str, Any]:
    if file.data is None:
        return {}
    try:
        return tomllib.loads(file.data.decode())
    except UnicodeDecodeError as err:
        raise ConfigError(f"{file.name} is not UTF-8 text ({err}): fix the file") from None
    except tomllib.TOMLDecodeError as err:
        raise ConfigError(
            f"{file.name} is not valid TOML ({err}); containerd cannot read it either: "
            "fix it and run the install again (nothing was changed)"
        ) from None


def strip_block(text: str) -> str:
    """``text`` without the block a previous install appended."""
    return _BLOCK_RE.sub("", text, count=1)


def has_block(text: str) -> bool:
    return _BLOCK_RE.search(text) is not None


def append_block(text: str, version: int, shim_config: str, *, default_runc: bool = False) -> str:
    base = strip_block(text)
    if base and not base.endswith("\n"):
        base += "\n"
    tables = reg.render_tables(version, shim_config, default_runc=default_runc)
    return f"{base}\n{BLOCK_BEGIN}\n{tables}{BLOCK_END}\n"


def import_patterns(
    main: ConfigFile, parsed: Mapping[str, Any], ctrd: tuple[int, ...] | None = None
) -> list[str]:
    """The ``imports`` as absolute host paths. A relative path is relative to the main
    config's directory, except a relative glob in containerd 1.x, which Go's
    ``filepath.Glob`` resolves against containerd's working directory: ``/`` under
    systemd."""
    raw = parsed.get("imports", [])
    if not isinstance(raw, list) or not all(isinstance(p, str) for p in raw):
        raise ConfigError(f"{main.name}: `imports` must be a list of strings")
    base = posixpath.dirname(main.path)
    old_glob = ctrd is None or ctrd[0] < 2
    out = []
    for p in raw:
        if not posixpath.isabs(p):
            p = posixpath.join("/" if old_glob and _magic(p) else base, p)
        out.append(posixpath.normpath(p))
    return out


def go_match(pattern: str, name: str) -> bool:
    """Go's ``filepath.Match`` for one path element (``[^...]`` negates, ``*`` also
    matches a leading dot)."""
    return fnmatch.fnmatchcase(name, pattern.replace("[^", "[!"))


def _magic(text: str) -> bool:
    return any(c in text for c in "*?[")


def dropin_target(patterns: Sequence[str]) -> str | None:
    """A file name that one of the imports globs covers, in a plain directory."""
    for pattern in patterns:
        directory, name = posixpath.split(pattern)
        if _magic(directory) or not _magic(name):
            continue  # a literal import names someone's file; not ours to create
        for candidate in DROPIN_NAMES:
            if go_match(name, candidate):
                return posixpath.join(directory, candidate)
    return None


def _get(tree: Mapping[str, Any], path: Sequence[str]) -> Any:
    node: Any = tree
    for key in path:
        if not isinstance(node, Mapping) or key not in node:
            return None
        node = node[key]
    return node


def config_version(
    main: ConfigFile, parsed: Mapping[str, Any], ctrd: tuple[int, ...] | None
) -> int:
    if main.data is None:
        # No config: containerd runs on its defaults, whatever the schema; write the
        # newest one this containerd reads.
        return 3 if ctrd is not None and ctrd[0] >= 2 else 2
    version = parsed.get("version")
    if version is None:
        raise ConfigError(
            f"{main.name} has no `version`: containerd reads it as the removed version 1 "
            "schema. Regenerate it with `containerd config default` (or migrate it with "
            "`containerd config migrate` on 2.x), then run the install again"
        )
    if version not in (2, 3):
        raise ConfigError(
            f"{main.name}: config version {version!r} is not supported (2 for containerd "
            "1.6/1.7, 3 for 2.x): migrate it, then run the install again"
        )
    if version == 3 and ctrd is not None and ctrd[0] < 2:
        raise ConfigError(
            f"{main.name} is config version 3 but containerd is "
            f"{'.'.join(map(str, ctrd))}, which reads at most version 2: fix the config"
        )
    return int(version)


def plan_registration(
    snap: Snapshot, shim_config: str = reg.DEFAULT_SHIM_CONFIG, *, allow_dropin: bool = True
) -> Plan:
    """Decide where the runtime tables go. Raises ConfigError for a config that cannot
    be used (invalid TOML, wrong version, a conflicting hand-made ``cedana`` runtime)."""
    main_text = snap.main.data.decode() if snap.main.data is not None else None
    main_parsed = parse(snap.main)
    version = config_version(snap.main, main_parsed, snap.containerd_version)
    wanted = reg.runtime_table(version, shim_config)
    rt_path = (*reg.runtimes_path(version), reg.HANDLER)

    deep_merge = (
        snap.containerd_version[0] >= 2 if snap.containerd_version is not None else version >= 3
    )
    if main_text is None:
        content = f"version = {version}\n\n{BLOCK_BEGIN}\n"
        content += reg.render_tables(version, shim_config, default_runc=not deep_merge)
        content += f"{BLOCK_END}\n"
        return Plan(
            "create",
            version,
            snap.main.path,
            content.encode(),
            (f"{snap.main.path} does not exist: containerd runs on defaults; creating it",),
        )

    # Our own block is ours to rewrite: judge the files as they were before it.
    files: list[tuple[ConfigFile, dict[str, Any], str]] = []
    for file in (snap.main, *snap.imported):
        text = file.data.decode(errors="replace") if file.data is not None else ""
        own = has_block(text)
        parsed = main_parsed if file is snap.main and not own else None
        if parsed is None:
            parsed = parse(ConfigFile(file.path, strip_block(text).encode(), file.shown))
        files.append((file, parsed, text))

    for file, parsed, _ in files:
        existing = _get(parsed, rt_path)
        if existing is None:
            continue
        if _same_registration(existing, wanted):
            return Plan(
                "present",
                version,
                file.path,
                None,
                (f"{file.path} already registers the {reg.HANDLER!r} runtime; left as it is",),
            )
        raise ConfigError(
            f"{file.name} already defines a {reg.HANDLER!r} runtime that differs from "
            f"cedana's ({'.'.join(rt_path)}): remove that table (or make it match "
            f"runtimeclass/containerd-config-v{version}.toml) and run the install again"
        )

    patterns = import_patterns(snap.main, main_parsed, snap.containerd_version)
    dropin = dropin_target(patterns) if allow_dropin else None
    reasons: list[str] = []
    target = snap.main
    default_runc = False
    if not deep_merge:
        cri = [(f, p) for f, p, _ in files if _get(p, ("plugins", reg.CRI_PLUGIN[2])) is not None]
        effective = _get(cri[-1][1], ("plugins", reg.CRI_PLUGIN[2])) if cri else {}
        default_runc = _lacks_default_runtime(effective)
        if default_runc:
            reasons.append(
                "no file names containerd's default runc runtime: adding it beside cedana "
                "(containerd 1.x drops its built-in runtimes once a config defines any)"
            )
        cri_files = [f for f, _ in cri]
        if cri_files:
            target = cri_files[-1]
            if dropin is not None:
                reasons.append(
                    f"containerd 1.x replaces a whole plugin table from an imported file, and "
                    f"{target.path} configures {reg.CRI_PLUGIN[2]!r}: a drop-in would erase "
                    f"those settings, so the runtime is added to {target.path} instead"
                )
            dropin = None
    if dropin is not None:
        reasons.append(f"imports {patterns} cover {dropin}: writing a drop-in there")
        return Plan(
            "dropin",
            version,
            dropin,
            reg.render_dropin(version, shim_config, default_runc=default_runc).encode(),
            tuple(reasons),
        )
    if not patterns:
        reasons.append(f"{snap.main.path} has no imports: adding a marked block to it")
    elif not reasons:
        reasons.append(f"no imports glob of {snap.main.path} can hold a drop-in: editing it")
    text = next(t for f, _, t in files if f is target)
    new_text = append_block(text, version, shim_config, default_runc=default_runc)
    check = parse(ConfigFile(target.path, new_text.encode(), target.shown))
    if not _same_registration(_get(check, rt_path), wanted):
        raise ConfigError(
            f"{target.name}: adding the cedana runtime tables does not take effect "
            "(the runtimes table is defined inline?): add them by hand:\n"
            + reg.render_tables(version, shim_config)
        )
    return Plan("edit", version, target.path, new_text.encode(), tuple(reasons))


def _lacks_default_runtime(cri_table: Any) -> bool:
    containerd = cri_table.get("containerd", {}) if isinstance(cri_table, Mapping) else {}
    if not isinstance(containerd, Mapping):
        return False
    default = containerd.get("default_runtime_name", "runc")
    runtimes = containerd.get("runtimes", {})
    return default == "runc" and not (isinstance(runtimes, Mapping) and "runc" in runtimes)


def _same_registration(existing: Any, wanted: Mapping[str, Any]) -> bool:
    if not isinstance(existing, Mapping):
        return False
    # runtime_path is how a by-hand registration names the shim when it is not on
    # PATH; anything else must be what cedana registers.
    return {k: v for k, v in existing.items() if k != "runtime_path"} == dict(wanted)


def restore_edited(current: bytes) -> bytes:
    """For uninstall when the edited file changed since install: drop only our block."""
    return strip_block(current.decode()).encode()


def handler_in_cri_config(cri_config: Mapping[str, Any]) -> str | None:
    """The runtime_type the CRI plugin reports for the cedana handler (Status verbose
    ``config``: ``containerd.runtimes.<name>.runtimeType`` in 1.6 through 2.1)."""
    runtimes = _get(cri_config, ("containerd", "runtimes"))
    if not isinstance(runtimes, Mapping):
        return None
    entry = runtimes.get(reg.HANDLER)
    if not isinstance(entry, Mapping):
        return None
    value = entry.get("runtimeType", entry.get("runtime_type"))
    return str(value) if value is not None else None
