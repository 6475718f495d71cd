"""Where the installer registers the runtime: the pure planning rules."""

from __future__ import annotations

import tomllib
from pathlib import Path

import pytest
import yaml
from cedana_shim.node import config_blocks
from cedana_shim.node import containerd_config as cc
from cedana_shim.node import registration as reg
from cedana_shim.node.cri import CriRuntimes, HandlerStatus, runtimes_in_cri_config

REPO = Path(__file__).resolve().parents[2]
V16 = (1, 6, 20)
V17 = (1, 7, 24)
V21 = (2, 1, 9)
OWN_TYPE = None  # shim_path for containerd 1.6's form: the shim's own runtime type

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
    assert rts["cedana"] == reg.runtime_table(2, OWN_TYPE)
    assert set(rts) == {"runc", "cedana"}  # the node's runc is there: no default added
    assert config_blocks.restore_edited(plan.content) == CRI_V2
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


@pytest.mark.parametrize(
    ("ctrd", "shim_path"),
    [
        (V16, OWN_TYPE),
        (V17, reg.DEFAULT_SHIM_PATH),
        (V17, "/opt/cedana/bin/containerd-shim-cedana-v2"),
    ],
)
def test_a_matching_registration_by_hand_is_left_alone(
    ctrd: tuple[int, int, int], shim_path: str | None
) -> None:
    by_hand = CRI_V2 + reg.render_tables(2, shim_path).encode()
    plan = cc.plan_registration(snap(by_hand, ctrd))
    assert plan.mode == "present" and plan.content is None


@pytest.mark.parametrize(
    ("ctrd", "version", "table"),
    [
        (
            V16,
            2,
            {"runtime_type": reg.RUNTIME_TYPE, "options": {"ConfigPath": "/etc/cedana/shim.toml"}},
        ),
        (
            None,
            2,
            {"runtime_type": reg.RUNTIME_TYPE, "options": {"ConfigPath": "/etc/cedana/shim.toml"}},
        ),
        (V17, 2, {"runtime_type": reg.RUNC_TYPE, "runtime_path": "/b/containerd-shim-cedana-v2"}),
        (V21, 3, {"runtime_type": reg.RUNC_TYPE, "runtime_path": "/b/containerd-shim-cedana-v2"}),
        (None, 3, {"runtime_type": reg.RUNC_TYPE, "runtime_path": "/b/containerd-shim-cedana-v2"}),
    ],
)
def test_containerd_from_1_7_runs_the_shim_as_a_runc_type_runtime(
    ctrd: tuple[int, int, int] | None, version: int, table: dict[str, object]
) -> None:
    """1.7 and 2.x run runtime_path (and 2.0-2.3.3 introspect only runc-type runtimes);
    1.6's CRI ignores it, and a containerd of unknown version reading config version
    2 may be 1.6."""
    plan = cc.plan_registration(
        snap(b"version = 3\n" if version == 3 else CRI_V2, ctrd),
        cc.Wanted(shim_path="/b/containerd-shim-cedana-v2"),
    )
    assert plan.content is not None
    cedana = runtimes(plan.content, version)["cedana"]
    assert isinstance(cedana, dict)
    assert {
        k: v for k, v in cedana.items() if k in ("runtime_type", "runtime_path", "options")
    } == table
    assert plan.shim_path == table.get("runtime_path")
    created = cc.plan_registration(snap(None, ctrd), cc.Wanted(shim_path="/b/x"))
    assert created.shim_path == ("/b/x" if reg.honours_runtime_path(ctrd, 2) else None)


def test_a_runc_type_registration_by_hand_must_run_the_cedana_shim() -> None:
    runc_shim = CRI_V2 + reg.render_tables(2, "/usr/bin/containerd-shim-runc-v2").encode()
    with pytest.raises(cc.ConfigError, match="already defines a 'cedana' runtime"):
        cc.plan_registration(snap(runc_shim, V17))
    own_type = CRI_V2 + reg.render_tables(2, OWN_TYPE).encode()
    with pytest.raises(cc.ConfigError, match="already defines a 'cedana' runtime"):
        cc.plan_registration(snap(own_type, V17))


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


