"""Which hooks apply to a container: containers/common's 1.0.0 ``when`` rules
(conditions ANDed, regexes searched, ``false`` conditions never hold)."""

from __future__ import annotations

import json
from typing import Any

import pytest
from cedana_shim.hooks.config import HookConfig, Stage, parse
from cedana_shim.hooks.match import has_bind_mounts, matches, select


def config(
    when: dict[str, Any], stages: tuple[str, ...] = ("precheckpoint",), name: str = "x"
) -> HookConfig:
    doc = {"version": "1.0.0", "hook": {"path": "/bin/true"}, "when": when, "stages": list(stages)}
    return parse(json.dumps(doc), source=f"/hooks.d/{name}.json")


def spec(
    annotations: dict[str, str] | None = None,
    args: list[str] | None = None,
    mounts: list[dict[str, Any]] | None = None,
) -> dict[str, Any]:
    out: dict[str, Any] = {"process": {"args": args if args is not None else ["/bin/sh"]}}
    if annotations is not None:
        out["annotations"] = annotations
    if mounts is not None:
        out["mounts"] = mounts
    return out


def bind(
    destination: str, *, options: tuple[str, ...] = ("rbind", "ro"), **extra: Any
) -> dict[str, Any]:
    return {
        "destination": destination,
        "source": "/host" + destination,
        "options": list(options),
        **extra,
    }


CASES: list[tuple[str, dict[str, Any], dict[str, Any], bool]] = [
    ("always", {"always": True}, spec(), True),
    ("always-false-never", {"always": False}, spec(), False),
    ("always-false-beats-match", {"always": False, "commands": ["sh"]}, spec(), False),
    # annotations: every key pattern needs one annotation whose key AND value match
    ("ann-match", {"annotations": {"^io\\.x/db$": "^pg"}}, spec({"io.x/db": "pg15"}), True),
    ("ann-value-miss", {"annotations": {"^io\\.x/db$": "^pg"}}, spec({"io.x/db": "mysql"}), False),
    (
        "ann-pair-not-mixed",  # key of one annotation, value of another
        {"annotations": {"^a$": "^1$"}},
        spec({"a": "2", "b": "1"}),
        False,
    ),
    (
        "ann-any-matching-pair",
        {"annotations": {"^a": "^1$"}},
        spec({"ab": "2", "ac": "1"}),
        True,
    ),
    ("ann-unanchored", {"annotations": {"x": "y"}}, spec({"a.x.b": "zzyzz"}), True),
    (
        "ann-all-patterns",
        {"annotations": {"^a$": ".", "^b$": "."}},
        spec({"a": "1"}),
        False,
    ),
    (
        "ann-all-patterns-present",
        {"annotations": {"^a$": ".", "^b$": "."}},
        spec({"a": "1", "b": "2"}),
        True,
    ),
    ("ann-none", {"annotations": {".": ".*"}}, spec(), False),
    # commands: process.args[0], searched
    ("cmd-match", {"commands": [".*/postgres$"]}, spec(args=["/usr/lib/postgres", "-D"]), True),
    ("cmd-search", {"commands": ["python"]}, spec(args=["/usr/bin/python3"]), True),
    ("cmd-any", {"commands": ["^nope$", "sh$"]}, spec(args=["/bin/sh"]), True),
    ("cmd-only-argv0", {"commands": ["-D"]}, spec(args=["/usr/lib/postgres", "-D"]), False),
    ("cmd-no-args", {"commands": ["."]}, spec(args=[]), False),
    # hasBindMounts
    ("bind-yes", {"hasBindMounts": True}, spec(mounts=[bind("/data")]), True),
    (
        "bind-type",
        {"hasBindMounts": True},
        spec(mounts=[bind("/d", options=(), type="bind")]),
        True,
    ),
    (
        "bind-none",
        {"hasBindMounts": True},
        spec(mounts=[{"destination": "/proc", "type": "proc"}]),
        False,
    ),
    (
        "bind-runtime-only",  # what every CRI container has does not count
        {"hasBindMounts": True},
        spec(mounts=[bind("/etc/hosts"), bind("/etc/resolv.conf"), bind("/dev/shm")]),
        False,
    ),
    ("bind-false-never", {"hasBindMounts": False}, spec(mounts=[]), False),
    # combined: ANDed
    (
        "and-all-hold",
        {"always": True, "commands": ["sh$"], "annotations": {"a": "1"}, "hasBindMounts": True},
        spec({"a": "1"}, ["/bin/sh"], [bind("/data")]),
        True,
    ),
    (
        "and-one-fails",
        {"always": True, "commands": ["sh$"], "annotations": {"a": "1"}, "hasBindMounts": True},
        spec({"a": "1"}, ["/bin/bash2"], [bind("/data")]),
        False,
    ),
    ("and-bind-fails", {"commands": ["sh$"], "hasBindMounts": True}, spec(args=["/bin/sh"]), False),
]


@pytest.mark.parametrize(
    ("when", "container", "expected"), [c[1:] for c in CASES], ids=[c[0] for c in CASES]
)
def test_when(when: dict[str, Any], container: dict[str, Any], expected: bool) -> None:
    assert matches(config(when).when, container) is expected


@pytest.mark.parametrize(
    "bad",
    [
        {"annotations": ["a"], "process": "x", "mounts": "y"},
        {"annotations": {"a": 1, 2: "b"}, "process": {"args": "sh"}, "mounts": [1, None]},
        {"process": {"args": [None]}, "mounts": [{"options": "rbind", "destination": "/d"}]},
        {},
    ],
)
def test_malformed_spec_never_matches_and_never_raises(bad: dict[str, Any]) -> None:
    for when in ({"annotations": {".*": ".*"}}, {"commands": [".*"]}, {"hasBindMounts": True}):
        assert matches(config(when).when, bad) is False
    assert matches(config({"always": True}).when, bad) is True


def test_has_bind_mounts() -> None:
    assert not has_bind_mounts({})
    assert has_bind_mounts(spec(mounts=[bind("/etc/hosts"), bind("/models")]))


def test_select_keeps_order_and_filters_stage() -> None:
    hooks = [
        config({"always": True}, ("precheckpoint",), "01"),
        config({"always": True}, ("postcheckpoint",), "02"),
        config({"commands": ["^nope$"]}, ("precheckpoint",), "03"),
        config({"always": True}, ("prerestore", "precheckpoint"), "04"),
    ]
    assert [h.name for h in select(hooks, Stage.PRECHECKPOINT, spec())] == ["01.json", "04.json"]
    assert [h.name for h in select(hooks, Stage.POSTRESTORE, spec())] == []
