"""Lazy restore on another node: CRIU's lazy-pages daemon fed from the registry.

Node A (no lazy restore) checkpoints a labelled workload with 64 MiB of random memory
and pushes it to a real registry (docker-registry, TLS, auth); node B, with
`lazy_restore` on and an empty store, starts the next container of the label. B pulls
only the small blobs and the pages CRIU's restore reads itself; the tasks resume while
`criu lazy-pages --page-server` asks the shim's page server for the rest, which fetches
each chunk from the registry when first needed (then the rest in address order) and
checks it before serving a byte of it.

- the workload resumes with its memory's checksum intact, and B's store ends up with
  the checkpoint, as a full pull would have left it;
- the registry killed once the restore is under way (the moment B's lazy-pages daemon
  starts: a `criu` wrapper on B's PATH kills it, then runs the real daemon): the tasks
  are killed, the same checkpoint cannot be pulled whole either, so the container
  starts cold, saying why; no daemon and no staging dir are left behind;
- a chunk corrupted in the registry that only the lazy-pages daemon asks for (none of
  the pages CRIU's restore reads itself): the restore gets as far as running tasks,
  the chunk fails its check when it is fetched, the tasks are killed, and the
  container starts cold (the eager pull of the same checkpoint fails on it too);
- the registry's connections cut as B's lazy-pages daemon starts (a TCP proxy between
  B and the registry drops every open connection and the next two it accepts): the
  chunk fetches that fail are tried again, and the workload resumes lazily with its
  memory intact, nothing passed over;
- the shim SIGKILLed while the tasks wait for pages (the registry frozen as B's
  lazy-pages daemon starts): the daemon does not take the page server's death for the
  end of its pages (it holds the server's end of their connection too); containerd's
  `delete` kills the tasks and the daemon; nothing is left.
"""

from __future__ import annotations

import contextlib
import os
import re
import signal
import socket
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
from cedana_shim.checkpoint.lazy_remote import task_pagemaps
from cedana_shim.checkpoint.remote.page_map import PageMap
from cedana_shim.checkpoint.store.layout import Chunk

from .conftest import MakeNode
from .harness import procs
from .harness.config import CRIU, CTR_NAMESPACE
from .harness.containerd import Containerd
from .harness.cr_events import TOPIC_EXIT, TOPIC_RESTORE, EventStream
from .harness.cr_support import (
    Box,
    Counter,
    ShimLog,
    Workloads,
    assert_continues,
    counter_script,
    entries,
    open_store,
    restored_from,
    shim_pid,
    unique_label,
    wait_ticks,
)
from .harness.registry import PASSWORD, PREFIX, USER, Registry, write_auth_file
from .harness.util import wait_for
from .test_lazy_restore import CHECK, PADSUM, _is_workload, check_memory, lazy_daemons, padsums

NewId = Callable[[str], str]
_TICK = re.compile(r"tick ([0-9a-f-]{36}) (\d+)\s*$")
pytestmark = pytest.mark.ctrd_versions("2.1")  # the shim's own machinery: one version
MEM_KIB = 64 * 1024
KILLER = """#!/bin/sh
# B's criu: the real one; its lazy-pages daemon starts only after the registry got
# signal {sig}.
[ "$1" = lazy-pages ] && kill -{sig} {pid}
exec {real} "$@"
"""


def _script() -> str:
    return counter_script(mem_kib=MEM_KIB, extra=PADSUM, each_tick=CHECK)


def _checkpoint_on_a(a: Containerd, new_id: NewId, label: str) -> tuple[str, str, Counter]:
    """A's container with its 64 MiB, stopped (pushed before its exit is reported):
    (checkpoint id, its memory's md5, its last count)."""
    with (
        EventStream(a.socket) as events,
        Workloads(a, new_id, label=label, script=_script(), namespace=CTR_NAMESPACE) as w,
    ):
        box = w.start("a")
        wait_ticks(box.lines, count=3, timeout=60)
        (padsum,) = padsums(box)
        w.ctr("task", "kill", "-s", "SIGTERM", box.cid)
        committed = events.wait_commit(box.cid, timeout=120)
        exited = events.wait_topic(TOPIC_EXIT, box.cid, timeout=120)
        assert exited.field("exit_status") == 143, exited
        w.delete(box)
        counted = box.ticks()
        assert counted is not None
        return committed.checkpoint_id, padsum, counted


