"""containerd's Tasks gRPC service, for the one call `ctr` has no command for.

`ctr task update` does not exist in ctr 1.6/1.7/2.1, so the test makes the RPC that
containerd's Go client (`Task.Update(WithResources(...))`) makes. The repo has no
bindings for containerd's services, and UpdateTaskRequest is two fields, so it is
encoded by hand from `api/services/tasks/v1/tasks.proto`:

    message UpdateTaskRequest {
        string container_id = 1;
        google.protobuf.Any resources = 2;
        map<string, string> annotations = 3;
    }
"""

# grpcio ships no type stubs.
# mypy: disable-error-code="import-untyped"

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import grpc
from cedana_shim.wire import bytes_field
from google.protobuf import any_pb2

# How containerd's typeurl registry names OCI spec types; their payload is JSON.
LINUX_RESOURCES_URL = "types.containerd.io/opencontainers/runtime-spec/1/LinuxResources"


def encode_update_task_request(container_id: str, linux_resources: dict[str, Any]) -> bytes:
    resources = any_pb2.Any(
        type_url=LINUX_RESOURCES_URL, value=json.dumps(linux_resources).encode()
    )
    return bytes_field(1, container_id.encode()) + bytes_field(2, resources.SerializeToString())


def update_task(socket: Path, namespace: str, container_id: str, resources: dict[str, Any]) -> None:
    with grpc.insecure_channel(f"unix://{socket}") as channel:
        call = channel.unary_unary(
            "/containerd.services.tasks.v1.Tasks/Update",
            request_serializer=lambda b: b,
            response_deserializer=lambda b: b,
        )
        call(
            encode_update_task_request(container_id, resources),
            metadata=[("containerd-namespace", namespace)],
            timeout=30,
        )
