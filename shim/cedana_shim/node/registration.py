"""What gets registered with containerd and Kubernetes, as data.

``runtimeclass/containerd-config-v{2,3}.toml`` and ``runtimeclass/runtimeclass.yaml``
in the repository are the human-readable source of truth; a unit test asserts that
the tables rendered here parse to exactly what those files say, so the installer and
the documented drop-ins cannot drift apart.
"""

from __future__ import annotations

import json
from typing import Any, Final

HANDLER: Final = "cedana"
RUNTIME_TYPE: Final = "io.containerd.cedana.v2"
SHIM_BINARY: Final = "containerd-shim-cedana-v2"
DEFAULT_RUNC_TYPE: Final = "io.containerd.runc.v2"
ANNOTATIONS: Final = ("cedana.ai/*",)
DEFAULT_SHIM_CONFIG: Final = "/etc/cedana/shim.toml"

# The CRI runtime tables containerd reads, per config schema version.
CRI_PLUGIN: Final = {2: "io.containerd.grpc.v1.cri", 3: "io.containerd.cri.v1.runtime"}
NODE_LABEL: Final = "cedana.ai/shim"  # RuntimeClass scheduling.nodeSelector
TAINT_KEY: Final = "cedana.ai/not-ready"
TAINT_EFFECT: Final = "NoSchedule"


def runtimes_path(version: int) -> tuple[str, ...]:
    """Key path of the ``runtimes`` table for a config schema version."""
    return ("plugins", CRI_PLUGIN[version], "containerd", "runtimes")


def runtime_table(version: int, shim_config: str = DEFAULT_SHIM_CONFIG) -> dict[str, Any]:
    """The ``runtimes.cedana`` table as plain data."""
    table: dict[str, Any] = {"runtime_type": RUNTIME_TYPE}
    if version >= 3:
        # podsandbox: the pause container runs through the Task API like any other;
        # a version-2 shim needs that (2.x's sandbox API is for bootstrap v3 shims).
        table["sandboxer"] = "podsandbox"
    table["pod_annotations"] = list(ANNOTATIONS)
    table["container_annotations"] = list(ANNOTATIONS)
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


def render_tables(
    version: int, shim_config: str = DEFAULT_SHIM_CONFIG, *, default_runc: bool = False
) -> str:
    """The ``[...runtimes.cedana]`` and ``[...runtimes.cedana.options]`` tables as
    TOML text (no ``version`` line), for a drop-in or for appending to a config.

    ``default_runc`` also writes containerd's default ``runc`` runtime: containerd 1.x
    replaces its default ``runtimes`` map with the one a config defines, so a config
    that names no runtime and gains ``cedana`` would otherwise lose ``runc``, the
    default runtime, and the CRI plugin would refuse to load.
    """
    prefix = ".".join(_toml_key(k) for k in runtimes_path(version))
    header = f"{prefix}.{HANDLER}"
    table = runtime_table(version, shim_config)
    options = table.pop("options")
    lines = [f"[{header}]"]
    lines += [f"  {k} = {_toml_value(v)}" for k, v in table.items()]
    lines += ["", f"  [{header}.options]"]
    lines += [f"    {k} = {_toml_value(v)}" for k, v in options.items()]
    if default_runc:
        lines += ["", "# containerd's default runtime, which a runtimes table must name in 1.x"]
        lines += [f"[{prefix}.runc]", f"  runtime_type = {_toml_value(DEFAULT_RUNC_TYPE)}"]
    return "\n".join(lines) + "\n"


def render_dropin(
    version: int, shim_config: str = DEFAULT_SHIM_CONFIG, *, default_runc: bool = False
) -> str:
    """A complete drop-in file for a directory named by the main config's ``imports``."""
    return (
        "# Written by `cedana node install`; `cedana node uninstall` removes it.\n"
        f"# Registers the {HANDLER!r} CRI runtime handler (cedana-shim).\n"
        f"version = {version}\n\n" + render_tables(version, shim_config, default_runc=default_runc)
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
