"""Kubernetes checkpoint archives (KEP-2008) in and out, on real containerd 2.1 over the CRI.

* The kubelet's checkpoint of a container under containerd's own runc shim (the CRI's
  CheckpointContainer, which `crictl checkpoint --export` and the kubelet's checkpoint API
  call) is imported with `cedana checkpoints import` and a NEW pod with
  `CEDANA_RESTORE=<id>` continues its count: a containerd that restores no archive itself
  (2.4 drops it) runs the forensic checkpoint again through the cedana handler.
* A cedana checkpoint exported with `cedana checkpoints export` is read by checkpointctl
  (Debian's, the format's reference reader): `show` names the container and the engine,
  `inspect --ps-tree --files --sockets` the container's command; the export imported back
  (under another label) restores too.
* `export --image` pushes it as a one-layer checkpoint image to the node config's registry
  (real docker-registry, TLS and auth): skopeo reads the manifest's org.criu.checkpoint.*
  annotations, and the layer it copies out is the archive checkpointctl reads.

Only containerd 2.x serves CheckpointContainer; the checks of crafted archives are
tests/unit/test_cri_archive.py.
"""

from __future__ import annotations

import contextlib
import gzip
import json
import subprocess
import uuid
from pathlib import Path

import pytest
from cedana_shim.api.cri.v1 import api_pb2 as cri_pb

from .harness.config import DEPS_DIR
from .harness.containerd import Containerd
from .harness.cr_events import TOPIC_RESTORE, EventStream
from .harness.cr_support import (
    DELETED_FILE,
    Counter,
    assert_continues,
    counter_script,
    entries,
    parse_ticks,
    wait_ticks,
)
from .harness.cri import CriClient
from .harness.cri_apps import ENV_LABEL, cri_stdout, start_app, stop_app
from .harness.registry import PASSWORD, USER, Registry, TlsFiles, skopeo
from .test_restore_by_hand import CHECKPOINT_ID, cedana

pytestmark = pytest.mark.ctrd_versions("2.1")
CHECKPOINTCTL = DEPS_DIR / "checkpointctl" / "checkpointctl"


def _checkpointctl(*args: str) -> str:
    assert CHECKPOINTCTL.exists(), f"{CHECKPOINTCTL} missing: run `make setup`"
    proc = subprocess.run(
        [str(CHECKPOINTCTL), *args], capture_output=True, text=True, timeout=120, check=False
    )
    assert proc.returncode == 0, f"checkpointctl {' '.join(args)}: {proc.stderr}{proc.stdout}"
    return proc.stdout


