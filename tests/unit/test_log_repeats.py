"""A burst of one warning or error is rate-limited in the shim's logs (RepeatFilter):
the first few of a kind are written, the rest counted and reported in one line
("N similar lines suppressed"), so that a flood cannot rotate earlier lines out of the
node's size-capped log file."""

from __future__ import annotations

import json
import logging
from collections.abc import Iterator
from pathlib import Path

import pytest
from cedana_shim import log as shim_log
from cedana_shim.log import JsonFormatter, RepeatFilter


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__()
        self.lines: list[dict[str, object]] = []
        self.setFormatter(JsonFormatter())

    def emit(self, record: logging.LogRecord) -> None:
        self.lines.append(json.loads(self.format(record)))


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def collected(clock: Clock) -> Iterator[tuple[logging.Logger, Collect]]:
    logger = logging.getLogger(f"test.repeats.{id(clock)}")
    logger.propagate = False
    logger.setLevel(logging.DEBUG)
    handler = Collect()
    handler.addFilter(RepeatFilter(handler, burst=3, window=10.0, clock=clock))
    logger.addHandler(handler)
    yield logger, handler
    logger.removeHandler(handler)


def test_a_burst_is_cut_to_its_first_lines_and_counted_once_the_window_is_over(
    collected: tuple[logging.Logger, Collect], clock: Clock
) -> None:
    logger, handler = collected
    for n in range(100):
        logger.warning("accept failed on %s", f"sock{n}", extra={"n": n})
    assert [line["n"] for line in handler.lines] == [0, 1, 2]
    clock.now += 9.9
    logger.warning("accept failed on %s", "late")
    assert len(handler.lines) == 3  # still the same window
    clock.now += 0.1
    logger.info("something else")
    summary, other = handler.lines[3:]
    assert summary["msg"] == "98 similar lines suppressed"
    assert (summary["level"], summary["logger"]) == ("warning", logger.name)
    assert summary["like"] == "accept failed on %s"
    assert other["msg"] == "something else"
    # The kind starts afresh: a new window, its first lines written again.
    logger.warning("accept failed on %s", "again")
    assert handler.lines[-1]["msg"] == "accept failed on again"


def test_kinds_are_the_logger_the_template_and_the_exception_type(
    collected: tuple[logging.Logger, Collect],
) -> None:
    logger, handler = collected
    for _ in range(5):
        logger.error("one")
        logger.error("two")
        try:
            raise OSError(24, "Too many open files")
        except OSError:
            logger.exception("one")
        try:
            raise ValueError("x")
        except ValueError:
            logger.exception("one")
        logging.getLogger(logger.name + ".child").error("one")  # propagates to the handler
    counts: dict[tuple[object, object, str], int] = {}
    for line in handler.lines:
        error = str(line.get("error", "")).splitlines()[-1:]  # "OSError: [Errno 24] ..."
        key = (line["logger"], line["msg"], error[0].split(":")[0] if error else "")
        counts[key] = counts.get(key, 0) + 1
    assert sorted(counts.values()) == [3, 3, 3, 3, 3]
    assert sum("OSError: [Errno 24]" in str(line.get("error", "")) for line in handler.lines) == 3


def test_info_and_debug_lines_are_never_held_back(
    collected: tuple[logging.Logger, Collect],
) -> None:
    logger, handler = collected
    for n in range(50):
        logger.info("checkpoint committed", extra={"n": n})
        logger.debug("runc exited")
    assert len(handler.lines) == 100


def test_a_template_built_per_call_is_still_bounded(
    collected: tuple[logging.Logger, Collect], clock: Clock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each f-string message is a kind of its own: the filter keeps at most
    REPEAT_KINDS of them, forgetting quiet ones first, never one with a count due."""
    monkeypatch.setattr(shim_log, "REPEAT_KINDS", 8)
    logger, handler = collected
    for _ in range(5):
        logger.warning("flood")
    for n in range(100):
        logger.warning(f"unique {n}")
    clock.now += 10.0
    logger.info("later")
    assert "2 similar lines suppressed" in [line["msg"] for line in handler.lines]
    flt = handler.filters[0]
    assert isinstance(flt, RepeatFilter) and len(flt._windows) <= 8


def test_a_flood_of_tracebacks_leaves_the_node_logs_earlier_lines(tmp_path: Path) -> None:
    """As the shim and the Slurm runner set up their logging: 12,500 identical
    tracebacks (what asyncio logged in a second for an accept() out of descriptors)
    on a file capped at 64 KiB keep the earlier line in the live file."""
    root = logging.getLogger()
    saved = list(root.handlers), root.level
    try:
        shim_log.configure(None, debug=False)
        shim_log.add_node_log(str(tmp_path / "shim.log"))
        node = next(h for h in root.handlers if isinstance(h, shim_log.NodeLogHandler))
        node.limit = 64 << 10
        logging.getLogger("cedana_shim.test").info("the job started")
        log = logging.getLogger("asyncio")
        for _ in range(12_500):
            try:
                raise OSError(24, "Too many open files")
            except OSError:
                log.exception("socket.accept() out of system resource")
        lines = [json.loads(x) for x in (tmp_path / "shim.log").read_text().splitlines()]
        assert lines[0]["msg"] == "the job started"
        assert len(lines) == 1 + shim_log.REPEAT_BURST
        assert not (tmp_path / "shim.log.1").exists()
    finally:
        for handler in list(root.handlers):
            root.removeHandler(handler)
            handler.close()
        for handler in saved[0]:
            root.addHandler(handler)
        root.setLevel(saved[1])
