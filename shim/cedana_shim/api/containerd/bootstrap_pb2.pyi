from google.protobuf import any_pb2 as _any_pb2
from google.protobuf.internal import containers as _containers
from google.protobuf.internal import enum_type_wrapper as _enum_type_wrapper
from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from collections.abc import Iterable as _Iterable, Mapping as _Mapping
from typing import ClassVar as _ClassVar, Optional as _Optional, Union as _Union

DESCRIPTOR: _descriptor.FileDescriptor

class LogLevel(int, metaclass=_enum_type_wrapper.EnumTypeWrapper):
    __slots__ = ()
    INFO: _ClassVar[LogLevel]
    TRACE: _ClassVar[LogLevel]
    DEBUG: _ClassVar[LogLevel]
    WARN: _ClassVar[LogLevel]
    ERROR: _ClassVar[LogLevel]
    FATAL: _ClassVar[LogLevel]
    PANIC: _ClassVar[LogLevel]
INFO: LogLevel
TRACE: LogLevel
DEBUG: LogLevel
WARN: LogLevel
ERROR: LogLevel
FATAL: LogLevel
PANIC: LogLevel

class Extension(_message.Message):
    __slots__ = ("value",)
    VALUE_FIELD_NUMBER: _ClassVar[int]
    value: _any_pb2.Any
    def __init__(self, value: _Optional[_Union[_any_pb2.Any, _Mapping]] = ...) -> None: ...

class BootstrapParams(_message.Message):
    __slots__ = ("instance_id", "namespace", "log_level", "containerd_version", "containerd_ttrpc_address", "containerd_grpc_address", "containerd_binary", "extensions", "socket_dir")
    INSTANCE_ID_FIELD_NUMBER: _ClassVar[int]
    NAMESPACE_FIELD_NUMBER: _ClassVar[int]
    LOG_LEVEL_FIELD_NUMBER: _ClassVar[int]
    CONTAINERD_VERSION_FIELD_NUMBER: _ClassVar[int]
    CONTAINERD_TTRPC_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    CONTAINERD_GRPC_ADDRESS_FIELD_NUMBER: _ClassVar[int]
    CONTAINERD_BINARY_FIELD_NUMBER: _ClassVar[int]
    EXTENSIONS_FIELD_NUMBER: _ClassVar[int]
    SOCKET_DIR_FIELD_NUMBER: _ClassVar[int]
    instance_id: str
    namespace: str
    log_level: LogLevel
    containerd_version: str
    containerd_ttrpc_address: str
    containerd_grpc_address: str
    containerd_binary: str
    extensions: _containers.RepeatedCompositeFieldContainer[Extension]
    socket_dir: str
    def __init__(self, instance_id: _Optional[str] = ..., namespace: _Optional[str] = ..., log_level: _Optional[_Union[LogLevel, str]] = ..., containerd_version: _Optional[str] = ..., containerd_ttrpc_address: _Optional[str] = ..., containerd_grpc_address: _Optional[str] = ..., containerd_binary: _Optional[str] = ..., extensions: _Optional[_Iterable[_Union[Extension, _Mapping]]] = ..., socket_dir: _Optional[str] = ...) -> None: ...
