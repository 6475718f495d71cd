import datetime

from google.protobuf import timestamp_pb2 as _timestamp_pb2
from cedana_shim.api.containerd.types import mount_pb2 as _mount_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class TaskCreate(_message.Message):
    __slots__ = ("container_id", "bundle", "rootfs", "io", "checkpoint", "pid")
    CONTAINER_ID_FIELD_NUMBER: _ClassVar[int]
    BUNDLE_FIELD_NUMBER: _ClassVar[int]
    ROOTFS_FIELD_NUMBER: _ClassVar[int]
    IO_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    container_id: str
    bundle: str
    rootfs: _containers.RepeatedCompositeFieldContainer[_mount_pb2.Mount]
    io: TaskIO
    checkpoint: str
    pid: int
    def __init__(self, container_id: _Optional[str] = ..., bundle: _Optional[str] = ..., rootfs: _Optional[_Iterable[_Union[_mount_pb2.Mount, _Mapping]]] = ..., io: _Optional[_Union[TaskIO, _Mapping]] = ..., checkpoint: _Optional[str] = ..., pid: _Optional[int] = ...) -> None: ...

class TaskStart(_message.Message):
    __slots__ = ("container_id", "pid")
    CONTAINER_ID_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    container_id: str
    pid: int
    def __init__(self, container_id: _Optional[str] = ..., pid: _Optional[int] = ...) -> None: ...

class TaskDelete(_message.Message):
    __slots__ = ("container_id", "pid", "exit_status", "exited_at", "id")
    CONTAINER_ID_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    EXIT_STATUS_FIELD_NUMBER: _ClassVar[int]
    EXITED_AT_FIELD_NUMBER: _ClassVar[int]
    ID_FIELD_NUMBER: _ClassVar[int]
    container_id: str
    pid: int
    exit_status: int
    exited_at: _timestamp_pb2.Timestamp
    id: str
    def __init__(self, container_id: _Optional[str] = ..., pid: _Optional[int] = ..., exit_status: _Optional[int] = ..., exited_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ..., id: _Optional[str] = ...) -> None: ...

class TaskIO(_message.Message):
    __slots__ = ("stdin", "stdout", "stderr", "terminal")
    STDIN_FIELD_NUMBER: _ClassVar[int]
    STDOUT_FIELD_NUMBER: _ClassVar[int]
    STDERR_FIELD_NUMBER: _ClassVar[int]
    TERMINAL_FIELD_NUMBER: _ClassVar[int]
    stdin: str
    stdout: str
    stderr: str
    terminal: bool
    def __init__(self, stdin: _Optional[str] = ..., stdout: _Optional[str] = ..., stderr: _Optional[str] = ..., terminal: _Optional[bool] = ...) -> None: ...

class TaskExit(_message.Message):
    __slots__ = ("container_id", "id", "pid", "exit_status", "exited_at")
    CONTAINER_ID_FIELD_NUMBER: _ClassVar[int]
    ID_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    EXIT_STATUS_FIELD_NUMBER: _ClassVar[int]
    EXITED_AT_FIELD_NUMBER: _ClassVar[int]
    container_id: str
    id: str
    pid: int
    exit_status: int
    exited_at: _timestamp_pb2.Timestamp
    def __init__(self, container_id: _Optional[str] = ..., id: _Optional[str] = ..., pid: _Optional[int] = ..., exit_status: _Optional[int] = ..., exited_at: _Optional[_Union[datetime.datetime, _timestamp_pb2.Timestamp, _Mapping]] = ...) -> None: ...

class TaskOOM(_message.Message):
    __slots__ = ("container_id",)
    CONTAINER_ID_FIELD_NUMBER: _ClassVar[int]
    container_id: str
    def __init__(self, container_id: _Optional[str] = ...) -> None: ...

class TaskExecAdded(_message.Message):
    __slots__ = ("container_id", "exec_id")
    CONTAINER_ID_FIELD_NUMBER: _ClassVar[int]
    EXEC_ID_FIELD_NUMBER: _ClassVar[int]
    container_id: str
    exec_id: str
    def __init__(self, container_id: _Optional[str] = ..., exec_id: _Optional[str] = ...) -> None: ...

class TaskExecStarted(_message.Message):
    __slots__ = ("container_id", "exec_id", "pid")
    CONTAINER_ID_FIELD_NUMBER: _ClassVar[int]
    EXEC_ID_FIELD_NUMBER: _ClassVar[int]
    PID_FIELD_NUMBER: _ClassVar[int]
    container_id: str
    exec_id: str
    pid: int
    def __init__(self, container_id: _Optional[str] = ..., exec_id: _Optional[str] = ..., pid: _Optional[int] = ...) -> None: ...

class TaskPaused(_message.Message):
    __slots__ = ("container_id",)
    CONTAINER_ID_FIELD_NUMBER: _ClassVar[int]
    container_id: str
    def __init__(self, container_id: _Optional[str] = ...) -> None: ...

class TaskResumed(_message.Message):
    __slots__ = ("container_id",)
    CONTAINER_ID_FIELD_NUMBER: _ClassVar[int]
    container_id: str
    def __init__(self, container_id: _Optional[str] = ...) -> None: ...

class TaskCheckpointed(_message.Message):
    __slots__ = ("container_id", "checkpoint")
    CONTAINER_ID_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_FIELD_NUMBER: _ClassVar[int]
    container_id: str
    checkpoint: str
    def __init__(self, container_id: _Optional[str] = ..., checkpoint: _Optional[str] = ...) -> None: ...
