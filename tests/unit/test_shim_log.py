"""The shim's logging: containerd's FIFO can never block the daemon, and every record
also lands in the node's log file (JSON lines, 0600 in a 0700 dir, size-capped rotation
shared by several daemons)."""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import stat
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from cedana_shim import log as shim_log
from cedana_shim.log import (
    FdHandler,
    JsonFormatter,
    NodeLogHandler,
    add_node_log,
    configure,
    open_log_fifo,
)


@pytest.fixture(autouse=True)
def restore_root_logger() -> Iterator[None]:
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    for handler in list(root.handlers):
        root.removeHandler(handler)
        if handler not in handlers:
            handler.close()
    for handler in handlers:
        root.addHandler(handler)
    root.setLevel(level)


def record(msg: str, **fields: object) -> logging.LogRecord:
    return logging.makeLogRecord(
        {"msg": msg, "levelno": logging.INFO, "levelname": "INFO", **fields}
    )


def fifo_nobody_reads(bundle: Path) -> int:
    """``<bundle>/log`` held open read-write, as containerd holds the shim's FIFO: writes
    never fail for want of a reader, and nothing drains it. Returns the holder's fd."""
    fifo = bundle / "log"
    os.mkfifo(fifo)
    return os.open(fifo, os.O_RDWR | os.O_NONBLOCK)


def drain(fd: int) -> bytes:
    data = b""
    while True:
        try:
            chunk = os.read(fd, 65536)
        except BlockingIOError:
            return data
        if not chunk:
            return data
        data += chunk


# -- containerd's FIFO --------------------------------------------------------------------


def test_a_full_fifo_nobody_reads_never_blocks_the_daemon(tmp_path: Path) -> None:
    """Before: the FIFO was made blocking, and the 65th KiB hung the daemon for good."""
    holder = fifo_nobody_reads(tmp_path)
    fd = open_log_fifo(str(tmp_path))
    assert fd is not None and not os.get_blocking(fd)
    configure(fd, debug=False)
    log = logging.getLogger("test")
    started = time.monotonic()
    for i in range(500):  # ~500 KiB: eight times the pipe buffer
        log.info("x" * 1000, extra={"n": i})
    elapsed = time.monotonic() - started
    # One bounded wait when the pipe fills, then each record is tried once and dropped.
    assert elapsed < 3 * shim_log.FIFO_WAIT + 2, elapsed
    lines = drain(holder).splitlines()
    assert lines, "nothing reached the FIFO"
    assert [json.loads(line)["n"] for line in lines] == list(range(len(lines)))
    assert len(lines) < 500
    os.close(fd)
    os.close(holder)


def test_the_fifo_carries_records_again_once_containerd_reads(tmp_path: Path) -> None:
    holder = fifo_nobody_reads(tmp_path)
    fd = open_log_fifo(str(tmp_path))
    assert fd is not None
    handler = FdHandler(fd, wait=0.05)
    handler.setFormatter(JsonFormatter())
    while not handler.stalled:
        handler.emit(record("filler " + "y" * 500))
    drain(holder)
    handler.emit(record("after the reader came back"))
    assert not handler.stalled
    assert json.loads(drain(holder))["msg"] == "after the reader came back"
    os.close(fd)
    os.close(holder)


def test_a_record_waits_for_a_slow_reader(tmp_path: Path) -> None:
    """containerd reading a bit late is not containerd gone: nothing is dropped."""
    holder = fifo_nobody_reads(tmp_path)
    fd = open_log_fifo(str(tmp_path))
    assert fd is not None
    handler = FdHandler(fd, wait=5.0)
    handler.setFormatter(JsonFormatter())
    pid = os.fork()
    if pid == 0:  # the reader: wakes up after 0.3 s and reads everything
        time.sleep(0.3)
        total = 0
        os.set_blocking(holder, True)
        while total < 200 * 1024:
            total += len(os.read(holder, 65536))
        os._exit(0)
    try:
        for i in range(200):
            handler.emit(record("z" * (1024 - 60), n=i))
        assert not handler.stalled
    finally:
        os.waitpid(pid, 0)
        os.close(fd)
        os.close(holder)


def test_a_fifo_without_a_reader_is_not_opened(tmp_path: Path) -> None:
    os.mkfifo(tmp_path / "log")
    assert open_log_fifo(str(tmp_path)) is None
    assert open_log_fifo(str(tmp_path / "missing")) is None


# -- the node's log file ------------------------------------------------------------------


def test_every_record_also_goes_to_the_node_log_file(tmp_path: Path) -> None:
    holder = fifo_nobody_reads(tmp_path)
    fd = open_log_fifo(str(tmp_path))
    configure(fd, debug=False, static={"namespace": "k8s.io"})
    path = tmp_path / "var" / "log" / "cedana" / "shim.log"
    add_node_log(str(path))
    logging.getLogger("cedana_shim.checkpoint").info("compacted", extra={"checkpoint": "c1"})
    in_fifo = json.loads(drain(holder))
    in_file = [json.loads(line) for line in path.read_text().splitlines()]
    assert in_file == [in_fifo]
    assert in_fifo["msg"] == "compacted" and in_fifo["namespace"] == "k8s.io"
    assert in_fifo["checkpoint"] == "c1"
    assert fd is not None
    os.close(fd)
    os.close(holder)


