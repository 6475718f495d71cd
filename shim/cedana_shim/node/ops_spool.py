"""The node agent's side of the operations spool (written by checkpoint/oplog.py).

Every round, :class:`OpsObserver` takes the records the shims left in
``<store>/ops/``, oldest first: posts each one's pod Events, counts it in the
metrics, then deletes it. An API server that cannot be reached (or answers 5xx)
ends the round with the record kept, so its Events are posted by a later round and
it is counted once, when it is consumed; one the API server refuses (4xx) is
logged and consumed. The store's size, count and pending pushes are read too.

The records consumed lately are the agent's history (its API's ``recent``: the
dashboard's restores, fall-backs and failures). It is kept in the store beside the
spool, ``ops/history.jsonl`` (the newest last, rewritten whole after a round that
consumed any), so an agent that restarts, or a new pod of it, shows what came before.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
from collections import deque
from dataclasses import dataclass
from typing import Any

from ..checkpoint import oplog
from ..checkpoint.remote import Outbox
from ..checkpoint.store import Store, StoreConfig, fsutil
from ..config import load_node_config
from ..errors import ShimError
from .hostfs import HostRoot
from .kube import EventApi, KubeError, Rejected
from .kube_events import events_for
from .metrics import AgentMetrics

log = logging.getLogger(__name__)

MAX_RECORD_BYTES = 1 << 20
HISTORY_FILE = "history.jsonl"  # in the spool's directory (oplog.spool_path)
MAX_HISTORY_BYTES = 16 << 20


def node_store(host: HostRoot, shim_config: str) -> StoreConfig | None:
    """The checkpoint store of the node config, as this process sees it; None
    (logged) when the config cannot be read."""
    try:
        config = load_node_config(host.path(shim_config), env={})
    except ShimError as err:
        log.warning("cannot read the node config %s: %s", shim_config, err)
        return None
    return StoreConfig.for_node(config, root=host.path(config.store_path))


@dataclass
class OpsObserver:
    api: EventApi | None  # None: metrics only (no Kubernetes API)
    metrics: AgentMetrics
    node: str
    # The operations consumed lately, newest last, for the agent's API (agent_api.py).
    history: deque[dict[str, Any]] | None = None
    _history_read: bool = dataclasses.field(default=False, init=False)

    def round(self, store: StoreConfig) -> int:
        """Refresh the store's gauges and consume the spool; the records consumed.

        The gauges first: a scrape that sees a record's counter (a restore) also sees
        the store as it was when that record was written, not the gauges of before a
        long spool was consumed."""
        self.refresh_store(store)
        return self.consume(oplog.spool_path(store.root))

    def consume(self, spool: str) -> int:
        if self.history is not None and not self._history_read and os.path.isdir(spool):
            self._history_read = True
            self.history.extendleft(reversed(read_history(spool, self.history.maxlen)))
        done = 0
        kept = 0
        for name in oplog.records(spool):
            path = os.path.join(spool, name)
            record = self._read(path)
            if record is not None:
                try:
                    self._post(record, name)
                except KubeError as err:
                    log.warning("cannot post pod events now, next round retries: %s", err)
                    break
                self.metrics.observe(record)
                if self.history is not None:
                    self.history.append({**dataclasses.asdict(record), "node": self.node})
                    kept += 1
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)
            done += 1
        if kept and self.history is not None:
            write_history(spool, self.history)
        self._take_dropped(spool)
        return done

    def _read(self, path: str) -> oplog.OpRecord | None:
        try:
            with open(path, "rb") as f:
                record = oplog.parse(f.read(MAX_RECORD_BYTES))
        except OSError as err:
            log.warning("cannot read operation record %s: %s", path, err)
            record = None
        if record is None:
            self.metrics.records_lost.labels("unreadable").inc()
            log.warning("operation record %s is not one; deleted", path)
        return record

    def _post(self, record: oplog.OpRecord, name: str) -> None:
        if self.api is None:
            return
        events = events_for(record, name, self.node)
        if events and not record.pod_uid:
            # `kubectl describe pod` lists the Events that name the pod's uid.
            try:
                uid = self.api.pod_uid(record.namespace, record.pod)
            except Rejected as err:
                log.warning("cannot look up the pod's uid, events go without it: %s", err)
                uid = ""
            for event in events:
                if uid:
                    event["involvedObject"]["uid"] = uid
        for event in events:
            try:
                self.api.create_event(record.namespace, event)
            except Rejected as err:
                log.warning("pod event refused by the API server, dropped: %s", err)

    def _take_dropped(self, spool: str) -> None:
        if not os.path.exists(os.path.join(spool, oplog.DROPPED_FILE)):
            return
        try:
            with oplog.locked(spool):
                dropped = oplog.read_dropped(spool)
                os.unlink(os.path.join(spool, oplog.DROPPED_FILE))
        except OSError as err:
            log.warning("cannot read the spool's drop counter: %s", err)
            return
        if dropped:
            self.metrics.records_lost.labels("spool_full").inc(dropped)
            log.warning("%d operation records were dropped from a full spool", dropped)

    def refresh_store(self, store: StoreConfig) -> None:
        if not os.path.isdir(store.root):
            return  # no checkpoint was ever taken on this node
        try:
            entries = Store(store).catalog.list()
            pending = Outbox(store.root).pending()
        except (ShimError, OSError) as err:
            log.warning("cannot read the checkpoint store %s: %s", store.root, err)
            return
        self.metrics.store_checkpoints.set(len(entries))
        # A compacted checkpoint may also keep its raw images (the restore cache).
        cached = sum(e.raw_bytes for e in entries if e.state == "compacted")
        self.metrics.store_bytes.set(sum(e.size for e in entries) + cached)
        self.metrics.pending_pushes.set(len(pending))


def read_history(spool: str, most: int | None) -> list[dict[str, Any]]:
    """The history an earlier agent kept (oldest first, at most ``most``); [] when
    there is none or it cannot be read (logged: the history is a convenience)."""
    try:
        fd = os.open(spool, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            data = fsutil.read_file_at(fd, HISTORY_FILE, MAX_HISTORY_BYTES, path=spool)
        finally:
            os.close(fd)
    except FileNotFoundError:
        return []
    except (OSError, ShimError) as err:
        log.warning("cannot read the agent's history in %s: %s", spool, err)
        return []
    items: list[dict[str, Any]] = []
    for line in data.splitlines():
        with contextlib.suppress(ValueError):
            item = json.loads(line)
            if isinstance(item, dict):
                items.append(item)
    return items[-most:] if most else items


def write_history(spool: str, history: deque[dict[str, Any]]) -> None:
    """Replace the kept history with ``history`` (a failure is logged, not raised)."""
    data = "".join(json.dumps(item, separators=(",", ":")) + "\n" for item in history)
    try:
        fd = os.open(spool, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            fsutil.write_file_atomic(fd, HISTORY_FILE, data.encode())
        finally:
            os.close(fd)
    except OSError as err:
        log.warning("cannot keep the agent's history in %s: %s", spool, err)
