"""The ttrpc client against containerd's own ttrpc server (starts a containerd: root)."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import tempfile
import time

import pytest
from cedana_shim import errors
from cedana_shim.api.containerd.events.task_pb2 import TaskExit
from cedana_shim.api.containerd.services.ttrpc_events_pb2 import Envelope, ForwardRequest
from cedana_shim.ttrpc.client import Client
from google.protobuf.any_pb2 import Any as AnyPb
from google.protobuf.empty_pb2 import Empty
from google.protobuf.timestamp_pb2 import Timestamp


def test_forward_event_to_real_containerd() -> None:
    assert shutil.which("containerd"), (
        "containerd is not installed (run scripts/setup-node-deps.sh)"
    )
    directory = tempfile.mkdtemp(prefix="ttrpc-ctd-", dir="/tmp")
    address = os.path.join(directory, "c.sock")
    config = os.path.join(directory, "config.toml")
    with open(config, "w") as f:
        f.write(
            f'version = 2\nroot = "{directory}/root"\nstate = "{directory}/state"\n'
            'disabled_plugins = ["io.containerd.grpc.v1.cri"]\n'
            f'[grpc]\n  address = "{address}"\n'
        )
    log = open(os.path.join(directory, "log"), "w")  # noqa: SIM115
    daemon = subprocess.Popen(["containerd", "--config", config], stdout=log, stderr=log)
    events = None
    try:
        deadline = time.monotonic() + 10
        while not os.path.exists(address + ".ttrpc"):
            assert daemon.poll() is None, "containerd exited; see " + log.name
            assert time.monotonic() < deadline, "containerd did not start"
            time.sleep(0.02)
        events = subprocess.Popen(
            ["ctr", "--address", address, "events"], stdout=subprocess.PIPE, text=True
        )
        time.sleep(0.3)  # let the subscription register

        exit_event = TaskExit(container_id="c1", id="c1", pid=42, exit_status=7)
        envelope = Envelope(
            timestamp=Timestamp(seconds=int(time.time())),
            namespace="default",
            topic="/tasks/exit",
            event=AnyPb(
                type_url="containerd.events.TaskExit", value=exit_event.SerializeToString()
            ),
        )

        async def main() -> None:
            async with await Client.connect("unix://" + address + ".ttrpc") as client:
                service = "containerd.services.events.ttrpc.v1.Events"
                meta = {"containerd-namespace-ttrpc": "default"}
                reply = await client.call(
                    service,
                    "Forward",
                    ForwardRequest(envelope=envelope),
                    Empty,
                    timeout=5,
                    metadata=meta,
                )
                assert reply == Empty()
                bad = Envelope()
                bad.CopyFrom(envelope)
                bad.ClearField("timestamp")
                # containerd's validateEnvelope wraps ErrInvalidArgument.
                with pytest.raises(errors.InvalidArgument, match="timestamp"):
                    await client.call(service, "Forward", ForwardRequest(envelope=bad), Empty)
                with pytest.raises(errors.Unimplemented):
                    await client.call(service, "Nope", Empty(), Empty)

        asyncio.run(asyncio.wait_for(main(), 10))
        time.sleep(0.3)
        events.terminate()
        out, _ = events.communicate(timeout=5)
        assert "/tasks/exit" in out and "c1" in out
    finally:
        if events is not None and events.poll() is None:
            events.kill()
            events.wait()
        daemon.terminate()
        daemon.wait(timeout=10)
        log.close()
        shutil.rmtree(directory, ignore_errors=True)
