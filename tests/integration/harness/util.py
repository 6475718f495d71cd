"""Small, bounded, event-driven waiting helpers."""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")


def slower() -> float:
    """How much slower than this project's host the machine is: every bound the harness
    puts on a step is multiplied by it (`CEDANA_TEST_SLOWER`; the VM tier's guest runs
    code 20-50x slower, more under load). Read at each use: tests/vm sets it."""
    return float(os.environ.get("CEDANA_TEST_SLOWER", "1"))


class WaitTimeout(AssertionError):
    """A condition did not become true in time (an AssertionError so pytest shows it as a
    test failure with the description, not as an error in the harness)."""


class WaitAborted(AssertionError):
    """Raised by a predicate when waiting longer is pointless (e.g. the process that
    should reach the state already exited); `wait_for` lets it through at once."""


def wait_for(
    predicate: Callable[[], T | None],
    *,
    timeout: float,
    interval: float = 0.05,
    what: str = "condition",
) -> T:
    """Poll `predicate` until it returns a truthy value and return that value.

    Exceptions from the predicate count as "not yet" until the deadline; the last one is
    chained onto the timeout so a persistent error is visible in the report.
    """
    timeout *= slower()
    deadline = time.monotonic() + timeout
    last_exc: BaseException | None = None
    last_value: object = None
    while True:
        try:
            value = predicate()
            last_exc = None
            if value:
                return value
            last_value = value
        except WaitAborted:
            raise
        except Exception as exc:
            last_exc = exc
        if time.monotonic() >= deadline:
            msg = f"timed out after {timeout:.1f}s waiting for {what} (last value: {last_value!r})"
            raise WaitTimeout(msg) from last_exc
        time.sleep(interval)
