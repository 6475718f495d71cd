"""The node config (``/etc/cedana/shim.toml``) and kubelet settings the installer writes.

The node config is validated with the shim's own loader before it is written: a
key this shim does not know (say, a chart newer than the image) fails the install
with the loader's message instead of failing every opted-in container later.
"""

from __future__ import annotations

import json
import os
import re
import tempfile
import textwrap
from collections.abc import Sequence
from dataclasses import fields

from cedana_shim.config import NodeConfig, load_node_config
from cedana_shim.errors import InvalidArgument

HEADER = (
    "# cedana-shim node config, written by `cedana node install`.\n"
    "# Every key can be overridden by CEDANA_<KEY> in containerd's environment.\n"
)
_DURATION_RE = re.compile(r"^(\d+(\.\d+)?(ns|us|µs|ms|s|m|h))+$")


class SettingsError(Exception):
    pass


def _field_kinds() -> dict[str, type]:
    default = NodeConfig()
    return {f.name: type(getattr(default, f.name)) for f in fields(NodeConfig)}


def render_node_config(settings: Sequence[tuple[str, str]]) -> bytes:
    """TOML for ``KEY=VALUE`` settings; values are typed by the node config's fields
    (a key the shim does not know is written as a string and fails validation)."""
    kinds = _field_kinds()
    keys = textwrap.fill("Keys: " + ", ".join(kinds), 78, subsequent_indent="  ")
    lines = [HEADER + textwrap.indent(keys, "# ", lambda _line: True)]
    for key, value in settings:
        kind = kinds.get(key, str)
        if kind is bool:
            literal = "true" if value.strip().lower() in ("1", "true", "yes", "on") else "false"
            if value.strip().lower() not in ("1", "true", "yes", "on", "0", "false", "no", "off"):
                literal = json.dumps(value)
        elif kind in (int, float) and re.fullmatch(r"-?\d+(\.\d+)?", value.strip()):
            literal = value.strip()
        else:
            literal = json.dumps(value)
        lines.append(f"{key} = {literal}")
    return ("\n".join(lines) + "\n").encode()


def validate_node_config(data: bytes, origin: str) -> None:
    with tempfile.NamedTemporaryFile(suffix=".toml") as tmp:
        tmp.write(data)
        tmp.flush()
        try:
            load_node_config(tmp.name, env={})
        except InvalidArgument as err:
            raise SettingsError(
                f"{origin}: {str(err).replace(tmp.name, 'node config')} "
                "(see the node configuration table in the README)"
            ) from None


def parse_setting(text: str) -> tuple[str, str]:
    key, sep, value = text.partition("=")
    if not sep or not key.strip():
        raise SettingsError(f"--set {text!r}: expected KEY=VALUE")
    return key.strip(), value


def check_duration(value: str) -> str:
    if not _DURATION_RE.match(value):
        raise SettingsError(f"{value!r} is not a Go duration (e.g. 10m, 1h30m, 90s)")
    return value


def set_kubelet_timeout(text: str, value: str, path: str) -> str:
    """``runtimeRequestTimeout`` in a kubelet config file (KubeletConfiguration in YAML
    or JSON), everything else left as it is."""
    check_duration(value)
    if path.endswith(".json") or text.lstrip().startswith("{"):
        try:
            doc = json.loads(text or "{}")
        except ValueError as err:
            raise SettingsError(f"{path} is not valid JSON ({err}): fix it first") from None
        doc["runtimeRequestTimeout"] = value
        return json.dumps(doc, indent=2) + "\n"
    line = f"runtimeRequestTimeout: {value}"
    pattern = re.compile(r"^runtimeRequestTimeout:.*$", re.MULTILINE)
    if pattern.search(text):
        return pattern.sub(line, text, count=1)
    if text and not text.endswith("\n"):
        text += "\n"
    return text + line + "\n"


def default_containerd_socket(main_config: dict[str, object]) -> str:
    grpc = main_config.get("grpc")
    if isinstance(grpc, dict) and isinstance(grpc.get("address"), str) and grpc["address"]:
        return str(grpc["address"])
    return "/run/containerd/containerd.sock"


def sandbox_image(main_config: dict[str, object]) -> str | None:
    plugins = main_config.get("plugins")
    if not isinstance(plugins, dict):
        return None
    for plugin, path in (
        ("io.containerd.cri.v1.images", ("pinned_images", "sandbox")),
        ("io.containerd.grpc.v1.cri", ("sandbox_image",)),
    ):
        node: object = plugins.get(plugin)
        for key in path:
            node = node.get(key) if isinstance(node, dict) else None
        if isinstance(node, str) and node:
            return node
    return None


def relpath_link(target: str, link: str) -> str:
    """A relative link target, so the link works from any root (the host's, /host in
    the DaemonSet, a temp dir in tests)."""
    return os.path.relpath(target, os.path.dirname(link))
