"""slurm.conf / plugstack.conf reading and the one-line edits of the Slurm installer."""

from __future__ import annotations

import os
import string
from pathlib import Path

import pytest
from cedana_shim import errors
from cedana_shim.slurm import slurm_conf as sc
from hypothesis import given
from hypothesis import strategies as st

LINE = "optional /usr/local/lib/cedana/slurm/cedana_spank.so runner=/opt/cedana/bin/r"


def test_settings_keys_are_case_insensitive_and_the_last_wins() -> None:
    text = (
        "# comment\n"
        "ClusterName=alpha   # trailing comment\n"
        "PLUGSTACKCONFIG=/etc/slurm/ps.conf\n"
        "NodeName=n[1-4] CPUs=8 PlugStackConfig=/not/a/setting\n"
        "PartitionName=low Nodes=ALL Default=YES\n"
        "clustername=beta\n"
        "SlurmctldParameters=enable_configless,idle_on_node_suspend\n"
    )
    settings, includes = sc.parse_slurm_conf_text(text)
    assert settings["clustername"] == "beta"
    assert settings["plugstackconfig"] == "/etc/slurm/ps.conf"
    assert "cpus" not in settings and "nodes" not in settings
    assert includes == []
    assert sc.is_configless(settings)


def test_include_files_are_read_relative_to_slurm_conf(tmp_path: Path) -> None:
    (tmp_path / "extra.conf").write_text("PlugStackConfig=spank/stack.conf\n")
    conf = tmp_path / "slurm.conf"
    conf.write_text("ClusterName=c\nInclude extra.conf\n")
    settings = sc.parse_slurm_conf(str(conf))
    assert settings["clustername"] == "c"
    assert sc.plugstack_path(str(conf), settings) == str(tmp_path / "spank" / "stack.conf")


def test_plugstack_defaults_beside_slurm_conf(tmp_path: Path) -> None:
    conf = tmp_path / "slurm.conf"
    assert sc.plugstack_path(str(conf), {}) == str(tmp_path / "plugstack.conf")
    assert sc.plugstack_path(str(conf), {"plugstackconfig": "/x/p.conf"}) == "/x/p.conf"
    assert not sc.is_configless({"slurmctldparameters": "idle_on_node_suspend"})


def test_locate_prefers_explicit_then_slurm_conf_env(tmp_path: Path) -> None:
    a, b = tmp_path / "a.conf", tmp_path / "b.conf"
    a.write_text("")
    b.write_text("")
    assert sc.locate_slurm_conf(str(a), {"SLURM_CONF": str(b)}) == str(a)
    assert sc.locate_slurm_conf(None, {"SLURM_CONF": str(b)}) == str(b)
    with pytest.raises(errors.NotFound, match="SLURM_CONF="):
        sc.locate_slurm_conf(None, {"SLURM_CONF": str(tmp_path / "missing")})
    with pytest.raises(errors.NotFound, match="--slurm-conf"):
        sc.locate_slurm_conf(str(tmp_path / "missing"), {})


def test_locate_asks_scontrol_for_the_compiled_in_path(tmp_path: Path) -> None:
    conf = tmp_path / "from-scontrol.conf"
    conf.write_text("")
    fake = tmp_path / "scontrol"
    fake.write_text(f"#!/bin/sh\necho 'Configuration data as of now'\necho 'SLURM_CONF = {conf}'\n")
    os.chmod(fake, 0o755)
    assert sc.locate_slurm_conf(None, {}, scontrol=str(fake)) == str(conf)


def test_locate_refuses_clearly_without_slurm(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setattr(sc, "BUILD_DEFAULTS", (str(tmp_path / "none.conf"),))
    with pytest.raises(errors.FailedPrecondition, match="Slurm is not configured"):
        sc.locate_slurm_conf(None, {}, scontrol=str(tmp_path / "no-scontrol"))


def test_plan_uses_an_included_directory(tmp_path: Path) -> None:
    (tmp_path / "plugstack.conf.d").mkdir()
    plugstack = str(tmp_path / "plugstack.conf")
    plan = sc.plan_plugstack(plugstack, f"include {tmp_path}/plugstack.conf.d/*.conf\n")
    assert plan == sc.PlugstackPlan("dropin", str(tmp_path / "plugstack.conf.d" / "cedana.conf"))
    # relative include patterns are relative to plugstack.conf's directory, as in SPANK
    assert sc.plan_plugstack(plugstack, "include plugstack.conf.d/*\n").kind == "dropin"


@pytest.mark.parametrize(
    "text",
    [
        None,
        "",
        "optional /usr/lib/x.so\n",
        "include /nonexistent/dir/*.conf\n",
        "include {d}/plugstack.conf.d/*.spank\n",  # our file's name does not match
        "# include {d}/plugstack.conf.d/*.conf\n",
    ],
)
def test_plan_appends_when_nothing_includes_our_file(tmp_path: Path, text: str | None) -> None:
    (tmp_path / "plugstack.conf.d").mkdir()
    plugstack = str(tmp_path / "plugstack.conf")
    given_text = None if text is None else text.format(d=tmp_path)
    assert sc.plan_plugstack(plugstack, given_text) == sc.PlugstackPlan("append", plugstack)


def test_spank_line_is_optional_and_detected() -> None:
    line = sc.spank_line("/p/cedana_spank.so", "/r/cedana-slurm-task")
    assert line == "optional /p/cedana_spank.so runner=/r/cedana-slurm-task"
    assert sc.has_plugin_line(f"required /x.so\n{line}\n", "/p/cedana_spank.so")
    assert not sc.has_plugin_line(f"# {line}\n", "/p/cedana_spank.so")


_texts = st.text(alphabet=string.printable, max_size=300)


@given(_texts)
def test_removing_our_line_gives_back_any_file_ending_in_a_newline(text: str) -> None:
    text = text.replace("\r", "")
    if LINE in text.splitlines():
        return
    original = text if text == "" or text.endswith("\n") else text + "\n"
    added = sc.with_line(original, LINE)
    assert added.startswith(original)
    assert added.splitlines().count(LINE) == 1
    assert sc.without_line(added, LINE) == original


@given(_texts)
def test_with_line_keeps_the_text_and_ends_with_the_line(text: str) -> None:
    added = sc.with_line(text, LINE)
    assert added.startswith(text)
    assert added.endswith(LINE + "\n")


@given(
    st.dictionaries(
        st.sampled_from(["ClusterName", "PlugStackConfig", "SlurmUser", "KillWait"]),
        st.text(alphabet=string.ascii_letters + string.digits + "/._-", min_size=1, max_size=20),
        min_size=1,
    ),
    st.sampled_from([" ", "\t", "  "]),
)
def test_parser_reads_back_what_was_written(values: dict[str, str], sep: str) -> None:
    text = "".join(f"{k}={v}{sep}# note\n" for k, v in values.items())
    settings, _ = sc.parse_slurm_conf_text(text)
    assert settings == {k.lower(): v for k, v in values.items()}


@given(_texts)
def test_parser_never_fails_on_any_text(text: str) -> None:
    settings, includes = sc.parse_slurm_conf_text(text)
    assert all(k == k.lower() for k in settings)
    assert all(inc.strip() == inc and inc for inc in includes)
