"""Checkpoints follow the workload to another node through an OCI registry.

Two containerds of their own ("node A", "node B": separate roots, separate checkpoint
stores, separate shims) share one real registry (Debian's docker-registry, TLS from a
test CA, htpasswd auth), configured as a cluster operator would: `registry`,
`registry_auth_file`, `registry_ca` (here through CEDANA_<KEY> in containerd's
environment). A labelled counter checkpointed on A resumes on B, whose store is empty.

- the stop on A pushes before the exit is reported (registry_sync = before-exit), so
  the tag is in the registry when containerd sees the exit;
- B pulls the checkpoint (verified) into its own store and restores it;
- with the registry down during the stop, the checkpoint is committed on A, the exit
  is reported, the push stays pending in A's outbox, and `cedana checkpoints sync`
  pushes it once the registry is back; then B resumes from it;
- namespaces stay apart across nodes: B in another namespace starts cold.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from .conftest import MakeNode
from .harness.config import CTR_NAMESPACE, SHIM_BIN_DIR
from .harness.containerd import Containerd
from .harness.cr_events import TOPIC_EXIT, EventStream
from .harness.cr_support import (
    Box,
    ShimLog,
    Workloads,
    assert_continues,
    counter_script,
    entries,
    restored_from,
    started_cold,
    unique_label,
    wait_ticks,
)
from .harness.registry import PASSWORD, USER, Registry, TlsFiles, make_test_ca, write_auth_file

NewId = Callable[[str], str]
pytestmark = pytest.mark.ctrd_versions("1.6", "2.1")
MEM_KIB = 16 * 1024
PREFIX = "cedana"


@pytest.fixture(scope="module")
def tls(tmp_path_factory: pytest.TempPathFactory) -> TlsFiles:
    return make_test_ca(tmp_path_factory.mktemp("tls"))


@pytest.fixture
def registry(tmp_path: Path, tls: TlsFiles) -> Iterator[Registry]:
    reg = Registry(tmp_path / "registry", tls=tls)
    reg.start()
    try:
        yield reg
    finally:
        reg.stop()


@pytest.fixture
def node_env(tmp_path: Path, registry: Registry, tls: TlsFiles) -> dict[str, str]:
    auth = write_auth_file(tmp_path / "registry-auth.json", registry.host, USER, PASSWORD)
    return {
        "CEDANA_REGISTRY": f"{registry.host}/{PREFIX}",
        "CEDANA_REGISTRY_AUTH_FILE": str(auth),
        "CEDANA_REGISTRY_CA": str(tls.ca_cert),
        "CEDANA_REGISTRY_TIMEOUT": "10",
    }


def _stop(w: Workloads, box: Box, events: EventStream) -> str:
    """SIGTERM through ctr: the checkpoint id, once the exit is reported."""
    wait_ticks(box.lines, count=3)
    w.ctr("task", "kill", "-s", "SIGTERM", box.cid)
    committed = events.wait_commit(box.cid, timeout=60)
    exited = events.wait_topic(TOPIC_EXIT, box.cid, timeout=120, id=box.cid)
    assert exited.field("exit_status") == 143, exited
    w.delete(box)
    return committed.checkpoint_id


def _cli(node: Containerd, env: dict[str, str], *args: str) -> subprocess.CompletedProcess[str]:
    """The admin CLI with node A's config (its store, the registry)."""
    full = {**os.environ, **env, "CEDANA_STORE_PATH": str(node.store)}
    return subprocess.run(
        [str(SHIM_BIN_DIR / "cedana"), *args],
        env=full,
        capture_output=True,
        text=True,
        timeout=300,
        check=False,
    )


def _remote_ids(node: Containerd, env: dict[str, str], label: str) -> list[str]:
    done = _cli(node, env, "checkpoints", "list", "--remote", "--label", label, "--json")
    assert done.returncode == 0, done.stderr
    return [item["id"] for item in json.loads(done.stdout)]


