"""The shipped examples under oci-hooks/: every hooks.d file parses, and the
example log hook does what the README says when run by the real runner."""

from __future__ import annotations

import asyncio
import json
from dataclasses import replace
from pathlib import Path

import pytest
from cedana_shim.hooks import HookReport, HookState, ProcessHookRunner, Stage
from cedana_shim.hooks.config import load, parse

OCI_HOOKS = Path(__file__).resolve().parents[2] / "oci-hooks"
EXAMPLE_HOOK = OCI_HOOKS / "examples" / "example-log-hook"


@pytest.mark.parametrize(
    "path", sorted((OCI_HOOKS / "hooks.d").glob("*.json")), ids=lambda p: p.name
)
def test_shipped_files_parse(path: Path) -> None:
    config = parse(path.read_bytes(), source=str(path))
    assert config.stages
    assert load([str(path.parent)]).errors == ()


def install_example(tmp: Path, log: Path) -> Path:
    doc = json.loads((OCI_HOOKS / "hooks.d" / "50-example-log.json").read_text())
    doc["hook"]["path"] = str(EXAMPLE_HOOK)
    doc["hook"]["env"] = [f"CEDANA_HOOK_LOG={log}"]
    hooks_d = tmp / "hooks.d"
    hooks_d.mkdir()
    (hooks_d / "50-example-log.json").write_text(json.dumps(doc))
    return hooks_d


def run_all_stages(hooks_d: Path) -> list[HookReport]:
    runner = ProcessHookRunner([str(hooks_d)])
    base = HookState(
        container_id="c1",
        bundle="/b",
        status="running",
        pid=77,
        spec={"process": {"args": ["/bin/sh"]}},
        checkpoint_id="ck-9",
        checkpoint_path="/img/ck-9",
    )
    stages = [
        (Stage.PRECHECKPOINT, base),
        (Stage.POSTCHECKPOINT, replace(base, outcome="ok")),
        (Stage.PRERESTORE, replace(base, status="creating", pid=0)),
        (Stage.POSTRESTORE, replace(base, outcome="failed")),
    ]

    async def body() -> list[HookReport]:
        return [await runner.run(stage, st) for stage, st in stages]

    return asyncio.run(body())


def test_example_log_hook_appends_stage_and_checkpoint(tmp_path: Path) -> None:
    log = tmp_path / "log" / "hooks.log"
    reports = run_all_stages(install_example(tmp_path, log))
    assert all(r.ok and len(r.results) == 1 for r in reports)
    lines = log.read_text().splitlines()
    assert [line.split()[1] for line in lines] == [
        "precheckpoint",
        "postcheckpoint",
        "prerestore",
        "postrestore",
    ]
    assert all("container=c1" in line and "checkpoint=ck-9" in line for line in lines)
    assert "images=/img/ck-9" in lines[0] and "pid=0" in lines[2]
    assert [line.split()[-1] for line in lines] == [
        "outcome=-",
        "outcome=ok",
        "outcome=-",
        "outcome=failed",
    ]


def test_example_log_hook_never_vetoes(tmp_path: Path) -> None:
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    reports = run_all_stages(install_example(tmp_path, blocker / "hooks.log"))
    assert all(r.ok for r in reports)  # the pre stages were not aborted
    assert "cannot write" in reports[0].results[0].output
