"""The outbox of pending pushes: durable records, one pusher per record, sync's report."""

from __future__ import annotations

import json
import logging
import os
import stat
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from cedana_shim.checkpoint.remote import Outbox, RemoteStore, sync
from cedana_shim.checkpoint.store import Store
from cedana_shim.errors import InvalidArgument
from cedana_shim.registry import RegistryClient, RegistryConfig
from store_support import make_store, stage


def _unreachable(store: Store) -> RemoteStore:
    """A registry nobody listens for: every push fails, fast."""
    config = RegistryConfig(registry="127.0.0.1:9/cedana", insecure=True, timeout=2)
    return RemoteStore(store, RegistryClient(config), "node-a")


@pytest.fixture
def store(tmp_path: Path) -> Store:
    return make_store(tmp_path)


def test_a_record_is_private_durable_and_listed_oldest_first(store: Store) -> None:
    outbox = Outbox(store.root)
    assert outbox.pending() == []
    ids = ["20261129T183001Z-00000002", "20261129T183000Z-00000001"]
    for checkpoint_id in ids:
        outbox.add(checkpoint_id)
    outbox.add(ids[0])  # twice: harmless
    assert outbox.pending() == sorted(ids)
    record = Path(store.root, "outbox", ids[0])
    assert stat.S_IMODE(record.stat().st_mode) == 0o600
    assert stat.S_IMODE(record.parent.stat().st_mode) == 0o700
    assert json.loads(record.read_bytes())["id"] == ids[0]
    # Something else in the directory is not a pending push.
    Path(store.root, "outbox", "uploads").mkdir()
    Path(store.root, "outbox", "notes.txt").write_text("x")
    assert Outbox(store.root).pending() == sorted(ids)
    outbox.done(ids[0])
    outbox.done(ids[0])  # idempotent
    assert outbox.pending() == [ids[1]]


def test_a_record_survives_its_writer_being_killed(store: Store) -> None:
    code = f"""
        import os, signal
        from cedana_shim.checkpoint.remote import Outbox
        Outbox({store.root!r}).add("20261129T183000Z-00000001")
        os.kill(os.getpid(), signal.SIGKILL)
    """
    child = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], check=False)
    assert child.returncode == -9
    assert Outbox(store.root).pending() == ["20261129T183000Z-00000001"]


@pytest.mark.parametrize("bad", ["", "../x", "latest", "20261129T183000Z-0000000g"])
def test_only_checkpoint_ids_are_recorded(store: Store, bad: str) -> None:
    with pytest.raises(InvalidArgument):
        Outbox(store.root).add(bad)


def test_sync_leaves_a_push_another_process_holds_and_reports_failures(store: Store) -> None:
    held = store.commit(stage(store, "held"))
    failing = store.commit(stage(store, "failing"))
    outbox = Outbox(store.root)
    outbox.add(held.id)
    outbox.add(failing.id)
    code = f"""
        import sys
        from cedana_shim.checkpoint.remote import Outbox
        with Outbox({store.root!r}).claimed({held.id!r}) as claimed:
            print(claimed, flush=True)
            sys.stdin.read()
    """
    holder = subprocess.Popen(
        [sys.executable, "-c", textwrap.dedent(code)],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "True\n"
        result = sync(_unreachable(store), outbox)
    finally:
        assert holder.stdin is not None
        holder.stdin.close()
        holder.wait(timeout=30)
    assert result.busy == [held.id] and result.pushed == []
    assert [cid for cid, _ in result.failed] == [failing.id]
    assert "127.0.0.1:9" in result.failed[0][1]
    assert sorted(outbox.pending()) == sorted([held.id, failing.id])
    only = sync(_unreachable(store), outbox, only=[held.id])
    assert [cid for cid, _ in only.failed] == [held.id] and only.busy == []


def test_a_checkpoint_gone_from_the_store_is_dropped_with_a_warning(
    store: Store, caplog: pytest.LogCaptureFixture
) -> None:
    entry = store.commit(stage(store, "gone"))
    outbox = Outbox(store.root)
    outbox.add(entry.id)
    store.maintenance.remove(entry.id)
    with caplog.at_level(logging.WARNING):
        result = sync(_unreachable(store), outbox)
    assert result.pushed == [] and result.failed == [] and result.busy == []
    assert outbox.pending() == []
    assert "dropping a pending push" in caplog.text and entry.id in caplog.text


def test_a_record_done_while_sync_waited_is_not_pushed_again(store: Store) -> None:
    outbox = Outbox(store.root)
    outbox.add("20261129T183000Z-00000001")
    with outbox.claimed("20261129T183000Z-00000001") as claimed:
        assert claimed is True
        os.unlink(os.path.join(store.root, "outbox", "20261129T183000Z-00000001"))
    with outbox.claimed("20261129T183000Z-00000001") as claimed:
        assert claimed is None


def test_a_checkpoint_whose_namespace_names_no_repository_fails_to_push(
    store: Store,
) -> None:
    entry = store.commit(stage(store, "app", scope="k8s.io"))
    outbox = Outbox(store.root)
    outbox.add(entry.id)
    result = sync(_unreachable(store), outbox)
    ((failed, why),) = result.failed
    assert failed == entry.id
    assert why.startswith(f"checkpoint {entry.id} (k8s.io/app) cannot be pushed to registry")
    assert "DNS-1123" in why
