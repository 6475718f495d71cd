"""Exception <-> google.rpc.Status mapping, table-driven over every class in errors.py."""

from __future__ import annotations

import inspect

import pytest
from cedana_shim import errors
from cedana_shim.api.google_rpc.status_pb2 import Status
from cedana_shim.errors import Code, ShimError
from cedana_shim.ttrpc.status import ERROR_CLASSES, error_from_status, status_from_exception

# The expected code is written out, not read from cls.code, so a class that changes its
# code fails here instead of silently changing what containerd sees.
TABLE: list[tuple[type[ShimError], Code]] = [
    (errors.Cancelled, Code.CANCELLED),
    (errors.Unknown, Code.UNKNOWN),
    (errors.InvalidArgument, Code.INVALID_ARGUMENT),
    (errors.DeadlineExceeded, Code.DEADLINE_EXCEEDED),
    (errors.NotFound, Code.NOT_FOUND),
    (errors.AlreadyExists, Code.ALREADY_EXISTS),
    (errors.PermissionDenied, Code.PERMISSION_DENIED),
    (errors.ResourceExhausted, Code.RESOURCE_EXHAUSTED),
    (errors.FailedPrecondition, Code.FAILED_PRECONDITION),
    (errors.Aborted, Code.ABORTED),
    (errors.Unimplemented, Code.UNIMPLEMENTED),
    (errors.Internal, Code.INTERNAL),
    (errors.Unavailable, Code.UNAVAILABLE),
    (errors.DataLoss, Code.DATA_LOSS),
]


def test_table_covers_every_class_in_errors_py() -> None:
    defined = {
        cls
        for _, cls in inspect.getmembers(errors, inspect.isclass)
        if issubclass(cls, ShimError) and cls is not ShimError and cls.__module__ == errors.__name__
    }
    assert defined == {cls for cls, _ in TABLE}
    assert set(ERROR_CLASSES.values()) == defined
    assert len(ERROR_CLASSES) == len(defined), "two classes share a code"


@pytest.mark.parametrize(("cls", "code"), TABLE, ids=[c.__name__ for c, _ in TABLE])
def test_class_to_status_and_back(cls: type[ShimError], code: Code) -> None:
    status = status_from_exception(cls("container abc not found"))
    assert status.code == code
    assert status.message == "container abc not found"
    assert not status.details

    err = error_from_status(status)
    assert type(err) is cls
    assert str(err) == "container abc not found"
    assert err.code == code


def test_chained_cause_does_not_change_the_status() -> None:
    try:
        try:
            raise ProcessLookupError(3, "No such process")
        except ProcessLookupError as cause:
            raise errors.NotFound("process already finished") from cause
    except errors.NotFound as exc:
        status = status_from_exception(exc)
    assert (status.code, status.message) == (Code.NOT_FOUND, "process already finished")


def test_subclass_from_another_layer_keeps_its_base_code() -> None:
    class RuncError(errors.Internal):
        pass

    status = status_from_exception(RuncError("runc create failed"))
    assert status.code == Code.INTERNAL
    assert type(error_from_status(status)) is errors.Internal


@pytest.mark.parametrize(
    ("exc", "message"),
    [
        (RuntimeError("boom"), "boom"),
        (KeyError("pid"), "'pid'"),
        (TimeoutError(), "TimeoutError"),
        (ValueError(), "ValueError"),
    ],
)
def test_anything_else_is_unknown(exc: Exception, message: str) -> None:
    status = status_from_exception(exc)
    assert status.code == Code.UNKNOWN
    assert status.message == message


def test_empty_shim_error_message_names_the_class() -> None:
    status = status_from_exception(errors.NotFound())
    assert (status.code, status.message) == (Code.NOT_FOUND, "NotFound")


@pytest.mark.parametrize("code", [Code.OUT_OF_RANGE, Code.UNAUTHENTICATED])
def test_code_without_a_class_survives_a_relay(code: Code) -> None:
    err = error_from_status(Status(code=code, message="m"))
    assert type(err) is ShimError
    assert err.code == code
    assert ShimError.code == Code.UNKNOWN, "the class default must not be touched"
    assert status_from_exception(err).code == code


def test_code_outside_the_enum_is_unknown() -> None:
    err = error_from_status(Status(code=99, message="odd"))
    assert type(err) is errors.Unknown
    assert "99" in str(err)
    assert "odd" in str(err)


def test_ok_is_not_an_error() -> None:
    with pytest.raises(ValueError):
        error_from_status(Status())
