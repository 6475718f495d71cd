"""Shared pieces of the checkpoint/restore tests: the counter workload, the shim's JSON
log records, the checkpoint store as the shim left it, and /proc probes for the CRIU
process of a dump in progress."""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import subprocess
import tarfile
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from cedana_shim.checkpoint.layers import CRIU_LAYER, MEDIA_TYPES, ROOTFS_LAYER
from cedana_shim.checkpoint.store import Entry, Store, StoreConfig

from . import procs
from .config import CTR_NAMESPACE
from .containerd import Containerd
from .cr_events import TOPIC_RESTORE, Event, EventStream
from .util import wait_for

__all__ = [
    "CRIU_LAYER",
    "MEDIA_TYPES",
    "ROOTFS_LAYER",
    "Counter",
    "CriuHold",
    "ShimLog",
    "assert_continues",
    "blob_path",
    "counter_script",
    "criu_hold",
    "criu_pids",
    "entries",
    "file_lines",
    "ingest_dirs",
    "open_store",
    "parse_ticks",
    "restored_from",
    "shim_pid",
    "started_cold",
    "store_is_sound",
    "tmpfs_store",
    "unique_label",
    "wait_compacted",
    "wait_ticks",
]

# -- the workload ------------------------------------------------------------------------

# What a tick line looks like: "tick <token> <n>". The token is drawn once by the first
# incarnation and lives in a shell variable (and in files): a restored process prints
# the same token, a cold start a new one.
_TICK = re.compile(r"tick ([0-9a-f-]{36}) (\d+)\s*$")
DELETED_FILE = "/etc/group"  # present in the test image (harness.images), deleted by the workload


def counter_script(
    *, mem_kib: int = 0, tick: float = 0.2, extra: str = "", each_tick: str = ""
) -> str:
    """A busybox shell counter whose state is only in memory (`i`), mirrored every tick
    to /var/count on the rootfs and to stdout; at start it records its token in
    /var/token and /dev/shm/token and deletes DELETED_FILE from the image.

    `mem_kib` keeps that much random (base64) text in a shell variable, so the dump has
    real memory to write. SIGTERM reaches the script only when the shim delivers it
    (pid 1 ignores signals without a handler); the trap prints `got-TERM` first, so a
    stop that was NOT a checkpoint is visible in the output. `each_tick` is shell run
    after every tick's line."""
    mem = ""
    if mem_kib:
        # base64 of random bytes: ~1.33x the bytes, held by the shell as one string.
        raw = mem_kib * 1024 * 3 // 4
        mem = f'pad=$(head -c {raw} /dev/urandom | base64); echo "pad ${{#pad}}"\n'
    return (
        "trap 'echo got-TERM; exit 143' TERM\n"
        "tok=$(cat /proc/sys/kernel/random/uuid)\n"
        'echo "$tok" > /var/token\n'
        'echo "$tok" > /dev/shm/token\n'
        f"rm {DELETED_FILE}\n"
        f"{mem}"
        f"{extra}"
        "i=0\n"
        "while :; do\n"
        "  i=$((i+1))\n"
        # Written aside and renamed: a reader (an exec'd `cat`, the rootfs diff of a
        # freeze between the truncation and the write) never sees it empty.
        '  echo "$i" > /var/count.new && mv /var/count.new /var/count\n'
        '  echo "tick $tok $i"\n'
        f"{each_tick}"
        f"  sleep {tick}\n"
        "done\n"
    )


@dataclass(frozen=True)
class Counter:
    token: str
    values: list[int]

    @property
    def first(self) -> int:
        return self.values[0]

    @property
    def last(self) -> int:
        return self.values[-1]


def parse_ticks(lines: list[str]) -> Counter | None:
    """The token and values of the tick lines (None without any); one token only."""
    found = [m for line in lines if (m := _TICK.search(line))]
    if not found:
        return None
    tokens = {m.group(1) for m in found}
    assert len(tokens) == 1, f"ticks from more than one incarnation: {sorted(tokens)}"
    return Counter(found[0].group(1), [int(m.group(2)) for m in found])


def file_lines(path: Path) -> list[str]:
    """Complete lines of a file the container's stdout goes to (`ctr run --log-uri
    file://`); the last line may still be being written."""
    if not path.exists():
        return []
    text = path.read_text(errors="replace")
    return text[: text.rfind("\n") + 1].splitlines()