def test_handler_and_default_are_found_in_cri_status_config() -> None:
    entry = {"runtimeType": reg.RUNC_TYPE, "runtimePath": reg.DEFAULT_SHIM_PATH}
    config = {"containerd": {"defaultRuntimeName": "cedana", "runtimes": {"cedana": entry}}}
    assert runtimes_in_cri_config(config) == CriRuntimes(
        reg.RUNC_TYPE, reg.DEFAULT_SHIM_PATH, "cedana"
    )
    bare = {"containerd": {"defaultRuntimeName": "runc", "runtimes": {}}}
    assert runtimes_in_cri_config(bare) == CriRuntimes(None, None, "runc")
    assert runtimes_in_cri_config({}) == CriRuntimes(None, None, None)


# -- the default runtime, the runc binary, the nvidia runtime ----------------------------

DEFAULT_ON = cc.Wanted(default_runtime=True)
# What `containerd config default` prints around the key (1.6/1.7, and 2.x's version 3).
STOCK_V2 = b"""version = 2

[plugins]
  [plugins."io.containerd.grpc.v1.cri"]
    sandbox_image = "registry.k8s.io/pause:3.8"
    [plugins."io.containerd.grpc.v1.cri".containerd]
      default_runtime_name = "runc"
      snapshotter = "overlayfs"
      [plugins."io.containerd.grpc.v1.cri".containerd.runtimes]
        [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
          runtime_type = "io.containerd.runc.v2"
"""
STOCK_V3 = b"""version = 3

[plugins]
  [plugins.'io.containerd.cri.v1.runtime']
    [plugins.'io.containerd.cri.v1.runtime'.containerd]
      default_runtime_name = 'runc'
      [plugins.'io.containerd.cri.v1.runtime'.containerd.runtimes.runc]
        runtime_type = 'io.containerd.runc.v2'
"""


def default_name(text: bytes, version: int) -> object:
    node: object = tomllib.loads(text.decode())
    for key in (*reg.containerd_path(version), reg.DEFAULT_RUNTIME_KEY):
        assert isinstance(node, dict)
        node = node.get(key)
    return node


@pytest.mark.parametrize(
    ("stock", "ctrd", "version", "shim_path"),
    [
        (STOCK_V2, V16, 2, OWN_TYPE),
        (STOCK_V2, V17, 2, reg.DEFAULT_SHIM_PATH),
        (STOCK_V3, V21, 3, reg.DEFAULT_SHIM_PATH),
    ],
)
def test_default_runtime_replaces_the_nodes_line_and_strips_back_exactly(
    stock: bytes, ctrd: tuple[int, int, int], version: int, shim_path: str | None
) -> None:
    plan = cc.plan_registration(snap(stock, ctrd), DEFAULT_ON)
    assert plan.mode == "edit" and plan.content is not None
    assert plan.default_runtime and plan.previous_default == "runc"
    assert default_name(plan.content, version) == "cedana"
    assert runtimes(plan.content, version)["cedana"] == reg.runtime_table(version, shim_path)
    assert set(runtimes(plan.content, version)) == {"runc", "cedana"}
    assert config_blocks.restore_edited(plan.content) == stock
    again = cc.plan_registration(snap(plan.content, ctrd), DEFAULT_ON)
    assert again.content == plan.content, "a second install must not change the file"
    assert again.previous_default == "runc", "the default before install, not ours"


def test_default_runtime_goes_into_a_containerd_table_without_the_key() -> None:
    main = STOCK_V2.replace(b'      default_runtime_name = "runc"\n', b"")
    plan = cc.plan_registration(snap(main), DEFAULT_ON)
    assert plan.content is not None and default_name(plan.content, 2) == "cedana"
    assert config_blocks.restore_edited(plan.content) == main


def test_default_runtime_table_is_added_where_the_file_has_none() -> None:
    plan = cc.plan_registration(snap(CRI_V2), DEFAULT_ON)
    assert plan.content is not None and plan.content.startswith(CRI_V2)
    assert default_name(plan.content, 2) == "cedana"
    assert config_blocks.restore_edited(plan.content) == CRI_V2


