"""`cedana` as containerd's default CRI runtime, on real containerd 1.6/1.7/2.1.

The node is configured as `cedana node install --default-runtime` leaves it
(`default_runtime_name = "cedana"`, runc still registered), and the CRI is driven
with NO runtime handler, as kubelet does for a pod without runtimeClassName. A
container with CEDANA_CHECKPOINT is checkpointed when the pod is deleted and resumes
in the next pod; an unlabelled container in the same pod runs and stops as under
runc; a pod naming the `runc` RuntimeClass keeps the runc shim. A second `cedana`
handler whose options name a runc binary (containerd's `BinaryName`, a wrapper that
logs its calls and execs runc) runs its containers through that binary.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import tomllib
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
from cedana_shim.api.cri.v1 import api_pb2 as cri_pb
from cedana_shim.node import config_blocks
from cedana_shim.node import containerd_config as cc
from cedana_shim.node import registration as reg

from .harness import images as harness_images
from .harness.config import CEDANA, CRI_NAMESPACE, ContainerdVersion
from .harness.containerd import Containerd
from .harness.cr_events import TOPIC_COMMITTED, TOPIC_FAILED, TOPIC_RESTORE, EventStream
from .harness.cr_support import assert_continues, entries, parse_ticks, wait_ticks
from .harness.cri import CriClient
from .harness.cri_apps import cri_stdout, start_app, stop_app
from .harness.util import wait_for

COMMIT_TIMEOUT = 60
WRAPPED = "cedana-wrapped"  # a second cedana handler with BinaryName = the wrapper
PLAIN = (
    "trap 'echo plain-TERM; exit 0' TERM; "
    "echo plain-start; while :; do echo tick > /var/plain; sleep 0.2; done"
)


class DefaultCedanaNode(Containerd):
    """The harness containerd with `cedana` as the CRI's default runtime and a
    `cedana-wrapped` handler whose runc is `wrapper`."""

    def __init__(self, *args: object, wrapper: Path, **kwargs: object) -> None:
        self.wrapper = wrapper
        super().__init__(*args, **kwargs)  # type: ignore[arg-type]

    def _runtime_tables(self, prefix: str) -> str:
        tables = super()._runtime_tables(prefix)
        assert 'default_runtime_name = "runc"' in tables
        tables = tables.replace('default_runtime_name = "runc"', 'default_runtime_name = "cedana"')
        return tables

    def _cedana_tables(self) -> str:
        # The wrapped handler is registered as install registers `cedana` with
        # --runc-binary on a systemd node: the same form, with runc's options.
        options = {"BinaryName": str(self.wrapper), "SystemdCgroup": True}
        shim = self.cedana_runtime_path()
        version = self.version.config_version
        wrapped = reg.render_tables(version, shim, str(self.node_config), runc_options=options)
        return (
            super()._cedana_tables()
            + "\n"
            + wrapped.replace(f".runtimes.{reg.HANDLER}", f".runtimes.{WRAPPED}")
        )


def _runc_typed(version: ContainerdVersion) -> bool:
    return reg.honours_runtime_path(version.major_minor, version.config_version)


def _cedana_type(version: ContainerdVersion) -> str:
    """What the CRI records as the runtime of a container of the cedana handler."""
    return reg.RUNC_TYPE if _runc_typed(version) else reg.RUNTIME_TYPE


def _wrapper(path: Path) -> Path:
    """A runc that appends its arguments to `<path>.log`, then execs the real runc
    without `--systemd-cgroup` (this machine's cgroups are not systemd's: the flag
    only has to arrive)."""
    runc = shutil.which("runc")
    assert runc, "runc not on PATH"
    path.write_text(
        f'#!/bin/sh\necho "$*" >> {path}.log\n'
        'for a; do shift; [ "$a" = --systemd-cgroup ] || set -- "$@" "$a"; done\n'
        f'exec {runc} "$@"\n'
    )
    path.chmod(0o755)
    return path


@pytest.fixture
def node(
    ctrd_version: ContainerdVersion, test_images: harness_images.TestImages, itest_root: Path
) -> Iterator[DefaultCedanaNode]:
    itest_root.mkdir(parents=True, exist_ok=True)
    base = Path(
        subprocess.run(
            ["mktemp", "-d", "-p", str(itest_root), f"{ctrd_version.id}-default-XXXX"],
            capture_output=True,
            text=True,
            check=True,
        ).stdout.strip()
    )
    wrapper = _wrapper(base / "runc-wrapper")
    instance = DefaultCedanaNode(ctrd_version, CEDANA, base / "ctrd", test_images, wrapper=wrapper)
    try:
        instance.start()
        instance.import_images(CRI_NAMESPACE)
        yield instance
    finally:
        instance.cleanup(keep_base=True, check=False)
        subprocess.run(["rm", "-rf", "--one-file-system", str(base)], check=False)


@contextlib.contextmanager
def cri_client(node: Containerd, handler: str) -> Iterator[CriClient]:
    client = CriClient(node.socket, handler)
    try:
        client.wait_ready()
        yield client
    finally:
        client.close()


def _runtime_type(client: CriClient, cid: str) -> str:
    return str(client.container_info(cid).get("runtimeType"))


def test_the_stock_config_of_each_containerd_gets_cedana_as_its_default(
    ctrd_version: ContainerdVersion, tmp_path: Path
) -> None:
    """`containerd config default` of the real binary, edited as install edits it:
    the same binary loads it with `cedana` as the default runtime and the handler
    registered, and stripping our blocks gives the stock file back byte for byte."""
    binary = str(ctrd_version.containerd)
    stock = subprocess.run([binary, "config", "default"], capture_output=True, check=True).stdout
    version = cc.parse_containerd_version(
        subprocess.run([binary, "--version"], capture_output=True, text=True).stdout
    )
    main = cc.ConfigFile(str(tmp_path / "config.toml"), stock)
    plan = cc.plan_registration(cc.Snapshot(main, (), version), cc.Wanted(default_runtime=True))
    assert plan.mode == "edit" and plan.content is not None and plan.previous_default == "runc"
    assert config_blocks.restore_edited(plan.content) == stock
    edited = tmp_path / "config.toml"
    edited.write_bytes(plan.content)
    dump = subprocess.run(
        [binary, "-c", str(edited), "config", "dump"], capture_output=True, text=True
    )
    assert dump.returncode == 0, dump.stderr
    loaded = tomllib.loads(dump.stdout)
    cri = reg.CRI_PLUGIN[int(loaded["version"])]
    containerd_table = loaded["plugins"][cri]["containerd"]
    assert containerd_table["default_runtime_name"] == "cedana", containerd_table
    cedana = containerd_table["runtimes"]["cedana"]
    assert cedana["runtime_type"] == _cedana_type(ctrd_version), cedana
    if _runc_typed(ctrd_version):
        assert cedana["runtime_path"] == reg.DEFAULT_SHIM_PATH, cedana
    assert containerd_table["runtimes"]["runc"]["runtime_type"] == "io.containerd.runc.v2"


def test_the_cri_reports_cedana_as_its_default(node: DefaultCedanaNode) -> None:
    with cri_client(node, "") as client:
        status = client.runtime.Status(cri_pb.StatusRequest(verbose=True))
        config = json.loads(status.info["config"])
        assert config["containerd"]["defaultRuntimeName"] == "cedana", config["containerd"]


def test_a_pod_without_handler_is_checkpointed_and_restored(node: DefaultCedanaNode) -> None:
    """A pod without runtimeClassName: the labelled container is checkpointed at pod
    deletion and resumes in the next pod; the unlabelled one beside it runs and stops
    as under runc (its own SIGTERM handler, exit 0) and is never checkpointed."""
    label = f"default-{uuid.uuid4().hex[:8]}"
    kns = f"ns-{uuid.uuid4().hex[:6]}"
    with (
        cri_client(node, "") as cri,
        EventStream(node.socket) as events,
        contextlib.ExitStack() as stack,
    ):
        first = start_app(stack, node, cri, label=label, namespace=kns)
        assert cri.pod_status(first.pod.id).status.runtime_handler == ""
        assert _runtime_type(cri, first.cid) == _cedana_type(node.version)
        cold = events.wait_topic(TOPIC_RESTORE, first.cid, timeout=30)
        assert cold.field("outcome") == "cold", cold
        plain = cri.create_container(first.pod, "plain", node.images.busybox, ["sh", "-c", PLAIN])
        cri.start_container(plain)
        plain_log = first.log.parent / "plain.log"
        wait_for(lambda: "plain-start" in cri_stdout(plain_log), timeout=10, what="plain start")
        wait_ticks(first.stdout, count=5)

        cri.stop_container(plain, timeout=30)
        st = cri.container_status(plain).status
        assert (st.state, st.exit_code) == (cri_pb.CONTAINER_EXITED, 0), st
        assert "plain-TERM" in cri_stdout(plain_log), "the unlabelled container missed SIGTERM"
        cri.remove_container(plain)
        stop_app(cri, first)  # exit 143: the checkpoint ended the labelled container
        committed = events.wait_commit(first.cid, timeout=COMMIT_TIMEOUT)
        assert (committed.field("scope"), committed.field("label")) == (kns, label)
        before = parse_ticks(first.stdout())
        assert before is not None

        second = start_app(stack, node, cri, label=label, namespace=kns)
        outcome = events.wait_topic(TOPIC_RESTORE, second.cid, timeout=30)
        assert outcome.field("outcome") == "restored", outcome
        assert outcome.checkpoint_id == committed.checkpoint_id
        assert_continues(before, wait_ticks(second.stdout, count=3), "default-runtime restore")

        cedana_topics = (TOPIC_COMMITTED, TOPIC_FAILED, TOPIC_RESTORE)
        touched = [
            e.topic
            for e in events.events(lambda e: e.topic in cedana_topics)
            if e.field("container_id") in (plain, first.pod.id)
        ]
        assert not touched, f"cedana events for the unlabelled/pause containers: {touched}"
    listed = entries(node.store, scope=kns)
    assert [e.id for e in listed] == [committed.checkpoint_id]
    assert {e.metadata["container"] for e in listed} == {"app"}


def test_a_pod_naming_another_runtime_class_keeps_it(node: DefaultCedanaNode) -> None:
    with cri_client(node, "runc") as cri, contextlib.ExitStack() as stack:
        app = start_app(stack, node, cri, label=None, namespace="other", script=PLAIN)
        assert cri.pod_status(app.pod.id).status.runtime_handler == "runc"
        assert _runtime_type(cri, app.cid) == "io.containerd.runc.v2"
        shims = node.shim_pids(CRI_NAMESPACE, app.pod.id)
        assert shims
        exe = os.readlink(f"/proc/{next(iter(shims))}/exe")
        assert exe.endswith("/containerd-shim-runc-v2"), exe


def test_binary_name_runs_the_handlers_runc(node: DefaultCedanaNode) -> None:
    """containerd >= 1.7 hands the handler (a runc-type runtime running our shim)
    runc's options; the shim runs the BinaryName there exactly as the runc shim would,
    with the table's SystemdCgroup.
    containerd 1.6 (the shim's own runtime type: its CRI ignores runtime_path) passes
    only ConfigPath, so the wrapper is never run (which is why `cedana node install
    --runc-binary` refuses 1.6)."""
    log = Path(f"{node.wrapper}.log")
    with cri_client(node, WRAPPED) as cri, contextlib.ExitStack() as stack:
        app = start_app(stack, node, cri, label=None, namespace="wrapped", script=PLAIN)
        wait_for(lambda: "plain-start" in app.stdout(), timeout=10, what="plain start")
        cri.stop_container(app.cid, timeout=30)
        calls = log.read_text().splitlines() if log.exists() else []
        if node.version.major_minor < (1, 7):
            assert calls == [], calls
            return
        creates = [c for c in calls if c.split()[-1:] == [app.cid] and " create " in f" {c} "]
        assert creates, f"the wrapper never created {app.cid}: {calls}"
        # SystemdCgroup from the same options table (what install mirrors from the
        # node's runc on systemd nodes).
        assert all("--systemd-cgroup" in c.split() for c in creates), creates
        assert any(app.pod.id in c for c in calls), "the pause container bypassed the wrapper"
        assert any(" kill " in f" {c} " and app.cid in c for c in calls), calls
