"""`cedana slurm install|uninstall|status` against a real (private) Slurm: what it
writes, that a second install changes nothing, and that uninstall gives back
Slurm's files byte for byte, with their mode and owner."""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from .harness.slurm import SlurmCluster, cedana, running_cluster, write_fake_runner

Snapshot = dict[str, tuple[str, int, int, int]]


@pytest.fixture(scope="module")
def cluster() -> Iterator[SlurmCluster]:
    with running_cluster() as c:
        yield c


@pytest.fixture
def prefix(tmp_path: Path) -> Path:
    return tmp_path / "prefix"


@pytest.fixture
def runner(cluster: SlurmCluster) -> Path:
    return write_fake_runner(cluster.dir / "runner", cluster.dir)


def _snapshot(root: Path) -> Snapshot:
    """Every file and directory under ``root``: content hash, mode, owner."""
    out: Snapshot = {}
    for path in [root, *sorted(root.rglob("*"))]:
        st = path.lstat()
        digest = hashlib.sha256(path.read_bytes()).hexdigest() if path.is_file() else "dir"
        out[str(path)] = (digest, st.st_mode, st.st_uid, st.st_gid)
    return out


def _slurm(*args: str) -> dict[str, Any]:
    done = cedana("slurm", *args, "--json")
    assert done.returncode == 0, done.stderr
    result: dict[str, object] = json.loads(done.stdout)
    return result


def _install(cluster: SlurmCluster, prefix: Path, runner: Path, *more: str) -> dict[str, Any]:
    return _slurm(
        "install",
        "--node-role",
        "worker",
        "--slurm-conf",
        str(cluster.conf),
        "--prefix",
        str(prefix),
        "--runner",
        str(runner),
        *more,
    )


def _uninstall(cluster: SlurmCluster, prefix: Path) -> dict[str, Any]:
    return _slurm("uninstall", "--slurm-conf", str(cluster.conf), "--prefix", str(prefix))


def test_worker_install_writes_a_dropin_and_uninstall_gives_everything_back(
    cluster: SlurmCluster, prefix: Path, runner: Path
) -> None:
    before = _snapshot(cluster.etc)
    report = _install(cluster, prefix, runner)
    plugin = prefix / "slurm" / "cedana_spank.so"
    dropin = cluster.plugstack_d / "cedana.conf"
    assert report["changed"] == [str(plugin), str(dropin)]
    assert dropin.read_text() == f"optional {plugin} runner={runner}\n"
    assert cluster.plugstack.read_text() == f"include {cluster.plugstack_d}/*.conf\n"
    state = prefix / "slurm" / "state" / "install.json"
    assert state.stat().st_mode & 0o777 == 0o600
    assert state.parent.stat().st_mode & 0o777 == 0o700

    again = _install(cluster, prefix, runner)
    assert again["changed"] == []

    status = _slurm("status", "--slurm-conf", str(cluster.conf), "--prefix", str(prefix))
    assert status["ok"] is True and status["role"] == "worker" and status["line_present"]

    report = _uninstall(cluster, prefix)
    assert sorted(report["changed"]) == sorted([str(plugin), str(dropin)])
    assert _snapshot(cluster.etc) == before
    assert not prefix.exists()


def test_without_an_include_one_line_is_appended_and_taken_back(tmp_path: Path) -> None:
    with running_cluster(plugstack_include=False) as cluster:
        runner = write_fake_runner(cluster.dir / "runner", cluster.dir)
        os.chmod(cluster.plugstack, 0o640)
        os.chown(cluster.plugstack, 0, 1)
        cluster.plugstack.write_bytes(b"# site SPANK plugins, no newline at the end")
        before = _snapshot(cluster.etc)
        prefix = tmp_path / "prefix"
        _install(cluster, prefix, runner)
        text = cluster.plugstack.read_text()
        assert text == (
            "# site SPANK plugins, no newline at the end\n"
            f"optional {prefix}/slurm/cedana_spank.so runner={runner}\n"
        )
        st = cluster.plugstack.stat()
        assert (st.st_mode & 0o777, st.st_uid, st.st_gid) == (0o640, 0, 1)
        assert not (cluster.plugstack_d / "cedana.conf").exists()
        assert _install(cluster, prefix, runner)["changed"] == []

        _uninstall(cluster, prefix)
        assert _snapshot(cluster.etc) == before


def test_a_plugstack_edited_after_install_keeps_the_edit(
    cluster: SlurmCluster, prefix: Path, runner: Path
) -> None:
    dropin = cluster.plugstack_d / "cedana.conf"
    _install(cluster, prefix, runner)
    dropin.write_text(dropin.read_text() + "# added by the site\n")
    report = _uninstall(cluster, prefix)
    assert dropin.read_text() == "# added by the site\n"
    assert any("changed since install" in n for n in report["notes"])
    dropin.unlink()