def wait_ticks(read: Callable[[], list[str]], *, count: int, timeout: float = 20) -> Counter:
    """Until the output holds at least `count` tick lines."""

    def enough() -> Counter | None:
        c = parse_ticks(read())
        return c if c is not None and len(c.values) >= count else None

    return wait_for(enough, timeout=timeout, interval=0.1, what=f"{count} counter ticks")


def assert_continues(before: Counter, after: Counter, what: str) -> None:
    """`after` is the same process as `before`, resumed: same in-memory token, the count
    goes on from above the last value seen (a dump freezes the loop at most a tick or two
    past the last line that reached the log), and it counts one by one."""
    assert after.token == before.token, (
        f"{what}: the new container drew a new token (a cold start), "
        f"old {before.token} ticks ..{before.last}, new {after.token} ticks {after.values[:5]}"
    )
    assert before.last < after.first <= before.last + 3, (
        f"{what}: counter resumed at {after.first}, last value before the stop was "
        f"{before.last}; ticks after: {after.values}"
    )
    assert after.values == list(range(after.first, after.first + len(after.values))), (
        f"{what}: the resumed counter skipped or repeated: {after.values}"
    )


def unique_label(what: str) -> str:
    """A label no other test uses (the store of a containerd outlives a test)."""
    return f"{what}-{uuid.uuid4().hex[:8]}"


# -- restores, as the /cedana/restore event tells them -----------------------------------


def restored_from(events: EventStream, box: Box, checkpoint_id: str) -> Event:
    outcome = events.wait_topic(TOPIC_RESTORE, box.cid, timeout=60)
    assert outcome.field("outcome") == "restored", outcome
    assert outcome.checkpoint_id == checkpoint_id, (
        f"restored {outcome.checkpoint_id!r}, expected {checkpoint_id}: {outcome.field('detail')}"
    )
    return outcome


def started_cold(events: EventStream, box: Box) -> Event:
    outcome = events.wait_topic(TOPIC_RESTORE, box.cid, timeout=30)
    assert outcome.field("outcome") == "cold", outcome
    assert outcome.checkpoint_id == ""
    return outcome


# -- the shim's log (JSON lines in containerd's log) -------------------------------------


class ShimLog:
    """The shim's structured records written to containerd's log since `mark()`, or,
    with `path`, those in the shims' own log file (node config log_file)."""

    def __init__(self, containerd: Containerd, *, path: Path | None = None) -> None:
        self.containerd = containerd
        self.path = path
        self.offset = 0 if path is not None else containerd.log_offset()

    def mark(self) -> ShimLog:
        self.offset = self.containerd.log_offset()
        return self

    def _text(self) -> str:
        if self.path is None:
            return self.containerd.log_since(self.offset, limit=50_000_000)
        return self.path.read_text(errors="replace") if self.path.exists() else ""

    def records(self) -> list[dict[str, Any]]:
        out = []
        for line in self._text().splitlines():
            if not line.startswith("{"):
                continue
            with contextlib.suppress(ValueError):
                record = json.loads(line)
                if isinstance(record, dict) and "msg" in record:
                    out.append(record)
        return out

    def find(self, msg: str, **fields: object) -> list[dict[str, Any]]:
        return [
            r
            for r in self.records()
            if r["msg"] == msg and all(r.get(k) == v for k, v in fields.items())
        ]

    def wait(self, msg: str, *, timeout: float = 30, **fields: object) -> dict[str, Any]:
        found: list[dict[str, Any]] = wait_for(
            lambda: self.find(msg, **fields),
            timeout=timeout,
            interval=0.1,
            what=f"shim log record {msg!r} with {fields}",
        )
        return found[0]

    def about(self, container: str) -> list[str]:
        """Messages of the records naming `container`, in order (for assertion texts)."""
        return [
            r["msg"]
            for r in self.records()
            if container in (r.get("container"), r.get("container_id"))
        ]


# -- the store ---------------------------------------------------------------------------


@contextlib.contextmanager
def tmpfs_store(containerd: Containerd, size_mib: int) -> Iterator[Path]:
    """A small tmpfs mounted as the instance's store before any shim has used it (the
    shim opens the store lazily, at the first opted-in container)."""
    store = containerd.store
    assert not store.exists(), "the store was used before the tmpfs could be mounted"
    store.mkdir(mode=0o700)
    subprocess.run(
        ["mount", "-t", "tmpfs", "-o", f"size={size_mib}m,mode=0700", "tmpfs", str(store)],
        check=True,
    )
    try:
        yield store
    finally:
        subprocess.run(["umount", "-l", str(store)], check=False)


