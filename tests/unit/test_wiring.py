"""The composition root's node pipelines: the node config is read once per file and
again only when the file changes; the store, hooks and GPU steps are built once per
config."""

from __future__ import annotations

import asyncio
import os
from pathlib import Path

from cedana_shim.cli.wiring import NodePipelines
from cedana_shim.runtime.reaper import Reaper


def _write(path: Path, store: Path, retain: int) -> None:
    path.write_text(f'store_path = "{store}"\nretain = {retain}\nhooks_dirs = ""\n')


def test_config_is_read_once_and_again_when_the_file_changes(tmp_path: Path) -> None:
    config = tmp_path / "shim.toml"
    _write(config, tmp_path / "store", 3)

    async def run() -> None:
        pipelines = NodePipelines(Reaper())
        first = pipelines.get(str(config))
        assert pipelines.get(str(config)) is first  # unchanged: the same objects
        assert first.config.retain == 3

        os.utime(config, ns=(1, 1))  # touched, same content: same pipeline
        assert pipelines.get(str(config)) is first

        _write(config, tmp_path / "store", 5)
        os.utime(config, ns=(2, 2))
        changed = pipelines.get(str(config))
        assert changed is not first and changed.config.retain == 5
        assert changed.store.config.retain == 5

    asyncio.run(run())


def test_each_config_file_has_its_own_pipeline(tmp_path: Path) -> None:
    a, b = tmp_path / "a.toml", tmp_path / "b.toml"
    _write(a, tmp_path / "store-a", 2)
    _write(b, tmp_path / "store-b", 4)

    async def run() -> None:
        pipelines = NodePipelines(Reaper())
        pa, pb = pipelines.get(str(a)), pipelines.get(str(b))
        assert (pa.store.root, pb.store.root) == (
            str(tmp_path / "store-a"),
            str(tmp_path / "store-b"),
        )
        assert pipelines.config(str(a)).retain == 2

    asyncio.run(run())
