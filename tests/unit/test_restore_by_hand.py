"""Restore by hand (CEDANA_RESTORE / cedana.ai/restore) on the fake runc, from a real
store in tmp_path: exactly the checkpoint asked for, by id or unique prefix, in the
same namespace only; every way it can be refused fails the container with an error
naming the checkpoint and why, unless CEDANA_RESTORE_FALLBACK=cold; a restore is
recorded in the store and timed by phase."""

from __future__ import annotations

import json
import os
import signal
from collections.abc import Mapping, Sequence
from pathlib import Path

import pytest
from cedana_shim.api.cedana.v1 import cedana_pb2 as cedana_pb
from cedana_shim.api.containerd.task.v2 import shim_pb2 as pb
from cedana_shim.checkpoint.compat import image_mismatch
from cedana_shim.checkpoint.remote import RemoteCheckpoint
from cedana_shim.checkpoint.restore import PHASES
from cedana_shim.errors import (
    DataLoss,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ShimError,
)
from task_support import COUNTER, TaskEnv, TaskWorld, ctx

LABEL = "web"
NS_KEY = "io.kubernetes.cri.sandbox-namespace"
IMAGE_KEY = "io.kubernetes.cri.image-name"


async def create(
    env: TaskEnv,
    container_id: str,
    *,
    env_vars: Sequence[str] = (),
    label: str | None = LABEL,
    annotations: Mapping[str, str] | None = None,
) -> int:
    """Create ``container_id`` running the counter, with extra env and annotations."""
    bundle = env.bundle(container_id, COUNTER, env=env_vars, label=label)
    config = Path(bundle) / "config.json"
    spec = json.loads(config.read_text())
    spec["annotations"] = dict(annotations or {})
    config.write_text(json.dumps(spec))
    req = pb.CreateTaskRequest(id=container_id, bundle=bundle)
    return int((await env.service.create(req, ctx("Create"))).pid)


async def three_checkpoints(
    env: TaskEnv,
    *,
    annotations: Mapping[str, str] | None = None,
    second_bad: bool = False,
) -> list[str]:
    """Checkpoints of LABEL taken by hand with the counter at 10, 20 and 30, oldest
    first; the container they came from is gone."""
    await create(env, "src", annotations=annotations)
    await env.start("src")
    await env.until(lambda: env.fake.memory("src") == "1", "the counter to start")
    ids = []
    for value in ("10", "20", "30"):
        env.fake.set_memory("src", value)
        if second_bad and value == "20":
            env.fake.control(checkpoint={"bad_images": True})
        ids.append((await env.cedana_checkpoint("src", leave_running=True)).checkpoint_id)
        env.fake.control()
    await env.kill("src", signal.SIGKILL)
    await env.wait("src")
    await env.delete("src")
    await env.checkpoints.drain(5.0)
    env.events.events.clear()
    return ids


def outcome_of(env: TaskEnv, container_id: str) -> cedana_pb.RestoreOutcome:
    (outcome,) = [o for o in env.events.of(cedana_pb.RestoreOutcome)
                  if o.container_id == container_id]  # fmt: skip
    return outcome


async def counter_reaches(env: TaskEnv, container_id: str, value: str) -> None:
    await env.until(lambda: env.fake.memory(container_id) == value, f"the counter at {value}")


async def refused(env: TaskEnv, container_id: str, kind: type[ShimError], **kw: object) -> str:
    """The Create fails with ``kind``; nothing of the container is left. Its message."""
    with pytest.raises(kind) as caught:
        await create(env, container_id, **kw)  # type: ignore[arg-type]
    assert container_id not in env.service.containers
    assert [c for c in env.fake.calls("create") if container_id in c] == []
    return str(caught.value)