def open_store(root: Path) -> Store:
    return Store(StoreConfig(root=str(root)))


def entries(root: Path, *, scope: str | None = None, label: str | None = None) -> list[Entry]:
    """Committed checkpoints (index.json members), newest first."""
    if not (root / "index.json").exists():
        return []
    return open_store(root).catalog.list(scope=scope, label=label)


def store_is_sound(root: Path) -> list[Entry]:
    """Every listed checkpoint is complete and verifies (deep); returns them."""
    listed = entries(root)
    store = open_store(root)
    for entry in listed:
        assert entry.damage is None, f"listed checkpoint {entry.id} is damaged: {entry.damage}"
        store.reader.verify(entry)  # raises DataLoss naming the bad blob
    return listed


def rootfs_diff_file(root: Path, entry: Entry, path: str) -> bytes | None:
    """A regular file's content in a checkpoint's rootfs-diff layer (verified stream)."""
    wanted = path.strip("/")
    with (
        open_store(root).reader.open_layer(entry, ROOTFS_LAYER) as stream,
        tarfile.open(fileobj=stream, mode="r|") as tar,
    ):
        for member in tar:
            if member.name.removeprefix("./").strip("/") == wanted and member.isfile():
                f = tar.extractfile(member)
                assert f is not None
                return f.read()
    return None


def wait_compacted(root: Path, checkpoint_id: str, timeout: float = 60) -> Entry:
    """Until the checkpoint is compressed (published raw, compacted in the background).
    Read from the store, not the log: containerd stops reading a shim's log once its
    last task is deleted, which is usually before the compression ends."""

    def compacted() -> Entry | None:
        for entry in entries(root):
            if entry.id == checkpoint_id and entry.state == "compacted":
                return entry
        return None

    found: Entry = wait_for(
        compacted, timeout=timeout, interval=0.05, what=f"checkpoint {checkpoint_id} compacted"
    )
    return found


def blob_path(root: Path, digest: str) -> Path:
    return root / "blobs" / "sha256" / digest.removeprefix("sha256:")


def ingest_dirs(root: Path) -> list[Path]:
    ingest = root / "ingest"
    return sorted(ingest.iterdir()) if ingest.is_dir() else []


def tree_bytes(path: Path) -> int:
    total = 0
    for dirpath, _dirs, files in os.walk(path):
        for name in files:
            with contextlib.suppress(OSError):
                total += os.lstat(os.path.join(dirpath, name)).st_size
    return total


# -- processes ---------------------------------------------------------------------------


def shim_pid(containerd: Containerd, box: Box) -> int:
    """The one shim daemon serving a ctr container of the test namespace."""
    pids = containerd.shim_pids(CTR_NAMESPACE, box.cid)
    assert len(pids) == 1, f"expected one shim daemon for {box.cid}, found {pids}"
    return pids.pop()


def criu_pids(shim_pid: int) -> set[int]:
    """CRIU processes working for this shim (shim -> runc -> criu): the `criu swrk`
    runc drives, not the shim's own `criu --version` (recorded in checkpoints)."""
    return {
        pid
        for pid in procs.descendants({shim_pid})
        if (argv := procs.read_argv(pid))
        and os.path.basename(argv[0]) == "criu"
        and "--version" not in argv
    }


def wait_criu(shim_pid: int, timeout: float = 15) -> set[int]:
    """Poll (every 2 ms: a dump of tens of MiB lasts a fraction of a second) until a
    CRIU process runs under the shim."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = criu_pids(shim_pid)
        if found:
            return found
        time.sleep(0.002)
    raise AssertionError(f"no criu process appeared under shim {shim_pid} in {timeout}s")


def kill_all(pids: set[int], sig: int = signal.SIGKILL) -> None:
    for pid in pids:
        procs.kill_quietly(pid, sig)


HOLD_SCRIPT = """#!/bin/sh
# Holds CRIU at one step ({stage}) of the one dump or restore it is armed for, until
# {go} appears (the step goes on) or it is killed (the step fails); 10 minutes at most.
[ "$CRTOOLS_SCRIPT_ACTION" = {stage} ] || exit 0
rm {armed} 2>/dev/null || exit 0
echo $$ >{held}.tmp && mv {held}.tmp {held}
turns=0
until rm {go} 2>/dev/null; do
  turns=$((turns + 1))
  [ $turns -lt 12000 ] || exit 1
  sleep 0.05
