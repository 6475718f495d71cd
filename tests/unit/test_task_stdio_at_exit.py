"""A process's exit is reported only once its output is out of the shim's pipes.

ctr's task Delete closes its FIFOs as soon as it learns of the exit (io.Close in
containerd 1.6, io.Cancel in 1.7 and 2.x), so output the shim had not copied yet
was lost. Here a process leaves a child holding its stdout that writes only after
the process itself is reaped: with the old order the exit was published before the
child's line was copied, whatever the machine's speed.
"""

from __future__ import annotations

import logging
import signal
from pathlib import Path

import pytest
from cedana_shim.api.containerd.events import task_pb2 as ev
from cedana_shim.task import container as container_module
from google.protobuf.message import Message
from task_support import SLEEP, TaskEnv, TaskWorld


def _late_writer(go: Path) -> list[str]:
    """Prints `head`, leaves a child holding stdout that prints `tail` once `go` exists."""
    return ["sh", "-c", f"(until [ -e {go} ]; do sleep 0.01; done; echo tail) & echo head"]


def _record_output_at_exit(env: TaskEnv, out: Path, process_id: str) -> list[str]:
    seen: list[str] = []

    def probe(event: Message) -> None:
        if isinstance(event, ev.TaskExit) and event.id == process_id:
            seen.append(out.read_text())

    env.events.probe(probe)
    return seen


@pytest.mark.parametrize("who", ["init", "exec"])
def test_exit_is_published_after_the_output_is_copied(tmp_path: Path, who: str) -> None:
    out, go = tmp_path / "out.log", tmp_path / "go"

    async def body(env: TaskEnv) -> None:
        process_id = "c1" if who == "init" else "e1"
        at_exit = _record_output_at_exit(env, out, process_id)
        if who == "init":
            pid = await env.run("c1", _late_writer(go), stdout=f"file://{out}")
        else:
            await env.run("c1", SLEEP)
            await env.exec("c1", "e1", _late_writer(go), stdout=f"file://{out}")
            pid = await env.start("c1", "e1")
        await env.until(lambda: env.fake.process_state(pid) == "gone", "the process to be reaped")
        go.touch()  # only now does the child write, and end the copy

        exited = await env.exit_event("c1", "" if who == "init" else "e1")
        assert exited.exit_status == 0
        assert at_exit == ["head\ntail\n"], "the exit was published before the output was copied"
        if who == "exec":
            await env.kill("c1", signal.SIGKILL)

    TaskWorld(tmp_path).run(body)


def test_a_pipe_held_open_for_ever_delays_the_exit_only_so_long(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """A grandchild that keeps stdout open must not keep the exit from being reported
    (containerd's runc shim bounds its wait for the copy the same way)."""
    monkeypatch.setattr(container_module, "IO_DRAIN_TIMEOUT", 0.2)
    out = tmp_path / "out.log"

    async def body(env: TaskEnv) -> None:
        await env.run("c1", ["sh", "-c", "sleep 60 & echo head; exit 3"], stdout=f"file://{out}")
        assert (await env.wait("c1")).exit_status == 3
        warned = [r for r in caplog.records if r.levelno == logging.WARNING
                  and getattr(r, "container", None) == "c1"
                  and "output still being copied" in r.getMessage()]  # fmt: skip
        assert warned, "no warning that the exit went out with the pipe still held"
        await env.delete("c1")

    TaskWorld(tmp_path).run(body)
