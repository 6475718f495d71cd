"""Restore compatibility: table tests over models, counts, indices and drivers."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
from cedana_shim import errors
from cedana_shim.gpu.compat import (
    check_restore,
    parse_driver_version,
    recorded_inventory,
)
from cedana_shim.gpu.driver import GpuFailedPrecondition, GpuUnavailable
from cedana_shim.gpu.inventory import GpuDevice, Inventory

H200 = "NVIDIA H200"
H100 = "NVIDIA H100 80GB HBM3"
MEM = {H200: 150_754_820_096, H100: 85_520_809_984}


def gpu(index: int, uid: str, name: str = H200, mig: bool = False) -> GpuDevice:
    return GpuDevice(index, f"GPU-{uid}", name, MEM[name], f"00000000:{index:02X}:00.0", mig)


def inv(*devices: GpuDevice, driver: str = "580.65.06") -> Inventory:
    return Inventory(driver, 13000, tuple(devices))


@dataclass
class Case:
    id: str
    recorded: Inventory
    current: Inventory
    driver: str | None = None
    device_map: dict[str, str] | None = None  # None: refused
    refusal: list[str] = field(default_factory=list)


A0, A1 = (
    gpu(0, "aaaa0000-0000-0000-0000-000000000000"),
    gpu(1, "aaaa1111-0000-0000-0000-000000000000"),
)
B0, B1 = (
    gpu(0, "bbbb0000-0000-0000-0000-000000000000"),
    gpu(1, "bbbb1111-0000-0000-0000-000000000000"),
)

CASES = [
    Case("same-gpus", inv(A0, A1), inv(A0, A1), device_map={}),
    Case("same-gpus-570", inv(A0, driver="570.86.10"), inv(A0, driver="570.86.10"), device_map={}),
    Case(
        "other-node-same-indices-580-maps",
        inv(A0, A1),
        inv(B0, B1),
        device_map={A0.uuid: B0.uuid, A1.uuid: B1.uuid},
    ),
    Case(
        "other-node-same-indices-570-restores-by-index",
        inv(A0, A1, driver="570.86.10"),
        inv(B0, B1, driver="570.86.10"),
        device_map={},
    ),
    Case("other-index-580-maps", inv(A0), inv(B1), device_map={A0.uuid: B1.uuid}),
    Case(
        "other-index-570-refused",
        inv(A0, driver="570.86.10"),
        inv(B1, driver="570.86.10"),
        refusal=["index 0", "index 1", "needs driver >= 580", "570.86.10"],
    ),
    Case(
        "same-node-swapped-order-580",
        inv(A0, A1),
        inv(A1, A0),
        device_map={},  # same UUIDs: nothing to remap
    ),
    Case(
        "count-differs",
        inv(A0, A1),
        inv(B0),
        refusal=["2 x NVIDIA H200", "1 x NVIDIA H200", "same GPU model and count"],
    ),
    Case(
        "model-differs",
        inv(A0),
        inv(gpu(0, "cccc0000-0000-0000-0000-000000000000", H100)),
        refusal=["1 x NVIDIA H200", "1 x NVIDIA H100 80GB HBM3"],
    ),
    Case(
        "mixed-models-reordered-580-pairs-by-model",
        inv(gpu(0, "a0", H100), gpu(1, "a1", H200)),
        inv(gpu(0, "b0", H200), gpu(1, "b1", H100)),
        device_map={"GPU-a0": "GPU-b1", "GPU-a1": "GPU-b0"},
    ),
    Case(
        "older-driver-refused",
        inv(A0, driver="580.65.06"),
        inv(A0, driver="575.51.03"),
        refusal=["580.65.06", "older 575.51.03", "same or a newer driver"],
    ),
    Case(
        "newer-driver-ok",
        inv(A0, driver="570.86.10"),
        inv(A0, driver="580.65.06"),
        device_map={},
    ),
    Case(
        "pre-570-refused",
        inv(A0, driver="550.54.15"),
        inv(A0, driver="550.54.15"),
        refusal=["550.54.15", ">= 570"],
    ),
    Case(
        "mig-refused",
        inv(A0),
        inv(gpu(0, "aaaa0000-0000-0000-0000-000000000000", mig=True)),
        refusal=["MIG is enabled"],
    ),
    Case(
        "explicit-driver-version-overrides",
        inv(A0, driver="570.86.10"),
        inv(B1),
        driver="570.172.08",
        refusal=["needs driver >= 580", "570.172.08"],
    ),
    Case("nothing-recorded", inv(), inv(A0), device_map={}),
    Case(
        "unknown-driver-refused",
        inv(A0),
        inv(A0, driver=""),
        refusal=["driver version is unknown"],
    ),
]


@pytest.mark.parametrize("case", CASES, ids=[c.id for c in CASES])
def test_check_restore(case: Case) -> None:
    if case.device_map is None:
        with pytest.raises(GpuFailedPrecondition) as info:
            check_restore(case.recorded, case.current, case.driver, container_id="job-7")
        text = str(info.value)
        assert text.startswith("GPU: cannot restore the GPU state of container job-7: ")
        for fragment in case.refusal:
            assert fragment in text
        assert isinstance(info.value, errors.FailedPrecondition)
    else:
        mapping = check_restore(case.recorded, case.current, case.driver)
        assert dict(mapping.device_map) == case.device_map
        assert mapping.notes
        assert len(mapping.pairs) == len(case.recorded.devices)


def test_less_memory_is_refused() -> None:
    small = GpuDevice(0, "GPU-b0", H200, MEM[H200] - 1, "", False)
    with pytest.raises(GpuFailedPrecondition, match="less than"):
        check_restore(inv(A0), inv(small))


def test_metadata_dicts_are_accepted_and_restricted_to_the_visible_gpus() -> None:
    node = inv(A0, A1)
    meta = {"inventory": node.to_dict(), "visible": [A1.uuid], "processes": []}
    recorded = recorded_inventory(meta)
    assert recorded.devices == (A1,)
    mapping = check_restore(recorded.to_dict(), inv(B0).to_dict())
    assert dict(mapping.device_map) == {A1.uuid: B0.uuid}
    assert mapping.to_dict()["pairs"] == [[A1.uuid, B0.uuid]]
    assert recorded_inventory({"inventory": node.to_dict()}) == node


@pytest.mark.parametrize(
    ("text", "version"),
    [("580.65.06", (580, 65, 6)), ("570.86.10", (570, 86, 10)), ("595", (595,)), ("", ())],
)
def test_parse_driver_version(text: str, version: tuple[int, ...]) -> None:
    assert parse_driver_version(text) == version


@pytest.mark.parametrize(
    ("visible", "expected"),
    [
        (None, (A0, A1)),
        ("all", (A0, A1)),
        ("none", ()),
        ("void", ()),
        ("", ()),
        ("1", (A1,)),
        ("1,0", (A1, A0)),
        (f"{A1.uuid}", (A1,)),
        ("GPU-aaaa1", (A1,)),  # a unique prefix is enough
    ],
)
def test_select_follows_nvidia_visible_devices(
    visible: str | None, expected: tuple[GpuDevice, ...]
) -> None:
    assert inv(A0, A1).select(visible).devices == expected


@pytest.mark.parametrize("visible", ["2", "GPU-zzzz", "GPU-aaaa"])  # missing, missing, ambiguous
def test_select_refuses_gpus_the_node_does_not_have(visible: str) -> None:
    with pytest.raises(GpuUnavailable, match="not a GPU of this node"):
        inv(A0, A1).select(visible)
