"""Restore by hand against a real containerd (1.6/1.7/2.1) and CRIU: a counter
checkpointed three times with `cedana checkpoint`, then a new container started with
CEDANA_RESTORE=<the second id> continues from the second checkpoint, not the third;
through `ctr` and through the CRI. Every bad input fails the container's start with
an error naming the checkpoint and why."""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

import grpc  # type: ignore[import-untyped, unused-ignore]
import pytest
from cedana_shim.checkpoint.store import Store, StoreConfig

from .conftest import MakeNode
from .harness.config import CEDANA as CEDANA_RUNTIME
from .harness.config import CTR_NAMESPACE, SHIM_BIN_DIR
from .harness.containerd import Containerd
from .harness.cr_events import EventStream
from .harness.cr_support import (
    Workloads,
    counter_script,
    entries,
    restored_from,
    unique_label,
    wait_ticks,
)
from .harness.cri import CriClient
from .harness.cri_apps import App
from .harness.ctr import Ctr
from .harness.registry import PASSWORD, USER, Registry, make_test_ca, write_auth_file
from .harness.util import wait_for

NewId = Callable[[str], str]
CEDANA = SHIM_BIN_DIR / "cedana"
CHECKPOINT_ID = re.compile(r"[0-9]{8}T[0-9]{6}Z-[0-9a-f]{8}")
COUNTER = "i=0; while true; do i=$((i+1)); echo $i > /tmp/count; sleep 0.1; done"
GAP = 30  # counts (3 s) between two checkpoints: their ranges never overlap


