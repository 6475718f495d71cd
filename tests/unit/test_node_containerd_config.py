"""Where the installer registers the runtime: the pure planning rules."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest
import yaml
from cedana_shim.node import containerd_config as cc
from cedana_shim.node import registration as reg

REPO = Path(__file__).resolve().parents[2]
V16 = (1, 6, 20)
V21 = (2, 1, 9)

CRI_V2 = b"""version = 2
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "example/pause:1"
  [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
    runtime_type = "io.containerd.runc.v2"
"""


def snap(
    main: bytes | None,
    ctrd: tuple[int, int, int] | None = V16,
    imported: tuple[tuple[str, bytes], ...] = (),
) -> cc.Snapshot:
    return cc.Snapshot(
        cc.ConfigFile("/etc/containerd/config.toml", main),
        tuple(cc.ConfigFile(p, d) for p, d in imported),
        ctrd,
    )


def runtimes(text: bytes, version: int) -> dict[str, object]:
    node: object = tomllib.loads(text.decode())
    for key in reg.runtimes_path(version):
        assert isinstance(node, dict)
        node = node[key]
    assert isinstance(node, dict)
    return node


@pytest.mark.parametrize("version", [2, 3])
def test_rendered_dropin_is_the_documented_one(version: int) -> None:
    documented = (REPO / f"runtimeclass/containerd-config-v{version}.toml").read_text()
    assert tomllib.loads(reg.render_dropin(version)) == tomllib.loads(documented)


def test_runtimeclass_matches_the_documented_one() -> None:
    documented = yaml.safe_load((REPO / "runtimeclass/runtimeclass.yaml").read_text())
    assert reg.runtimeclass_manifest() == documented


def test_edit_appends_a_block_that_strips_back_exactly() -> None:
    plan = cc.plan_registration(snap(CRI_V2))
    assert plan.mode == "edit" and plan.target == "/etc/containerd/config.toml"
    assert plan.content is not None and plan.content.startswith(CRI_V2)
    rts = runtimes(plan.content, 2)
    assert rts["cedana"] == reg.runtime_table(2)
    assert set(rts) == {"runc", "cedana"}  # the node's runc is there: no default added
    assert cc.restore_edited(plan.content) == CRI_V2
    again = cc.plan_registration(snap(plan.content))
    assert again.content == plan.content, "a second install must not change the file"


def test_a_file_without_trailing_newline_still_strips_to_a_valid_config() -> None:
    plan = cc.plan_registration(snap(CRI_V2.rstrip(b"\n")))
    assert plan.content is not None
    tomllib.loads(plan.content.decode())


def test_containerd_1x_gets_runc_back_when_no_file_names_it() -> None:
    plain = b'version = 2\n[plugins."io.containerd.grpc.v1.cri"]\n  sandbox_image = "p"\n'
    plan = cc.plan_registration(snap(plain))
    assert plan.content is not None
    rts = runtimes(plan.content, 2)
    assert rts["runc"] == {"runtime_type": "io.containerd.runc.v2"}
    assert any("default runc runtime" in r for r in plan.reasons)
    # 2.x merges its defaults: nothing extra there.
    plan21 = cc.plan_registration(snap(plain, V21))
    assert plan21.content is not None and set(runtimes(plan21.content, 2)) == {"cedana"}


def test_v3_with_imports_gets_a_dropin_and_the_main_file_is_untouched() -> None:
    main = b"version = 3\nimports = ['/etc/containerd/conf.d/*.toml']\n"
    plan = cc.plan_registration(snap(main, V21))
    assert plan.mode == "dropin"
    assert plan.target == "/etc/containerd/conf.d/99-cedana.toml"
    assert plan.content is not None
    assert runtimes(plan.content, 3)["cedana"] == reg.runtime_table(3)


@pytest.mark.parametrize(
    ("pattern", "expected"),
    [
        ("/etc/containerd/conf.d/*.conf", "/etc/containerd/conf.d/99-cedana.conf"),
        ("/etc/containerd/conf.d/*", "/etc/containerd/conf.d/99-cedana.toml"),
        ("/etc/containerd/conf.d/[^0]*.toml", "/etc/containerd/conf.d/99-cedana.toml"),
        ("/etc/containerd/conf.d/c*.toml", "/etc/containerd/conf.d/cedana.toml"),
        ("/etc/containerd/runtimes.toml", None),  # a literal import is someone's file
        ("/etc/*/conf.d/*.toml", None),  # a glob in the directory: no single place
    ],
)
def test_dropin_names_match_the_glob(pattern: str, expected: str | None) -> None:
    assert cc.dropin_target([pattern]) == expected


def test_relative_imports_follow_containerd() -> None:
    main = cc.ConfigFile("/etc/containerd/config.toml", b"")
    parsed = {"imports": ["conf.d/*.toml", "extra.toml"]}
    # 1.x hands a relative glob to filepath.Glob (the working dir, / under systemd).
    assert cc.import_patterns(main, parsed, V16) == [
        "/conf.d/*.toml",
        "/etc/containerd/extra.toml",
    ]
    assert cc.import_patterns(main, parsed, V21) == [
        "/etc/containerd/conf.d/*.toml",
        "/etc/containerd/extra.toml",
    ]


def test_1x_imports_with_the_cri_table_in_the_main_file_edit_it() -> None:
    main = CRI_V2.replace(b"version = 2\n", b'version = 2\nimports = ["/etc/c.d/*.toml"]\n')
    plan = cc.plan_registration(snap(main))
    assert plan.mode == "edit" and plan.target == "/etc/containerd/config.toml"
    assert any("replaces a whole plugin table" in r for r in plan.reasons)


def test_1x_edits_the_imported_file_that_configures_cri() -> None:
    main = b'version = 2\nimports = ["/etc/c.d/*.toml"]\n'
    imported = (("/etc/c.d/10-cri.toml", CRI_V2),)
    plan = cc.plan_registration(snap(main, V16, imported))
    assert plan.mode == "edit" and plan.target == "/etc/c.d/10-cri.toml"
    assert plan.content is not None and plan.content.startswith(CRI_V2)


def test_1x_dropin_when_no_file_configures_cri() -> None:
    main = b'version = 2\nimports = ["/etc/c.d/*.toml"]\n'
    plan = cc.plan_registration(snap(main))
    assert plan.mode == "dropin" and plan.target == "/etc/c.d/99-cedana.toml"
    assert plan.content is not None and "runc" in runtimes(plan.content, 2)


def test_no_config_creates_one_for_the_containerd_version() -> None:
    for ctrd, version in ((V16, 2), (V21, 3), (None, 2)):
        plan = cc.plan_registration(snap(None, ctrd))
        assert plan.mode == "create" and plan.config_version == version
        assert plan.content is not None
        assert tomllib.loads(plan.content.decode())["version"] == version


def test_a_matching_registration_by_hand_is_left_alone() -> None:
    by_hand = CRI_V2 + reg.render_tables(2).encode()
    plan = cc.plan_registration(snap(by_hand))
    assert plan.mode == "present" and plan.content is None


def test_a_different_registration_by_hand_is_refused() -> None:
    other = CRI_V2 + b'[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.cedana]\n'
    other += b'  runtime_type = "io.containerd.other.v1"\n'
    with pytest.raises(cc.ConfigError, match="already defines a 'cedana' runtime"):
        cc.plan_registration(snap(other))


@pytest.mark.parametrize(
    ("body", "ctrd", "message"),
    [
        (b"[plugins\nx = \n", V16, r"config.toml is not valid TOML \(.*line 1"),
        (b'root = "/var/lib/containerd"\n', V16, "has no `version`"),
        (b"version = 1\n", V16, "version 1 is not supported"),
        (b"version = 3\n", V16, "reads at most version 2"),
        (b"version = 2\nimports = 3\n", V16, "must be a list"),
    ],
)
def test_unusable_configs_are_reported(
    body: bytes, ctrd: tuple[int, int, int], message: str
) -> None:
    with pytest.raises(cc.ConfigError, match=message):
        cc.plan_registration(snap(body, ctrd))


def test_invalid_imported_file_is_named() -> None:
    main = b'version = 2\nimports = ["/etc/c.d/*.toml"]\n'
    with pytest.raises(cc.ConfigError, match=r"/etc/c\.d/bad\.toml is not valid TOML"):
        cc.plan_registration(snap(main, V16, (("/etc/c.d/bad.toml", b"x = [\n"),)))


@pytest.mark.parametrize(
    ("text", "version"),
    [
        ("containerd github.com/containerd/containerd 1.6.20~ds1 1.6.20~ds1-1+deb12u3", V16),
        ("containerd github.com/containerd/containerd/v2 2.1.9+unknown ", V21),
        ("containerd containerd.io v1.7.24 88bf19b2", (1, 7, 24)),
        ("nonsense", None),
    ],
)
def test_containerd_version_parsing(text: str, version: tuple[int, int, int] | None) -> None:
    assert cc.parse_containerd_version(text) == version


def test_handler_is_found_in_cri_status_config() -> None:
    config = {"containerd": {"runtimes": {"cedana": {"runtimeType": reg.RUNTIME_TYPE}}}}
    assert cc.handler_in_cri_config(config) == reg.RUNTIME_TYPE
    assert cc.handler_in_cri_config({"containerd": {"runtimes": {}}}) is None
