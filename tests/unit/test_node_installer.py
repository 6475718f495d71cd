"""The installer's file handling in a temporary host root, with stand-ins at the edges
(a containerd and a CRIU that only print versions, a payload whose interpreter only
exits 0, a restart command that counts). The real containerd runs in
tests/integration/test_node_install.py."""

from __future__ import annotations

import hashlib
import json
import os
import stat
import subprocess
import tomllib
from pathlib import Path

import pytest
from cedana_shim.node.cli import main
from cedana_shim.node.hostfs import STATE_FILE, HostRoot

CONFIG = b"""# the node's own config
version = 2
[plugins."io.containerd.grpc.v1.cri"]
  sandbox_image = "example/pause:3"
  [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc]
    runtime_type = "io.containerd.runc.v2"
"""


def _script(path: Path, body: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(0o755)


@pytest.fixture
def payload(tmp_path: Path) -> Path:
    out = tmp_path / "payload"
    _script(out / "bin/python3.11", "exit 0")
    for name in ("containerd-shim-cedana-v2", "cedana"):
        _script(out / "bin" / name, "exit 0")
    manifest = {"version": "0.1.0", "python": "3.11.7", "digest": "d1", "portable": True}
    (out / "cedana-bundle.json").write_text(json.dumps(manifest))
    return out


@pytest.fixture
def host(tmp_path: Path) -> Path:
    root = tmp_path / "host"
    _script(
        root / "usr/bin/containerd", 'echo "containerd github.com/containerd/containerd 1.6.20 x"'
    )
    _script(root / "usr/local/sbin/criu", 'echo "Version: 4.1.1"')
    (root / "etc/containerd").mkdir(parents=True)
    (root / "etc/containerd/config.toml").write_bytes(CONFIG)
    os.chmod(root / "etc/containerd/config.toml", 0o640)
    return root


def tree(root: Path) -> dict[str, str]:
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in [*filenames, *dirnames]:
            path = Path(dirpath) / name
            rel = str(path.relative_to(root))
            if path.is_symlink():
                out[rel] = "-> " + os.readlink(path)
            elif path.is_dir():
                out[rel] = "dir"
            else:
                digest = hashlib.sha256(path.read_bytes()).hexdigest()[:16]
                out[rel] = f"{oct(stat.S_IMODE(path.stat().st_mode))} {digest}"
    return out


class Node:
    def __init__(self, host: Path, payload: Path, tmp: Path) -> None:
        self.host = host
        self.payload = payload
        self.restarts = tmp / "restarts"

    @property
    def restart_count(self) -> int:
        return len(self.restarts.read_text().splitlines()) if self.restarts.exists() else 0

    def run(self, *args: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, dict, str]:
        restart = f"echo restart >> {self.restarts}"
        common = ["--host-root", str(self.host), "--restart-command", restart]
        code = main([args[0], *common, "--verify", "none", "--json", *args[1:]])
        out, err = capsys.readouterr()
        return code, json.loads(out) if out.strip().startswith("{") else {}, err

    def install(self, *args: str, capsys: pytest.CaptureFixture[str]) -> tuple[int, dict, str]:
        return self.run("install", "--payload", str(self.payload), *args, capsys=capsys)


@pytest.fixture
def node(host: Path, payload: Path, tmp_path: Path) -> Node:
    return Node(host, payload, tmp_path)


def test_install_twice_then_uninstall_restores_everything(
    node: Node, capsys: pytest.CaptureFixture[str]
) -> None:
    before = tree(node.host)
    code, report, err = node.install(capsys=capsys)
    assert code == 0, err
    assert report["restarted"] and node.restart_count == 1
    config = (node.host / "etc/containerd/config.toml").read_bytes()
    assert config.startswith(CONFIG) and b"io.containerd.cedana.v2" in config
    assert oct((node.host / "etc/containerd/config.toml").stat().st_mode & 0o777) == "0o640"
    link = node.host / "usr/local/bin/containerd-shim-cedana-v2"
    assert os.readlink(link) == "../../../opt/cedana/bin/containerd-shim-cedana-v2"
    assert link.resolve() == (node.host / "opt/cedana/bin/containerd-shim-cedana-v2")
    assert (node.host / "etc/cedana/shim.toml").exists()
    installed = tree(node.host)

    code, report, err = node.install(capsys=capsys)
    assert code == 0, err
    assert not report["changed"] and not report["restarted"] and node.restart_count == 1
    assert tree(node.host) == installed

    code, report, err = node.run("uninstall", capsys=capsys)
    assert code == 0, err
    assert report["restarted"] and node.restart_count == 2
    assert (node.host / "etc/containerd/config.toml").read_bytes() == CONFIG
    assert tree(node.host) == before


def test_malformed_config_is_reported_and_left_alone(
    node: Node, capsys: pytest.CaptureFixture[str]
) -> None:
    config = node.host / "etc/containerd/config.toml"
    config.write_bytes(b"version = 2\n[plugins\n")
    before = tree(node.host)
    code, report, err = node.install(capsys=capsys)
    assert code == 1
    assert f"{config} is not valid TOML" in err and "line 2" in err
    assert tree(node.host) == before and node.restart_count == 0
    assert not report["ok"]


def test_missing_criu_says_how_to_get_one(node: Node, capsys: pytest.CaptureFixture[str]) -> None:
    (node.host / "usr/local/sbin/criu").unlink()
    _script(node.host / "usr/sbin/criu", 'echo "Version: 3.17.1"')
    before = tree(node.host)
    code, _, err = node.install(capsys=capsys)
    assert code == 1
    assert "/usr/sbin/criu is CRIU 3.17.1, older than 4.1" in err and "--criu-source" in err
    assert tree(node.host) == before


def test_criu_source_is_installed_and_removed_again(
    node: Node, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (node.host / "usr/local/sbin/criu").unlink()
    source = tmp_path / "criu-4.1"
    _script(source, 'echo "Version: 4.1.1"')
    before = tree(node.host)
    code, _, err = node.install("--criu-source", str(source), capsys=capsys)
    assert code == 0, err
    assert (node.host / "usr/local/sbin/criu").read_bytes() == source.read_bytes()
    assert node.run("uninstall", capsys=capsys)[0] == 0
    assert tree(node.host) == before


def test_node_config_settings_are_validated_by_the_shim(
    node: Node, capsys: pytest.CaptureFixture[str]
) -> None:
    code, _, err = node.install("--set", "compresion_level=5", capsys=capsys)
    assert code == 1 and "unknown keys compresion_level" in err
    code, _, err = node.install(
        "--set", "store_path=/data/ckpt", "--set", "compression_level=7", capsys=capsys
    )
    assert code == 0, err
    text = (node.host / "etc/cedana/shim.toml").read_text()
    assert 'store_path = "/data/ckpt"' in text and "compression_level = 7" in text


def test_a_by_hand_launcher_and_node_config_come_back(
    node: Node, capsys: pytest.CaptureFixture[str]
) -> None:
    (node.host / "usr/local/bin").mkdir(parents=True)
    os.symlink(
        "/srv/venv/bin/containerd-shim-cedana-v2",
        node.host / "usr/local/bin/containerd-shim-cedana-v2",
    )
    (node.host / "etc/cedana").mkdir()
    (node.host / "etc/cedana/shim.toml").write_text("retain = 9\n")
    before = tree(node.host)
    assert node.install(capsys=capsys)[0] == 0
    # The node's own config is kept unless settings are given.
    assert (node.host / "etc/cedana/shim.toml").read_text() == "retain = 9\n"
    assert node.run("uninstall", capsys=capsys)[0] == 0
    assert tree(node.host) == before


def test_config_edited_after_install_keeps_the_edit(
    node: Node, capsys: pytest.CaptureFixture[str]
) -> None:
    assert node.install(capsys=capsys)[0] == 0
    config = node.host / "etc/containerd/config.toml"
    config.write_bytes(config.read_bytes() + b"\n[metrics]\n  address = '127.0.0.1:1338'\n")
    code, report, err = node.run("uninstall", capsys=capsys)
    assert code == 0, err
    assert config.read_bytes() == CONFIG + b"\n[metrics]\n  address = '127.0.0.1:1338'\n"
    assert any("changed since install" in s["detail"] for s in report["steps"])


def test_dropin_and_its_directory_go_away_on_uninstall(
    node: Node, capsys: pytest.CaptureFixture[str]
) -> None:
    config = node.host / "etc/containerd/config.toml"
    config.write_bytes(b'version = 2\nimports = ["/etc/containerd/conf.d/*.toml"]\n')
    before = tree(node.host)
    code, _, err = node.install(capsys=capsys)
    assert code == 0, err
    dropin = node.host / "etc/containerd/conf.d/99-cedana.toml"
    assert b"io.containerd.cedana.v2" in dropin.read_bytes()
    assert b"io.containerd.runc.v2" in dropin.read_bytes()  # 1.x: runc kept as default
    assert node.run("uninstall", capsys=capsys)[0] == 0
    assert tree(node.host) == before


def test_kubelet_timeout_is_set_and_restored(
    node: Node, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    kubelet = node.host / "var/lib/kubelet/config.yaml"
    kubelet.parent.mkdir(parents=True)
    original = "kind: KubeletConfiguration\nruntimeRequestTimeout: 2m\ncgroupDriver: systemd\n"
    kubelet.write_text(original)
    restarts = tmp_path / "kubelet-restarts"
    args = ("--kubelet-restart-command", f"echo r >> {restarts}")
    code, _, err = node.install("--kubelet-runtime-request-timeout", "10m", *args, capsys=capsys)
    assert code == 0, err
    assert kubelet.read_text() == original.replace("2m", "10m")
    assert restarts.read_text() == "r\n"
    assert node.run("uninstall", *args, capsys=capsys)[0] == 0
    assert kubelet.read_text() == original and restarts.read_text() == "r\nr\n"


def test_bad_kubelet_duration_is_refused(node: Node, capsys: pytest.CaptureFixture[str]) -> None:
    kubelet = node.host / "var/lib/kubelet/config.yaml"
    kubelet.parent.mkdir(parents=True)
    kubelet.write_text("kind: KubeletConfiguration\n")
    code, _, err = node.install("--kubelet-runtime-request-timeout", "ten", capsys=capsys)
    assert code == 1 and "not a Go duration" in err


def test_someone_elses_opt_cedana_is_not_replaced(
    node: Node, capsys: pytest.CaptureFixture[str]
) -> None:
    (node.host / "opt/cedana").mkdir(parents=True)
    (node.host / "opt/cedana/mine").write_text("x")
    code, _, err = node.install(capsys=capsys)
    assert code == 1 and "is not a cedana payload" in err
    assert (node.host / "opt/cedana/mine").read_text() == "x"


def test_status_reports_the_install(node: Node, capsys: pytest.CaptureFixture[str]) -> None:
    assert node.install(capsys=capsys)[0] == 0
    code = main(["status", "--host-root", str(node.host), "--no-cri", "--json"])
    info = json.loads(capsys.readouterr().out)
    assert code == 0 and info["ok"], info
    assert info["registration"]["mode"] == "edit" and info["registration"]["present"]
    assert info["criu"]["ok"] and info["environment"]["version"] == "0.1.0"


def test_status_of_a_bare_node_is_not_ok(host: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["status", "--host-root", str(host), "--no-cri"]) == 1
    assert "status: NOT ok" in capsys.readouterr().out


def test_host_paths_resolve_absolute_links_inside_the_root(tmp_path: Path) -> None:
    root = tmp_path / "r"
    (root / "data/containerd").mkdir(parents=True)
    (root / "etc").mkdir()
    os.symlink("/data/containerd", root / "etc/containerd")
    host = HostRoot(str(root))
    assert host.path("/etc/containerd/config.toml") == str(root / "data/containerd/config.toml")
    assert host.path("/etc/containerd", follow_last=False) == str(root / "etc/containerd")
    assert host.path("/../../etc/containerd") == str(root / "data/containerd")


def test_install_builds_the_payload_from_this_python_once(
    node: Node, capsys: pytest.CaptureFixture[str]
) -> None:
    code, report, err = node.run("install", capsys=capsys)
    assert code == 0, err
    env = next(s for s in report["steps"] if s["name"] == "environment")
    assert env["outcome"] == "changed"
    shim = node.host / "usr/local/bin/containerd-shim-cedana-v2"
    proc = subprocess.run([str(shim), "-v"], capture_output=True, text=True, check=False)
    assert proc.returncode == 0 and "Version:" in proc.stdout, proc.stderr
    manifest = node.host / "opt/cedana/cedana-bundle.json"
    stamp = manifest.stat().st_mtime_ns
    code, report, err = node.run("install", capsys=capsys)
    assert code == 0 and not report["changed"], (err, report)
    assert manifest.stat().st_mtime_ns == stamp, "an unchanged environment was rebuilt"
    assert not (node.host / "opt/cedana.cedana-new").exists()
    assert node.run("uninstall", capsys=capsys)[0] == 0
    assert not (node.host / "opt").exists()


def _step(report: dict, name: str) -> dict:
    return next(s for s in report["steps"] if s["name"] == name)


def test_default_runtime_is_on_by_default_and_uninstall_gives_the_old_one_back(
    node: Node, capsys: pytest.CaptureFixture[str]
) -> None:
    stock = CONFIG.replace(
        b"  [plugins",
        b'  [plugins."io.containerd.grpc.v1.cri".containerd]\n    default_runtime_name = "runc"\n'
        b"  [plugins",
        1,
    )
    (node.host / "etc/containerd/config.toml").write_bytes(stock)
    code, report, err = node.install(capsys=capsys)
    assert code == 0, err
    config = (node.host / "etc/containerd/config.toml").read_bytes()
    assert b'\n    default_runtime_name = "cedana"\n' in config
    assert "cedana (was runc)" in _step(report, "default runtime")["detail"]
    # The file changed after install: uninstall takes out only our blocks, and the
    # node's line comes back with them.
    edited = config + b"# the operator's note\n"
    (node.host / "etc/containerd/config.toml").write_bytes(edited)
    code, report, err = node.run("uninstall", capsys=capsys)
    assert code == 0, err
    restored = (node.host / "etc/containerd/config.toml").read_bytes()
    assert restored == stock + b"# the operator's note\n"


def test_no_default_runtime_leaves_the_default_alone(
    node: Node, capsys: pytest.CaptureFixture[str]
) -> None:
    code, report, err = node.install("--no-default-runtime", capsys=capsys)
    assert code == 0, err
    assert b"default_runtime_name" not in (node.host / "etc/containerd/config.toml").read_bytes()
    assert "--no-default-runtime" in _step(report, "default runtime")["detail"]


def test_runc_binary_and_the_nodes_nvidia_runtime_are_reported(
    node: Node, capsys: pytest.CaptureFixture[str]
) -> None:
    _script(node.host / "usr/bin/containerd", 'echo "containerd x 1.7.24 y"')
    nvidia = CONFIG + (
        b'  [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.nvidia]\n'
        b'    runtime_type = "io.containerd.runc.v2"\n'
        b'    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.nvidia.options]\n'
        b'      BinaryName = "/usr/bin/nvidia-container-runtime"\n'
    )
    (node.host / "etc/containerd/config.toml").write_bytes(nvidia)
    code, report, err = node.install(capsys=capsys)
    assert code == 0, err
    warning = _step(report, "nvidia runtime")
    assert warning["outcome"] == "warning"
    assert "--runc-binary /usr/bin/nvidia-container-runtime" in warning["detail"]

    code, report, err = node.install(
        "--runc-binary", "/usr/bin/nvidia-container-runtime", capsys=capsys
    )
    assert code == 1 and "no executable file" in err, "checked before anything changes"
    _script(node.host / "usr/bin/nvidia-container-runtime", 'exec runc "$@"')
    code, report, err = node.install(
        "--runc-binary", "/usr/bin/nvidia-container-runtime", capsys=capsys
    )
    assert code == 0, err
    assert _step(report, "nvidia runtime")["outcome"] == "ok"
    config = (node.host / "etc/containerd/config.toml").read_bytes()
    assert b'BinaryName = "/usr/bin/nvidia-container-runtime"' in config.split(b"cedana-shim")[1]
    main(["status", "--host-root", str(node.host), "--no-cri", "--json"])
    info = json.loads(capsys.readouterr().out)
    assert info["registration"]["runc_binary"] == "/usr/bin/nvidia-container-runtime"
    assert info["registration"]["default_runtime"] == "cedana"


def test_taking_the_default_from_the_nvidia_runtime_needs_a_decision(
    node: Node, capsys: pytest.CaptureFixture[str]
) -> None:
    _script(node.host / "usr/bin/containerd", 'echo "containerd x 1.7.24 y"')
    gpu_node = CONFIG + (
        b'  [plugins."io.containerd.grpc.v1.cri".containerd]\n'
        b'    default_runtime_name = "nvidia"\n'
        b'  [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.nvidia]\n'
        b'    runtime_type = "io.containerd.runc.v2"\n'
        b'    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.nvidia.options]\n'
        b'      BinaryName = "/usr/bin/nvidia-container-runtime"\n'
    )
    (node.host / "etc/containerd/config.toml").write_bytes(gpu_node)
    before = tree(node.host)
    code, _, err = node.install(capsys=capsys)
    assert code == 1 and "--runc-binary /usr/bin/nvidia-container-runtime" in err, err
    assert "--no-default-runtime" in err
    assert tree(node.host) == before, "refused before anything was written"

    _script(node.host / "usr/bin/nvidia-container-runtime", 'exec runc "$@"')
    runc = "/usr/bin/nvidia-container-runtime"
    code, report, err = node.install("--runc-binary", runc, capsys=capsys)
    assert code == 0, err
    assert "cedana (was nvidia)" in _step(report, "default runtime")["detail"]
    code, report, err = node.run("uninstall", capsys=capsys)
    assert code == 0, err
    assert (node.host / "etc/containerd/config.toml").read_bytes() == gpu_node


def test_the_cgroup_driver_is_reported(node: Node, capsys: pytest.CaptureFixture[str]) -> None:
    systemd = CONFIG + (
        b'    [plugins."io.containerd.grpc.v1.cri".containerd.runtimes.runc.options]\n'
        b"      SystemdCgroup = true\n"
    )
    (node.host / "etc/containerd/config.toml").write_bytes(systemd)
    code, report, err = node.install(capsys=capsys)  # containerd 1.6: cannot pass it on
    assert code == 0, err
    step = _step(report, "cgroup driver")
    assert step["outcome"] == "warning" and "containerd 1.6" in step["detail"], step
    _script(node.host / "usr/bin/containerd", 'echo "containerd x 1.7.24 y"')
    code, report, err = node.install(capsys=capsys)
    assert code == 0, err
    assert _step(report, "cgroup driver")["outcome"] == "ok"
    config = tomllib.loads((node.host / "etc/containerd/config.toml").read_text())
    cedana = config["plugins"]["io.containerd.grpc.v1.cri"]["containerd"]["runtimes"]["cedana"]
    assert cedana["options"] == {"SystemdCgroup": True}


def test_containerd_1_7_runs_the_installed_shim_as_a_runc_type_runtime(
    node: Node, capsys: pytest.CaptureFixture[str]
) -> None:
    _script(node.host / "usr/bin/containerd", 'echo "containerd x 1.7.24 y"')
    code, _report, err = node.install("--bin-dir", "/opt/bin", capsys=capsys)
    assert code == 0, err
    config = tomllib.loads((node.host / "etc/containerd/config.toml").read_text())
    cedana = config["plugins"]["io.containerd.grpc.v1.cri"]["containerd"]["runtimes"]["cedana"]
    assert cedana["runtime_type"] == "io.containerd.runc.v2"
    assert cedana["runtime_path"] == "/opt/bin/containerd-shim-cedana-v2"
    assert (node.host / "opt/bin/containerd-shim-cedana-v2").resolve().is_file()
    state = json.loads((node.host / STATE_FILE.lstrip("/")).read_text())
    assert state["registration"]["runtime_path"] == "/opt/bin/containerd-shim-cedana-v2"
    main(["status", "--host-root", str(node.host), "--no-cri", "--bin-dir", "/opt/bin"])
    assert "shim:          /opt/bin/containerd-shim-cedana-v2 (" in capsys.readouterr().out


def test_a_node_config_elsewhere_is_refused_where_no_config_path_reaches_the_shim(
    node: Node, capsys: pytest.CaptureFixture[str]
) -> None:
    _script(node.host / "usr/bin/containerd", 'echo "containerd x 1.7.24 y"')
    before = tree(node.host)
    code, report, _err = node.install("--shim-config", "/etc/other.toml", capsys=capsys)
    assert code != 0
    assert "no ConfigPath" in report["error"] and "/etc/cedana/shim.toml" in report["error"]
    assert tree(node.host) == before