def test_opting_out_leaves_the_default_alone() -> None:
    plan = cc.plan_registration(snap(STOCK_V2))
    assert plan.content is not None and default_name(plan.content, 2) == "runc"
    assert not plan.default_runtime


def test_default_runtime_in_a_v3_dropin() -> None:
    main = b"version = 3\nimports = ['/etc/containerd/conf.d/*.toml']\n"
    plan = cc.plan_registration(snap(main, V21), DEFAULT_ON)
    assert plan.mode == "dropin" and plan.content is not None
    assert default_name(plan.content, 3) == "cedana"


def test_the_previous_default_follows_containerd_2x_merging() -> None:
    main = b"version = 3\nimports = ['/etc/c.d/*.toml']\n"
    kata = b"version = 3\n[plugins.'io.containerd.cri.v1.runtime'.containerd]\n"
    kata += b"default_runtime_name = 'kata'\n"
    plan = cc.plan_registration(snap(main, V21, (("/etc/c.d/10-kata.toml", kata),)), DEFAULT_ON)
    assert plan.previous_default == "kata" and plan.mode == "dropin"
    assert any("was 'kata'" in r for r in plan.reasons)


def test_a_registration_by_hand_still_gets_the_default() -> None:
    by_hand = STOCK_V2 + reg.render_tables(2, OWN_TYPE).encode()
    plan = cc.plan_registration(snap(by_hand), DEFAULT_ON)
    assert plan.mode == "edit" and plan.content is not None
    assert default_name(plan.content, 2) == "cedana"
    assert plan.content.count(b"runtimes.cedana]") == 1, "the tables are not added twice"
    assert config_blocks.restore_edited(plan.content) == by_hand
    done = cc.plan_registration(snap(plan.content), DEFAULT_ON)
    assert done.content == plan.content


def test_a_default_set_by_dotted_keys_is_refused_with_the_tables_to_add() -> None:
    dotted = b'version = 2\n[plugins."io.containerd.grpc.v1.cri"]\n'
    dotted += b'containerd.default_runtime_name = "runc"\n'
    with pytest.raises(cc.ConfigError, match="add them by hand"):
        cc.plan_registration(snap(dotted), DEFAULT_ON)


def test_runc_binary_becomes_the_handlers_binary_name() -> None:
    wanted = cc.Wanted(runc_binary="/usr/bin/nvidia-container-runtime")
    plan = cc.plan_registration(snap(STOCK_V3, V21), wanted)
    assert plan.content is not None
    options = runtimes(plan.content, 3)["cedana"]
    assert isinstance(options, dict)
    # runc's own options, as containerd hands a runc-type runtime.
    assert options["options"] == {"BinaryName": "/usr/bin/nvidia-container-runtime"}


@pytest.mark.parametrize(
    ("wanted", "ctrd", "message"),
    [
        (cc.Wanted(runc_binary="/x/runc"), V16, "1.6.20 passes the 'cedana' runtime only its"),
        (cc.Wanted("/etc/other.toml", runc_binary="/x/runc"), None, "either a ConfigPath or"),
        (cc.Wanted("/etc/other.toml"), V17, "options have no ConfigPath"),
        (cc.Wanted("/etc/other.toml"), V21, "options have no ConfigPath"),
    ],
)
def test_options_containerd_cannot_pass_on_are_refused(
    wanted: cc.Wanted, ctrd: tuple[int, int, int] | None, message: str
) -> None:
    with pytest.raises(cc.ConfigError, match=message):
        cc.plan_registration(snap(STOCK_V2, ctrd), wanted)


def test_the_nodes_nvidia_runtime_is_found() -> None:
    nvidia = b'[plugins."io.containerd.grpc.v1.cri".containerd.runtimes.nvidia]\n'
    nvidia += b'  runtime_type = "io.containerd.runc.v2"\n'
    nvidia += b'  [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.nvidia.options]\n'
    nvidia += b'    BinaryName = "/usr/bin/nvidia-container-runtime"\n'
    plan = cc.plan_registration(snap(STOCK_V2 + nvidia))
    assert plan.nvidia_binary == "/usr/bin/nvidia-container-runtime"
    assert cc.plan_registration(snap(STOCK_V2)).nvidia_binary is None


