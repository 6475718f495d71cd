"""hooks.d parsing and loading: what a valid file becomes, what each invalid one
is refused with (file + field + reason), name order and directory masking, and
a Hypothesis check that the parser only ever raises HookConfigError."""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path
from typing import Any

import pytest
from cedana_shim import errors
from cedana_shim.hooks.config import (
    MAX_FILE_BYTES,
    HookConfig,
    HookConfigError,
    Stage,
    load,
    parse,
)
from hypothesis import given, settings
from hypothesis import strategies as st
from support.examples import examples

SRC = "/etc/cedana/hooks.d/50-x.json"
BASE: dict[str, Any] = {
    "version": "1.0.0",
    "hook": {"path": "/usr/bin/true"},
    "when": {"always": True},
    "stages": ["precheckpoint"],
}


def with_(path: str, value: Any) -> dict[str, Any]:
    """BASE with the dotted ``path`` set to ``value`` (or removed when value is DEL)."""
    doc = copy.deepcopy(BASE)
    *parents, last = path.split(".")
    node = doc
    for key in parents:
        node = node[key]
    if value is DEL:
        del node[last]
    else:
        node[last] = value
    return doc


DEL = object()


def test_full_file() -> None:
    text = json.dumps(
        {
            "version": "1.0.0",
            "hook": {
                "path": "/opt/hooks/quiesce",
                "args": ["quiesce", "--db"],
                "env": ["A=1", "B=x=y"],
                "timeout": 20,
            },
            "when": {
                "always": True,
                "annotations": {"^io\\.example/db$": "^postgres"},
                "commands": [".*/postgres$"],
                "hasBindMounts": True,
            },
            "stages": ["precheckpoint", "postcheckpoint", "precheckpoint", "prestart"],
        }
    )
    config = parse(text, source=SRC)
    assert config.name == "50-x.json"
    assert config.source == SRC
    assert config.hook.path == "/opt/hooks/quiesce"
    assert config.hook.argv == ("quiesce", "--db")
    assert config.hook.env == ("A=1", "B=x=y")
    assert config.hook.timeout == 20
    assert config.when.always is True
    assert config.when.has_bind_mounts is True
    [(key_re, value_re)] = config.when.annotations
    assert (key_re.pattern, value_re.pattern) == ("^io\\.example/db$", "^postgres")
    assert [r.pattern for r in config.when.commands] == [".*/postgres$"]
    assert config.stages == {Stage.PRECHECKPOINT, Stage.POSTCHECKPOINT, Stage.PRESTART}


def test_minimal_file_defaults() -> None:
    config = parse(json.dumps(BASE).encode(), source=SRC)
    assert config.hook.argv == ("/usr/bin/true",)  # no args: argv is (path,), as in runc
    assert config.hook.env is None  # inherit, as runc does
    assert config.hook.timeout is None
    assert config.when.annotations == () and config.when.commands == ()
    assert config.when.has_bind_mounts is None


@pytest.mark.parametrize("stage", [s.value for s in Stage])
def test_every_stage_is_accepted(stage: str) -> None:
    assert parse(json.dumps(with_("stages", [stage])), source=SRC).stages == {Stage(stage)}