def test_the_node_log_file_is_private_whatever_the_umask(tmp_path: Path) -> None:
    path = tmp_path / "new-dir" / "shim.log"
    old = os.umask(0)
    try:
        handler = NodeLogHandler(str(path))
    finally:
        os.umask(old)
    handler.close()
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_an_existing_directory_keeps_its_mode(tmp_path: Path) -> None:
    shared = tmp_path / "var-log"
    shared.mkdir(mode=0o755)
    shared.chmod(0o755)
    NodeLogHandler(str(shared / "shim.log")).close()
    assert stat.S_IMODE(shared.stat().st_mode) == 0o755


def test_rotation_keeps_the_newest_generations(tmp_path: Path) -> None:
    path = tmp_path / "shim.log"
    handler = NodeLogHandler(str(path), limit=1000, generations=2)
    handler.setFormatter(JsonFormatter())
    for i in range(60):
        handler.emit(record("r" * 40, n=i))
    handler.close()
    files = sorted(p.name for p in tmp_path.iterdir())
    assert files == ["shim.log", "shim.log.1", "shim.log.2"]
    numbers = []
    for name in ("shim.log.2", "shim.log.1", "shim.log"):
        text = (tmp_path / name).read_text()
        assert len(text) <= 1000
        numbers += [json.loads(line)["n"] for line in text.splitlines()]
    # The newest records, in order, none missing after the oldest one kept.
    assert numbers == list(range(numbers[0], 60))
    assert numbers[0] > 0


def _write_lines(path: str, who: int, count: int) -> None:
    handler = NodeLogHandler(path, limit=20_000, generations=50)
    handler.setFormatter(JsonFormatter())
    for i in range(count):
        handler.emit(record("w" * 100, who=who, n=i))
    handler.close()


def test_daemons_sharing_the_file_rotate_it_without_losing_or_breaking_a_line(
    tmp_path: Path,
) -> None:
    path = tmp_path / "shim.log"
    ctx = multiprocessing.get_context("fork")
    writers = [ctx.Process(target=_write_lines, args=(str(path), w, 400)) for w in range(4)]
    for w in writers:
        w.start()
    for w in writers:
        w.join(60)
        assert w.exitcode == 0
    seen: dict[int, list[int]] = {w: [] for w in range(4)}
    files = [p for p in tmp_path.iterdir() if p.name.startswith("shim.log")]
    assert len(files) > 5  # it did rotate, many times
    for p in sorted(files, key=lambda p: -int(p.suffix[1:]) if p.suffix != ".log" else 0):
        for line in p.read_text().splitlines():
            entry = json.loads(line)  # every line whole
            seen[entry["who"]].append(entry["n"])
    for who, numbers in seen.items():
        assert sorted(numbers) == list(range(400)), f"writer {who} lost lines"


def test_a_file_moved_away_is_recreated(tmp_path: Path) -> None:
    """An operator's logrotate (move, no copytruncate) or an rm: the next record
    starts a new file instead of going to the old inode."""
    path = tmp_path / "shim.log"
    handler = NodeLogHandler(str(path))
    handler.setFormatter(JsonFormatter())
    handler.emit(record("one"))
    path.rename(tmp_path / "moved.log")
    handler.emit(record("two"))
    handler.close()
    assert [json.loads(line)["msg"] for line in path.read_text().splitlines()] == ["two"]


def test_add_node_log_switches_and_turns_off(tmp_path: Path) -> None:
    configure(None, debug=False, static={"namespace": "n"})
    first, second = tmp_path / "a.log", tmp_path / "b.log"
    add_node_log(str(first))
    add_node_log(str(first))  # the same file: once
    logging.getLogger("t").info("to a")
    add_node_log(str(second))
    logging.getLogger("t").info("to b")
    add_node_log("")
    logging.getLogger("t").info("nowhere")
    assert [json.loads(x)["msg"] for x in first.read_text().splitlines()] == ["to a"]
    assert [json.loads(x)["msg"] for x in second.read_text().splitlines()] == ["to b"]
    assert json.loads(second.read_text())["namespace"] == "n"


def test_an_unusable_node_log_file_is_reported_not_raised(tmp_path: Path) -> None:
    holder = fifo_nobody_reads(tmp_path)
    fd = open_log_fifo(str(tmp_path))
    configure(fd, debug=False)
    blocker = tmp_path / "not-a-dir"
    blocker.write_text("")
    add_node_log(str(blocker / "shim.log"))
    warning = json.loads(drain(holder))
    assert warning["msg"].startswith("cannot open the node's shim log file")
    assert warning["log_file"] == str(blocker / "shim.log")
    assert fd is not None
    os.close(fd)
    os.close(holder)
