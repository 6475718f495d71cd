"""The hook runner against a real container: runc's own ``state`` and the
bundle's config.json become the HookState, and a real CRIU checkpoint and
restore (through runc) sit between the four stages. Each hook checks, from the
host, that what its stdin says is true: the pid is the container's, the image
directory holds CRIU images, the restored pid runs the same program.

It drives runc directly with a private ``--root``; the containerd-level test
comes with the pipeline wiring.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import pytest
from cedana_shim.hooks import HookReport, HookState, ProcessHookRunner, Stage, reaper_spawn
from cedana_shim.runtime.reaper import Reaper

BUSYBOX = Path("/bin/busybox")

# Runs on the host: checks the state against /proc and the image directory,
# then records what it saw.
HOOK = """#!{python}
import json, os, sys
state = json.load(sys.stdin)
ann = state["annotations"]
seen = {{"stage": ann["cedana.ai/checkpoint.stage"], "state": state}}
if state["pid"]:
    with open(f"/proc/{{state['pid']}}/cmdline", "rb") as f:
        seen["cmdline"] = f.read().split(b"\\0")[0].decode()
images = ann["cedana.ai/checkpoint.path"]
seen["images"] = sorted(os.listdir(images)) if os.path.isdir(images) else None
with open({out!r}, "a") as f:
    f.write(json.dumps(seen) + "\\n")
"""


@dataclass
class Container:
    id: str
    root: Path
    bundle: Path

    def runc(self, *args: str, detached: bool = False) -> str:
        # A detached container inherits runc's stdio: pipes would be held open
        # for as long as it runs, and CRIU cannot dump a host file as its fd 1,
        # so it gets /dev/null and runc's errors come from --log.
        log = self.root.parent / "runc.log"
        std = subprocess.DEVNULL if detached else subprocess.PIPE
        done = subprocess.run(
            ["runc", "--root", str(self.root), "--log", str(log), *args],
            stdin=subprocess.DEVNULL,
            stdout=std,
            stderr=std,
            timeout=60,
        )
        if done.returncode != 0:
            detail = done.stderr or (log.read_bytes() if log.exists() else b"")
            raise AssertionError(f"runc {args[0]}: {detail.decode(errors='replace')}")
        return done.stdout.decode() if done.stdout else ""

    def state(self) -> dict[str, Any]:
        state: dict[str, Any] = json.loads(self.runc("state", self.id))
        return state

    def spec(self) -> dict[str, Any]:
        spec: dict[str, Any] = json.loads((self.bundle / "config.json").read_text())
        return spec


@pytest.fixture
def container(tmp_path: Path) -> Iterator[Container]:
    bundle = tmp_path / "bundle"
    (bundle / "rootfs" / "bin").mkdir(parents=True)
    shutil.copy2(BUSYBOX, bundle / "rootfs" / "bin" / "busybox")
    for applet in ("sh", "sleep"):
        (bundle / "rootfs" / "bin" / applet).symlink_to("busybox")
    c = Container(f"hooks-{uuid.uuid4().hex[:8]}", tmp_path / "runc-root", bundle)
    subprocess.run(["runc", "spec", "--bundle", str(bundle)], check=True)
    spec = c.spec()
    spec["process"].update(terminal=False, args=["/bin/sleep", "1000"])
    spec["root"]["readonly"] = False
    spec["annotations"] = {"io.example/db": "pg"}
    (bundle / "config.json").write_text(json.dumps(spec))
    try:
        c.runc("run", "--detach", "--bundle", str(bundle), c.id, detached=True)
        yield c
    finally:
        subprocess.run(["runc", "--root", str(c.root), "delete", "--force", c.id], check=False)


def run_stage(runner_dirs: list[str], stage: Stage, state: HookState) -> HookReport:
    async def main() -> HookReport:
        reaper = Reaper()
        reaper.install()
        try:
            runner = ProcessHookRunner(runner_dirs, spawn=reaper_spawn(reaper))
            return await runner.run(stage, state)
        finally:
            reaper.close()

    return asyncio.run(main())


def test_hooks_see_the_real_container_across_checkpoint_and_restore(
    tmp_path: Path, container: Container
) -> None:
    out = tmp_path / "seen.jsonl"
    hook = tmp_path / "hook"
    hook.write_text(HOOK.format(python=sys.executable, out=str(out)))
    hook.chmod(0o755)
    hooks_d = tmp_path / "hooks.d"
    hooks_d.mkdir()
    (hooks_d / "10-check.json").write_text(
        json.dumps(
            {
                "version": "1.0.0",
                "hook": {"path": str(hook), "timeout": 10},
                "when": {"annotations": {"^io\\.example/db$": "^pg$"}, "commands": ["sleep$"]},
                "stages": ["precheckpoint", "postcheckpoint", "prerestore", "postrestore"],
            }
        )
    )
    dirs = [str(hooks_d)]
    images, spec = tmp_path / "images", container.spec()
    runc_state = container.state()
    before = HookState(
        container_id=runc_state["id"],
        bundle=runc_state["bundle"],
        status=runc_state["status"],
        pid=runc_state["pid"],
        spec=spec,
        checkpoint_id="itest-1",
        checkpoint_path=str(images),
    )

    assert run_stage(dirs, Stage.PRECHECKPOINT, before).ok
    container.runc(
        "checkpoint", "--image-path", str(images), "--work-path", str(tmp_path / "w1"), container.id
    )
    after_dump = replace(before, status="stopped", outcome="ok")
    assert run_stage(dirs, Stage.POSTCHECKPOINT, after_dump).ok
    assert run_stage(dirs, Stage.PRERESTORE, replace(before, status="creating", pid=0)).ok
    container.runc(
        "restore",
        "--detach",
        "--bundle",
        str(container.bundle),
        "--image-path",
        str(images),
        "--work-path",
        str(tmp_path / "w2"),
        container.id,
        detached=True,
    )
    restored = container.state()
    assert restored["status"] == "running"
    post = replace(before, pid=restored["pid"], status="running", outcome="ok")
    assert run_stage(dirs, Stage.POSTRESTORE, post).ok

    seen = [json.loads(line) for line in out.read_text().splitlines()]
    assert [s["stage"] for s in seen] == [
        "precheckpoint",
        "postcheckpoint",
        "prerestore",
        "postrestore",
    ]
    pre, post_dump, pre_restore, post_restore = seen
    assert pre["state"]["id"] == container.id and pre["state"]["bundle"] == str(container.bundle)
    assert pre["cmdline"] == "/bin/sleep"  # the pid in the state is the container's init
    assert pre["state"]["annotations"]["io.example/db"] == "pg"
    assert pre["images"] is None  # not dumped yet
    assert "inventory.img" in post_dump["images"]  # CRIU's images, where the state says
    assert post_dump["state"]["annotations"]["cedana.ai/checkpoint.outcome"] == "ok"
    assert pre_restore["state"]["pid"] == 0 and "cmdline" not in pre_restore
    assert post_restore["cmdline"] == "/bin/sleep"
    assert post_restore["state"]["pid"] == restored["pid"]