INVALID: list[tuple[str, Any, str, str]] = [
    # (id, document or raw text, field, reason fragment)
    ("not-json", "{", "", "not JSON: Expecting property name"),
    ("not-utf8", b'{"a": "\xff"}', "", "not UTF-8"),
    ("array", [], "", "must be an object, not an array"),
    ("nan", '{"version": NaN}', "", "NaN is not JSON"),
    ("huge-int", '{"version": ' + "1" * 5000 + "}", "", "not usable JSON"),
    ("deep", "[" * 100_000, "", "not usable JSON"),
    (
        "duplicate",
        '{"version": "1.0.0", "version": "1.0.0"}',
        "version",
        "appears twice in one object",
    ),
    ("no-version", with_("version", DEL), "version", 'missing (this reader knows "1.0.0")'),
    ("old-version", with_("version", "0.1.0"), "version", '"0.1.0" is not supported'),
    ("numeric-version", with_("version", 1), "version", "a number is not supported"),
    ("unknown-top", {**BASE, "hooks": {}}, "hooks", "unknown key (expected one of hook,"),
    ("no-hook", with_("hook", DEL), "hook", "missing"),
    ("hook-string", with_("hook", "/bin/true"), "hook", "must be an object, not a string"),
    ("no-path", with_("hook.path", DEL), "hook.path", "missing"),
    (
        "relative-path",
        with_("hook.path", "true"),
        "hook.path",
        'must be an absolute path, not "true"',
    ),
    ("numeric-path", with_("hook.path", 5), "hook.path", "must be a string, not a number"),
    ("nul-path", with_("hook.path", "/bin/t\0rue"), "hook.path", "contains a NUL byte"),
    ("unknown-hook", with_("hook.cmd", "x"), "hook.cmd", "unknown key"),
    ("args-string", with_("hook.args", "x"), "hook.args", "must be an array of strings"),
    ("args-number", with_("hook.args", ["x", 1]), "hook.args[1]", "must be a string, not a number"),
    (
        "env-no-eq",
        with_("hook.env", ["A=1", "NOEQ"]),
        "hook.env[1]",
        'must be KEY=VALUE, not "NOEQ"',
    ),
    ("env-no-key", with_("hook.env", ["=v"]), "hook.env[0]", "must be KEY=VALUE"),
    ("env-nul", with_("hook.env", ["A=\0"]), "hook.env[0]", "contains a NUL byte"),
    ("timeout-zero", with_("hook.timeout", 0), "hook.timeout", "must be between 1 and 86400"),
    ("timeout-negative", with_("hook.timeout", -3), "hook.timeout", "must be between 1 and"),
    ("timeout-huge", with_("hook.timeout", 10**30), "hook.timeout", "must be between 1 and"),
    ("timeout-float", with_("hook.timeout", 1.5), "hook.timeout", "must be a whole number"),
    ("timeout-bool", with_("hook.timeout", True), "hook.timeout", "not a boolean"),
    ("timeout-string", with_("hook.timeout", "5"), "hook.timeout", "not a string"),
    ("no-when", with_("when", DEL), "when", "missing"),
    ("empty-when", with_("when", {}), "when", "set at least one of always, annotations,"),
    # podman once shipped this misspelling; here it is refused, not ignored
    ("annotation-typo", with_("when", {"annotation": {"a": "b"}}), "when.annotation", "unknown"),
    ("always-string", with_("when.always", "yes"), "when.always", "must be true or false"),
    ("bind-number", with_("when", {"hasBindMounts": 1}), "when.hasBindMounts", "true or false"),
    ("annotations-empty", with_("when", {"annotations": {}}), "when.annotations", "is empty"),
    ("annotations-list", with_("when", {"annotations": ["a"]}), "when.annotations", "an array"),
    (
        "annotation-key-regex",
        with_("when", {"annotations": {"(": "x"}}),
        'when.annotations["("]',
        'bad regular expression "("',
    ),
    (
        "annotation-value-regex",
        with_("when", {"annotations": {"a": "["}}),
        'when.annotations["a"]',
        'bad regular expression "["',
    ),
    (
        "annotation-value-number",
        with_("when", {"annotations": {"a": 1}}),
        'when.annotations["a"]',
        "must be a string",
    ),
    ("commands-empty", with_("when", {"commands": []}), "when.commands", "is empty"),
    (
        "commands-regex",
        with_("when", {"commands": ["ok", "a{4294967296}"]}),
        "when.commands[1]",
        "bad regular expression",
    ),
    ("no-stages", with_("stages", DEL), "stages", "missing"),
    ("stages-empty", with_("stages", []), "stages", "is empty: the hook would never run"),
    ("stages-string", with_("stages", "precheckpoint"), "stages", "must be an array"),
    (
        "stage-case",
        with_("stages", ["postrestore", "preCheckpoint"]),
        "stages[1]",
        'unknown stage "preCheckpoint" (known: prestart, createRuntime,',
    ),
]


@pytest.mark.parametrize(
    ("doc", "field", "reason"), [c[1:] for c in INVALID], ids=[c[0] for c in INVALID]
)
def test_invalid_files_name_file_and_field(doc: Any, field: str, reason: str) -> None:
    data = doc if isinstance(doc, str | bytes) else json.dumps(doc)
    with pytest.raises(HookConfigError) as caught:
        parse(data, source=SRC)
    err = caught.value
    assert err.source == SRC
    assert err.field == field
    assert reason in err.reason
    where = f"{SRC}: {field}" if field else SRC
    assert str(err) == f"hooks file {where}: {err.reason}"
    assert isinstance(err, errors.FailedPrecondition)


# -- directories ------------------------------------------------------------------


def write(directory: Path, name: str, **top: Any) -> Path:
    directory.mkdir(parents=True, exist_ok=True)
    path = directory / name
    path.write_text(json.dumps({**BASE, **top}))
    return path


def test_missing_directories_are_no_hooks(tmp_path: Path) -> None:
    catalog = load([str(tmp_path / "nope"), str(tmp_path / "nor-this")])
    assert catalog.hooks == () and catalog.errors == ()


def test_order_is_lowercased_file_name(tmp_path: Path) -> None:
    d = tmp_path / "hooks.d"
    for name in ["b.json", "a.json", "A.json", "01-z.json", "10-b.json", "02-B.json"]:
        write(d, name)
    (d / "README").write_text("not a hook")
    (d / "c.json~").write_text("{")  # editor backups are not hooks
    names = [h.name for h in load([str(d)]).hooks]
    assert names == ["01-z.json", "02-B.json", "10-b.json", "A.json", "a.json", "b.json"]


