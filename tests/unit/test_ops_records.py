"""What a shim hands the node agent per operation, on the fake runc with a real store:
one spool record and one log line per checkpoint (phases adding up to the wall
time, the pod from the CRI annotations), containerd's /tasks/checkpointed event, a
failed checkpoint's record, the restore's record, and the background compaction's."""

from __future__ import annotations

import json
import logging
import signal
from pathlib import Path

import pytest
from cedana_shim.api.containerd.events import task_pb2 as ev
from cedana_shim.api.containerd.task.v2 import shim_pb2 as pb
from cedana_shim.checkpoint import oplog
from cedana_shim.checkpoint.op_records import background_record, restore_outcome
from cedana_shim.checkpoint.restore import RestoreReport
from cedana_shim.errors import ShimError
from store_support import make_store, publish
from task_support import COUNTER, NAMESPACE, SLEEP, TaskEnv, TaskWorld, ctx

POD_ANNOTATIONS = {
    "io.kubernetes.cri.container-type": "container",
    "io.kubernetes.cri.sandbox-namespace": "team-a",
    "io.kubernetes.cri.sandbox-name": "trainer-0",
    "io.kubernetes.cri.sandbox-uid": "6f1c0de4-0000-4000-8000-000000000001",
    "io.kubernetes.cri.container-name": "main",
}


def spool_records(env: TaskEnv) -> list[oplog.OpRecord]:
    spool = oplog.spool_path(env.store.root)
    found = []
    for name in oplog.records(spool):
        record = oplog.parse((Path(spool) / name).read_bytes())
        assert record is not None, name
        found.append(record)
    return found


async def create_in_pod(env: TaskEnv, container_id: str, label: str) -> None:
    bundle = Path(env.bundle(container_id, SLEEP, label=label))
    spec = json.loads((bundle / "config.json").read_text())
    spec["annotations"] = POD_ANNOTATIONS
    (bundle / "config.json").write_text(json.dumps(spec))
    await env.service.create(
        pb.CreateTaskRequest(id=container_id, bundle=str(bundle)), ctx("Create")
    )
    await env.start(container_id)


def test_checkpoint_on_stop_leaves_one_record_and_one_line(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="cedana_shim")

    async def body(env: TaskEnv) -> None:
        await create_in_pod(env, "c1", "web")
        await env.kill("c1", signal.SIGTERM)
        assert (await env.wait("c1")).exit_status == 143
        await env.checkpoints.drain(5.0)

        (checkpointed,) = env.events.of(ev.TaskCheckpointed)
        (entry_id,) = [e.id for e in env.store.catalog.list(scope="team-a", label="web")]
        assert (checkpointed.container_id, checkpointed.checkpoint) == ("c1", entry_id)
        assert "/tasks/checkpointed" in env.events.topics()

        cold, checkpoint, compaction = spool_records(env)
        assert (cold.kind, cold.outcome, cold.pod, cold.checkpoint_id) == (
            "restore", "cold", "trainer-0", "",
        )  # fmt: skip
        assert (checkpoint.kind, checkpoint.outcome, checkpoint.trigger) == (
            "checkpoint", "committed", "stop",
        )  # fmt: skip
        assert (checkpoint.namespace, checkpoint.pod, checkpoint.container) == (
            "team-a", "trainer-0", "main",
        )  # fmt: skip
        assert checkpoint.pod_uid == POD_ANNOTATIONS["io.kubernetes.cri.sandbox-uid"]
        assert (checkpoint.checkpoint_id, checkpoint.label) == (entry_id, "web")
        assert checkpoint.size_bytes > 0  # the raw size at commit: compaction changes it
        # A phase under half a millisecond (the rootfs here: not an overlay) is left out.
        assert {"dump", "commit"} <= set(checkpoint.phases)
        assert set(checkpoint.phases) <= {"freeze", "dump", "rootfs", "commit", "other"}
        assert sum(checkpoint.phases.values()) == pytest.approx(
            checkpoint.duration_seconds, abs=0.002
        )
        assert checkpoint.versions["shim"]

        assert (compaction.kind, compaction.outcome, compaction.trigger) == (
            "compaction", "done", "stop",
        )  # fmt: skip
        compacted = env.store.catalog.get(entry_id)
        assert compaction.size_bytes == compacted.size
        assert compaction.raw_bytes == sum(layer.raw_size for layer in compacted.layers)
        assert set(compaction.phases) <= {"compress", "other"}

        lines = [r for r in caplog.records if r.getMessage() == "checkpoint committed"]
        assert len(lines) == 1
        line = lines[0]
        assert line.__dict__["phases"] == checkpoint.phases
        assert line.__dict__["seconds"] == checkpoint.duration_seconds

    TaskWorld(tmp_path).run(body)


