"""`cedana node install|uninstall` against REAL containerd 1.6.20 and 2.1.9.

Each case puts a containerd config into a temporary host root, runs a private
containerd on it (the harness's `Containerd`, pointed at that file), and runs the
installer with `--host-root` and a restart command that asks this test process to
restart that containerd. Then: containerd restarted, a CRI pod and a container run
with runtime_handler "cedana" through the installed launcher (the venv's shim is
NOT on containerd's PATH), a second install changes nothing, uninstall restores the
config byte for byte and containerd still starts on it.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import socket
import subprocess
import sys
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
from cedana_shim.api.cri.v1 import api_pb2 as cri_pb
from cedana_shim.node import config_blocks
from cedana_shim.node.registration import RUNC_TYPE, RUNTIME_TYPE, SHIM_BINARY

from .harness import images as harness_images
from .harness.config import CEDANA, CNI_BIN_DIR, CONTAINERD_VERSIONS, CRIU, ContainerdVersion
from .harness.containerd import Containerd, _toml_str
from .harness.cri import CriClient

REPO = Path(__file__).resolve().parents[2]
VERSIONS = {v.short: v for v in CONTAINERD_VERSIONS}
NODE_CLI = [sys.executable, "-m", "cedana_shim.node"]


def _link_or_copy(src: Path, dst: Path) -> None:
    """Binaries inside the host root: a link out of it would point back into it when
    resolved the way the host sees it."""
    dst.parent.mkdir(parents=True, exist_ok=True)
    try:
        os.link(src.resolve(), dst)
    except OSError:
        shutil.copy2(src.resolve(), dst)


class RestartServer:
    """The restart command's other end: `systemctl restart containerd` for a
    containerd that is a child of this test process."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.instance: Containerd | None = None
        self.restarts = 0
        self.listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        self.listener.bind(str(path))
        self.listener.listen(4)
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    @property
    def command(self) -> str:
        code = (
            "import socket,sys;s=socket.socket(socket.AF_UNIX);s.connect(sys.argv[1]);"
            "s.sendall(b'restart');s.shutdown(1);r=s.recv(65536);"
            "sys.stderr.write(r.decode()[3:]);sys.exit(0 if r==b'ok\\n' else 1)"
        )
        return f'{sys.executable} -c "{code}" {self.path}'

    def _serve(self) -> None:
        while True:
            try:
                conn, _ = self.listener.accept()
            except OSError:
                return
            with conn:
                conn.recv(64)
                try:
                    assert self.instance is not None
                    self.instance.restart()
                    self.restarts += 1
                    conn.sendall(b"ok\n")
                except BaseException as exc:
                    conn.sendall(f"err{exc}".encode())

    def close(self) -> None:
        self.listener.close()


class NodeContainerd(Containerd):
    """A harness containerd whose config is the host root's config.toml and whose
    PATH has the host root's /usr/local/bin (where the installer puts the shim) and
    not the venv (so only an installed shim can serve the cedana handler).

    It runs in a mount namespace of its own whose /usr/local/bin holds only a link to
    the host root's launcher: the `runtime_path` install registers (containerd >= 1.7)
    is that host path, /usr/local/bin/containerd-shim-cedana-v2."""

    host_root: Path

    def _command(self) -> list[str]:
        launcher = f"usr/local/bin/{SHIM_BINARY}"
        script = (
            "mount -t tmpfs -o size=1m,mode=755 cedana-itest-bin /usr/local/bin && "
            f'ln -s "$1" /{launcher} && shift && exec "$@"'
        )
        return [
            "unshare", "--mount", "--propagation", "private",
            "sh", "-c", script, "sh", str(self.host_root / launcher), *super()._command(),
        ]  # fmt: skip

    def _env(self) -> dict[str, str]:
        env = super()._env()
        path = [p for p in env["PATH"].split(":") if ".venv" not in p]
        env["PATH"] = ":".join([str(self.host_root / "usr/local/bin"), *path])
        env["CEDANA_FORKSERVER_IDLE"] = "30"
        return env


