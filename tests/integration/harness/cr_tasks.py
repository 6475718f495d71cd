"""containerd's Tasks.Kill over gRPC: what `ctr task kill -s SIG <id>` sends, without
spawning ctr, so a signal lands within milliseconds of the moment a test picked (a dump
in progress lasts a few hundred ms).

From api/services/tasks/v1/tasks.proto:

    message KillRequest {
        string container_id = 1;
        string exec_id = 2;
        uint32 signal = 3;
        bool all = 4;
    }
"""

# grpcio ships no type stubs.
# mypy: disable-error-code="import-untyped"

from __future__ import annotations

from pathlib import Path

import grpc
from cedana_shim.wire import bytes_field, varint_field


def encode_kill_request(container_id: str, signal: int, *, all_processes: bool = False) -> bytes:
    return (
        bytes_field(1, container_id.encode())
        + varint_field(3, signal)
        + varint_field(4, int(all_processes))
    )


class TaskKiller:
    """A connected Tasks client: `kill()` costs one RPC round-trip."""

    def __init__(self, socket: Path, namespace: str) -> None:
        self._channel = grpc.insecure_channel(f"unix://{socket}")
        self._namespace = namespace
        self._kill = self._channel.unary_unary(
            "/containerd.services.tasks.v1.Tasks/Kill",
            request_serializer=lambda b: b,
            response_deserializer=lambda b: b,
        )
        grpc.channel_ready_future(self._channel).result(timeout=10)

    def kill(self, container_id: str, signal: int, *, timeout: float = 30) -> None:
        self._kill(
            encode_kill_request(container_id, signal),
            metadata=[("containerd-namespace", self._namespace)],
            timeout=timeout,
        )

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> TaskKiller:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