def test_a_checkpoint_taken_on_one_node_resumes_on_another(
    make_node: MakeNode, node_env: dict[str, str], new_id: NewId
) -> None:
    a, b = make_node(node_env), make_node(node_env)
    label = unique_label("move")
    script = counter_script(mem_kib=MEM_KIB)
    with (
        EventStream(a.socket) as events_a,
        EventStream(b.socket) as events_b,
        Workloads(a, new_id, label=label, script=script, namespace=CTR_NAMESPACE) as on_a,
        Workloads(b, new_id, label=label, script=script, namespace=CTR_NAMESPACE) as on_b,
    ):
        first = on_a.start("a")
        checkpoint = _stop(on_a, first, events_a)
        before = first.ticks()
        assert before is not None
        # before-exit: in the registry by the time the exit was reported
        assert _remote_ids(a, node_env, label) == [checkpoint]

        assert not entries(b.store)  # B has nothing of its own
        log_b = ShimLog(b)
        second = on_b.start("b")
        restored_from(events_b, second, checkpoint)
        assert_continues(before, wait_ticks(second.lines, count=3), "restore on another node")
        pulled = log_b.wait("pulled checkpoint from the registry", checkpoint=checkpoint)
        assert pulled["container"] == second.cid
        assert [e.id for e in entries(b.store, label=label)] == [checkpoint]


def test_a_push_the_registry_missed_is_made_later(
    make_node: MakeNode, node_env: dict[str, str], registry: Registry, new_id: NewId
) -> None:
    a, b = make_node(node_env), make_node(node_env)
    label = unique_label("later")
    script = counter_script(mem_kib=MEM_KIB)
    with (
        EventStream(a.socket) as events_a,
        EventStream(b.socket) as events_b,
        Workloads(a, new_id, label=label, script=script, namespace=CTR_NAMESPACE) as on_a,
        Workloads(b, new_id, label=label, script=script, namespace=CTR_NAMESPACE) as on_b,
    ):
        first = on_a.start("a")
        registry.stop(signal.SIGKILL)
        log_a = ShimLog(a)
        checkpoint = _stop(on_a, first, events_a)  # committed here, exit reported
        before = first.ticks()
        assert before is not None
        log_a.wait("checkpoint push failed; it stays pending", checkpoint=checkpoint)
        assert [e.id for e in entries(a.store, label=label)] == [checkpoint]

        registry.start()
        synced = _cli(a, node_env, "checkpoints", "sync", "--json")
        assert synced.returncode == 0, synced.stderr
        assert checkpoint in json.loads(synced.stdout)["pushed"], synced.stdout
        assert _remote_ids(a, node_env, label) == [checkpoint]

        second = on_b.start("b")
        restored_from(events_b, second, checkpoint)
        assert_continues(before, wait_ticks(second.lines, count=3), "restore after a late push")


def test_namespaces_stay_apart_across_nodes(
    make_node: MakeNode, node_env: dict[str, str], new_id: NewId
) -> None:
    a, b = make_node(node_env), make_node(node_env)
    label = unique_label("apart")
    other_ns = f"{CTR_NAMESPACE}-other"
    b.import_images(other_ns)
    script = counter_script()
    with (
        EventStream(a.socket) as events_a,
        EventStream(b.socket) as events_b,
        Workloads(a, new_id, label=label, script=script, namespace=CTR_NAMESPACE) as on_a,
        Workloads(b, new_id, label=label, script=script, namespace=other_ns) as on_b,
    ):
        _stop(on_a, on_a.start("a"), events_a)
        started_cold(events_b, on_b.start("b"))


def test_retention_applies_in_the_registry(
    make_node: MakeNode, node_env: dict[str, str], new_id: NewId
) -> None:
    """retain = 1: after the second checkpoint of the label is pushed, the registry
    holds only it (the first one's manifest deleted), as the node's store does."""
    env = {**node_env, "CEDANA_RETAIN": "1"}
    a = make_node(env)
    label = unique_label("retain")
    with (
        EventStream(a.socket) as events,
        Workloads(a, new_id, label=label, script=counter_script(), namespace=CTR_NAMESPACE) as w,
    ):
        first = _stop(w, w.start("a"), events)
        second_box = w.start("b")
        restored_from(events, second_box, first)
        second = _stop(w, second_box, events)
        assert _remote_ids(a, env, label) == [second]
        assert [e.id for e in entries(a.store, label=label)] == [second]
