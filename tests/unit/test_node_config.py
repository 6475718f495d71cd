"""Node config file plus CEDANA_* overrides; typos are errors."""

from pathlib import Path

import pytest
from cedana_shim.config import NodeConfig, load_node_config
from cedana_shim.errors import InvalidArgument


def test_defaults_without_a_file(tmp_path: Path) -> None:
    assert load_node_config(env={"CEDANA_CONFIG": str(tmp_path / "none.toml")}) == NodeConfig()


def test_file_then_env_override(tmp_path: Path) -> None:
    path = tmp_path / "shim.toml"
    path.write_text('store_path = "/srv/ckpt"\nretain = 5\ntcp_established = false\n')
    config = load_node_config(str(path), env={"CEDANA_RETAIN": "7"})
    assert (config.store_path, config.retain, config.tcp_established) == ("/srv/ckpt", 7, False)


@pytest.mark.parametrize(
    "body, message",
    [
        ("retian = 3\n", "unknown keys retian"),
        ('retain = "many"\n', "retain"),
        ("retain = 0\n", "at least one"),
        ("compression_level = 40\n", "1..22"),
        ("not toml [\n", "not valid TOML"),
        ("chunk_size = 100\n", "chunk_size 100 must be 0"),
        ('registry_sync = "later"\n', "before-exit or background"),
        ("registry_timeout = 0\n", "registry_timeout"),
        ('dirty_tracking = "on"\n', "dirty_tracking 'on' is not auto or off"),
    ],
)
def test_mistakes_are_reported(tmp_path: Path, body: str, message: str) -> None:
    path = tmp_path / "shim.toml"
    path.write_text(body)
    with pytest.raises(InvalidArgument, match=message):
        load_node_config(str(path), env={})


def test_named_file_must_exist(tmp_path: Path) -> None:
    with pytest.raises(InvalidArgument, match="does not exist"):
        load_node_config(str(tmp_path / "missing.toml"), env={})
