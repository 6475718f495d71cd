"""Error classes shared by every layer, mirroring containerd's errdefs.

Lower layers raise these (chaining the cause with ``raise ... from err``); the
ttrpc boundary maps each class to its status code in exactly one place
(:func:`cedana_shim.ttrpc.status.status_from_exception`). Anything that is not a
:class:`ShimError` leaves the shim as UNKNOWN and is logged with its traceback.
"""

from __future__ import annotations

from enum import IntEnum


class Code(IntEnum):
    """gRPC / ttrpc status codes (google.rpc.Code)."""

    OK = 0
    CANCELLED = 1
    UNKNOWN = 2
    INVALID_ARGUMENT = 3
    DEADLINE_EXCEEDED = 4
    NOT_FOUND = 5
    ALREADY_EXISTS = 6
    PERMISSION_DENIED = 7
    RESOURCE_EXHAUSTED = 8
    FAILED_PRECONDITION = 9
    ABORTED = 10
    OUT_OF_RANGE = 11
    UNIMPLEMENTED = 12
    INTERNAL = 13
    UNAVAILABLE = 14
    DATA_LOSS = 15
    UNAUTHENTICATED = 16


class ShimError(Exception):
    """Base class: an error whose class decides the status code."""

    code: Code = Code.UNKNOWN


class Cancelled(ShimError):
    code = Code.CANCELLED


class Unknown(ShimError):
    code = Code.UNKNOWN


class InvalidArgument(ShimError):
    code = Code.INVALID_ARGUMENT


class DeadlineExceeded(ShimError):
    code = Code.DEADLINE_EXCEEDED


class NotFound(ShimError):
    code = Code.NOT_FOUND


class AlreadyExists(ShimError):
    code = Code.ALREADY_EXISTS


class PermissionDenied(ShimError):
    code = Code.PERMISSION_DENIED


class ResourceExhausted(ShimError):
    code = Code.RESOURCE_EXHAUSTED


class FailedPrecondition(ShimError):
    code = Code.FAILED_PRECONDITION


class Aborted(ShimError):
    code = Code.ABORTED


class Unimplemented(ShimError):
    code = Code.UNIMPLEMENTED


class Internal(ShimError):
    code = Code.INTERNAL


class Unavailable(ShimError):
    code = Code.UNAVAILABLE


class DataLoss(ShimError):
    code = Code.DATA_LOSS
