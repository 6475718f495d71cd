"""`cedana doctor` reports what this node has, and fails loudly on what it lacks."""

import json
import os
from pathlib import Path

import pytest
from cedana_shim.cli.admin import main
from cedana_shim.cli.admin_doctor import check_store


def test_doctor_on_this_node_is_ready(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert main(["doctor", "--json", "--store", str(tmp_path / "store")]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["ready"] is True
    assert report["criu"]["ok"] and report["criu"]["version"] >= "4.2"
    assert report["criu"]["inetSockets"] is True  # a real dump of a TCP socket
    assert report["runc"]["ok"]
    # No GPU here: reported as such, and not a reason to fail a CPU node.
    assert report["gpu"]["devices"] == []


def test_store_with_open_permissions_is_a_problem(tmp_path: Path) -> None:
    store = tmp_path / "store"
    store.mkdir(mode=0o755)
    os.chmod(store, 0o755)
    report = check_store(str(store))
    assert report["ok"] is False
    assert "0700" in report["problem"]
    os.chmod(store, 0o700)
    assert check_store(str(store))["ok"] is True
