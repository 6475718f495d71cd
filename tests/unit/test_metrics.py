"""The node agent's metrics (node/metrics.py): what each operation record adds, label
values kept to small sets, the build info following the shims' versions, and an
exposition that `promtool check metrics` (Debian's prometheus) finds clean."""

from __future__ import annotations

import subprocess

from cedana_shim import __version__
from cedana_shim.checkpoint import oplog
from cedana_shim.node.metrics import AgentMetrics, word
from prometheus_client import generate_latest
from test_ops_spool import record, sample

PROMTOOL = "/usr/bin/promtool"


def fed() -> AgentMetrics:
    metrics = AgentMetrics()
    metrics.observe(
        record(
            size_bytes=1000,
            versions={"shim": "9.9", "criu": "Version: 4.1", "runc": "runc version 1.2.5"},
        )
    )
    metrics.observe(record(outcome="failed", trigger="periodic", phases={"other": 0.4}))
    metrics.observe(
        record(
            kind=oplog.COMPACTION,
            outcome="done",
            size_bytes=300,
            raw_bytes=1000,
            phases={"compress": 0.7},
        )
    )
    metrics.observe(record(kind=oplog.PUSH, outcome="done", phases={"push": 2.0}))
    metrics.observe(
        record(kind=oplog.RESTORE, outcome="fell_back", phases={"fetch": 1.0, "restore": 0.5})
    )
    metrics.observe(record(kind=oplog.RESTORE, outcome="cold", phases={}))
    return metrics


def test_operations_are_counted_by_trigger_phase_and_outcome() -> None:
    metrics = fed()
    assert sample(metrics, "cedana_checkpoints_total", trigger="stop", outcome="committed") == 1
    assert sample(metrics, "cedana_checkpoints_total", trigger="periodic", outcome="failed") == 1
    assert (
        sample(
            metrics, "cedana_checkpoint_duration_seconds_sum", trigger="stop", outcome="committed"
        )
        == 1.5
    )
    assert (
        sample(
            metrics, "cedana_checkpoint_phase_duration_seconds_sum", trigger="stop", phase="dump"
        )
        == 1.2
    )
    for phase, seconds in (("compress", 0.7), ("push", 2.0)):
        assert (
            sample(
                metrics, "cedana_checkpoint_phase_duration_seconds_sum", trigger="stop", phase=phase
            )
            == seconds
        )
    assert sample(metrics, "cedana_checkpoint_raw_bytes_total") == 1000
    assert sample(metrics, "cedana_checkpoint_stored_bytes_total") == 300
    assert sample(metrics, "cedana_restores_total", outcome="fell_back") == 1
    assert sample(metrics, "cedana_restores_total", outcome="cold") == 1
    assert sample(metrics, "cedana_restore_phase_duration_seconds_sum", phase="fetch") == 1.0
    assert (
        sample(
            metrics,
            "cedana_checkpoint_background_operations_total",
            operation="compaction",
            outcome="done",
        )
        == 1
    )


def test_build_info_follows_the_shims() -> None:
    metrics = AgentMetrics()
    assert sample(metrics, "cedana_build_info", shim=__version__, criu="", runc="") == 1
    metrics = fed()
    assert sample(metrics, "cedana_build_info", shim=__version__, criu="", runc="") == 0
    assert (
        sample(
            metrics, "cedana_build_info", shim="9.9", criu="Version: 4.1", runc="runc version 1.2.5"
        )
        == 1
    )


def test_label_values_stay_in_small_sets() -> None:
    assert word("stop") == "stop"
    assert word("task-api") == "task-api"
    for hostile in ("", "Stop", "a" * 40, "trainer-0 in team-a", 'x"}'):
        assert word(hostile) == "other"
    metrics = AgentMetrics()
    metrics.observe(record(trigger="my-pod-name-is-very-long-and-unique-123", phases={"X Y": 1.0}))
    assert sample(metrics, "cedana_checkpoints_total", trigger="other", outcome="committed") == 1
    assert (
        sample(
            metrics,
            "cedana_checkpoint_phase_duration_seconds_count",
            trigger="other",
            phase="other",
        )
        == 1
    )


def test_promtool_finds_the_exposition_clean() -> None:
    exposition = generate_latest(fed().registry)
    assert b"cedana_checkpoint_duration_seconds_bucket" in exposition
    check = subprocess.run(
        [PROMTOOL, "check", "metrics"], input=exposition, capture_output=True, timeout=60
    )
    assert check.returncode == 0, check.stdout.decode() + check.stderr.decode()
    assert check.stdout.strip() == b"" and check.stderr.strip() == b""
