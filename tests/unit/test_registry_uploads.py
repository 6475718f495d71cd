"""Unfinished uploads: kept in memory and in the state dir, across client instances."""

from __future__ import annotations

import json
import stat
from pathlib import Path

from cedana_shim.registry.uploads import UploadState, UploadStates

DIGEST = "sha256:" + "ab" * 32
STATE = UploadState(location="https://r.example.com/v2/a/blobs/uploads/u?_state=x", offset=42)


def test_a_new_instance_finds_the_state_on_disk(tmp_path: Path) -> None:
    UploadStates("r.example.com", str(tmp_path / "d")).put("a", DIGEST, STATE)
    (path,) = (tmp_path / "d").iterdir()
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE((tmp_path / "d").stat().st_mode) == 0o700
    later = UploadStates("r.example.com", str(tmp_path / "d"))
    assert later.get("a", DIGEST) == STATE
    assert later.get("b", DIGEST) is None
    assert UploadStates("other.example.com", str(tmp_path / "d")).get("a", DIGEST) is None
    later.drop("a", DIGEST)
    assert list((tmp_path / "d").iterdir()) == []
    assert later.get("a", DIGEST) is None


def test_without_a_dir_the_state_lives_in_memory(tmp_path: Path) -> None:
    states = UploadStates("r.example.com", None)
    states.put("a", DIGEST, STATE)
    assert states.get("a", DIGEST) == STATE
    states.drop("a", DIGEST)
    assert states.get("a", DIGEST) is None


def test_damaged_or_foreign_state_files_are_ignored(tmp_path: Path) -> None:
    UploadStates("r.example.com", str(tmp_path)).put("a", DIGEST, STATE)
    (path,) = tmp_path.iterdir()
    record = json.loads(path.read_text())
    for damaged in (
        "{",
        "[]",
        json.dumps({**record, "digest": "sha256:" + "cd" * 32}),
        json.dumps({**record, "offset": -1}),
        json.dumps({**record, "location": 5}),
    ):
        path.write_text(damaged)
        assert UploadStates("r.example.com", str(tmp_path)).get("a", DIGEST) is None
