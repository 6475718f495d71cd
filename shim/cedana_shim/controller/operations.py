"""Long actions (a migration) run in a thread of their own; the UI polls their steps.

An operation is kept in memory for :data:`KEEP_S` after it ends; a controller restart
forgets it (the audit trail, in the log and the pods' Events, stays)."""

from __future__ import annotations

import contextlib
import itertools
import logging
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any, Final

KEEP_S: Final = 3600.0

log = logging.getLogger("cedana.controller")


class StepFailed(Exception):
    """A step could not be done; the message says why and what to do."""


@dataclass
class Step:
    name: str
    state: str = "pending"  # pending | running | done | failed | skipped
    detail: str = ""
    started: float = 0.0
    finished: float = 0.0


@dataclass
class Operation:
    id: str
    kind: str
    user: str
    namespace: str
    target: str
    steps: list[Step]
    state: str = "running"  # running | done | failed
    error: str = ""
    started: float = field(default_factory=time.time)
    finished: float = 0.0
    result: dict[str, Any] = field(default_factory=dict)

    @contextlib.contextmanager
    def step(self, name: str) -> Iterator[Step]:
        current = next(s for s in self.steps if s.name == name)
        current.state, current.started = "running", time.time()
        try:
            yield current
        except BaseException as err:
            current.state, current.finished = "failed", time.time()
            current.detail = current.detail or str(err)
            raise
        if current.state == "running":
            current.state = "done"
        current.finished = time.time()

    def to_json(self) -> dict[str, Any]:
        return asdict(self)


class Operations:
    def __init__(self) -> None:
        self._ops: dict[str, Operation] = {}
        self._ids = itertools.count(1)
        self._lock = threading.Lock()

    def start(
        self,
        kind: str,
        user: str,
        namespace: str,
        target: str,
        steps: list[str],
        work: Callable[[Operation], None],
        done: Callable[[Operation], None],
    ) -> Operation:
        """Run ``work`` in a thread; ``done`` (the audit) runs after it, whatever happened."""
        with self._lock:
            now = time.time()
            self._ops = {
                k: o for k, o in self._ops.items() if not o.finished or now - o.finished < KEEP_S
            }
            op = Operation(
                f"op-{next(self._ids)}", kind, user, namespace, target, [Step(s) for s in steps]
            )
            self._ops[op.id] = op

        def run() -> None:
            try:
                work(op)
                op.state = "done"
            except StepFailed as err:
                op.state, op.error = "failed", str(err)
            except Exception as err:
                log.exception("operation %s (%s of %s) failed", op.id, kind, target)
                op.state, op.error = "failed", f"unexpected: {err}"
            finally:
                op.finished = time.time()
                for s in op.steps:
                    if s.state == "pending" and op.state == "failed":
                        s.state = "skipped"
                done(op)

        threading.Thread(target=run, name=op.id, daemon=True).start()
        return op

    def get(self, op_id: str) -> Operation | None:
        with self._lock:
            return self._ops.get(op_id)
