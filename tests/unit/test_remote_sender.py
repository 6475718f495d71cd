"""BlobSender: the blobs of one push go out as they are offered, after the marker, and
the first failure stops the rest without ever blocking whoever offers."""

from __future__ import annotations

import io
import threading
import time
from typing import IO, Any, cast

import pytest
from cedana_shim import errors
from cedana_shim.checkpoint.remote.sender import UPLOAD_WORKERS, BlobSender
from cedana_shim.registry import PushResult, RegistryClient


class FakeClient:
    """Records push_blob calls; fails the digests in ``fail``; holds each push until
    ``gate`` is set."""

    def __init__(self, fail: set[str] | None = None) -> None:
        self.pushed: list[str] = []
        self.fail = fail or set()
        self.gate = threading.Event()
        self.gate.set()
        self.lock = threading.Lock()

    def push_blob(self, repo: str, digest: str, size: int, open_at: Any, progress: Any) -> Any:
        self.gate.wait(10)
        if digest in self.fail:
            raise errors.Unavailable(f"registry down for {digest}")
        with open_at(0) as stream:
            assert stream.read() == b"x" * size
        progress(size)
        with self.lock:
            self.pushed.append(digest)
        return PushResult(existed=False, resumed_from=0, sent=size)


def _source(size: int) -> Any:
    def open_at(offset: int) -> IO[bytes]:
        stream = io.BytesIO(b"x" * size)
        stream.seek(offset)
        return stream

    return open_at


def _sender(client: FakeClient, progress: Any = None) -> BlobSender:
    return BlobSender(cast(RegistryClient, client), "cedana/ns", "checkpoint c1", progress)


def test_blobs_go_after_the_marker_and_the_rest_at_finish() -> None:
    client = FakeClient()
    seen: list[tuple[int, int]] = []
    marker_done = threading.Event()
    with _sender(client, lambda done, total: seen.append((done, total))) as sender:
        order: list[str] = []

        def marker() -> str:
            time.sleep(0.2)  # a slow registry: offers queue meanwhile
            order.append("marker")
            marker_done.set()
            return "sha256:marker"

        first = sender.first(marker)
        began = time.monotonic()
        sender.offer("sha256:a", 3, _source(3))
        sender.offer("sha256:a", 3, _source(3))  # once per digest
        assert time.monotonic() - began < 0.1  # offering never waits
        sender.finish({"sha256:a": 3, "sha256:b": 5}, lambda d: _source(5))
    assert first.result() == "sha256:marker" and order == ["marker"]
    assert sorted(client.pushed) == ["sha256:a", "sha256:b"]
    assert seen[-1] == (8, 8)


def test_the_first_failure_stops_the_rest_and_is_raised_at_finish() -> None:
    client = FakeClient(fail={"sha256:a"})
    with _sender(client) as sender:
        sender.first(lambda: "sha256:marker")
        sender.offer("sha256:a", 1, _source(1))
        time.sleep(0.2)
        sender.offer("sha256:b", 1, _source(1))  # after the failure: not sent
        with pytest.raises(errors.Unavailable, match="registry down"):
            sender.finish({"sha256:a": 1, "sha256:b": 1, "sha256:c": 1}, lambda d: _source(1))
    assert client.pushed == []


def test_a_failed_marker_sends_no_blob() -> None:
    client = FakeClient()

    def marker() -> str:
        raise errors.Unavailable("cannot connect")

    with _sender(client) as sender:
        sender.first(marker)
        sender.offer("sha256:a", 1, _source(1))
        with pytest.raises(errors.Unavailable, match="cannot connect"):
            sender.finish({"sha256:a": 1}, lambda d: _source(1))
    assert client.pushed == []


def test_a_hung_registry_never_blocks_the_offers() -> None:
    client = FakeClient()
    client.gate.clear()  # every upload hangs
    sender = _sender(client)
    sender.first(lambda: "sha256:marker")
    began = time.monotonic()
    for i in range(50):
        sender.offer(f"sha256:{i:064x}", 1, _source(1))
    assert time.monotonic() - began < 0.5
    # Released only once close has begun: released before, the workers could drain the
    # whole queue while the test thread waits for a CPU.
    threading.Timer(0.3, client.gate.set).start()
    sender.close()  # what was queued is skipped; the uploads in flight finish
    assert len(client.pushed) <= UPLOAD_WORKERS