def _import(containerd: Containerd, archive: Path, namespace: str, label: str) -> str:
    proc = cedana(
        "checkpoints", "import", str(archive), "--store", str(containerd.store),
        "--namespace", namespace, "--label", label, "--json",
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    doc = json.loads(proc.stdout)
    assert CHECKPOINT_ID.fullmatch(doc["id"]), doc
    assert (doc["namespace"], doc["label"]) == (namespace, label)
    assert doc["restoreWith"]["env"] == f"CEDANA_RESTORE={doc['id']}"
    return str(doc["id"])


def _restore(
    stack: contextlib.ExitStack,
    containerd: Containerd,
    cri: CriClient,
    events: EventStream,
    namespace: str,
    label: str,
    checkpoint_id: str,
    token: str,
) -> Counter:
    """A new pod of `namespace` with CEDANA_RESTORE=<id>: restored, not cold, with the
    process's `token` (in memory) and its rootfs changes; its first ticks."""
    log_dir = containerd.pod_logs / uuid.uuid4().hex[:12]
    pod = stack.enter_context(cri.pod("again", log_dir, host_network=False, namespace=namespace))
    envs = {ENV_LABEL: label, "CEDANA_RESTORE": checkpoint_id}
    cid = cri.create_container(
        pod, "app", containerd.images.busybox, ["sh", "-c", counter_script()], envs=envs
    )
    cri.start_container(cid)
    outcome = events.wait_topic(TOPIC_RESTORE, cid, timeout=60)
    assert outcome.field("outcome") == "restored", outcome
    assert outcome.checkpoint_id == checkpoint_id
    after = wait_ticks(lambda: cri_stdout(log_dir / "app.log"), count=3)
    assert after.token == token, f"a cold start: token {after.token}, not {token}"
    on_disk = cri.exec_sync(cid, ["cat", "/var/token"]).stdout.decode().strip()
    assert on_disk == token, "the rootfs diff of the archive was not applied"
    gone = cri.exec_sync(cid, ["sh", "-c", f"test -e {DELETED_FILE}; echo $?"])
    assert gone.stdout.decode().strip() == "1", f"{DELETED_FILE}, deleted in the archive, is back"
    assert cri.container_status(cid).status.state == cri_pb.CONTAINER_RUNNING
    return after


def test_a_kubelet_checkpoint_archive_resumes_through_cedana(
    containerd: Containerd, cri: CriClient, tmp_path: Path
) -> None:
    namespace = f"ns-{uuid.uuid4().hex[:6]}"
    label = f"forensic-{uuid.uuid4().hex[:6]}"
    archive = tmp_path / "checkpoint-counter.tar"
    runc = CriClient(containerd.socket, "runc")
    with (
        contextlib.closing(runc),
        EventStream(containerd.socket) as events,
        contextlib.ExitStack() as stack,
    ):
        first = start_app(stack, containerd, runc, label=None, namespace=namespace)
        printed = wait_ticks(first.stdout, count=5)
        # What the kubelet's checkpoint API does: the container keeps running.
        runc.runtime.CheckpointContainer(
            cri_pb.CheckpointContainerRequest(
                container_id=first.cid, location=str(archive), timeout=60
            ),
            timeout=120,
        )
        ticks = parse_ticks(first.stdout())
        assert ticks is not None and ticks.token == printed.token
        runc.stop_container(first.cid, timeout=1)
        # The archive is containerd's own: engine containerd, runtime runc.
        shown = _checkpointctl("show", str(archive))
        assert "io.containerd.runc.v2" in shown and "containerd" in shown, shown

        checkpoint_id = _import(containerd, archive, namespace, label)
        (entry,) = entries(containerd.store, scope=namespace, label=label)
        assert entry.id == checkpoint_id
        assert entry.metadata["imported"]["engine"] == "containerd"
        assert entry.metadata["container"] == "app"
        after = _restore(
            stack, containerd, cri, events, namespace, label, checkpoint_id, ticks.token
        )
        # It goes on from the archive's moment (between what was printed before the
        # CheckpointContainer and after it), not from where the runc container stopped.
        assert printed.last < after.first <= ticks.last + 3, (printed.last, ticks.last, after)
        assert after.values == list(range(after.first, after.first + len(after.values)))


def test_an_export_is_read_by_checkpointctl_and_imports_back(
    containerd: Containerd, cri: CriClient, tmp_path: Path
) -> None:
    namespace = f"ns-{uuid.uuid4().hex[:6]}"
    label = f"export-{uuid.uuid4().hex[:6]}"
    archive = tmp_path / "export.tar"
    with EventStream(containerd.socket) as events, contextlib.ExitStack() as stack:
        first = start_app(stack, containerd, cri, label=label, namespace=namespace)
        wait_ticks(first.stdout, count=5)
        stop_app(cri, first)
        committed = events.wait_commit(first.cid, timeout=60)
        before = parse_ticks(first.stdout())
        assert before is not None

        proc = cedana(
            "checkpoints", "export", committed.checkpoint_id, "--store", str(containerd.store),
            "-o", str(archive), "--json",
        )  # fmt: skip
        assert proc.returncode == 0, proc.stderr
        done = json.loads(proc.stdout)
        assert done["archive"] == str(archive) and done["size"] == archive.stat().st_size
        assert archive.stat().st_mode & 0o777 == 0o600
        shown = _checkpointctl("show", str(archive))
        assert "app" in shown and "containerd" in shown and "io.containerd.cedana.v2" in shown
        tree = _checkpointctl("inspect", "--ps-tree", "--files", "--sockets", str(archive))
        assert "Process tree" in tree and "] sh" in " ".join(tree.split()), tree
        stats = _checkpointctl("inspect", "--stats", str(archive))
        assert "Pages written" in stats, stats

        again = f"{label}-imported"
        checkpoint_id = _import(containerd, archive, namespace, again)
        assert checkpoint_id != committed.checkpoint_id
        (entry,) = entries(containerd.store, scope=namespace, label=again)
        assert entry.metadata["imported"]["engine"] == "cedana"
        after = _restore(
            stack, containerd, cri, events, namespace, again, checkpoint_id, before.token
        )
        assert_continues(before, after, "restore of an exported and imported checkpoint")


def test_an_export_pushed_as_an_image_is_a_checkpoint_image_skopeo_and_checkpointctl_read(
    containerd: Containerd,
    cri: CriClient,
    tmp_path: Path,
    registry: Registry,
    tls: TlsFiles,
    node_env: dict[str, str],
) -> None:
    namespace = f"ns-{uuid.uuid4().hex[:6]}"
    label = f"image-{uuid.uuid4().hex[:6]}"
    env = node_env
    with EventStream(containerd.socket) as events, contextlib.ExitStack() as stack:
        first = start_app(stack, containerd, cri, label=label, namespace=namespace)
        wait_ticks(first.stdout, count=3)
        stop_app(cri, first)
        committed = events.wait_commit(first.cid, timeout=60)
    store = ("--store", str(containerd.store))
    elsewhere = cedana(
        "checkpoints", "export", committed.checkpoint_id, *store,
        "--image", "example.invalid:5000/forensics/counter:v1", env=env,
    )  # fmt: skip
    assert elsewhere.returncode == 1 and f"configured for {registry.host}" in elsewhere.stderr
    ref = f"{registry.host}/forensics/counter:v1"
    proc = cedana(
        "checkpoints", "export", committed.checkpoint_id, *store, "--image", ref, "--json",
        env=env,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    pushed = json.loads(proc.stdout)
    assert pushed["image"] == ref and pushed["digest"].startswith("sha256:")

    creds = ("--creds", f"{USER}:{PASSWORD}")
    raw = skopeo("inspect", "--raw", "--cert-dir", str(tls.cert_dir), *creds, f"docker://{ref}")
    assert raw.returncode == 0, raw.stderr
    manifest = json.loads(raw.stdout)
    notes = manifest["annotations"]
    assert notes["org.criu.checkpoint.container.name"] == "app"
    assert notes["org.criu.checkpoint.pod.namespace"] == namespace
    assert notes["org.criu.checkpoint.engine.name"] == "cedana"
    (layer,) = manifest["layers"]
    assert layer["mediaType"] == "application/vnd.oci.image.layer.v1.tar"
    layout = tmp_path / "oci"
    copy = skopeo(
        "copy", "--src-cert-dir", str(tls.cert_dir), "--src-creds", f"{USER}:{PASSWORD}",
        f"docker://{ref}", f"oci:{layout}:v1",
    )  # fmt: skip
    assert copy.returncode == 0, copy.stderr
    # skopeo may recompress the layer on its way into the layout: read what it wrote.
    blobs = layout / "blobs" / "sha256"
    (entry,) = json.loads((layout / "index.json").read_text())["manifests"]
    copied = json.loads((blobs / entry["digest"].removeprefix("sha256:")).read_text())
    (copied_layer,) = copied["layers"]
    data = (blobs / copied_layer["digest"].removeprefix("sha256:")).read_bytes()
    if copied_layer["mediaType"].endswith("+gzip"):
        data = gzip.decompress(data)
    (tmp_path / "layer.tar").write_bytes(data)
    shown = _checkpointctl("show", str(tmp_path / "layer.tar"))
    assert "app" in shown and "io.containerd.cedana.v2" in shown, shown
    assert not list(Path(containerd.store, "spool").glob("*.tar")), "the export was left"