def test_later_directory_masks_same_name(tmp_path: Path) -> None:
    vendor, admin = tmp_path / "usr", tmp_path / "etc"
    write(vendor, "10-x.json", hook={"path": "/vendor/x"})
    write(vendor, "20-y.json", hook={"path": "/vendor/y"})
    write(admin, "10-x.json", hook={"path": "/admin/x"})
    write(admin, "05-z.json", hook={"path": "/admin/z"})
    catalog = load([str(vendor), str(admin)])
    assert [(h.name, h.hook.path) for h in catalog.hooks] == [
        ("05-z.json", "/admin/z"),
        ("10-x.json", "/admin/x"),
        ("20-y.json", "/vendor/y"),
    ]
    assert catalog.hooks[1].source == str(admin / "10-x.json")
    # and the other way round the vendor file wins
    assert load([str(admin), str(vendor)]).hooks[1].hook.path == "/vendor/x"


def test_broken_file_is_reported_and_masks_the_good_one(tmp_path: Path) -> None:
    vendor, admin = tmp_path / "usr", tmp_path / "etc"
    write(vendor, "10-x.json")
    write(vendor, "20-ok.json")
    (admin / "10-x.json").parent.mkdir()
    (admin / "10-x.json").write_text('{"version": "1.0.0"')
    catalog = load([str(vendor), str(admin)])
    assert [h.name for h in catalog.hooks] == ["20-ok.json"]
    [err] = catalog.errors
    assert err.source == str(admin / "10-x.json")
    assert "not JSON" in str(err)


def test_unreadable_entries(tmp_path: Path) -> None:
    d = tmp_path / "hooks.d"
    (d / "dir.json").mkdir(parents=True)
    (d / "big.json").write_bytes(b" " * (MAX_FILE_BYTES + 1))
    not_a_dir = tmp_path / "file"
    not_a_dir.write_text("")
    catalog = load([str(d), str(not_a_dir)])
    assert catalog.hooks == ()
    reasons = sorted(str(e) for e in catalog.errors)
    assert any("big.json: larger than" in r for r in reasons)
    assert any("dir.json: cannot read" in r or "not a regular file" in r for r in reasons)
    assert any(f"{not_a_dir}: cannot list: Not a directory" in r for r in reasons)


def test_symlinked_file_is_followed(tmp_path: Path) -> None:
    target = write(tmp_path / "elsewhere", "real.json")
    d = tmp_path / "hooks.d"
    d.mkdir()
    os.symlink(target, d / "30-link.json")
    assert [h.name for h in load([str(d)]).hooks] == ["30-link.json"]


# -- property: only HookConfigError ------------------------------------------------

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=6), inner),
    max_leaves=12,
)
paths = st.sampled_from(["/bin/true", "rel", "", "/x\0y"]) | st.text(max_size=10)
regexes = st.sampled_from(["^a$", "(", "[", ".*", "a{99999999999}", "(?P<a>x)(?P<a>y)"])
near_valid = st.fixed_dictionaries(
    {},
    optional={
        "version": st.sampled_from(["1.0.0", "0.1.0", ""]) | json_values,
        "hook": st.fixed_dictionaries(
            {},
            optional={
                "path": paths | json_values,
                "args": st.lists(st.text(max_size=5)) | json_values,
                "env": st.lists(st.sampled_from(["A=1", "=x", "B", "C=\0"]) | st.text(max_size=5)),
                "timeout": st.integers(min_value=-2, max_value=10**6) | json_values,
                "extra": json_values,
            },
        )
        | json_values,
        "when": st.fixed_dictionaries(
            {},
            optional={
                "always": st.booleans() | json_values,
                "annotations": st.dictionaries(
                    regexes | st.text(max_size=4), regexes | json_values
                ),
                "commands": st.lists(regexes | st.text(max_size=4)) | json_values,
                "hasBindMounts": st.booleans() | json_values,
            },
        )
        | json_values,
        "stages": st.lists(st.sampled_from([s.value for s in Stage]) | st.text(max_size=6))
        | json_values,
        "junk": json_values,
    },
)


def check_parse(data: str | bytes) -> None:
    try:
        config = parse(data, source=SRC)
    except HookConfigError as err:
        assert err.source == SRC
        return
    assert isinstance(config, HookConfig)
    assert os.path.isabs(config.hook.path) and config.stages
    assert config.hook.timeout is None or config.hook.timeout > 0


@settings(max_examples=examples(400), deadline=None)
@given(near_valid)
def test_parser_never_crashes_on_documents(doc: dict[str, Any]) -> None:
    check_parse(json.dumps(doc))


@settings(max_examples=examples(200), deadline=None)
@given(st.binary(max_size=200) | st.text(max_size=200))
def test_parser_never_crashes_on_bytes(data: bytes | str) -> None:
    check_parse(data)
