"""What a checkpoint records of its dumping node's CPU, and how a candidate's record
is weighed before a pull (the CRIU run itself: tests/privileged/test_cpu_fit_real.py)."""

from __future__ import annotations

import asyncio
import base64
import os
from pathlib import Path

import pytest
from cedana_shim.checkpoint import cpu_fit
from cedana_shim.config import NodeConfig


def test_the_dumps_cpuinfo_is_recorded_as_base64(tmp_path: Path) -> None:
    (tmp_path / "cpuinfo.img").write_bytes(b"\x19CVT\x13@@a" + bytes(range(40)))
    recorded = cpu_fit.record(str(tmp_path))
    assert base64.b64decode(recorded) == (tmp_path / "cpuinfo.img").read_bytes()
    assert cpu_fit.decode(recorded) == (tmp_path / "cpuinfo.img").read_bytes()


@pytest.mark.parametrize(
    "content", [None, b"", b"x" * (cpu_fit.MAX_CPUINFO_BYTES + 1)], ids=["none", "empty", "huge"]
)
def test_nothing_is_recorded_without_a_plausible_cpuinfo(
    tmp_path: Path, content: bytes | None
) -> None:
    if content is not None:
        (tmp_path / "cpuinfo.img").write_bytes(content)
    assert cpu_fit.record(str(tmp_path)) == ""


def test_a_symlink_is_not_followed(tmp_path: Path) -> None:
    (tmp_path / "elsewhere").write_bytes(b"secret")
    os.symlink(tmp_path / "elsewhere", tmp_path / "cpuinfo.img")
    with pytest.raises(OSError):
        cpu_fit.record(str(tmp_path))


@pytest.mark.parametrize(
    "recorded",
    [42, ["AAAA"], "not base64!", "QUJD\n", "A" * 8192, "===="],
    ids=["number", "list", "alphabet", "newline", "huge", "padding"],
)
def test_a_malformed_record_is_refused_without_running_criu(recorded: object) -> None:
    asked: list[bytes] = []

    async def check(image: bytes, cap: str) -> str:
        asked.append(image)
        return ""

    why = asyncio.run(cpu_fit.misfit(recorded, NodeConfig(), check))
    assert why == "its recorded CPU description (cpuinfo) is malformed"
    assert asked == []


@pytest.mark.parametrize(
    ("extra", "cap"),
    [
        ("", ""),
        ("cpu-cap fpu", "fpu"),
        ("--cpu-cap=ins", "ins"),
        ("link-remap\ncpu-cap cpu\ncpu-cap fpu", "fpu"),
        ("action-script /x.sh", ""),
    ],
)
def test_the_restores_cpu_cap_is_the_nodes_extra_criu_option(extra: str, cap: str) -> None:
    assert cpu_fit.cpu_cap(NodeConfig(criu_config_extra=extra)) == cap


def test_the_check_gets_the_image_and_the_cap_and_says_why() -> None:
    asked: list[tuple[bytes, str]] = []

    async def check(image: bytes, cap: str) -> str:
        asked.append((image, cap))
        return "no fit"

    config = NodeConfig(criu_config_extra="cpu-cap fpu")
    recorded = base64.b64encode(b"image").decode()
    assert asyncio.run(cpu_fit.misfit(recorded, config, check)) == "no fit"
    assert asked == [(b"image", "fpu")]


@pytest.mark.parametrize(
    ("recorded", "extra"),
    [(None, ""), ("", ""), (base64.b64encode(b"image").decode(), "cpu-cap none")],
    ids=["older-shim", "other-arch", "cap-none"],
)
def test_no_check_without_a_record_or_with_cpu_cap_none(recorded: object, extra: str) -> None:
    async def check(image: bytes, cap: str) -> str:
        raise AssertionError("CRIU must not run")

    config = NodeConfig(criu_config_extra=extra)
    assert asyncio.run(cpu_fit.misfit(recorded, config, check)) == ""
