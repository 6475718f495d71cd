"""``containerd-shim-cedana-v2 -info``: RuntimeInfo with the features of the runc the
options name, as containerd 2.x reads it."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from cedana_shim.api.containerd import runtimeoptions_pb2
from cedana_shim.api.containerd.runc import options_pb2
from cedana_shim.api.containerd.types import introspection_pb2
from cedana_shim.cli.info import FEATURES_TYPE_URL, InfoError, runtime_info
from google.protobuf.any_pb2 import Any

REPO = Path(__file__).resolve().parents[2]
FEATURES = {"ociVersionMin": "1.0.0", "mountOptions": ["ro", "rro"], "linux": {}}


def fake_runc(path: Path, features: str | None = json.dumps(FEATURES)) -> Path:
    """A runc whose ``features`` prints ``features`` (or fails when None)."""
    body = f"cat <<'EOF'\n{features}\nEOF" if features is not None else "echo no >&2; exit 3"
    path.write_text(f'#!/bin/sh\n[ "$1" = features ] || exit 9\n{body}\n')
    path.chmod(0o755)
    return path


def pack(message: object) -> bytes:
    return Any(
        type_url="type.googleapis.com/" + message.DESCRIPTOR.full_name,  # type: ignore[attr-defined]
        value=message.SerializeToString(),  # type: ignore[attr-defined]
    ).SerializeToString()


def test_no_options_describe_runc_on_path(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    fake_runc(tmp_path / "runc")
    monkeypatch.setenv("PATH", f"{tmp_path}:{os.environ['PATH']}")
    info = runtime_info(b"")
    assert info.name == "io.containerd.cedana.v2" and info.version.version
    assert not info.HasField("options")
    assert info.features.type_url == FEATURES_TYPE_URL
    assert json.loads(info.features.value) == FEATURES


def test_runc_options_binary_name_is_used_and_echoed(tmp_path: Path) -> None:
    runc = fake_runc(tmp_path / "my-runc", json.dumps({"mountOptions": ["rro"]}))
    stdin = pack(options_pb2.Options(binary_name=str(runc), root="/r"))
    info = runtime_info(stdin)
    assert json.loads(info.features.value) == {"mountOptions": ["rro"]}
    assert info.options.SerializeToString() == stdin  # as the runc shim: options back


def test_cri_options_table_binary_name_is_used(tmp_path: Path) -> None:
    runc = fake_runc(tmp_path / "wrapped-runc", json.dumps({"mountOptions": ["rbind"]}))
    body = f'BinaryName = "{runc}"\n'.encode()
    info = runtime_info(pack(runtimeoptions_pb2.Options(config_body=body)))
    assert json.loads(info.features.value) == {"mountOptions": ["rbind"]}


def test_a_runc_without_features_gives_info_without_them(tmp_path: Path) -> None:
    runc = fake_runc(tmp_path / "old-runc", None)
    info = runtime_info(pack(options_pb2.Options(binary_name=str(runc))))
    assert info.name == "io.containerd.cedana.v2" and not info.HasField("features")


def test_a_missing_binary_is_an_error() -> None:
    with pytest.raises(InfoError, match="look up the path of '/nonexistent/runc'"):
        runtime_info(pack(options_pb2.Options(binary_name="/nonexistent/runc")))


def test_undecodable_options_are_an_error() -> None:
    with pytest.raises(InfoError, match="do not decode"):
        runtime_info(b"\xff\xff\xff")
    with pytest.raises(InfoError, match="unsupported runtime options type"):
        runtime_info(Any(type_url="x.Other", value=b"").SerializeToString())


def test_the_shim_binary_answers_info_on_stdout(tmp_path: Path) -> None:
    runc = fake_runc(tmp_path / "runc")
    proc = subprocess.run(
        [sys.executable, "-c", "from cedana_shim.cli.shim_main import main; exit(main())", "-info"],
        input=pack(options_pb2.Options(binary_name=str(runc))),
        capture_output=True,
        check=False,
        cwd=REPO,
    )
    assert proc.returncode == 0, proc.stderr
    info = introspection_pb2.RuntimeInfo.FromString(proc.stdout)
    assert json.loads(info.features.value) == FEATURES
    failed = subprocess.run(
        [sys.executable, "-c", "from cedana_shim.cli.shim_main import main; exit(main())", "-info"],
        input=pack(options_pb2.Options(binary_name="/nonexistent/runc")),
        capture_output=True,
        check=False,
    )
    assert failed.returncode == 1 and failed.stdout == b""
    assert b"-info: failed to look up the path" in failed.stderr
