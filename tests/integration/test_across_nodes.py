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
- namespaces stay apart across nodes: B in another namespace starts cold;
- a container starting on B while A's push is still in flight (its marker in the
  registry, refreshed by its pusher) waits for it and resumes from it; a marker dated
  in the future, or one its pusher stopped refreshing (a push that failed), delays no
  start; a registry that never answers does not wedge a start; retention applies in
  the registry;
- a forged checkpoint someone pushed to the registry, newer than the label's good
  ones (its CRIU layer a zstd bomb), is refused at its recorded size, does not stay
  in the node's store, and is not tried first again; the label's history stays;
- the same move through the CRI: a pod deleted on A resumes in a new pod on B.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import signal
import subprocess
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from pathlib import Path

import pytest
from cedana_shim.checkpoint.remote import Outbox
from cedana_shim.checkpoint.remote.manifest import EMPTY_CONFIG, EMPTY_DIGEST, marker_manifest
from cedana_shim.checkpoint.remote.tags import PENDING_SUFFIX, node_hash, tag_for
from cedana_shim.checkpoint.store.layout import MEDIA_TYPE_MANIFEST, format_created
from cedana_shim.registry import RegistryClient
from support.cpuinfo import this_cpu, unfit
from support.forged import RECORDED_TAR_BYTES, MiB, forge, push_forged, zstd_bomb

from .conftest import MakeNode
from .harness.config import CTR_NAMESPACE, SHIM_BIN_DIR
from .harness.containerd import Containerd
from .harness.cr_events import TOPIC_EXIT, TOPIC_RESTORE, EventStream
from .harness.cr_support import (
    Box,
    ShimLog,
    Workloads,
    assert_continues,
    counter_script,
    entries,
    open_store,
    parse_ticks,
    restored_from,
    shim_pid,
    started_cold,
    unique_label,
    wait_compacted,
    wait_ticks,
)
from .harness.cri_apps import start_app, stop_app
from .harness.registry import (
    PREFIX,
    HungServer,
    Registry,
    TlsFiles,
)
from .harness.remote_support import registry_config
from .harness.util import wait_for

NewId = Callable[[str], str]
pytestmark = pytest.mark.ctrd_versions("1.6", "2.1")
MEM_KIB = 16 * 1024


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


@dataclass
class Nodes:
    """Node A and node B, each with its event stream and its labelled workloads."""

    a: Containerd
    b: Containerd
    events_a: EventStream
    events_b: EventStream
    on_a: Workloads
    on_b: Workloads


@contextlib.contextmanager
def two_nodes(
    make_node: MakeNode,
    env: dict[str, str],
    new_id: NewId,
    label: str,
    script: str,
    namespace_b: str = CTR_NAMESPACE,
    env_a: dict[str, str] | None = None,
) -> Iterator[Nodes]:
    a, b = make_node({**env, **(env_a or {})}), make_node(env)
    if namespace_b != CTR_NAMESPACE:
        b.import_images(namespace_b)
    with (
        EventStream(a.socket) as events_a,
        EventStream(b.socket) as events_b,
        Workloads(a, new_id, label=label, script=script, namespace=CTR_NAMESPACE) as on_a,
        Workloads(b, new_id, label=label, script=script, namespace=namespace_b) as on_b,
    ):
        yield Nodes(a, b, events_a, events_b, on_a, on_b)


def test_a_checkpoint_taken_on_one_node_resumes_on_another(
    make_node: MakeNode, node_env: dict[str, str], new_id: NewId
) -> None:
    label = unique_label("move")
    script = counter_script(mem_kib=MEM_KIB)
    with two_nodes(make_node, node_env, new_id, label, script) as n:
        first = n.on_a.start("a")
        checkpoint = _stop(n.on_a, first, n.events_a)
        before = first.ticks()
        assert before is not None
        # before-exit: in the registry by the time the exit was reported
        assert _remote_ids(n.a, node_env, label) == [checkpoint]

        assert not entries(n.b.store)  # B has nothing of its own
        log_b = ShimLog(n.b)
        second = n.on_b.start("b")
        restored_from(n.events_b, second, checkpoint)
        assert_continues(before, wait_ticks(second.lines, count=3), "restore on another node")
        pulled = log_b.wait("pulled checkpoint from the registry", checkpoint=checkpoint)
        assert pulled["container"] == second.cid
        # Its raw images were checked as the pull wrote them: CRIU reads them once.
        fresh = log_b.wait("restoring from raw images checked as they were pulled")
        assert (fresh["container"], fresh["checkpoint"]) == (second.cid, checkpoint)
        assert [e.id for e in entries(n.b.store, label=label)] == [checkpoint]