def test_an_inline_block_keeps_lines_that_look_like_markers() -> None:
    text = STOCK_V2.replace(b'"runc"\n', b'"runc" #| not ours\n', 1)
    plan = cc.plan_registration(snap(text), DEFAULT_ON)
    assert plan.content is not None
    assert config_blocks.restore_edited(plan.content) == text


SYSTEMD_RUNC = (
    b'  [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]\n'
    b"    SystemdCgroup = true\n"
)


def test_the_nodes_systemd_cgroup_driver_is_mirrored() -> None:
    """kubelet's pod cgroups are systemd slices when the node's runc uses systemd:
    cedana's runc must too, through the options table (no ConfigPath then)."""
    plan = cc.plan_registration(snap(CRI_V2 + SYSTEMD_RUNC, V17), DEFAULT_ON)
    assert plan.content is not None and plan.systemd_cgroup and not plan.systemd_cgroup_lost
    cedana = runtimes(plan.content, 2)["cedana"]
    assert isinstance(cedana, dict) and cedana["options"] == {"SystemdCgroup": True}
    with_binary = cc.Wanted(runc_binary="/usr/bin/nvidia-container-runtime")
    plan = cc.plan_registration(snap(CRI_V2 + SYSTEMD_RUNC, V21), with_binary)
    assert plan.content is not None
    assert runtimes(plan.content, 2)["cedana"]["options"] == {  # type: ignore[index]
        "BinaryName": "/usr/bin/nvidia-container-runtime",
        "SystemdCgroup": True,
    }
    again = cc.plan_registration(snap(plan.content, V21), with_binary)
    assert again.content == plan.content


@pytest.mark.parametrize(
    ("ctrd", "shim_config", "why"),
    [(V16, reg.DEFAULT_SHIM_CONFIG, "containerd 1.6"), (None, "/etc/x.toml", "--shim-config")],
)
def test_a_systemd_cgroup_driver_that_cannot_be_passed_on_is_flagged(
    ctrd: tuple[int, int, int] | None, shim_config: str, why: str
) -> None:
    plan = cc.plan_registration(snap(CRI_V2 + SYSTEMD_RUNC, ctrd), cc.Wanted(shim_config))
    assert plan.systemd_cgroup and plan.systemd_cgroup_lost and why in plan.systemd_cgroup_lost
    assert plan.content is not None
    assert runtimes(plan.content, 2)["cedana"]["options"] == {  # type: ignore[index]
        "ConfigPath": shim_config
    }


def test_a_cgroupfs_node_gets_no_options() -> None:
    off = CRI_V2 + SYSTEMD_RUNC.replace(b"true", b"false")
    plan = cc.plan_registration(snap(off, V21))
    assert not plan.systemd_cgroup and plan.content is not None
    cedana = runtimes(plan.content, 2)["cedana"]
    assert cedana == reg.runtime_table(2) and "options" not in cedana


@pytest.mark.parametrize(
    ("runtime_type", "runtime_path", "registered"),
    [
        (reg.RUNC_TYPE, reg.DEFAULT_SHIM_PATH, True),
        (reg.RUNC_TYPE, "/opt/cedana/bin/containerd-shim-cedana-v2", True),
        (reg.RUNTIME_TYPE, None, True),  # containerd 1.6's form
        (reg.RUNC_TYPE, None, False),  # runc's own shim
        (reg.RUNC_TYPE, "/usr/bin/containerd-shim-runc-v2", False),
        (None, None, False),
    ],
)
def test_the_handler_counts_as_registered_only_when_it_runs_the_cedana_shim(
    runtime_type: str | None, runtime_path: str | None, registered: bool
) -> None:
    status = HandlerStatus(True, runtime_type, runtime_path, ("cedana",), None, "cedana", "")
    assert status.registered is registered


def test_an_unknown_containerd_with_a_version_2_config_gets_the_form_every_one_runs() -> None:
    plan = cc.plan_registration(snap(CRI_V2, None))
    assert plan.shim_path is None and any("version is unknown" in r for r in plan.reasons)