def _config(node: NodeContainerd, variant: str, images: harness_images.TestImages) -> str:
    """The node's containerd config for a variant: (a) plain, (b) with imports,
    (c) with a runc runtime and other settings, and a version-2 config read by
    containerd 2.x. Every one has what this VM needs (restrict_oom_score_adj, a local
    sandbox image, private dirs and sockets)."""
    config_version = 2 if variant == "v2-config" else node.version.config_version
    v3 = config_version == 3
    q = "'" if v3 else '"'
    head = f"""version = {config_version}
root = {_toml_str(node.root)}
state = {_toml_str(node.state)}
"""
    if variant == "imports":
        # Relative: the same files for containerd (in the real root) and for the
        # installer (under --host-root); 2.x reads it relative to this file.
        head += 'imports = ["conf.d/*.toml"]\n'
    head += f"""
[grpc]
  address = {_toml_str(node.socket)}

[ttrpc]
  address = {_toml_str(str(node.socket) + ".ttrpc")}

[debug]
  level = "debug"

[plugins.{q}io.containerd.internal.v1.opt{q}]
  path = {_toml_str(node.base / "opt")}

[plugins.{q}io.containerd.nri.v1.nri{q}]
  disable = true
"""
    if v3:
        runtime = "plugins.'io.containerd.cri.v1.runtime'"
        body = f"""
[plugins.'io.containerd.grpc.v1.cri']
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"

[plugins.'io.containerd.cri.v1.images'.pinned_images]
  sandbox = {_toml_str(images.pause)}

[{runtime}]
  restrict_oom_score_adj = true
  [{runtime}.cni]
    bin_dirs = [{_toml_str(CNI_BIN_DIR)}]
    conf_dir = {_toml_str(node.cni_conf_dir)}
"""
    else:
        runtime = 'plugins."io.containerd.grpc.v1.cri"'
        body = f"""
[{runtime}]
  restrict_oom_score_adj = true
  sandbox_image = {_toml_str(images.pause)}
  stream_server_address = "127.0.0.1"
  stream_server_port = "0"
  [{runtime}.cni]
    bin_dir = {_toml_str(CNI_BIN_DIR)}
    conf_dir = {_toml_str(node.cni_conf_dir)}
"""
    if variant == "runc":
        body += f"""  # The node's own runtime and settings: must survive install and uninstall.
  [{runtime}.containerd]
    default_runtime_name = "runc"
    [{runtime}.containerd.runtimes.runc]
      runtime_type = "io.containerd.runc.v2"
      [{runtime}.containerd.runtimes.runc.options]
        SystemdCgroup = false
"""
        body += '\n[metrics]\n  address = ""\n  grpc_histogram = false\n'
    return head + body