def test_a_checkpoint_is_not_restored_into_another_image_on_another_node(
    make_node: MakeNode, node_env: dict[str, str], new_id: NewId
) -> None:
    """On B the image's tag has moved (it names another image there): the checkpoint A
    took from that tag is skipped before anything is pulled, the two digests (asked of
    each node's containerd) in the reason, and the container starts cold."""
    label = unique_label("image")
    script = counter_script()
    with two_nodes(make_node, node_env, new_id, label, script) as n:
        checkpoint = _stop(n.on_a, n.on_a.start("a"), n.events_a)
        images = n.b.images
        n.on_b.ctr("images", "tag", "--force", images.pause, images.busybox)
        log_b = ShimLog(n.b)
        second = n.on_b.start("b")
        outcome = started_cold(n.events_b, second)
        detail = str(outcome.field("detail"))
        assert checkpoint in detail and "this container's image is" in detail, detail
        digests = re.findall(r"sha256:[0-9a-f]{64}", detail)
        assert len(set(digests)) == 2, detail
        assert not entries(n.b.store)  # refused before the pull
        assert not log_b.find("pulled checkpoint from the registry")
        # The digest was asked by a child: grpc never stays in the pod's shim.
        maps = Path(f"/proc/{shim_pid(n.b, second)}/maps").read_text()
        assert "cygrpc" not in maps and "grpc" not in maps


def test_a_checkpoint_from_a_cpu_this_node_lacks_is_skipped_before_the_pull(
    make_node: MakeNode, node_env: dict[str, str], new_id: NewId, tmp_path: Path
) -> None:
    """A's dump describes a CPU with an xsave feature no CPU has (an action script puts
    such a cpuinfo.img among A's images, as CRIU on a newer CPU would write it): B runs
    `criu cpuinfo check` on the copy in the checkpoint's metadata, skips the checkpoint
    with CRIU's reason before anything is pulled, and the container starts cold."""
    unfit_image = tmp_path / "unfit-cpuinfo.img"
    unfit_image.write_bytes(unfit(this_cpu(tmp_path / "this-cpu")))
    newer_cpu = tmp_path / "newer-cpu.sh"
    newer_cpu.write_text(
        '#!/bin/sh\n[ "$CRTOOLS_SCRIPT_ACTION" = post-dump ] || exit 0\n'
        f'cp {unfit_image} "$CRTOOLS_IMAGE_DIR/cpuinfo.img"\n'
    )
    newer_cpu.chmod(0o755)
    env_a = {"CEDANA_CRIU_CONFIG_EXTRA": f"action-script {newer_cpu}"}
    label = unique_label("cpu")
    with two_nodes(make_node, node_env, new_id, label, counter_script(), env_a=env_a) as n:
        checkpoint = _stop(n.on_a, n.on_a.start("a"), n.events_a)
        log_b = ShimLog(n.b)
        second = n.on_b.start("b")
        outcome = started_cold(n.events_b, second)
        detail = str(outcome.field("detail"))
        assert checkpoint in detail and "criu cpuinfo check: " in detail, detail
        assert "xfeatures" in detail, detail  # CRIU's own words
        assert not entries(n.b.store)  # refused before the pull
        assert not log_b.find("pulled checkpoint from the registry")


