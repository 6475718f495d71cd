"""What gets registered with containerd and Kubernetes, as data.

``runtimeclass/containerd-config-v{2,3}.toml`` and ``runtimeclass/runtimeclass.yaml``
in the repository are the human-readable source of truth; a unit test asserts that
the tables rendered here parse to exactly what those files say, so the installer and
the documented drop-ins cannot drift apart.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from typing import Any, Final

HANDLER: Final = "cedana"
# The shim's own runtime name: what `ctr run --runtime` names and `-info` reports.
RUNTIME_TYPE: Final = "io.containerd.cedana.v2"
SHIM_BINARY: Final = "containerd-shim-cedana-v2"
# From containerd 1.7 the CRI handler is a runc-type runtime whose runtime_path is our
# shim: containerd 2.0 ... 2.3.3's CRI asks only runc-type runtimes for their features
# (recursive read-only mounts), and a runc-type runtime gets runc's own options
# (BinaryName, SystemdCgroup, Root), which have no ConfigPath: the shim then reads
# DEFAULT_SHIM_CONFIG. containerd 1.6's CRI ignores runtime_path (it would run runc's
# shim), so there the handler keeps the shim's own type; 1.6 asks no runtime for its
# features anyway.
RUNC_TYPE: Final = "io.containerd.runc.v2"
ANNOTATIONS: Final = ("cedana.ai/*",)
DEFAULT_SHIM_CONFIG: Final = "/etc/cedana/shim.toml"
DEFAULT_SHIM_PATH: Final = f"/usr/local/bin/{SHIM_BINARY}"

# The CRI runtime tables containerd reads, per config schema version.
CRI_PLUGIN: Final = {2: "io.containerd.grpc.v1.cri", 3: "io.containerd.cri.v1.runtime"}
NODE_LABEL: Final = "cedana.ai/shim"  # RuntimeClass scheduling.nodeSelector
TAINT_KEY: Final = "cedana.ai/not-ready"
TAINT_EFFECT: Final = "NoSchedule"


NVIDIA_HANDLER: Final = "nvidia"  # what the NVIDIA container toolkit registers
DEFAULT_RUNTIME_KEY: Final = "default_runtime_name"


def containerd_path(version: int) -> tuple[str, ...]:
    """Key path of the CRI plugin's ``containerd`` table (``default_runtime_name``)."""
    return ("plugins", CRI_PLUGIN[version], "containerd")


def runtimes_path(version: int) -> tuple[str, ...]:
    """Key path of the ``runtimes`` table for a config schema version."""
    return (*containerd_path(version), "runtimes")


def is_shim_path(path: object) -> bool:
    """Whether a ``runtime_path`` names the cedana shim (wherever it is installed)."""
    return isinstance(path, str) and path.rsplit("/", 1)[-1] == SHIM_BINARY


def honours_runtime_path(containerd: tuple[int, ...] | None, config_version: int) -> bool:
    """Whether the CRI of this containerd runs a runtime's ``runtime_path`` (1.7 on);
    an unknown containerd reading config version 2 may be 1.6."""
    if containerd is None:
        return config_version >= 3
    return tuple(containerd[:2]) >= (1, 7)


def runtime_table(
    version: int,
    shim_path: str | None = DEFAULT_SHIM_PATH,
    runc_options: Mapping[str, Any] | None = None,
    shim_config: str = DEFAULT_SHIM_CONFIG,
) -> dict[str, Any]:
    """The ``runtimes.cedana`` table as plain data.

    With ``shim_path`` (containerd >= 1.7) the handler is a runc-type runtime running
    that binary, and ``runc_options`` (``BinaryName``, ``SystemdCgroup``: how the shim
    must call runc) are its ``options`` table (none: no table). ``shim_path=None``
    (containerd 1.6) gives the shim's own runtime type, found on containerd's PATH,
    whose options name the node config (``ConfigPath``) unless ``runc_options``
    replace it (containerd passes a non-runc runtime its options table only when it
    has no ``ConfigPath``).
    """
    table: dict[str, Any] = (
        {"runtime_type": RUNC_TYPE, "runtime_path": shim_path}
        if shim_path is not None
        else {"runtime_type": RUNTIME_TYPE}
    )
    if version >= 3:
        # podsandbox: the pause container runs through the Task API like any other;
        # a version-2 shim needs that (2.x's sandbox API is for bootstrap v3 shims).
        table["sandboxer"] = "podsandbox"
    table["pod_annotations"] = list(ANNOTATIONS)
    table["container_annotations"] = list(ANNOTATIONS)
    if runc_options:
        table["options"] = dict(runc_options)
    elif shim_path is None:
        table["options"] = {"ConfigPath": shim_config}
    return table


