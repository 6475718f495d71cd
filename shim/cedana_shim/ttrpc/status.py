"""The one place where exceptions become ttrpc statuses, and statuses become exceptions.

Like containerd's ``errgrpc.ToGRPC``/``ToNative``: a :class:`~cedana_shim.errors.ShimError`
carries its code, anything else is UNKNOWN (the server logs its traceback). Clients map
a status back to the matching class so callers can ``except errors.NotFound``.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Final

from cedana_shim import errors
from cedana_shim.api.google_rpc.status_pb2 import Status
from cedana_shim.errors import Code, ShimError

__all__ = ["ERROR_CLASSES", "error_from_status", "status_from_exception"]

# Explicit rather than discovered via __subclasses__(): subclasses defined in other layers
# (say a RuncError(Internal)) must not take over a code. A unit test checks that every
# class in errors.py appears here.
ERROR_CLASSES: Final[Mapping[Code, type[ShimError]]] = {
    cls.code: cls
    for cls in (
        errors.Cancelled,
        errors.Unknown,
        errors.InvalidArgument,
        errors.DeadlineExceeded,
        errors.NotFound,
        errors.AlreadyExists,
        errors.PermissionDenied,
        errors.ResourceExhausted,
        errors.FailedPrecondition,
        errors.Aborted,
        errors.Unimplemented,
        errors.Internal,
        errors.Unavailable,
        errors.DataLoss,
    )
}


def status_from_exception(exc: BaseException) -> Status:
    """The status to send for ``exc``. Non-:class:`ShimError` exceptions become UNKNOWN."""
    message = str(exc) or type(exc).__name__
    if isinstance(exc, ShimError):
        return Status(code=int(exc.code), message=message)
    return Status(code=int(Code.UNKNOWN), message=message)


def error_from_status(status: Status) -> ShimError:
    """The exception a client raises for a non-OK ``status``.

    A valid code without its own class in errors.py (OUT_OF_RANGE, UNAUTHENTICATED)
    becomes a plain :class:`ShimError` that still carries the code, so that relaying
    the error with :func:`status_from_exception` keeps it.
    """
    try:
        code = Code(status.code)
    except ValueError:
        return errors.Unknown(f"unknown status code {status.code}: {status.message}")
    if code is Code.OK:
        raise ValueError("an OK status is not an error")
    cls = ERROR_CLASSES.get(code)
    if cls is not None:
        return cls(status.message)
    err = ShimError(status.message)
    err.code = code
    return err