def _signalling_criu(registry: Registry, sig: str, tmp_path: Path) -> Path:
    """A dir holding a `criu` that sends the registry `sig` as the lazy-pages daemon
    starts (before anything but the pages CRIU's restore reads itself was fetched)."""
    pid = registry._process.pid if registry._process is not None else 0
    assert pid
    wrapped = tmp_path / f"criu-{sig.lower()}"
    wrapped.mkdir()
    (wrapped / "criu").write_text(KILLER.format(sig=sig, pid=pid, real=CRIU))
    (wrapped / "criu").chmod(0o755)
    return wrapped


class CuttingProxy:
    """A TCP proxy to ``registry`` (TLS passes through) that, once a `criu lazy-pages`
    on B announces itself (``trigger`` appears), closes every connection it holds
    and the next ``cuts`` it accepts, then lets the daemon go on (``armed``): no
    fetch of the lazy restore can reach the registry before its connections are cut."""

    def __init__(self, registry: Registry, workdir: Path, cuts: int) -> None:
        self._upstream = ("127.0.0.1", registry.port)
        self.trigger, self.armed = workdir / "lazy-pages-started", workdir / "proxy-armed"
        self._listener = socket.create_server(("127.0.0.1", 0))
        self.host = f"127.0.0.1:{self._listener.getsockname()[1]}"
        self._cuts = cuts
        self._cutting = 0  # accepted connections still to close at once
        self.cut = 0  # connections closed on purpose
        self._open: set[socket.socket] = set()
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._threads = [
            threading.Thread(target=self._accept, daemon=True),
            threading.Thread(target=self._watch, daemon=True),
        ]
        for t in self._threads:
            t.start()

    def _watch(self) -> None:
        while not self._closed.wait(0.02):
            if self.trigger.exists():
                with self._lock:
                    for conn in self._open:
                        self._drop(conn)
                    self.cut += len(self._open) // 2  # a client's and its upstream
                    self._open.clear()
                    self._cutting = self._cuts
                self.armed.touch()
                return

    def _accept(self) -> None:
        while True:
            try:
                client, _ = self._listener.accept()
            except OSError:
                return
            with self._lock:
                if self._cutting > 0:
                    self._cutting -= 1
                    self.cut += 1
                    self._drop(client)
                    continue
            try:
                upstream = socket.create_connection(self._upstream, timeout=10)
            except OSError:
                client.close()
                continue
            upstream.settimeout(None)
            with self._lock:
                self._open |= {client, upstream}
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(a, b), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while block := src.recv(1 << 16):
                dst.sendall(block)
        except OSError:
            pass
        for end in (src, dst):
            with contextlib.suppress(OSError):
                end.shutdown(socket.SHUT_RDWR)

    @staticmethod
    def _drop(conn: socket.socket) -> None:
        with contextlib.suppress(OSError):
            conn.shutdown(socket.SHUT_RDWR)
        conn.close()

    def close(self) -> None:
        self._closed.set()
        self._listener.close()
        with self._lock:
            for conn in self._open:
                self._drop(conn)


ANNOUNCER = """#!/bin/sh
# B's criu: the real one; its lazy-pages daemon starts only once the proxy has cut
# the registry's connections.
if [ "$1" = lazy-pages ]; then
    touch {trigger}
    while [ ! -e {armed} ]; do sleep 0.05; done
fi
exec {real} "$@"
"""


def _lazy_env(node_env: dict[str, str], **more: str) -> dict[str, str]:
    return {**node_env, "CEDANA_LAZY_RESTORE": "true", **more}


def _late_chunk(a: Containerd, checkpoint: str, tmp_path: Path) -> Chunk:
    """A chunk of the checkpoint's pages that CRIU's restore does not read itself: only
    the lazy-pages daemon asks for it, once the tasks run."""
    store = open_store(a.store)
    entry = store.catalog.get(checkpoint)
    images = tmp_path / "images"
    store.reader.extract_layer(entry, "criu", str(images))
    chunks = entry.layer("criu").chunks
    pages = PageMap(task_pagemaps(str(images)), chunks)
    eager = set(pages.eager_chunks())
    late = [c for c in chunks if c not in eager and sum(x.digest == c.digest for x in chunks) == 1]
    assert late, "every chunk is read by the restore itself"
    return max(late, key=lambda c: c.size)


def _fell_back_cold(events: EventStream, box: Box, checkpoint: str) -> str:
    outcome = events.wait_topic(TOPIC_RESTORE, box.cid, timeout=180)
    assert outcome.field("outcome") == "cold", outcome
    detail = str(outcome.field("detail"))
    assert f"{checkpoint}: lazy restore failed, restoring eagerly" in detail, detail
    assert "cannot pull it" in detail, detail
    return detail