def test_a_failed_checkpoint_is_recorded_with_its_error(tmp_path: Path) -> None:
    async def body(env: TaskEnv) -> None:
        await env.run("c1", SLEEP, label="web")
        env.fake.control(checkpoint={"error": "no space for pages"})
        with pytest.raises(ShimError):
            await env.cedana_checkpoint("c1", leave_running=True)
        cold, record = spool_records(env)
        assert (cold.kind, cold.outcome) == ("restore", "cold")
        assert (record.kind, record.outcome, record.trigger) == ("checkpoint", "failed", "manual")
        assert (record.namespace, record.pod, record.container) == (NAMESPACE, "", "c1")
        assert "runc checkpoint failed" in record.detail
        assert record.checkpoint_id == ""
        assert sum(record.phases.values()) == pytest.approx(record.duration_seconds, abs=0.002)
        await env.kill("c1", signal.SIGKILL)
        await env.wait("c1")

    TaskWorld(tmp_path).run(body)


def test_a_restore_is_recorded(tmp_path: Path) -> None:
    async def body(env: TaskEnv) -> None:
        await env.run("src", COUNTER, label="web")
        checkpoint_id = (await env.cedana_checkpoint("src", leave_running=True)).checkpoint_id
        await env.kill("src", signal.SIGKILL)
        await env.wait("src")
        await env.delete("src")
        await env.checkpoints.drain(5.0)
        spool = Path(oplog.spool_path(env.store.root))
        for name in oplog.records(str(spool)):
            (spool / name).unlink()

        await env.run("c1", COUNTER, label="web")
        (record,) = [r for r in spool_records(env) if r.kind == "restore"]
        assert (record.outcome, record.checkpoint_id, record.label) == (
            "restored", checkpoint_id, "web",
        )  # fmt: skip
        assert record.skipped == []
        assert "restore" in record.phases
        assert record.duration_seconds > 0
        assert sum(record.phases.values()) == pytest.approx(record.duration_seconds, abs=0.002)
        await env.kill("c1", signal.SIGKILL)
        await env.wait("c1")

    TaskWorld(tmp_path).run(body)


@pytest.mark.parametrize(
    ("checkpoint_id", "skipped", "store_problem", "outcome"),
    [
        ("ck2", [], "", "restored"),
        ("ck1", ["ck2: restore failed: criu failed"], "", "fell_back"),
        ("", [], "", "cold"),
        ("", ["ck2: damaged"], "", "failed"),
        ("", [], "checkpoint store unusable: EIO", "failed"),
    ],
)
def test_restore_outcomes(
    checkpoint_id: str, skipped: list[str], store_problem: str, outcome: str
) -> None:
    report = RestoreReport("c1", "ns", "web", checkpoint_id, skipped, store_problem)
    assert restore_outcome(report) == outcome


def test_a_refused_restore_by_hand_is_failed() -> None:
    report = RestoreReport("c1", "ns", "web", failed="checkpoint ck9 not found")
    assert restore_outcome(report) == "failed"


def test_background_records_say_what_the_checkpoint_says_of_itself(tmp_path: Path) -> None:
    store = make_store(tmp_path)
    entry = publish(store, "web", scope="team-a")
    push = background_record(store.catalog, oplog.PUSH, "done", entry.id, 2.0, {"push": 2.0})
    assert (push.namespace, push.label, push.checkpoint_id) == ("team-a", "web", entry.id)
    assert (push.size_bytes, push.raw_bytes, push.duration_seconds) == (0, 0, 2.0)

    compacted = store.compactor.compact(entry.id)
    assert compacted is not None
    done = background_record(
        store.catalog, oplog.COMPACTION, "done", entry.id, 1.0, {"compress": 1.0}
    )
    assert done.size_bytes == compacted.size
    assert done.raw_bytes == sum(layer.raw_size for layer in compacted.layers) > 0

    gone = background_record(
        store.catalog, oplog.PUSH, "failed", "0" * 26, 0.5, {}, detail="HTTP 500"
    )
    assert (gone.namespace, gone.label, gone.detail) == ("", "", "HTTP 500")