@dataclass
class Node:
    version: ContainerdVersion
    variant: str
    host_root: Path
    containerd: NodeContainerd
    restarter: RestartServer
    payload: Path

    @property
    def config(self) -> Path:
        return self.host_root / "etc/containerd/config.toml"

    def cli(self, *args: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        proc = subprocess.run(
            [*NODE_CLI, *args],
            capture_output=True,
            text=True,
            timeout=300,
            check=False,
            cwd=REPO,
        )
        if check and proc.returncode != 0:
            pytest.fail(
                f"cedana node {' '.join(args)} exited {proc.returncode}\n"
                f"stdout:\n{proc.stdout}\nstderr:\n{proc.stderr}\n"
                f"containerd log:\n{self.containerd.log_tail(40)}"
            )
        return proc

    def node_args(self) -> list[str]:
        return [
            "--host-root", str(self.host_root),
            "--containerd-socket", str(self.containerd.socket),
            "--restart-command", self.restarter.command,
        ]  # fmt: skip

    def install(self, *extra: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return self.cli(
            "install", *self.node_args(), "--payload", str(self.payload), "--json", *extra,
            check=check,
        )  # fmt: skip

    def uninstall(self, *extra: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return self.cli("uninstall", *self.node_args(), "--json", *extra, check=check)


def _tree(root: Path) -> dict[str, str]:
    """Every file and link under root (payload excluded) -> content hash / target."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        if Path(dirpath) == root / "opt":
            dirnames[:] = []
            continue
        for name in filenames + [d for d in dirnames if os.path.islink(os.path.join(dirpath, d))]:
            path = Path(dirpath) / name
            rel = str(path.relative_to(root))
            if path.is_symlink():
                out[rel] = "-> " + os.readlink(path)
            else:
                out[rel] = hashlib.sha256(path.read_bytes()).hexdigest()
    return out


@pytest.fixture(scope="session")
def node_payload(itest_root: Path) -> Path:
    """One payload for the session, built by `cedana node bundle` from this Python."""
    out = itest_root / "payload"
    proc = subprocess.run(
        [*NODE_CLI, "bundle", str(out), "--json"], capture_output=True, text=True, timeout=300
    )
    assert proc.returncode == 0, proc.stderr
    return out


@contextlib.contextmanager
def make_node(
    version: ContainerdVersion,
    variant: str,
    images: harness_images.TestImages,
    parent: Path,
    payload: Path,
    *,
    config_text: str | None = None,
) -> Iterator[Node]:
    base = parent / f"node-{version.id}-{variant}-{uuid.uuid4().hex[:6]}"
    base.mkdir()
    host_root = base / "host"
    (host_root / "etc/containerd").mkdir(parents=True)
    _link_or_copy(version.containerd, host_root / "usr/bin/containerd")
    _link_or_copy(CRIU, host_root / "usr/local/sbin/criu")
    instance = NodeContainerd(version, CEDANA, base / "ctrd", images)
    instance.host_root = host_root
    instance.config_path = host_root / "etc/containerd/config.toml"
    instance.config_path.write_text(config_text or _config(instance, variant, images))
    if variant == "imports":
        (host_root / "etc/containerd/conf.d").mkdir()
    restarter = RestartServer(base / "restart.sock")
    restarter.instance = instance
    try:
        instance.start()
        instance.import_images("k8s.io")
        yield Node(version, variant, host_root, instance, restarter, payload)
    finally:
        restarter.close()
        instance.cleanup(keep_base=True)
        _kill_payload_processes(host_root)
        subprocess.run(["rm", "-rf", "--one-file-system", str(base)], check=False)


def _kill_payload_processes(host_root: Path) -> None:
    """The shim's warm fork server, started from the installed payload, outlives the
    pods by design; it must not outlive the test."""
    prefix = str(host_root / "opt/cedana") + "/"
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        with contextlib.suppress(OSError):
            if os.readlink(f"/proc/{pid}/exe").startswith(prefix):
                os.kill(int(pid), 9)


def _cri_config(node: Node) -> dict[str, Any]:
    client = node.containerd.cri()
    try:
        status = client.runtime.Status(cri_pb.StatusRequest(verbose=True))
        config: dict[str, Any] = json.loads(status.info["config"])
        return config
    finally:
        client.close()


def _run_cri_pod(node: Node, images: harness_images.TestImages, handler: str = "cedana") -> None:
    """A pod and a container with `handler` ("": the CRI's default, as for a pod
    without runtimeClassName) run through the installed shim."""
    client = CriClient(node.containerd.socket, handler)
    try:
        log_dir = node.containerd.pod_logs / uuid.uuid4().hex[:8]
        with client.pod("node-install", log_dir, host_network=True) as pod:
            cid = client.run_container(
                pod, "hello", images.busybox, ["sh", "-c", "echo cedana-ok; sleep 60"]
            )
            status = client.wait_container_state(cid, cri_pb.CONTAINER_RUNNING)
            assert status.state == cri_pb.CONTAINER_RUNNING
            info = client.container_info(cid)
            runc_typed = node.containerd.version.major_minor >= (1, 7)
            expected = RUNC_TYPE if runc_typed else RUNTIME_TYPE
            assert info.get("runtimeType") == expected, info.get("runtimeType")
            shim_pids = node.containerd.shim_pids("k8s.io", pod.id)
            assert shim_pids, "no shim serves the pod"
            exe = os.readlink(f"/proc/{next(iter(shim_pids))}/exe")
            assert exe.startswith(str(node.host_root / "opt/cedana")), (
                f"the pod's shim runs {exe}, not the installed payload"
            )
            client.stop_container(cid, timeout=1)
    finally:
        client.close()


CASES = [(v, variant) for v in ("1.6", "2.1") for variant in ("plain", "imports", "runc")]
# containerd 2.x still reads version-2 configs (nodes upgraded from 1.7), and 1.7 too.
CASES += [("2.1", "v2-config"), ("1.7", "imports")]


@pytest.mark.parametrize(("short", "variant"), CASES, ids=[f"ctrd-{v}-{c}" for v, c in CASES])
def test_install_idempotent_uninstall(
    short: str,
    variant: str,
    test_images: harness_images.TestImages,
    itest_root: Path,
    node_payload: Path,
) -> None:
    version = VERSIONS[short]
    with make_node(version, variant, test_images, itest_root, node_payload) as node:
        original = node.config.read_bytes()
        original_mode = node.config.stat().st_mode
        before = _tree(node.host_root)

        result = json.loads(node.install().stdout)
        assert result["ok"] and result["restarted"], result
        assert node.restarter.restarts == 1
        steps = {s["name"]: s for s in result["steps"]}
        reg = next(s for name, s in steps.items() if name.startswith("registration"))
        expect_dropin = variant == "imports" and version.config_version == 3
        if expect_dropin:
            assert "registration (dropin)" in steps, reg
            assert node.config.read_bytes() == original, "a drop-in install edited the main config"
            dropin = node.host_root / "etc/containerd/conf.d/99-cedana.toml"
            assert (
                b'runtime_path = "/usr/local/bin/containerd-shim-cedana-v2"' in dropin.read_bytes()
            )
        else:
            assert "registration (edit)" in steps, reg
            if variant == "imports":
                # containerd 1.x would let a drop-in erase the main config's CRI table.
                assert "replaces a whole plugin table" in reg["detail"]
            # Our blocks, and nothing else: stripping them gives the node's file back.
            assert config_blocks.restore_edited(node.config.read_bytes()) == original
        assert steps["probe pod"]["outcome"] == "ok", steps["probe pod"]
        shim = node.host_root / "usr/local/bin/containerd-shim-cedana-v2"
        assert shim.is_symlink() and not os.readlink(shim).startswith("/")
        _run_cri_pod(node, test_images)
        # On by default: a pod without runtimeClassName goes through the shim too.
        assert _cri_config(node)["containerd"]["defaultRuntimeName"] == "cedana"
        assert "cedana (was runc)" in steps["default runtime"]["detail"], steps
        _run_cri_pod(node, test_images, handler="")

        installed = _tree(node.host_root)
        again = json.loads(node.install().stdout)
        assert again["ok"] and not again["restarted"] and not again["changed"], again
        assert node.restarter.restarts == 1
        assert _tree(node.host_root) == installed

        status = json.loads(node.cli("status", *node.node_args()[:4], "--json").stdout)
        assert status["ok"] and status["handler"]["registered"], status
        assert status["handler"]["default_runtime"] == "cedana", status

        # A pod without runtimeClassName runs under cedana (the default): uninstall
        # refuses while it runs.
        client = CriClient(node.containerd.socket, "")
        try:
            with client.pod("no-handler", node.containerd.pod_logs / "nh", host_network=True):
                refused = node.uninstall(check=False)
                assert refused.returncode != 0 and "/no-handler" in refused.stdout, refused
        finally:
            client.close()

        removed = json.loads(node.uninstall().stdout)
        assert removed["ok"] and removed["restarted"], removed
        assert node.config.read_bytes() == original
        assert node.config.stat().st_mode == original_mode
        assert _tree(node.host_root) == before
        assert not (node.host_root / "opt/cedana").exists()
        assert not (node.host_root / "var/lib/cedana").exists()
        # containerd came back on the restored config (the restart helper checks its
        # plugins) and no longer knows the handler.
        assert node.restarter.restarts == 2
        client = node.containerd.cri()
        try:
            cfg = json.loads(
                client.runtime.Status(cri_pb.StatusRequest(verbose=True)).info["config"]
            )
            assert "cedana" not in cfg["containerd"]["runtimes"]
            assert cfg["containerd"]["defaultRuntimeName"] == "runc"
        finally:
            client.close()


@pytest.mark.parametrize("short", ["1.7", "2.1"], ids=["ctrd-1.7", "ctrd-2.1"])
def test_opt_out_of_the_default_runtime_and_a_runc_binary(
    short: str, test_images: harness_images.TestImages, itest_root: Path, node_payload: Path
) -> None:
    """--no-default-runtime leaves the CRI's default as it was; --runc-binary makes the
    cedana handler run that binary (a wrapper that logs its calls and execs runc, as
    nvidia-container-runtime does); uninstall restores the config byte for byte."""
    version = VERSIONS[short]
    with make_node(version, "runc", test_images, itest_root, node_payload) as node:
        original = node.config.read_bytes()
        # A name on containerd's PATH (this host root is not containerd's real root).
        wrapper = node.host_root / "usr/local/bin/runc-wrapper"
        log = node.host_root.parent / "runc-wrapper.log"
        wrapper.parent.mkdir(parents=True, exist_ok=True)
        wrapper.write_text(f'#!/bin/sh\necho "$*" >> {log}\nexec {shutil.which("runc")} "$@"\n')
        wrapper.chmod(0o755)
        result = json.loads(
            node.install("--no-default-runtime", "--runc-binary", "runc-wrapper").stdout
        )
        steps = {s["name"]: s for s in result["steps"]}
        assert "--no-default-runtime" in steps["default runtime"]["detail"], steps
        assert _cri_config(node)["containerd"]["defaultRuntimeName"] == "runc"
        _run_cri_pod(node, test_images)
        calls = log.read_text().splitlines()
        assert any(" create " in f" {c} " for c in calls), calls
        client = CriClient(node.containerd.socket, "")
        try:
            log_dir = node.containerd.pod_logs / uuid.uuid4().hex[:8]
            with client.pod("opted-out", log_dir, host_network=True) as pod:
                cid = client.run_container(pod, "plain", test_images.busybox, ["sleep", "60"])
                assert client.container_info(cid)["runtimeType"] == "io.containerd.runc.v2"
                shims = node.containerd.shim_pids("k8s.io", pod.id)
                exe = os.readlink(f"/proc/{next(iter(shims))}/exe")
                assert exe.endswith("/containerd-shim-runc-v2"), exe
                client.stop_container(cid, timeout=1)
        finally:
            client.close()
        status = json.loads(node.cli("status", *node.node_args()[:4], "--json").stdout)
        assert status["registration"]["runc_binary"] == "runc-wrapper", status
        assert status["handler"]["default_runtime"] == "runc", status
        removed = json.loads(node.uninstall().stdout)
        assert removed["ok"], removed
        assert node.config.read_bytes() == original


@pytest.mark.parametrize("short", ["1.6", "2.1"], ids=["ctrd-1.6", "ctrd-2.1"])
def test_malformed_config_is_reported_and_untouched(
    short: str, test_images: harness_images.TestImages, itest_root: Path, node_payload: Path
) -> None:
    version = VERSIONS[short]
    with make_node(version, "plain", test_images, itest_root, node_payload) as node:
        bad = node.config.read_bytes() + b"\n[plugins\nbroken = \n"
        node.config.write_bytes(bad)
        before = _tree(node.host_root)
        proc = node.install(check=False)
        assert proc.returncode == 1
        assert str(node.config) in proc.stderr or "etc/containerd/config.toml" in proc.stderr
        assert "not valid TOML" in proc.stderr and "line" in proc.stderr, proc.stderr
        assert node.config.read_bytes() == bad
        assert _tree(node.host_root) == before
        assert node.restarter.restarts == 0


def test_registry_credentials_are_installed_root_only(
    test_images: harness_images.TestImages, itest_root: Path, node_payload: Path, tmp_path: Path
) -> None:
    """The chart's dockerconfigjson Secret, as the helper sees it, becomes the node's
    /etc/cedana/registry-auth.json, 0600, named by the node config; a file that is not a
    docker config.json is refused before anything is written."""
    version = VERSIONS["2.1"]
    with make_node(version, "plain", test_images, itest_root, node_payload) as node:
        bad = tmp_path / "bad.json"
        bad.write_text('{"not": "auths"}')
        before = _tree(node.host_root)
        proc = node.install("--registry-auth-source", str(bad), check=False)
        assert proc.returncode == 1 and 'no "auths" object' in proc.stderr, proc.stderr
        assert _tree(node.host_root) == before

        secret = tmp_path / ".dockerconfigjson"
        secret.write_text('{"auths": {"harbor.example.com": {"auth": "dTpw"}}}')
        settings = "--set=registry_auth_file=/etc/cedana/registry-auth.json"
        result = json.loads(node.install("--registry-auth-source", str(secret), settings).stdout)
        assert result["ok"], result
        installed = node.host_root / "etc/cedana/registry-auth.json"
        assert installed.read_bytes() == secret.read_bytes()
        assert installed.stat().st_mode & 0o777 == 0o600
        assert b"registry_auth_file" in (node.host_root / "etc/cedana/shim.toml").read_bytes()


def test_checkpoint_keys_are_installed_root_only(
    test_images: harness_images.TestImages, itest_root: Path, node_payload: Path, tmp_path: Path
) -> None:
    """The chart's keys Secret, as the helper sees it mounted (each key a link into
    ..data), becomes /etc/cedana/keys/<name>, 0600 each, named by the node config; a
    file that is not a PEM key is refused before anything is written."""
    version = VERSIONS["2.1"]
    with make_node(version, "plain", test_images, itest_root, node_payload) as node:
        mount = tmp_path / "keys"
        (mount / "..data").mkdir(parents=True)
        pem = b"-----BEGIN PUBLIC KEY-----\nAAAA\n-----END PUBLIC KEY-----\n"
        (mount / "..data" / "sign.pub").write_bytes(pem)
        (mount / "sign.pub").symlink_to("..data/sign.pub")
        (mount / "..data" / "notes.txt").write_bytes(b"not a key")
        (mount / "notes.txt").symlink_to("..data/notes.txt")
        before = _tree(node.host_root)
        proc = node.install("--keys-source", str(mount), check=False)
        assert proc.returncode == 1 and "not a PEM key file" in proc.stderr, proc.stderr
        assert _tree(node.host_root) == before

        (mount / "notes.txt").unlink()
        settings = "--set=trusted_keys=/etc/cedana/keys/sign.pub"
        result = json.loads(node.install("--keys-source", str(mount), settings).stdout)
        assert result["ok"], result
        installed = node.host_root / "etc/cedana/keys/sign.pub"
        assert installed.read_bytes() == pem and installed.stat().st_mode & 0o777 == 0o600
        assert b"trusted_keys" in (node.host_root / "etc/cedana/shim.toml").read_bytes()
