from google.protobuf import descriptor as _descriptor
from google.protobuf import message as _message
from typing import ClassVar as _ClassVar, Optional as _Optional

DESCRIPTOR: _descriptor.FileDescriptor

class PagemapHead(_message.Message):
    __slots__ = ("pages_id",)
    PAGES_ID_FIELD_NUMBER: _ClassVar[int]
    pages_id: int
    def __init__(self, pages_id: _Optional[int] = ...) -> None: ...

class PagemapEntry(_message.Message):
    __slots__ = ("vaddr", "compat_nr_pages", "in_parent", "flags", "nr_pages")
    VADDR_FIELD_NUMBER: _ClassVar[int]
    COMPAT_NR_PAGES_FIELD_NUMBER: _ClassVar[int]
    IN_PARENT_FIELD_NUMBER: _ClassVar[int]
    FLAGS_FIELD_NUMBER: _ClassVar[int]
    NR_PAGES_FIELD_NUMBER: _ClassVar[int]
    vaddr: int
    compat_nr_pages: int
    in_parent: bool
    flags: int
    nr_pages: int
    def __init__(self, vaddr: _Optional[int] = ..., compat_nr_pages: _Optional[int] = ..., in_parent: _Optional[bool] = ..., flags: _Optional[int] = ..., nr_pages: _Optional[int] = ...) -> None: ...