def cedana(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    proc = subprocess.run(
        [str(CEDANA), *args],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
        env={**os.environ, **(env or {})},
    )
    assert "Traceback" not in proc.stderr, proc.stderr
    return proc


def checkpoint(containerd: Containerd, cid: str, namespace: str) -> str:
    proc = cedana(
        "checkpoint", cid, "--leave-running", "--namespace", namespace,
        "--containerd-state", str(containerd.state),
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr
    checkpoint_id = proc.stdout.strip()
    assert CHECKPOINT_ID.fullmatch(checkpoint_id), proc.stdout
    return checkpoint_id


def three_checkpoints(
    containerd: Containerd, cid: str, namespace: str, count: Callable[[], int]
) -> list[tuple[str, int, int]]:
    """(id, count before, count after) of three checkpoints, GAP counts apart."""
    taken = []
    for _ in range(3):
        before = count()
        checkpoint_id = checkpoint(containerd, cid, namespace)
        after = count()
        taken.append((checkpoint_id, before, after))
        floor = after + GAP
        wait_for(lambda: count() > floor, timeout=30, what="counting on")  # noqa: B023 (waited on here)
    return taken


# -- ctr -------------------------------------------------------------------------------


def ctr_count(containerd: Containerd, cid: str) -> int:
    rootfs = containerd.bundle(CTR_NAMESPACE, cid) / "rootfs"
    try:
        return int((rootfs / "tmp" / "count").read_text() or 0)
    except (OSError, ValueError):
        return 0


def ctr_run(
    ctr: Ctr, image: str, cid: str, *env: str, check: bool = True
) -> subprocess.CompletedProcess[str]:
    flags: list[str] = ["-d"]
    for item in env:
        flags += ["--env", item]
    args = ctr.run_args(image, cid, "sh", "-c", COUNTER, flags=tuple(flags))
    args[args.index("--runtime") + 1] = CEDANA_RUNTIME.runtime_type
    return ctr(*args, check=check)


# CI time: the shim's code here does not change with containerd's version: oldest and newest.
@pytest.mark.ctrd_versions("1.6", "2.1")
@pytest.mark.parametrize("opt_in", ["label", "enable"])
def test_ctr_restores_the_second_of_three(
    containerd: Containerd, ctr: Ctr, new_id: NewId, opt_in: str
) -> None:
    src, dst = new_id("rbh-src"), new_id("rbh-dst")
    label = f"lbl-{uuid.uuid4().hex[:8]}" if opt_in == "label" else src
    opt = f"CEDANA_CHECKPOINT={label}" if opt_in == "label" else "CEDANA_ENABLE=1"
    image = containerd.images.busybox
    try:
        ctr_run(ctr, image, src, opt)
        ctr.wait_status(src, "RUNNING")
        wait_for(lambda: ctr_count(containerd, src) >= 3, timeout=10, what="counting")
        taken = three_checkpoints(
            containerd, src, CTR_NAMESPACE, lambda: ctr_count(containerd, src)
        )
        ctr.remove(src)
        (second, before, _), (_, third_before, _) = taken[1], taken[2]

        ctr_run(ctr, image, dst, opt, f"CEDANA_RESTORE={second}")
        ctr.wait_status(dst, "RUNNING")
        first = wait_for(lambda: ctr_count(containerd, dst) or None, timeout=10, what="the count")
        assert before <= first < third_before, (first, taken)  # the second's, not the third's
        wait_for(lambda: ctr_count(containerd, dst) > first, timeout=10, what="counting on")

        inspect = cedana(
            "checkpoints", "inspect", second, "--json", "--store", str(containerd.store)
        )
        assert inspect.returncode == 0, inspect.stderr
        doc = json.loads(inspect.stdout)
        assert [r["containerId"] for r in doc["restores"]] == [dst]
        assert doc["restoreWith"]["env"] == f"CEDANA_RESTORE={second}"
        listing = cedana("checkpoints", "list", "--store", str(containerd.store))
        assert f"CEDANA_RESTORE={second}" in listing.stdout
    finally:
        ctr.remove(src)
        ctr.remove(dst)


def test_ctr_bad_input_fails_the_start(containerd: Containerd, ctr: Ctr, new_id: NewId) -> None:
    src = new_id("rbh-bad")
    label = f"lbl-{uuid.uuid4().hex[:8]}"
    image = containerd.images.busybox
    try:
        ctr_run(ctr, image, src, f"CEDANA_CHECKPOINT={label}")
        ctr.wait_status(src, "RUNNING")
        wait_for(lambda: ctr_count(containerd, src) >= 3, timeout=10, what="counting")
        first = checkpoint(containerd, src, CTR_NAMESPACE)
        second = checkpoint(containerd, src, CTR_NAMESPACE)
        ctr.remove(src)
        common = next(n for n in range(len(first)) if first[n] != second[n])
        unknown = "20000101T000000Z-00000000"
        cases = [
            (unknown, f"no checkpoint {unknown!r} in namespace {CTR_NAMESPACE!r}"),
            (first[:common], f"checkpoints start with {first[:common]!r}"),
            ("../../etc/passwd", "path separator"),
            ("a" * 40, "over 25"),
        ]
        for n, (value, expected) in enumerate(cases):
            cid = new_id(f"rbh-bad{n}")
            try:
                proc = ctr_run(
                    ctr,
                    image,
                    cid,
                    f"CEDANA_CHECKPOINT={label}",
                    f"CEDANA_RESTORE={value}",
                    check=False,
                )
                assert proc.returncode != 0, f"{value!r}: the container started"
                assert expected in proc.stderr, proc.stderr
                assert ctr.task(cid) is None
            finally:
                ctr.remove(cid)

        # A damaged checkpoint: refused, not replaced by the label's other one.
        store = Store(StoreConfig(root=str(containerd.store)))
        entry = wait_for(
            lambda: ((e := store.catalog.get(first)).state == "compacted" and e) or None,
            timeout=60,
            what="the first checkpoint compacted",
        )
        blob = Path(store.root, "blobs", "sha256", entry.layers[0].digest.split(":")[1])
        cid = new_id("rbh-damaged")
        with contextlib.ExitStack() as undo:
            data = blob.read_bytes()
            undo.callback(blob.write_bytes, data)
            blob.write_bytes(data[:-1])
            try:
                proc = ctr_run(
                    ctr, image, cid, f"CEDANA_CHECKPOINT={label}", f"CEDANA_RESTORE={first}",
                    check=False,
                )  # fmt: skip
                assert proc.returncode != 0, "a damaged checkpoint was restored"
                assert f"cannot restore checkpoint {first!r}" in proc.stderr, proc.stderr
            finally:
                ctr.remove(cid)
    finally:
        ctr.remove(src)


# -- CRI -------------------------------------------------------------------------------


def app_count(app: App) -> int:
    """The last count the counter printed ("tick <token> <i>")."""
    ticks = [line.split()[-1] for line in app.stdout() if line.startswith("tick ")]
    return int(ticks[-1]) if ticks else 0


def start_counter(
    stack: contextlib.ExitStack,
    containerd: Containerd,
    cri: CriClient,
    namespace: str,
    envs: dict[str, str],
) -> App:
    """The counter in a new pod of ``namespace`` (removed when ``stack`` closes)."""
    log_dir = containerd.pod_logs / uuid.uuid4().hex[:12]
    pod = stack.enter_context(cri.pod("counter", log_dir, host_network=True, namespace=namespace))
    image = containerd.images.busybox
    cid = cri.create_container(pod, "app", image, ["sh", "-c", counter_script()], envs=envs)
    cri.start_container(cid)
    return App(pod, cid, log_dir / "app.log")


# CI time: one of each runtime registration (1.6's own type, 2.x's runc-typed one).
@pytest.mark.ctrd_versions("1.6", "2.1")
def test_cri_restores_the_second_of_three_in_its_namespace_only(
    containerd: Containerd, cri: CriClient
) -> None:
    label = f"lbl-{uuid.uuid4().hex[:8]}"
    namespace = f"team-{uuid.uuid4().hex[:6]}"
    with contextlib.ExitStack() as stack:
        opt = {"CEDANA_CHECKPOINT": label}
        src = start_counter(stack, containerd, cri, namespace, opt)
        wait_for(lambda: app_count(src) >= 3, timeout=15, what="counting")
        taken = three_checkpoints(containerd, src.cid, "k8s.io", lambda: app_count(src))
        (second, before, _), (_, third_before, _) = taken[1], taken[2]
        cri.stop_container(src.cid, timeout=30)

        dst = start_counter(stack, containerd, cri, namespace, {**opt, "CEDANA_RESTORE": second})
        first = wait_for(lambda: app_count(dst) or None, timeout=15, what="the count")
        assert before < first <= third_before, (first, taken)

        # Another namespace: refused exactly like an id that exists nowhere.
        messages = []
        for ref in (second, "20000101T000000Z-00000000"):
            with pytest.raises(grpc.RpcError) as caught:
                start_counter(stack, containerd, cri, "elsewhere", {**opt, "CEDANA_RESTORE": ref})
            details = str(caught.value.details())
            assert f"no checkpoint {ref!r} in namespace 'elsewhere'" in details, details
            assert namespace not in details
            messages.append(re.sub(r"container \S+", "container X", details.replace(ref, "REF")))
        assert messages[0] == messages[1]


# -- from the registry (the checkpoint was taken on another node) -------------------------


@pytest.fixture
def node_env(tmp_path: Path) -> Iterator[dict[str, str]]:
    """Both nodes' registry settings: a real registry with TLS and auth."""
    tls = make_test_ca(tmp_path / "tls")
    registry = Registry(tmp_path / "registry", tls=tls)
    registry.start()
    try:
        auth = write_auth_file(tmp_path / "registry-auth.json", registry.host, USER, PASSWORD)
        yield {
            "CEDANA_REGISTRY": f"{registry.host}/cedana",
            "CEDANA_REGISTRY_AUTH_FILE": str(auth),
            "CEDANA_REGISTRY_CA": str(tls.ca_cert),
            "CEDANA_REGISTRY_TIMEOUT": "10",
        }
    finally:
        registry.stop()


@pytest.mark.ctrd_versions("1.6", "2.1")
def test_a_checkpoint_in_the_registry_is_restored_by_hand_on_another_node(
    make_node: MakeNode, node_env: dict[str, str], new_id: NewId
) -> None:
    a, b = make_node(node_env), make_node(node_env)
    label = unique_label("rbh")
    script = counter_script()
    with (
        EventStream(b.socket) as events_b,
        Workloads(a, new_id, label=label, script=script, namespace=CTR_NAMESPACE) as on_a,
        Workloads(b, new_id, label=label, script=script, namespace=CTR_NAMESPACE) as on_b,
    ):
        src = on_a.start("src")
        before = wait_ticks(src.lines, count=3)
        chosen = checkpoint(a, src.cid, CTR_NAMESPACE)
        after = src.ticks()
        assert after is not None
        later = wait_ticks(src.lines, count=len(after.values) + GAP)
        checkpoint(a, src.cid, CTR_NAMESPACE)  # newer: the label's latest, not asked for
        remote_a = {**node_env, "CEDANA_STORE_PATH": str(a.store)}

        def pushed() -> list[str]:
            done = cedana("checkpoints", "list", "--remote", "--json", env=remote_a)
            assert done.returncode == 0, done.stderr
            items = json.loads(done.stdout)
            return [i["restoreWith"]["env"] for i in items if i["id"] == chosen]

        assert wait_for(pushed, timeout=120, what="the chosen checkpoint in the registry") == [
            f"CEDANA_RESTORE={chosen}"
        ]
        assert not entries(b.store)
        dst = on_b.start("dst", extra=("--env", f"CEDANA_RESTORE={chosen[:20]}"))
        restored_from(events_b, dst, chosen)
        resumed = wait_ticks(dst.lines, count=3)
        # The same process (its in-memory token), from the chosen checkpoint's count:
        # between what was printed before and after it, far below the newer one's.
        assert resumed.token == before.token, (resumed, before)
        assert before.last < resumed.first <= after.last + 1 < later.last, (resumed, after)
        assert [e.id for e in entries(b.store)] == [chosen]
