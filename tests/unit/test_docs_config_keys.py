"""The README documents every node config key, and nothing that is not one."""

from __future__ import annotations

import re
from dataclasses import fields
from pathlib import Path

from cedana_shim.config import NodeConfig

README = Path(__file__).resolve().parents[2] / "README.md"


def _documented() -> set[str]:
    text = README.read_text()
    table = text[text.index("### Node configuration") :]
    table = table[: table.index("\n### ")]
    keys: set[str] = set()
    for line in table.splitlines():
        if line.startswith("| `"):
            first_cell = line.split("|")[1]
            keys.update(re.findall(r"`([a-z_]+)`", first_cell))
    return keys


def test_every_node_config_key_is_in_the_readme_table() -> None:
    assert _documented() == {f.name for f in fields(NodeConfig)}
