"""A push's in-flight marker, kept fresh while the push runs and removed when it ends.

The pushing node is another machine than the one whose start waits for it, so "its
pusher is alive" is something the marker itself says: :class:`MarkerHeartbeat` puts
the marker again every ``HEARTBEAT_S`` with the time in ``cedana.ai/push.heartbeat``
(manifest.py), deleting the previous manifest each time (a tag moved off it: it would
linger in the registry untagged). A node waits only for a marker refreshed within
``MARKER_FRESH_S`` (and not dated in the future): a pusher that crashed, hung or lost
the registry stops refreshing, and its marker stops delaying anyone soon after.
When the push ends, done or failed, the marker goes: a failed push's marker delays
nobody (a registry that refuses deletes keeps it; it goes stale all the same).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable
from concurrent.futures import Future
from datetime import UTC, datetime

from cedana_shim import errors

from .manifest import HEARTBEAT_S, MARKER_FRESH_S

__all__ = ["MarkerHeartbeat"]

log = logging.getLogger(__name__)


class MarkerHeartbeat:
    """Refreshes the marker ``first`` put (its digest, once put) until closed.

    ``put(now)`` puts the marker again, beating at ``now``, and returns its digest;
    ``delete(digest)`` deletes a manifest (logging, never raising). Closing stops the
    beats and deletes the marker; use it as a context manager around the push.
    """

    def __init__(
        self,
        first: Future[str],
        put: Callable[[datetime], str],
        delete: Callable[[str], object],
        what: str,
        *,
        interval: float = HEARTBEAT_S,
    ) -> None:
        self._first = first
        self._put = put
        self._delete = delete
        self._what = what
        self._interval = interval
        self._digest = ""
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cedana-marker", daemon=True)
        self._thread.start()

    def __enter__(self) -> MarkerHeartbeat:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        """No more beats; the marker deleted (after the put in flight, if any)."""
        self._stop.set()
        self._thread.join()
        if self._digest:
            self._delete(self._digest)
            self._digest = ""

    def _run(self) -> None:
        try:
            self._digest = self._first.result()
        except BaseException:  # no marker: the push fails on that error itself
            return
        warned = False
        while not self._stop.wait(self._interval):
            try:
                digest = self._put(datetime.now(UTC))
            except (errors.ShimError, OSError) as err:
                if not warned:  # tried again at the next beat
                    warned = True
                    log.warning(
                        "%s: cannot refresh the in-flight marker (%s); other nodes stop "
                        "waiting for this push %gs after its last refresh",
                        self._what,
                        err,
                        MARKER_FRESH_S,
                    )
                continue
            previous, self._digest = self._digest, digest
            if previous != digest:
                self._delete(previous)