def _runs_cold(box: Box, restored: Counter) -> None:
    """Ticks of a new incarnation from 1 on. The restored one may have ticked before it
    was killed (it ran, lazily, until the pages failed it): its lines are not this."""

    def cold() -> list[int] | None:
        ticks = [m for line in box.lines() if (m := _TICK.search(line))]
        values = [int(m.group(2)) for m in ticks if m.group(1) != restored.token]
        return values if len(values) >= 2 else None

    values = wait_for(cold, timeout=60, what=f"{box.cid} to tick from a cold start")
    assert values[0] == 1, values


def _nothing_left(b: Containerd, box: Box) -> None:
    assert lazy_daemons(shim_pid(b, box)) == set()
    assert not entries(b.store)
    ingest = b.store / "ingest"
    assert not ingest.exists() or not [p for p in os.listdir(ingest) if p.startswith("adopt-")]


def test_a_lazy_restore_from_the_registry_resumes_with_its_memory_intact(
    make_node: MakeNode, node_env: dict[str, str], new_id: NewId
) -> None:
    label = unique_label("lazyremote")
    a = make_node(node_env)
    checkpoint, padsum, counted = _checkpoint_on_a(a, new_id, label)
    b = make_node(_lazy_env(node_env))
    log = ShimLog(b)
    with (
        EventStream(b.socket) as events,
        Workloads(b, new_id, label=label, script=_script(), namespace=CTR_NAMESPACE) as w,
    ):
        box = w.start("b")
        restored_from(events, box, checkpoint)
        done = log.wait("restored from checkpoint", container=box.cid)
        assert done["memory"] == "lazy", done
        assert not done["why"], done  # nothing passed over: served from the registry
        assert_continues(counted, wait_ticks(box.lines, count=3), "lazy restore from the registry")
        check_memory(w, box, padsum)
        assert lazy_daemons(shim_pid(b, box)) == set()  # it exited once all was in
        # The pull completed behind the restore: B's store has it, as a full pull leaves it.
        assert [e.id for e in entries(b.store, label=label)] == [checkpoint]
        open_store(b.store).reader.verify(open_store(b.store).catalog.get(checkpoint))
        assert not log.find("pulled checkpoint from the registry")  # no full pull first


def test_a_registry_killed_mid_restore_kills_the_tasks_and_falls_back(
    make_node: MakeNode,
    node_env: dict[str, str],
    registry: Registry,
    new_id: NewId,
    tmp_path: Path,
) -> None:
    label = unique_label("lazykill")
    a = make_node(node_env)
    checkpoint, _, counted = _checkpoint_on_a(a, new_id, label)
    wrapped = _signalling_criu(registry, "KILL", tmp_path)
    b = make_node(_lazy_env(node_env, PATH=str(wrapped), CEDANA_REGISTRY_TIMEOUT="3"))
    with (
        EventStream(b.socket) as events,
        Workloads(b, new_id, label=label, script=_script(), namespace=CTR_NAMESPACE) as w,
    ):
        box = w.start("b")
        detail = _fell_back_cold(events, box, checkpoint)
        assert re.search(r"registry|connect|refused", detail, re.IGNORECASE), detail
        _runs_cold(box, counted)
        _nothing_left(b, box)
    registry.stop()  # reaps the process the wrapper killed


