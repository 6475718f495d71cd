"""``cedana node run``: the DaemonSet helper's loop.

1. Taint the node at once: a helper that (re)starts has proven nothing yet.
2. Install (idempotent: on an installed node it changes nothing and restarts nothing).
3. Every ``interval``: read the node and this node's helper/health-check pods, check
   that CRI still lists the handler, and patch the taint/label to match ``taint.decide``.
   The install runs again every ``reinstall_interval`` to repair drift (someone
   rewrote containerd's config), and at once after a failed attempt.

Beside the loop, in threads of their own (:func:`in_background`), run what must not
wait for the install: the shims' operation records becoming pod Events and metrics.
"""

from __future__ import annotations

import logging
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from types import FrameType

from . import taint
from .kube import Conflict, KubeError, NodeApi

log = logging.getLogger("cedana.node")


@dataclass(frozen=True)
class Selectors:
    namespace: str
    helper: str  # label selectors of this release's pods
    health: str


class TaintController:
    def __init__(self, api: NodeApi, node: str, selectors: Selectors) -> None:
        self.api = api
        self.node = node
        self.selectors = selectors
        self.last: taint.Decision | None = None  # for the agent's API

    def pods(self) -> list[taint.PodState]:
        found: list[taint.PodState] = []
        for role, selector in (
            ("helper", self.selectors.helper),
            ("health", self.selectors.health),
        ):
            for pod in self.api.list_pods(self.selectors.namespace, self.node, selector):
                found.append(taint.pod_state(pod, role))  # type: ignore[arg-type]
        return found

    def reconcile(self, local: taint.Local, *, uninstalling: bool = False) -> taint.Decision:
        """Make the node's taint and label match the decision; retried on conflicts."""
        for attempt in range(5):
            node = self.api.get_node(self.node)
            pods = self.pods() if local.installed and not uninstalling else []
            decision = taint.decide(pods, local, uninstalling=uninstalling)
            patch = taint.node_patch(node, decision)
            self.last = decision
            if patch is None:
                return decision
            try:
                self.api.patch_node(self.node, patch)
            except Conflict:
                time.sleep(0.05 * (attempt + 1))
                continue
            verb = "tainted" if decision.tainted else "untainted"
            log.info("node %s %s: %s", self.node, verb, "; ".join(decision.reasons) or "ready")
            return decision
        raise KubeError(f"node {self.node} kept changing under the patch (5 conflicts)")


class Stop:
    """Set by SIGTERM/SIGINT; the loop's sleeps wake up on it."""

    def __init__(self) -> None:
        self.event = threading.Event()

    def install_handlers(self) -> None:
        def handler(signum: int, frame: FrameType | None) -> None:
            self.event.set()

        signal.signal(signal.SIGTERM, handler)
        signal.signal(signal.SIGINT, handler)

    def wait(self, seconds: float) -> bool:
        return self.event.wait(seconds)


def run_loop(
    controller: TaintController,
    install: Callable[[], bool],
    handler_ok: Callable[[], bool],
    *,
    interval: float,
    reinstall_interval: float,
    stop: Stop,
    max_rounds: int | None = None,
    chores: tuple[Callable[[], object], ...] = (),
) -> int:
    """The helper's life; returns when ``stop`` is set (or after ``max_rounds``).
    ``chores`` run once a round, after the taint (they log their own failures)."""
    local = taint.Local(installed=False, handler_ok=False)
    _reconcile(controller, local)
    next_install = time.monotonic()
    failures = 0
    rounds = 0
    while not stop.event.is_set():
        now = time.monotonic()
        if now >= next_install:
            ok = install()
            failures = 0 if ok else failures + 1
            # A failing install (no CRIU, a broken config) is retried, more slowly
            # each time, up to every 5 minutes: it will not fix itself every 10 s.
            delay = reinstall_interval if ok else min(300.0, interval * 2 ** min(failures, 5))
            next_install = now + delay
            local = taint.Local(installed=ok, handler_ok=ok)
        elif local.installed:
            local = taint.Local(installed=True, handler_ok=handler_ok())
        _reconcile(controller, local)
        if local.installed:
            for chore in chores:
                chore()
        rounds += 1
        if max_rounds is not None and rounds >= max_rounds:
            break
        stop.wait(interval)
    return 0


def in_background(
    chore: Callable[[], object], *, interval: float, stop: Stop, name: str
) -> threading.Thread:
    """Run ``chore`` every ``interval`` in a thread of its own until ``stop``, whatever
    the install's state (the shims installed earlier still report what they do). An
    unexpected failure is logged and the next round runs as usual."""

    def loop() -> None:
        while not stop.event.is_set():
            try:
                chore()
            except Exception:
                log.exception("%s failed; retrying next round", name)
            stop.wait(interval)

    thread = threading.Thread(target=loop, name=name, daemon=True)
    thread.start()
    return thread


def _reconcile(controller: TaintController, local: taint.Local) -> None:
    try:
        controller.reconcile(local)
    except KubeError as err:
        # The API server being away must not kill the helper: the next round retries.
        log.warning("taint reconcile failed: %s", err)
