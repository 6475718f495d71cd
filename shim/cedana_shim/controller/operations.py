"""Long actions (a migration) run in a thread of their own; the UI polls their steps.

An operation is kept for :data:`KEEP_S` after it ends (at most :data:`KEEP` of them),
in memory and, at every change of a step, in a ConfigMap (op_store.py): the
controller has no disk of its own. A restarted controller reads them back; one that
was running then is marked failed ("interrupted": its remaining steps were not
carried out), since the thread that drove it is gone. The audit trail (the log, the
pods' Events) is apart from this."""

from __future__ import annotations

import contextlib
import copy
import logging
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, field
from typing import Any, Final, Protocol

KEEP_S: Final = 3600.0
KEEP: Final = 50  # operations kept at most (a ConfigMap holds 1 MiB)
INTERRUPTED: Final = (
    "interrupted: the controller restarted during this operation, and its remaining steps "
    "were not carried out; look at the pod, and migrate it again if need be"
)

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
    # Told of every change of a step (Operations persists then).
    changed: Callable[[], None] = field(default=lambda: None, repr=False, compare=False)

    @contextlib.contextmanager
    def step(self, name: str) -> Iterator[Step]:
        current = next(s for s in self.steps if s.name == name)
        current.state, current.started = "running", time.time()
        self.changed()
        try:
            yield current
        except BaseException as err:
            current.state, current.finished = "failed", time.time()
            current.detail = current.detail or str(err)
            self.changed()
            raise
        if current.state == "running":
            current.state = "done"
        current.finished = time.time()
        self.changed()

    def to_json(self) -> dict[str, Any]:
        return {
            "id": self.id, "kind": self.kind, "user": self.user, "namespace": self.namespace,
            "target": self.target, "steps": [asdict(s) for s in self.steps],
            "state": self.state, "error": self.error, "started": self.started,
            "finished": self.finished, "result": copy.deepcopy(self.result),
        }  # fmt: skip

    @classmethod
    def from_json(cls, doc: dict[str, Any]) -> Operation:
        op = cls(
            str(doc["id"]), str(doc["kind"]), str(doc["user"]), str(doc["namespace"]),
            str(doc["target"]), [],
        )  # fmt: skip
        op.steps = [
            Step(str(s["name"]), str(s["state"]), str(s.get("detail") or ""),
                 float(s.get("started") or 0), float(s.get("finished") or 0))
            for s in doc.get("steps") or ()
        ]  # fmt: skip
        op.state, op.error = str(doc.get("state") or "failed"), str(doc.get("error") or "")
        op.started, op.finished = float(doc.get("started") or 0), float(doc.get("finished") or 0)
        op.result = dict(doc.get("result") or {})
        return op

    def interrupt(self, now: float) -> None:
        """Mark an operation whose driver is gone (a controller restart) as failed."""
        self.state, self.error, self.finished = "failed", INTERRUPTED, now
        for s in self.steps:
            if s.state == "running":
                s.state, s.finished = "failed", now
                s.detail = s.detail or "interrupted by a controller restart"
            elif s.state == "pending":
                s.state = "skipped"


class OperationStore(Protocol):
    def load(self) -> list[dict[str, Any]]: ...

    def save(self, ops: list[dict[str, Any]]) -> None: ...


class Operations:
    def __init__(self, store: OperationStore | None = None) -> None:
        self._ops: dict[str, Operation] = {}
        self._lock = threading.Lock()
        self._save_lock = threading.Lock()
        self._store = store
        if store is not None:
            self._restore(store)

    def _restore(self, store: OperationStore) -> None:
        now = time.time()
        interrupted = False
        for doc in store.load():
            try:
                op = Operation.from_json(doc)
            except (KeyError, TypeError, ValueError) as err:
                log.warning("skipped a stored operation that does not parse: %s", err)
                continue
            if op.state == "running":
                op.interrupt(now)
                interrupted = True
                log.warning("operation %s (%s of %s) %s", op.id, op.kind, op.target, op.error)
            op.changed = self._save
            self._ops[op.id] = op
        if interrupted:
            self._save()

    def _save(self) -> None:
        """Write every kept operation to the store (logged, not raised, on failure)."""
        if self._store is None:
            return
        with self._save_lock:  # one write at a time, each with the newest states
            with self._lock:
                docs = [o.to_json() for o in self._ops.values()]
            try:
                self._store.save(docs)
            except Exception as err:  # a KubeError or worse: the operation goes on
                log.warning("cannot persist the operations: %s", err)

    def recent(self) -> list[Operation]:
        """Newest first."""
        with self._lock:
            return sorted(self._ops.values(), key=lambda o: o.started, reverse=True)

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
            kept = [o for o in self._ops.values() if not o.finished or now - o.finished < KEEP_S]
            kept = sorted(kept, key=lambda o: o.started)[-(KEEP - 1) :]
            self._ops = {o.id: o for o in kept}
            op = Operation(
                f"op-{uuid.uuid4().hex[:12]}", kind, user, namespace, target,
                [Step(s) for s in steps], changed=self._save,
            )  # fmt: skip
            self._ops[op.id] = op
        self._save()

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
                self._save()
                done(op)

        threading.Thread(target=run, name=op.id, daemon=True).start()
        return op

    def get(self, op_id: str) -> Operation | None:
        with self._lock:
            return self._ops.get(op_id)
