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
- the CRI's default runtime is ``default_runtime_name`` in the CRI plugin's
  ``containerd`` table (both schemas). Where the file being edited already defines
  that table, the key goes into it as a marked inline block; one that replaces the
  node's own line keeps that line, commented, and stripping the block puts it back.
- from containerd 1.7 the ``cedana`` handler is a runc-type runtime whose
  ``runtime_path`` is our shim (``registration.RUNC_TYPE`` says why), so its
  ``options`` are runc's: no ``ConfigPath``, and the shim reads the default node
  config. containerd 1.6 ignores ``runtime_path``: there the handler keeps the shim's
  own type, and its options only ``ConfigPath``.
"""

from __future__ import annotations

import copy
import fnmatch
import posixpath
import re
import tomllib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Final, Literal

from . import registration as reg
from .config_blocks import (
    BLOCK_BEGIN,
    BLOCK_END,
    append_block,
    has_block,
    set_default_inline,
    strip_block,
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
    # The CRI's default runtime before install, and whether install makes it cedana.
    previous_default: str = "runc"
    default_runtime: bool = False
    # The node's `nvidia` runtime and the runc binary it names ("" = runc), if any.
    nvidia_binary: str | None = None
    # The node's runc uses the systemd cgroup driver; why cedana's cannot, if so.
    systemd_cgroup: bool = False
    systemd_cgroup_lost: str | None = None
    # The shim binary the handler runs as a runc-type runtime; None: by its own type.
    shim_path: str | None = None


@dataclass(frozen=True)
class Wanted:
    """What the registration asks of containerd."""

    shim_config: str = reg.DEFAULT_SHIM_CONFIG
    shim_path: str = reg.DEFAULT_SHIM_PATH  # the shim binary as containerd sees it
    default_runtime: bool = False  # make `cedana` the CRI's default runtime
    runc_binary: str | None = None  # BinaryName for the `cedana` handler


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
    snap: Snapshot, wanted: Wanted = Wanted(), *, allow_dropin: bool = True
) -> Plan:
    """Decide where the runtime tables (and the default runtime) go. Raises
    ConfigError for a config that cannot be used (invalid TOML, wrong version, a
    conflicting hand-made ``cedana`` runtime, options containerd cannot pass on)."""
    main_text = snap.main.data.decode() if snap.main.data is not None else None
    main_parsed = parse(snap.main)
    version = config_version(snap.main, main_parsed, snap.containerd_version)
    ctrd = snap.containerd_version
    shim_path = wanted.shim_path if reg.honours_runtime_path(ctrd, version) else None
    _check_options(wanted, ctrd, runc_typed=shim_path is not None)
    rt_path = (*reg.runtimes_path(version), reg.HANDLER)
    default_path = (*reg.containerd_path(version), reg.DEFAULT_RUNTIME_KEY)
    runc_options: dict[str, Any] = {}
    if wanted.runc_binary:
        runc_options["BinaryName"] = wanted.runc_binary

    def render(*, runtime: bool, default: bool, default_runc: bool, dropin: bool = False) -> str:
        renderer = reg.render_dropin if dropin else reg.render_tables
        return renderer(
            version,
            shim_path,
            wanted.shim_config,
            default_runc=default_runc,
            runc_options=runc_options,
            default_runtime=default,
            runtime=runtime,
        )

    deep_merge = (
        snap.containerd_version[0] >= 2 if snap.containerd_version is not None else version >= 3
    )
    if main_text is None:
        content = f"version = {version}\n\n{BLOCK_BEGIN}\n"
        content += render(runtime=True, default=wanted.default_runtime, default_runc=not deep_merge)
        content += f"{BLOCK_END}\n"
        return Plan(
            "create",
            version,
            snap.main.path,
            content.encode(),
            (f"{snap.main.path} does not exist: containerd runs on defaults; creating it",),
            default_runtime=wanted.default_runtime,
            shim_path=shim_path,
        )

    # Our own blocks are ours to rewrite: judge the files as they were before them.
    files: list[tuple[ConfigFile, dict[str, Any], str]] = []
    for file in (snap.main, *snap.imported):
        text = file.data.decode(errors="replace") if file.data is not None else ""
        own = has_block(text)
        if own:
            text = strip_block(text)
        parsed = main_parsed if file is snap.main and not own else None
        if parsed is None:
            parsed = parse(ConfigFile(file.path, text.encode(), file.shown))
        files.append((file, parsed, text))
    cri = [(f, p) for f, p, _ in files if _get(p, ("plugins", reg.CRI_PLUGIN[version])) is not None]
    before = _merged([(f, p) for f, p, _ in files], deep_merge)
    previous_default = _get(before, default_path) or "runc"
    nvidia = _get(before, (*reg.runtimes_path(version), reg.NVIDIA_HANDLER))
    systemd = _node_systemd_cgroup(before, version, previous_default)
    cgroup_note = None
    if systemd and shim_path is None and not _passes_options_table(ctrd):
        cgroup_note = "containerd 1.6 passes a non-runc runtime only its ConfigPath"
    elif systemd and shim_path is None and wanted.shim_config != reg.DEFAULT_SHIM_CONFIG:
        cgroup_note = "--shim-config is not the default: ConfigPath stays, SystemdCgroup cannot"
    elif systemd:
        runc_options["SystemdCgroup"] = True
    table = reg.runtime_table(version, shim_path, runc_options, wanted.shim_config)
    found = Plan(
        "present",
        version,
        snap.main.path,
        None,
        previous_default=previous_default,
        default_runtime=wanted.default_runtime,
        nvidia_binary=_binary_name(nvidia) if isinstance(nvidia, Mapping) else None,
        systemd_cgroup=systemd,
        systemd_cgroup_lost=cgroup_note,
        shim_path=shim_path,
    )

    present = None
    for file, parsed, _ in files:
        existing = _get(parsed, rt_path)
        if existing is None:
            continue
        if not _same_registration(existing, table):
            raise ConfigError(
                f"{file.name} already defines a {reg.HANDLER!r} runtime that differs from "
                f"cedana's ({'.'.join(rt_path)}): remove that table (or make it match "
                f"runtimeclass/containerd-config-v{version}.toml) and run the install again"
            )
        present = file
    default_done = not wanted.default_runtime or previous_default == reg.HANDLER
    if present is not None and default_done:
        return replace(
            found,
            target=present.path,
            reasons=(
                f"{present.path} already registers the {reg.HANDLER!r} runtime; left as it is",
            ),
        )
    need_runtime = present is None
    default_in_block = wanted.default_runtime and not default_done

    patterns = import_patterns(snap.main, main_parsed, snap.containerd_version)
    dropin = dropin_target(patterns) if allow_dropin else None
    reasons: list[str] = []
    if shim_path is None and ctrd is None:
        reasons.append(
            "containerd's version is unknown and the config is version 2: registered by "
            f"the shim's own type ({reg.RUNTIME_TYPE}), which every containerd runs (1.6 "
            "ignores runtime_path); containerd 2.x then reports no features for it"
        )
    target = snap.main
    default_runc = False
    if not deep_merge:
        effective = _get(cri[-1][1], ("plugins", reg.CRI_PLUGIN[version])) if cri else {}
        default_runc = present is None and _lacks_default_runtime(effective)
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
                    f"{target.path} configures {reg.CRI_PLUGIN[version]!r}: a drop-in would "
                    f"erase those settings, so the runtime is added to {target.path} instead"
                )
            dropin = None
    if wanted.default_runtime and not default_done:
        reasons.append(
            f"the CRI's default runtime becomes {reg.HANDLER!r} (was {previous_default!r}); "
            "pods that name a RuntimeClass keep theirs"
        )
    if dropin is not None:
        reasons.append(f"imports {patterns} cover {dropin}: writing a drop-in there")
        dropin_text = render(
            runtime=need_runtime, default=default_in_block, default_runc=default_runc, dropin=True
        )
        return replace(
            found,
            mode="dropin",
            target=dropin,
            content=dropin_text.encode(),
            reasons=tuple(reasons),
        )
    if not patterns:
        reasons.append(f"{snap.main.path} has no imports: adding a marked block to it")
    elif not reasons:
        reasons.append(f"no imports glob of {snap.main.path} can hold a drop-in: editing it")
    text = next(t for f, _, t in files if f is target)
    if wanted.default_runtime and not default_done:
        inline = set_default_inline(text, version)
        if inline is not None:
            text, default_in_block = inline, False
    new_text = text
    if need_runtime or default_in_block or default_runc:
        tables = render(runtime=need_runtime, default=default_in_block, default_runc=default_runc)
        new_text = append_block(text, tables)
    try:
        check = parse(ConfigFile(target.path, new_text.encode(), target.shown))
    except ConfigError:
        check = {}  # the file defines those tables in a way a block cannot extend
    after = _merged([(f, check if f is target else p) for f, p, _ in files], deep_merge)
    if not _same_registration(_get(after, rt_path), table) or (
        wanted.default_runtime and _get(after, default_path) != reg.HANDLER
    ):
        raise ConfigError(
            f"{target.name}: adding the cedana runtime tables does not take effect "
            "(the CRI plugin's tables are defined inline or by dotted keys?): add them by "
            "hand:\n"
            + render(runtime=need_runtime, default=wanted.default_runtime, default_runc=False)
        )
    return replace(
        found, mode="edit", target=target.path, content=new_text.encode(), reasons=tuple(reasons)
    )


def _check_options(wanted: Wanted, ctrd: tuple[int, ...] | None, *, runc_typed: bool) -> None:
    """Refuse what the registration cannot hand the shim (before anything is written)."""
    own_config = wanted.shim_config != reg.DEFAULT_SHIM_CONFIG
    if own_config and runc_typed:
        raise ConfigError(
            f"--shim-config {wanted.shim_config}: containerd >= 1.7 runs the {reg.HANDLER!r} "
            "handler as a runc-type runtime (the only kind containerd 2.0-2.3.3 asks for its "
            "features), whose options have no ConfigPath, so the shim always reads "
            f"{reg.DEFAULT_SHIM_CONFIG}: keep the node config there (drop --shim-config; "
            "--shim-config-file and --set write that file)"
        )
    if own_config and wanted.runc_binary is not None:
        raise ConfigError(
            f"--runc-binary with --shim-config {wanted.shim_config}: containerd hands the "
            "shim either a ConfigPath or the options table (BinaryName), not both, and "
            f"without ConfigPath the shim reads {reg.DEFAULT_SHIM_CONFIG}: keep the node "
            "config there, or drop --runc-binary"
        )
    if wanted.runc_binary is not None and not runc_typed and not _passes_options_table(ctrd):
        raise ConfigError(
            f"--runc-binary: containerd {'.'.join(map(str, ctrd or ()))} passes the "
            f"{reg.HANDLER!r} runtime only its ConfigPath, never BinaryName (its CRI ignores "
            "runtime_path, so the handler cannot be a runc-type runtime; 1.7 and later "
            "can): upgrade containerd, or drop --runc-binary"
        )


def _passes_options_table(ctrd: tuple[int, ...] | None) -> bool:
    """Whether containerd hands a non-runc runtime its ``options`` table (1.7 on)."""
    return ctrd is None or ctrd[:2] >= (1, 7)


def _node_systemd_cgroup(config: Mapping[str, Any], version: int, default: str) -> bool:
    """Whether the node's runc (the default runtime's, else ``runc``'s) uses the
    systemd cgroup driver: kubelet's pod cgroups are then systemd slices, and runc
    must be called with ``--systemd-cgroup`` for containers to land in them."""
    runtimes = _get(config, reg.runtimes_path(version))
    if not isinstance(runtimes, Mapping):
        return False
    for name in (default, "runc"):
        entry = runtimes.get(name)
        options = entry.get("options") if isinstance(entry, Mapping) else None
        if isinstance(options, Mapping) and "SystemdCgroup" in options:
            return options["SystemdCgroup"] is True
    return False


def _merged(
    files: Sequence[tuple[ConfigFile, Mapping[str, Any]]],
    deep_merge: bool,
) -> dict[str, Any]:
    """The config containerd ends up with: 2.x merges every file key by key; 1.x
    keeps the CRI plugin table of the last file that has one."""
    merged: dict[str, Any] = {}
    for _, parsed in files:
        if deep_merge:
            _deep_merge(merged, copy.deepcopy(dict(parsed)))
        else:
            plugins = parsed.get("plugins")
            for name, table in (plugins if isinstance(plugins, Mapping) else {}).items():
                merged.setdefault("plugins", {})[name] = table
    return merged


def _deep_merge(into: dict[str, Any], other: Mapping[str, Any]) -> None:
    for key, value in other.items():
        if isinstance(value, Mapping) and isinstance(into.get(key), dict):
            _deep_merge(into[key], value)
        else:
            into[key] = value


def _binary_name(runtime: Mapping[str, Any]) -> str:
    options = runtime.get("options")
    value = options.get("BinaryName", "") if isinstance(options, Mapping) else ""
    return value if isinstance(value, str) else ""


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
    # A by-hand registration may keep the shim elsewhere (or, on 1.6, name it in a
    # runtime_path containerd ignores); anything else must be what cedana registers.
    if "runtime_path" in wanted and not reg.is_shim_path(existing.get("runtime_path")):
        return False
    return {k: v for k, v in existing.items() if k != "runtime_path"} == {
        k: v for k, v in wanted.items() if k != "runtime_path"
    }