def _toml_key(key: str) -> str:
    return key if key.replace("_", "").replace("-", "").isalnum() else json.dumps(key)


def _toml_value(value: Any) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, list):
        return "[" + ", ".join(_toml_value(v) for v in value) + "]"
    if isinstance(value, str):
        return json.dumps(value)  # a JSON string is a valid TOML basic string
    return str(value)


def toml_header(path: tuple[str, ...]) -> str:
    return "[" + ".".join(_toml_key(k) for k in path) + "]"


def render_default_runtime(indent: str = "") -> str:
    """The ``default_runtime_name`` line that makes ``cedana`` the CRI's default."""
    return f"{indent}{DEFAULT_RUNTIME_KEY} = {_toml_value(HANDLER)}\n"


def render_tables(
    version: int,
    shim_path: str | None = DEFAULT_SHIM_PATH,
    shim_config: str = DEFAULT_SHIM_CONFIG,
    *,
    default_runc: bool = False,
    runc_options: Mapping[str, Any] | None = None,
    default_runtime: bool = False,
    runtime: bool = True,
) -> str:
    """The ``[...runtimes.cedana]`` and ``[...runtimes.cedana.options]`` tables as
    TOML text (no ``version`` line), for a drop-in or for appending to a config.

    ``default_runc`` also writes containerd's default ``runc`` runtime: containerd 1.x
    replaces its default ``runtimes`` map with the one a config defines, so a config
    that names no runtime and gains ``cedana`` would otherwise lose ``runc``, the
    default runtime, and the CRI plugin would refuse to load. ``default_runtime``
    also writes the ``containerd`` table with ``default_runtime_name = "cedana"``
    (only where the config does not define that table itself); ``runtime=False``
    leaves out the ``cedana`` tables (a config that already has them).
    """
    prefix = ".".join(_toml_key(k) for k in runtimes_path(version))
    header = f"{prefix}.{HANDLER}"
    lines = []
    if default_runtime:
        lines += [toml_header(containerd_path(version)), render_default_runtime("  ").rstrip("\n")]
    if runtime:
        table = runtime_table(version, shim_path, runc_options, shim_config)
        options = table.pop("options", {})
        lines += [""] if lines else []
        lines += [f"[{header}]"]
        lines += [f"  {k} = {_toml_value(v)}" for k, v in table.items()]
        if options:
            lines += ["", f"  [{header}.options]"]
            lines += [f"    {k} = {_toml_value(v)}" for k, v in options.items()]
    if default_runc:
        lines += ["", "# containerd's default runtime, which a runtimes table must name in 1.x"]
        lines += [f"[{prefix}.runc]", f"  runtime_type = {_toml_value(RUNC_TYPE)}"]
    return "\n".join(lines) + "\n"


def render_dropin(
    version: int,
    shim_path: str | None = DEFAULT_SHIM_PATH,
    shim_config: str = DEFAULT_SHIM_CONFIG,
    *,
    default_runc: bool = False,
    runc_options: Mapping[str, Any] | None = None,
    default_runtime: bool = False,
    runtime: bool = True,
) -> str:
    """A complete drop-in file for a directory named by the main config's ``imports``
    (the tables as :func:`render_tables` writes them)."""
    tables = render_tables(
        version,
        shim_path,
        shim_config,
        default_runc=default_runc,
        runc_options=runc_options,
        default_runtime=default_runtime,
        runtime=runtime,
    )
    return (
        "# Written by `cedana node install`; `cedana node uninstall` removes it.\n"
        f"# Registers the {HANDLER!r} CRI runtime handler (cedana-shim).\n"
        f"version = {version}\n\n" + tables
    )


def runtimeclass_manifest() -> dict[str, Any]:
    """The RuntimeClass object (what ``runtimeclass/runtimeclass.yaml`` holds)."""
    return {
        "apiVersion": "node.k8s.io/v1",
        "kind": "RuntimeClass",
        "metadata": {"name": HANDLER},
        "handler": HANDLER,
        "overhead": {"podFixed": {"memory": "32Mi", "cpu": "10m"}},
        "scheduling": {"nodeSelector": {NODE_LABEL: "true"}},
    }