def test_restores_the_second_of_three_not_the_newest(tmp_path: Path) -> None:
    async def body(env: TaskEnv) -> None:
        first, second, third = await three_checkpoints(env)
        await create(env, "c1", env_vars=[f"CEDANA_RESTORE={second}"])
        await env.start("c1")
        await counter_reaches(env, "c1", "21")  # the second's 20, and on: not 31
        outcome = outcome_of(env, "c1")
        assert (outcome.outcome, outcome.checkpoint_id, outcome.detail) == (
            "restored", second, "",
        )  # fmt: skip
        assert len(env.fake.calls("restore")) == 1
        # Recorded in the store, for `cedana checkpoints inspect`.
        (record,) = env.store.restore_records.restores(second)
        assert (record["containerId"], record["label"], record["byHand"]) == ("c1", LABEL, True)
        assert record["restoredAt"].endswith("Z")
        assert (
            env.store.restore_records.restores(third)
            == env.store.restore_records.restores(first)
            == []
        )
        # Later checkpoints of the restored container carry its label as usual.
        later = await env.cedana_checkpoint("c1", leave_running=True)
        assert env.store.catalog.get(later.checkpoint_id).label == LABEL

    TaskWorld(tmp_path).run(body)


def test_a_unique_prefix_and_the_annotation_name_the_checkpoint(tmp_path: Path) -> None:
    async def body(env: TaskEnv) -> None:
        first, second, third = await three_checkpoints(env)
        prefix = next(
            second[:n]
            for n in range(1, len(second))
            if not first.startswith(second[:n]) and not third.startswith(second[:n])
        )
        await create(env, "c1", annotations={"cedana.ai/restore": prefix})
        await env.start("c1")
        await counter_reaches(env, "c1", "21")
        assert outcome_of(env, "c1").checkpoint_id == second

    TaskWorld(tmp_path).run(body)


def test_with_enable_and_no_label_restores_and_checkpoints_under_the_container_name(
    tmp_path: Path,
) -> None:
    async def body(env: TaskEnv) -> None:
        _, second, _ = await three_checkpoints(env)
        await create(
            env, "c1", label=None, env_vars=["CEDANA_ENABLE=1", f"CEDANA_RESTORE={second}"]
        )
        await env.start("c1")
        await counter_reaches(env, "c1", "21")
        assert outcome_of(env, "c1").checkpoint_id == second
        later = await env.cedana_checkpoint("c1", leave_running=True)
        assert env.store.catalog.get(later.checkpoint_id).label == "c1"

    TaskWorld(tmp_path).run(body)


def test_an_unknown_id_and_another_namespaces_id_are_refused_alike(tmp_path: Path) -> None:
    async def body(env: TaskEnv) -> None:
        ids = await three_checkpoints(env, annotations={NS_KEY: "team-a"})
        elsewhere = ids[1]
        # Same length, same form, nowhere: the message must not tell them apart.
        unknown = elsewhere[:-8] + ("0" * 8 if not elsewhere.endswith("0" * 8) else "1" * 8)
        team_b = {NS_KEY: "team-b"}
        m1 = await refused(
            env, "c1", NotFound, env_vars=[f"CEDANA_RESTORE={elsewhere}"], annotations=team_b
        )
        m2 = await refused(
            env, "c2", NotFound, env_vars=[f"CEDANA_RESTORE={unknown}"], annotations=team_b
        )
        assert m1.replace(elsewhere, "X").replace("c1", "C") == m2.replace(unknown, "X").replace(
            "c2", "C"
        )
        assert f"no checkpoint {elsewhere!r} in namespace 'team-b'" in m1
        assert "CEDANA_RESTORE_FALLBACK=cold" in m1
        assert "team-a" not in m1
        assert outcome_of(env, "c1").outcome == "failed"

    TaskWorld(tmp_path).run(body)