def test_controller_and_login_change_nothing(
    cluster: SlurmCluster, prefix: Path, runner: Path
) -> None:
    before = _snapshot(cluster.etc)
    for role in ("controller", "login"):
        report = _slurm(
            "install",
            "--node-role",
            role,
            "--slurm-conf",
            str(cluster.conf),
            "--prefix",
            str(prefix),
            "--runner",
            str(runner),
        )
        assert report["changed"] == []
        assert _snapshot(cluster.etc) == before
        _uninstall(cluster, prefix)
        assert not prefix.exists()


@pytest.mark.parametrize("order", [("controller", "worker"), ("worker", "controller")])
def test_a_node_that_is_controller_and_worker_gets_both_in_either_order(
    cluster: SlurmCluster, prefix: Path, runner: Path, order: tuple[str, str]
) -> None:
    """A one-node cluster: one install per role, in either order, or both in one;
    the node is then what a worker is, and says it has both roles."""
    before = _snapshot(cluster.etc)
    where = ("--slurm-conf", str(cluster.conf), "--prefix", str(prefix), "--runner", str(runner))
    plugin = prefix / "slurm" / "cedana_spank.so"
    dropin = cluster.plugstack_d / "cedana.conf"
    first = _slurm("install", "--node-role", order[0], *where)
    second = _slurm("install", "--node-role", order[1], *where)
    assert second["roles"] == ["controller", "worker"] and second["role"] == "controller+worker"
    assert sorted(first["changed"] + second["changed"]) == sorted([str(plugin), str(dropin)])
    assert dropin.read_text() == f"optional {plugin} runner={runner}\n"
    status = _slurm("status", "--slurm-conf", str(cluster.conf), "--prefix", str(prefix))
    assert status["ok"] is True and status["roles"] == ["controller", "worker"], status
    both = _slurm("install", "--node-role", order[1], "--node-role", order[0], *where)
    assert both["changed"] == [] and both["roles"] == ["controller", "worker"]

    report = _uninstall(cluster, prefix)
    assert sorted(report["changed"]) == sorted([str(plugin), str(dropin)])
    assert _snapshot(cluster.etc) == before
    assert not prefix.exists()


def test_a_configless_controller_hands_the_line_out(tmp_path: Path) -> None:
    with running_cluster() as cluster:
        runner = write_fake_runner(cluster.dir / "runner", cluster.dir)
        with cluster.conf.open("a") as f:
            f.write("SlurmctldParameters=enable_configless\n")
        before = _snapshot(cluster.etc)
        prefix = tmp_path / "prefix"
        report = _slurm(
            "install",
            "--node-role",
            "controller",
            "--slurm-conf",
            str(cluster.conf),
            "--prefix",
            str(prefix),
            "--runner",
            str(runner),
        )
        assert report["changed"] == [str(cluster.plugstack_d / "cedana.conf")]
        assert any("scontrol reconfigure" in n for n in report["notes"])
        _uninstall(cluster, prefix)
        assert _snapshot(cluster.etc) == before


def test_a_worker_without_slurm_headers_is_told_what_to_install(
    cluster: SlurmCluster, prefix: Path, runner: Path, tmp_path: Path
) -> None:
    before = _snapshot(cluster.etc)
    done = cedana(
        "slurm",
        "install",
        "--node-role",
        "worker",
        "--slurm-conf",
        str(cluster.conf),
        "--prefix",
        str(prefix),
        "--runner",
        str(runner),
        "--slurm-include",
        str(tmp_path),
    )
    assert done.returncode == 1
    assert f"{tmp_path}/slurm/spank.h is missing" in done.stderr
    assert "libslurm-dev" in done.stderr
    assert _snapshot(cluster.etc) == before
    assert not prefix.exists()


def test_install_refuses_where_slurm_is_not_configured(prefix: Path, tmp_path: Path) -> None:
    done = cedana(
        "slurm",
        "install",
        "--node-role",
        "worker",
        "--prefix",
        str(prefix),
        env={**os.environ, "SLURM_CONF": str(tmp_path / "slurm.conf")},
    )
    assert done.returncode == 1
    assert f"SLURM_CONF={tmp_path}/slurm.conf: no such file" in done.stderr
    assert not prefix.exists()


def test_a_runner_others_may_write_is_refused(
    cluster: SlurmCluster, prefix: Path, runner: Path
) -> None:
    os.chmod(runner, 0o777)
    done = cedana(
        "slurm",
        "install",
        "--node-role",
        "worker",
        "--slurm-conf",
        str(cluster.conf),
        "--prefix",
        str(prefix),
        "--runner",
        str(runner),
    )
    assert done.returncode == 1
    assert "only root may write" in done.stderr
    assert not (cluster.plugstack_d / "cedana.conf").exists()