def test_a_corrupted_chunk_served_late_kills_the_tasks_and_falls_back(
    make_node: MakeNode,
    node_env: dict[str, str],
    registry: Registry,
    new_id: NewId,
    tmp_path: Path,
) -> None:
    label = unique_label("lazyrot")
    a = make_node(node_env)
    checkpoint, _, counted = _checkpoint_on_a(a, new_id, label)
    chunk = _late_chunk(a, checkpoint, tmp_path)
    registry.corrupt_blob(chunk.digest, offset=chunk.size // 2)
    b = make_node(_lazy_env(node_env))
    log = ShimLog(b)
    with (
        EventStream(b.socket) as events,
        Workloads(b, new_id, label=label, script=_script(), namespace=CTR_NAMESPACE) as w,
    ):
        box = w.start("b")
        detail = _fell_back_cold(events, box, checkpoint)
        assert "the registry's pages failed while the tasks ran" in detail, detail
        assert chunk.digest.removeprefix("sha256:") in detail, detail
        # Only the lazy-pages daemon asks for that chunk, and only once the tasks run:
        # the failure came while they ran, and they were killed.
        assert not log.find("lazy restore: all memory in", container_id=box.cid)
        _runs_cold(box, counted)
        _nothing_left(b, box)


def test_registry_connections_cut_mid_restore_are_retried_and_the_workload_survives(
    make_node: MakeNode,
    node_env: dict[str, str],
    registry: Registry,
    new_id: NewId,
    tmp_path: Path,
) -> None:
    label = unique_label("lazycut")
    a = make_node(node_env)
    checkpoint, padsum, counted = _checkpoint_on_a(a, new_id, label)
    proxy = CuttingProxy(registry, tmp_path, cuts=2)
    try:
        wrapped = tmp_path / "criu-announcing"
        wrapped.mkdir()
        script = ANNOUNCER.format(trigger=proxy.trigger, armed=proxy.armed, real=CRIU)
        (wrapped / "criu").write_text(script)
        (wrapped / "criu").chmod(0o755)
        auth = write_auth_file(tmp_path / "proxy-auth.json", proxy.host, USER, PASSWORD)
        b = make_node(
            _lazy_env(
                node_env,
                PATH=str(wrapped),
                CEDANA_REGISTRY=f"{proxy.host}/{PREFIX}",
                CEDANA_REGISTRY_AUTH_FILE=str(auth),
            )
        )
        log = ShimLog(b)
        with (
            EventStream(b.socket) as events,
            Workloads(b, new_id, label=label, script=_script(), namespace=CTR_NAMESPACE) as w,
        ):
            box = w.start("b")
            restored_from(events, box, checkpoint)
            done = log.wait("restored from checkpoint", container=box.cid)
            assert done["memory"] == "lazy", done
            assert not done["why"], done  # the same lazy restore, nothing passed over
            assert proxy.armed.exists() and proxy.cut >= 1, proxy.cut
            retried = log.find("fetching a chunk of the pages failed; trying again")
            assert retried, log.about(box.cid)
            assert {r["checkpoint"] for r in retried} == {checkpoint}, retried
            assert_continues(counted, wait_ticks(box.lines, count=3), "lazy restore, retried")
            check_memory(w, box, padsum)
            assert [e.id for e in entries(b.store, label=label)] == [checkpoint]
    finally:
        proxy.close()


def test_a_shim_killed_while_the_tasks_wait_for_the_registry_is_cleaned_up_by_delete(
    make_node: MakeNode,
    node_env: dict[str, str],
    registry: Registry,
    new_id: NewId,
    tmp_path: Path,
) -> None:
    label = unique_label("lazyshim")
    a = make_node(node_env)
    _checkpoint_on_a(a, new_id, label)
    wrapped = _signalling_criu(registry, "STOP", tmp_path)
    # Long enough that no fetch gives up while the test holds the registry frozen.
    b = make_node(_lazy_env(node_env, PATH=str(wrapped), CEDANA_REGISTRY_TIMEOUT="120"))
    try:
        with Workloads(b, new_id, label=label, script=_script(), namespace=CTR_NAMESPACE) as w:
            cid = new_id("b")
            box = Box(cid, w.logs / f"{cid}.log")
            w.started.append(box)
            run = w.ctr.popen(
                *w.ctr.run_args(
                    b.images.busybox, cid, "sh", "-c", w.script,
                    flags=("-d", "--env", f"CEDANA_CHECKPOINT={label}",
                           "--log-uri", f"file://{box.out}"),
                )
            )  # fmt: skip

            def waiting() -> tuple[int, set[int], set[int]] | None:
                shims = b.shim_pids(CTR_NAMESPACE, cid)
                daemons = lazy_daemons(*shims)
                tasks = {p for p in procs.descendants(shims) if _is_workload(p)}
                if len(shims) == 1 and daemons and tasks:
                    return next(iter(shims)), daemons, tasks
                return None

            shim, daemons, tasks = wait_for(
                waiting, timeout=120, what="b's restored tasks and its lazy-pages daemon"
            )
            assert run.poll() is None  # Start waits: the pages cannot all be in
            os.kill(shim, signal.SIGKILL)
            run.communicate(timeout=120)
            wait_for(
                lambda: not any(procs.pid_alive(p) for p in daemons | tasks),
                timeout=60,
                what=f"the daemon {daemons} and the tasks {tasks} to be gone",
            )
            w.ctr.remove(cid)
    finally:
        registry.resume()