def test_an_ambiguous_prefix_is_refused_with_the_matches(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    async def body(env: TaskEnv) -> None:
        ids = await three_checkpoints(env)
        caplog.clear()
        message = await refused(env, "c1", InvalidArgument, env_vars=["CEDANA_RESTORE=20"])
        assert "3 checkpoints start with '20'" in message
        assert all(i in message for i in ids)
        # The log says the container does not start, not that it starts cold.
        said = [r.getMessage() for r in caplog.records if getattr(r, "container", "") == "c1"]
        assert "restore refused: the container does not start" in said
        assert "starting cold" not in said

    TaskWorld(tmp_path).run(body)


def test_a_damaged_checkpoint_is_refused_not_replaced_by_another(tmp_path: Path) -> None:
    async def body(env: TaskEnv) -> None:
        _, second, _ = await three_checkpoints(env)
        entry = env.store.catalog.get(second)
        blob = Path(env.config.store_path, "blobs", "sha256", entry.layers[0].digest.split(":")[1])
        blob.write_bytes(blob.read_bytes()[:-1])
        message = await refused(env, "c1", DataLoss, env_vars=[f"CEDANA_RESTORE={second}"])
        assert f"cannot restore checkpoint {second!r}" in message
        assert env.fake.calls("restore") == []

    TaskWorld(tmp_path).run(body)


def test_a_failing_restore_fails_the_start_without_trying_another(tmp_path: Path) -> None:
    async def body(env: TaskEnv) -> None:
        _, second, _ = await three_checkpoints(env, second_bad=True)
        await create(env, "c1", env_vars=[f"CEDANA_RESTORE={second}"])
        with pytest.raises(
            ShimError, match=f"cannot restore checkpoint '{second}'.*restore failed"
        ):
            await env.start("c1")
        assert len(env.fake.calls("restore")) == 1
        assert env.fake.live_pids("c1") == []
        assert outcome_of(env, "c1").outcome == "failed"
        assert env.store.restore_records.restores(second) == []

    TaskWorld(tmp_path).run(body)


def test_fallback_cold_starts_cold_and_says_why(tmp_path: Path) -> None:
    async def body(env: TaskEnv) -> None:
        await three_checkpoints(env)
        gone = "20200101T000000Z-00000000"
        await create(env, "c1", env_vars=[f"CEDANA_RESTORE={gone}", "CEDANA_RESTORE_FALLBACK=cold"])
        await env.start("c1")
        await counter_reaches(env, "c1", "1")  # cold: not the label's newest either
        outcome = outcome_of(env, "c1")
        assert (outcome.outcome, outcome.checkpoint_id) == ("cold", "")
        assert f"no checkpoint {gone!r}" in outcome.detail
        assert env.fake.calls("restore") == []

    TaskWorld(tmp_path).run(body)


def test_another_image_is_refused(tmp_path: Path) -> None:
    async def body(env: TaskEnv) -> None:
        _, second, _ = await three_checkpoints(env, annotations={IMAGE_KEY: "app:1"})
        message = await refused(
            env, "c1", FailedPrecondition,
            env_vars=[f"CEDANA_RESTORE={second}"], annotations={IMAGE_KEY: "app:2"},
        )  # fmt: skip
        assert "taken from image app:1, this container's image is app:2" in message

    TaskWorld(tmp_path).run(body)


def test_hostile_values_fail_the_create_with_the_rule(tmp_path: Path) -> None:
    async def body(env: TaskEnv) -> None:
        for n, (value, rule) in enumerate(
            [
                ("../../etc", "path separator"),
                ("a\x1bb", "control characters"),
                ("9" * 300, "over 25"),
                ("abc$", "outside"),
            ]
        ):
            message = await refused(
                env, f"c{n}", InvalidArgument, env_vars=[f"CEDANA_RESTORE={value}"]
            )
            assert rule in message
            assert len(message) < 500  # a long value is cut, not echoed whole

    TaskWorld(tmp_path).run(body)


def test_every_phase_is_timed_and_the_total_covers_them(tmp_path: Path) -> None:
    reports = []

    async def body(env: TaskEnv) -> None:
        _, second, _ = await three_checkpoints(env)
        original = env.checkpoints.report_restore

        def keep(report, *args, **kwargs):  # type: ignore[no-untyped-def]
            reports.append(report)
            return original(report, *args, **kwargs)

        env.checkpoints.report_restore = keep  # type: ignore[method-assign]
        await create(env, "c1", env_vars=[f"CEDANA_RESTORE={second}"])
        await env.start("c1")
        await counter_reaches(env, "c1", "21")

    TaskWorld(tmp_path).run(body)
    (report,) = reports
    assert tuple(report.phases) == PHASES
    assert report.phases["restore"] > 0 and report.phases["list"] > 0
    assert report.total >= sum(report.phases.values()) > 0
    assert os.environ.get("CEDANA_RESTORE") is None  # nothing leaked into the test process


class FakeRegistry:
    """The registry's edge as RemoteStore presents it: one newer checkpoint of the
    label, taken from another image; pulling it is a test failure."""

    def __init__(self) -> None:
        self.candidate = RemoteCheckpoint(
            repository="cedana/default", tag="t", checkpoint_id=NEWER_REMOTE, scope="default",
            label=LABEL, created="2099-01-01T00:00:00Z", node="node-b", complete=True,
        )  # fmt: skip
        self.metadata = {"image": "app:1", "versions": {}}

    def candidates(self, scope: str, label: str) -> list[RemoteCheckpoint]:
        return [self.candidate]

    def list(self, scope: str) -> list[RemoteCheckpoint]:
        return [self.candidate]

    def in_flight(self, scope: str, label: str, **_: object) -> list[RemoteCheckpoint]:
        return []

    def fetch_metadata(self, remote: RemoteCheckpoint) -> Mapping[str, object]:
        return self.metadata

    def pull(self, remote: RemoteCheckpoint) -> object:
        raise AssertionError("a checkpoint of another image was pulled")


NEWER_REMOTE = "20990101T000000Z-0000beef"


@pytest.mark.parametrize("by_hand", [False, True])
def test_a_registry_checkpoint_of_another_image_is_skipped_before_the_pull(
    tmp_path: Path, by_hand: bool
) -> None:
    async def body(env: TaskEnv) -> None:
        _, _, third = await three_checkpoints(env)
        env.pipeline.delivery._remote = FakeRegistry()  # type: ignore[assignment]
        env.reconfigure(registry="registry.invalid/cedana")
        image = {IMAGE_KEY: "app:2"}
        if not by_hand:  # the label's newest is in the registry: skipped, the local next
            await create(env, "c1", annotations=image)
            await env.start("c1")
            await counter_reaches(env, "c1", "31")
            outcome = outcome_of(env, "c1")
            assert (outcome.outcome, outcome.checkpoint_id) == ("restored", third)
            assert (
                f"{NEWER_REMOTE} (registry, from node node-b): it was taken from image app:1, "
                "this container's image is app:2"
            ) in outcome.detail
            return
        message = await refused(
            env, "c1", FailedPrecondition,
            env_vars=[f"CEDANA_RESTORE={NEWER_REMOTE}"], annotations=image,
        )  # fmt: skip
        assert f"cannot restore checkpoint {NEWER_REMOTE!r} ({NEWER_REMOTE} (registry" in message
        assert "taken from image app:1, this container's image is app:2" in message

    TaskWorld(tmp_path).run(body)


@pytest.mark.parametrize(
    ("recorded", "reason"),
    [
        ({"cpuinfo": "not base64!"}, "its recorded CPU description (cpuinfo) is malformed"),
        ({"gpu": {"processes": [{"pid": 1}], "inventory": {}}}, "GPU: "),  # no NVML here
    ],
    ids=["cpu", "gpu"],
)
def test_a_registry_checkpoint_this_node_cannot_run_is_skipped_before_the_pull(
    tmp_path: Path, recorded: dict[str, object], reason: str
) -> None:
    """The CPU and the GPUs a checkpoint needs are weighed on its metadata, before
    anything is pulled (this node has no GPU)."""

    async def body(env: TaskEnv) -> None:
        _, _, third = await three_checkpoints(env)
        registry = FakeRegistry()
        registry.metadata = {"image": "app:2", "versions": {}, **recorded}
        env.pipeline.delivery._remote = registry  # type: ignore[assignment]
        env.reconfigure(registry="registry.invalid/cedana")
        await create(env, "c1", annotations={IMAGE_KEY: "app:2"})
        await env.start("c1")
        await counter_reaches(env, "c1", "31")
        outcome = outcome_of(env, "c1")
        assert (outcome.outcome, outcome.checkpoint_id) == ("restored", third)
        assert f"{NEWER_REMOTE} (registry, from node node-b): {reason}" in outcome.detail

    TaskWorld(tmp_path).run(body)


def test_image_mismatch_compares_digests_first_then_names() -> None:
    d1, d2 = "sha256:" + "1" * 64, "sha256:" + "2" * 64
    pinned = {"image": f"app@{d1}", "imageDigest": d1}
    assert image_mismatch(pinned, f"mirror/app@{d1}", d1) == ""  # same image, other name
    assert f"({d1}), this container's image is app:2 ({d2})" in image_mismatch(pinned, "app:2", d2)
    assert "this container's image is app:2" in image_mismatch({"image": "app:1"}, "app:2", "")
    assert image_mismatch({"image": "app:1"}, "app:1", "") == ""
    assert image_mismatch({}, "app:2", d2) == ""  # a checkpoint that recorded no image
    assert image_mismatch(pinned, "", "") == ""  # a container made with ctr: no image known