def test_a_chunk_corrupted_in_the_registry_leaves_nothing_on_the_pulling_node(
    make_node: MakeNode, node_env: dict[str, str], registry: Registry, new_id: NewId
) -> None:
    """A page-image chunk damaged in the registry is found while it streams into B's
    page images: the pull fails, nothing of it is left in B's store (no checkpoint, no
    raw images, no staging), and the container falls back (cold: there is no other)."""
    label = unique_label("rot")
    with two_nodes(make_node, node_env, new_id, label, counter_script(mem_kib=MEM_KIB)) as n:
        checkpoint = _stop(n.on_a, n.on_a.start("a"), n.events_a)
        (entry,) = entries(n.a.store, label=label)
        chunk = max(entry.layer("criu").chunks, key=lambda c: c.size)
        registry.corrupt_blob(chunk.digest, offset=chunk.size // 2)
        second = n.on_b.start("b")
        outcome = started_cold(n.events_b, second)
        detail = str(outcome.field("detail"))
        assert checkpoint in detail and "cannot pull it" in detail, detail
        assert not entries(n.b.store)
        assert not (n.b.store / "raw").exists() or not os.listdir(n.b.store / "raw")
        assert [p for p in os.listdir(n.b.store / "ingest") if p.startswith("adopt-")] == []


def test_a_push_the_registry_missed_is_made_later(
    make_node: MakeNode, node_env: dict[str, str], registry: Registry, new_id: NewId
) -> None:
    label = unique_label("later")
    script = counter_script(mem_kib=MEM_KIB)
    with two_nodes(make_node, node_env, new_id, label, script) as n:
        first = n.on_a.start("a")
        registry.stop(signal.SIGKILL)
        log_a = ShimLog(n.a)
        checkpoint = _stop(n.on_a, first, n.events_a)  # committed here, exit reported
        before = first.ticks()
        assert before is not None
        log_a.wait("checkpoint push failed; it stays pending", checkpoint=checkpoint)
        assert [e.id for e in entries(n.a.store, label=label)] == [checkpoint]

        registry.start()
        synced = _cli(n.a, node_env, "checkpoints", "sync", "--json")
        assert synced.returncode == 0, synced.stderr
        assert checkpoint in json.loads(synced.stdout)["pushed"], synced.stdout
        assert _remote_ids(n.a, node_env, label) == [checkpoint]

        second = n.on_b.start("b")
        restored_from(n.events_b, second, checkpoint)
        assert_continues(before, wait_ticks(second.lines, count=3), "restore after a late push")


def test_namespaces_stay_apart_across_nodes(
    make_node: MakeNode, node_env: dict[str, str], new_id: NewId
) -> None:
    label = unique_label("apart")
    other_ns = f"{CTR_NAMESPACE}-other"
    script = counter_script()
    with two_nodes(make_node, node_env, new_id, label, script, namespace_b=other_ns) as n:
        _stop(n.on_a, n.on_a.start("a"), n.events_a)
        started_cold(n.events_b, n.on_b.start("b"))


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


@contextlib.contextmanager
def _marker(
    client: RegistryClient,
    label: str,
    created: datetime,
    checkpoint_id: str,
    node: str,
    *,
    started: datetime,
    beat: datetime | None = None,
) -> Iterator[None]:
    """An in-flight marker in the registry, as a pusher writes it. ``beat`` None: kept
    fresh while the block runs (put again every second, as a live pusher does); else
    written once with that heartbeat (a pusher that stopped, or a forger's)."""
    repo = client.repository_for(CTR_NAMESPACE)
    tag = tag_for(label, format_created(created), checkpoint_id, node).tag + PENDING_SUFFIX
    client.push_blob(repo, EMPTY_DIGEST, len(EMPTY_CONFIG), lambda _: io.BytesIO(EMPTY_CONFIG))

    def put(heartbeat: datetime) -> None:
        marker = marker_manifest(checkpoint_id, CTR_NAMESPACE, label, node, started, heartbeat)
        client.put_manifest(repo, tag, marker, MEDIA_TYPE_MANIFEST)

    put(beat or datetime.now(UTC))
    ended = threading.Event()

    def beating() -> None:
        while not ended.wait(1.0):
            put(datetime.now(UTC))

    thread = threading.Thread(target=beating, daemon=True)
    if beat is None:
        thread.start()
    try:
        yield
    finally:
        ended.set()
        if beat is None:
            thread.join()


def test_a_start_waits_for_a_push_still_in_flight(
    make_node: MakeNode,
    node_env: dict[str, str],
    registry: Registry,
    tls: TlsFiles,
    tmp_path: Path,
    new_id: NewId,
) -> None:
    """The newest checkpoint of the label is still being pushed by node A (its marker is
    in the registry, refreshed as A's push does, its tag not yet) when the container
    starts on B: B waits for it instead of starting cold, and resumes from it once the
    push lands."""
    label = unique_label("inflight")
    script = counter_script()
    with (
        two_nodes(make_node, node_env, new_id, label, script) as n,
        ThreadPoolExecutor(1) as pool,
    ):
        first = n.on_a.start("a")
        registry.stop(signal.SIGKILL)
        checkpoint = _stop(n.on_a, first, n.events_a)  # committed on A, not pushed
        before = first.ticks()
        assert before is not None
        registry.start()
        # A's push has begun: the marker it writes before any blob, and keeps fresh.
        entry = next(e for e in entries(n.a.store, label=label) if e.id == checkpoint)
        client = RegistryClient(registry_config(registry, tls, tmp_path))
        node = str(entry.metadata["node"])
        created = datetime.fromisoformat(entry.created)
        log_b = ShimLog(n.b)
        with _marker(client, label, created, entry.id, node, started=datetime.now(UTC)):
            starting = pool.submit(n.on_b.start, "b")  # its Create waits for the push
            waiting = log_b.wait("waiting for a checkpoint of the label being written", label=label)
            assert any(checkpoint in w for w in waiting["writers"]), waiting
            assert not starting.done()
        synced = _cli(n.a, node_env, "checkpoints", "sync", "--json")  # the push completes
        assert synced.returncode == 0, synced.stderr
        second = starting.result(timeout=120)
        restored_from(n.events_b, second, checkpoint)
        assert_continues(before, wait_ticks(second.lines, count=3), "restore after the wait")


@pytest.mark.parametrize("marker", ["future", "stale"])
def test_a_start_does_not_wait_for_a_marker_of_no_live_push(
    make_node: MakeNode,
    node_env: dict[str, str],
    registry: Registry,
    tls: TlsFiles,
    tmp_path: Path,
    new_id: NewId,
    marker: str,
) -> None:
    """A marker of the label newer than its checkpoint, but dated a day ahead (a forger's:
    its checkpoint, its start, its heartbeat), or left by a push that failed five minutes
    ago (under checkpoint_timeout): B, with label_wait_timeout 60 s, restores the label's
    checkpoint at once. Before, it waited the whole 60 s and then said so."""
    env = {**node_env, "CEDANA_LABEL_WAIT_TIMEOUT": "60"}
    label = unique_label(marker)
    with two_nodes(make_node, env, new_id, label, counter_script()) as n:
        checkpoint = _stop(n.on_a, n.on_a.start("a"), n.events_a)
        client = RegistryClient(registry_config(registry, tls, tmp_path))
        now = datetime.now(UTC)
        when = now + timedelta(days=1) if marker == "future" else now - timedelta(minutes=5)
        created = when if marker == "future" else now
        pending = f"{created:%Y%m%dT%H%M%S}Z-{uuid.uuid4().hex[:8]}"
        log_b = ShimLog(n.b)
        with _marker(client, label, created, pending, "node-x", started=when, beat=when):
            second = n.on_b.start("b")
            outcome = restored_from(n.events_b, second, checkpoint)
        assert outcome.field("detail") == "", outcome
        assert not log_b.find("waiting for a checkpoint of the label being written")


def test_a_forged_newer_checkpoint_in_the_registry_changes_nothing_on_a_node(
    make_node: MakeNode,
    node_env: dict[str, str],
    registry: Registry,
    tls: TlsFiles,
    tmp_path: Path,
    new_id: NewId,
) -> None:
    """Someone able to push to the registry published a checkpoint of the label newer
    than its three good ones: a copy of the newest whose CRIU layer's tar is a zstd bomb
    (256 MiB from a few KiB, its config saying 4 KiB). The next start pulls it first
    (it is the newest), refuses it at the recorded size, and restores the newest good
    one; the forged one is not left in the store, the three good ones stay (here and in
    the registry), and the start after that restores the newest good one without
    trying the forged one first. Before, it was committed to the store and tried first
    by every start, and retention then dropped the good ones in its favour."""
    env = {**node_env, "CEDANA_RETAIN": "3"}
    a = make_node(env)
    label = unique_label("forged")
    with (
        EventStream(a.socket) as events,
        Workloads(a, new_id, label=label, script=counter_script(), namespace=CTR_NAMESPACE) as w,
    ):
        good = [_stop(w, w.start("a0"), events)]
        for i in (1, 2):
            box = w.start(f"a{i}")
            restored_from(events, box, good[-1])
            good.append(_stop(w, box, events))
        history = list(reversed(good))
        assert _remote_ids(a, env, label) == history
        store = open_store(a.store)
        newest = wait_compacted(a.store, good[-1])
        newer = datetime.fromisoformat(newest.created) + timedelta(minutes=1)
        forged = forge(store, newest, newer, bomb=zstd_bomb(256 * MiB))
        client = RegistryClient(registry_config(registry, tls, tmp_path))
        push_forged(client, store, forged, "node-x", scope=CTR_NAMESPACE)
        assert _remote_ids(a, env, label) == [forged.id, *history]

        box = w.start("a3")
        detail = str(restored_from(events, box, good[-1]).field("detail"))
        hashed = node_hash("node-x")  # the tag names the node by its hash only
        assert f"{forged.id} (registry, from node #{hashed}): cannot pull it" in detail, detail
        assert f"more than the {RECORDED_TAR_BYTES} bytes recorded" in detail, detail
        assert [e.id for e in entries(a.store, label=label)] == history
        assert _remote_ids(a, env, label) == [forged.id, *history]
        # No checkpoint at a SIGKILL: the next start chooses again, among the same.
        w.ctr("task", "kill", "-s", "SIGKILL", box.cid)
        events.wait_topic(TOPIC_EXIT, box.cid, timeout=60, id=box.cid)
        w.delete(box)
        again = w.start("a4")
        assert restored_from(events, again, good[-1]).field("detail") == ""
        assert [e.id for e in entries(a.store, label=label)] == history


def test_a_hung_registry_does_not_wedge_a_start(
    make_node: MakeNode, node_env: dict[str, str], new_id: NewId
) -> None:
    """The registry accepts connections and never answers: a container of the label
    starts cold within a few registry timeouts, and says why."""
    hung = HungServer()
    try:
        env = {
            **node_env,
            "CEDANA_REGISTRY": f"{hung.host}/{PREFIX}",
            "CEDANA_REGISTRY_TIMEOUT": "2",
        }
        b = make_node(env)
        with (
            EventStream(b.socket) as events,
            Workloads(
                b,
                new_id,
                label=unique_label("hung"),
                script=counter_script(),
                namespace=CTR_NAMESPACE,
            ) as w,
        ):
            began = time.monotonic()
            box = w.start("b")
            outcome = started_cold(events, box)
            assert time.monotonic() - began < 30
            assert "registry" in str(outcome.field("detail")), outcome
            wait_ticks(box.lines, count=2)
    finally:
        hung.close()


def test_a_pod_deleted_on_one_node_resumes_in_a_new_pod_on_another(
    make_node: MakeNode, node_env: dict[str, str]
) -> None:
    """The same through the CRI, as kubelet drives it: a pod on A deleted (StopContainer
    with a grace period, then the sandbox), a new pod of the namespace with the label on
    B, a CNI network of its own there: it resumes, counting on."""
    a, b = make_node(node_env), make_node(node_env)
    label = unique_label("pod")
    kns = f"ns-{uuid.uuid4().hex[:6]}"
    cri_a, cri_b = a.cri(), b.cri()
    try:
        with (
            EventStream(a.socket) as events_a,
            EventStream(b.socket) as events_b,
            contextlib.ExitStack() as stack,
        ):
            first = start_app(stack, a, cri_a, label=label, namespace=kns, host_network=False)
            wait_ticks(first.stdout, count=3)
            stop_app(cri_a, first)
            committed = events_a.wait_commit(first.cid, timeout=60)
            before = parse_ticks(first.stdout())
            assert before is not None
            second = start_app(stack, b, cri_b, label=label, namespace=kns, host_network=False)
            outcome = events_b.wait_topic(TOPIC_RESTORE, second.cid, timeout=60)
            assert outcome.field("outcome") == "restored", outcome
            assert outcome.checkpoint_id == committed.checkpoint_id
            assert_continues(before, wait_ticks(second.stdout, count=3), "a pod on another node")
    finally:
        cri_a.close()
        cri_b.close()


HELD_TRIES = 5


def test_the_exit_waits_for_a_push_another_process_holds(
    make_node: MakeNode, node_env: dict[str, str], new_id: NewId
) -> None:
    """registry_sync = before-exit while another process (the node agent, a sweep, the
    CLI) holds the checkpoint's outbox record: the exit is not reported while it does;
    let go unpushed, the stop pushes it itself, and the exit follows with the tag there.
    Before: the stop's own push found the record busy and the exit went out at once.

    The shim claims the record itself a few ms after writing it (its push compacts on
    the way), so the test, standing in for the other process, has to get there first:
    it tries again with a new container when the shim won (at most HELD_TRIES times)."""
    a = make_node(node_env)
    outbox = Outbox(str(a.store))
    for _ in range(HELD_TRIES):
        label = unique_label("held")
        with (
            EventStream(a.socket) as events,
            Workloads(
                a,
                new_id,
                label=label,
                script=counter_script(mem_kib=4 * MEM_KIB),
                namespace=CTR_NAMESPACE,
            ) as w,
        ):
            box = w.start("a")
            wait_ticks(box.lines, count=3)
            w.ctr("task", "kill", "-s", "SIGTERM", box.cid)
            pending = wait_for(outbox.pending, timeout=60, interval=0.001, what="the outbox record")
            with outbox.claimed(pending[0]) as held:
                if held:
                    time.sleep(3)
                    assert not events.of(TOPIC_EXIT, box.cid), (
                        "exit reported while the push was held"
                    )
            exited = events.wait_topic(TOPIC_EXIT, box.cid, timeout=60, id=box.cid)
            assert exited.field("exit_status") == 143, exited
            assert _remote_ids(a, node_env, label) == pending
        if held:
            return
    pytest.fail(f"the shim claimed the outbox record before the test in {HELD_TRIES} tries")