done
"""


@dataclass
class CriuHold:
    """A CRIU action script, added through the node config (`criu_config_extra`), that
    holds CRIU at one step of the next dump or restore after `arm()`: the step is hit
    exactly, whatever the machine's speed. The held script is `pid()`; it fails (and
    with it the CRIU step) when killed, as `release()` and leaving a `with` block do;
    `resume()` lets the step go on."""

    stage: str
    script: Path
    armed: Path
    held: Path
    go: Path

    def arm(self) -> None:
        self.held.unlink(missing_ok=True)
        self.go.unlink(missing_ok=True)
        self.armed.touch()

    def resume(self) -> None:
        """Let the held step go on."""
        self.go.touch()

    def wait_held(self, timeout: float = 30) -> int:
        wait_for(self.held.exists, timeout=timeout, what=f"CRIU to reach {self.stage}")
        return self.pid()

    def pid(self) -> int:
        return int(self.held.read_text())

    def release(self) -> None:
        """Kill the held script if it still runs (what a test leaves held forever)."""
        if self.held.exists():
            procs.kill_quietly(self.pid(), signal.SIGKILL)

    def __enter__(self) -> CriuHold:
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()


def criu_hold(containerd: Containerd, stage: str, env: dict[str, str] | None = None) -> CriuHold:
    """Install a CriuHold for `stage` and restart `containerd` so that its shims use it
    (with `env` added to the shims' environment as well)."""
    base = containerd.base
    hold = CriuHold(stage, base / "hold.sh", base / "armed", base / "held", base / "go")
    hold.script.write_text(
        HOLD_SCRIPT.format(stage=stage, armed=hold.armed, held=hold.held, go=hold.go)
    )
    hold.script.chmod(0o755)
    containerd.extra_env.update(env or {})
    containerd.extra_env["CEDANA_CRIU_CONFIG_EXTRA"] = f"action-script {hold.script}"
    containerd.restart()
    return hold


@contextlib.contextmanager
def stopped(pid: int) -> Iterator[None]:
    """SIGSTOP `pid` for the duration of the block (SIGCONT after, if it still lives)."""
    os.kill(pid, signal.SIGSTOP)
    try:
        yield
    finally:
        procs.kill_quietly(pid, signal.SIGCONT)


# -- ctr containers of one label ---------------------------------------------------------


@dataclass
class Box:
    """One `ctr run -d` container of a test; its stdout goes to `out`."""

    cid: str
    out: Path

    def lines(self) -> list[str]:
        return file_lines(self.out)

    def ticks(self) -> Counter | None:
        return parse_ticks(self.lines())


class Workloads:
    """Containers started with `ctr run -d --env CEDANA_CHECKPOINT=<label>`, all removed
    (SIGKILL, delete) when the block ends."""

    def __init__(
        self,
        containerd: Containerd,
        new_id: Callable[[str], str],
        *,
        label: str,
        script: str,
        namespace: str,
    ) -> None:
        self.containerd = containerd
        self.ctr = containerd.ctr(namespace)
        self.new_id = new_id
        self.label = label
        self.script = script
        self.logs = containerd.base / "ctr-logs"
        self.logs.mkdir(exist_ok=True)
        self.started: list[Box] = []

    def start(self, tag: str, *, label: str | None = None, extra: tuple[str, ...] = ()) -> Box:
        """`ctr run -d` of the script (with `extra` ctr run flags, e.g. --net-host)."""
        cid = self.new_id(tag)
        box = Box(cid, self.logs / f"{cid}.log")
        self.started.append(box)
        flags = (
            "-d",
            "--env",
            f"CEDANA_CHECKPOINT={label or self.label}",
            "--log-uri",
            f"file://{box.out}",
            *extra,
        )
        self.ctr(
            *self.ctr.run_args(
                self.containerd.images.busybox, cid, "sh", "-c", self.script, flags=flags
            )
        )
        return box

    def delete(self, box: Box) -> None:
        """`ctr task delete` + `ctr containers delete` of a stopped container."""
        self.ctr("task", "delete", box.cid)
        self.ctr("containers", "delete", box.cid)

    def pid(self, box: Box) -> int:
        task = self.ctr.task(box.cid)
        assert task is not None, f"no task {box.cid}"
        return task.pid

    def close(self) -> None:
        for box in self.started:
            self.ctr.remove(box.cid)

    def __enter__(self) -> Workloads:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
