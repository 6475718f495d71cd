from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class CheckpointRequest(_message.Message):
    __slots__ = ("container_id", "leave_running")
    CONTAINER_ID_FIELD_NUMBER: _ClassVar[int]
    LEAVE_RUNNING_FIELD_NUMBER: _ClassVar[int]
    container_id: str
    leave_running: bool
    def __init__(self, container_id: _Optional[str] = ..., leave_running: _Optional[bool] = ...) -> None: ...

class CheckpointResponse(_message.Message):
    __slots__ = ("checkpoint_id", "label", "scope", "size")
    CHECKPOINT_ID_FIELD_NUMBER: _ClassVar[int]
    LABEL_FIELD_NUMBER: _ClassVar[int]
    SCOPE_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    checkpoint_id: str
    label: str
    scope: str
    size: int
    def __init__(self, checkpoint_id: _Optional[str] = ..., label: _Optional[str] = ..., scope: _Optional[str] = ..., size: _Optional[int] = ...) -> None: ...

class CheckpointCommitted(_message.Message):
    __slots__ = ("container_id", "checkpoint_id", "scope", "label", "reason", "size")
    CONTAINER_ID_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_ID_FIELD_NUMBER: _ClassVar[int]
    SCOPE_FIELD_NUMBER: _ClassVar[int]
    LABEL_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    SIZE_FIELD_NUMBER: _ClassVar[int]
    container_id: str
    checkpoint_id: str
    scope: str
    label: str
    reason: str
    size: int
    def __init__(self, container_id: _Optional[str] = ..., checkpoint_id: _Optional[str] = ..., scope: _Optional[str] = ..., label: _Optional[str] = ..., reason: _Optional[str] = ..., size: _Optional[int] = ...) -> None: ...

class CheckpointFailed(_message.Message):
    __slots__ = ("container_id", "scope", "label", "reason", "error")
    CONTAINER_ID_FIELD_NUMBER: _ClassVar[int]
    SCOPE_FIELD_NUMBER: _ClassVar[int]
    LABEL_FIELD_NUMBER: _ClassVar[int]
    REASON_FIELD_NUMBER: _ClassVar[int]
    ERROR_FIELD_NUMBER: _ClassVar[int]
    container_id: str
    scope: str
    label: str
    reason: str
    error: str
    def __init__(self, container_id: _Optional[str] = ..., scope: _Optional[str] = ..., label: _Optional[str] = ..., reason: _Optional[str] = ..., error: _Optional[str] = ...) -> None: ...

class RestoreOutcome(_message.Message):
    __slots__ = ("container_id", "scope", "label", "checkpoint_id", "outcome", "detail")
    CONTAINER_ID_FIELD_NUMBER: _ClassVar[int]
    SCOPE_FIELD_NUMBER: _ClassVar[int]
    LABEL_FIELD_NUMBER: _ClassVar[int]
    CHECKPOINT_ID_FIELD_NUMBER: _ClassVar[int]
    OUTCOME_FIELD_NUMBER: _ClassVar[int]
    DETAIL_FIELD_NUMBER: _ClassVar[int]
    container_id: str
    scope: str
    label: str
    checkpoint_id: str
    outcome: str
    detail: str
    def __init__(self, container_id: _Optional[str] = ..., scope: _Optional[str] = ..., label: _Optional[str] = ..., checkpoint_id: _Optional[str] = ..., outcome: _Optional[str] = ..., detail: _Optional[str] = ...) -> None: ...
