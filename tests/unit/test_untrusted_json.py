"""untrusted_json: the depth bound, and that it changes nothing else."""

from __future__ import annotations

import json
import sys
from typing import Any

import pytest
from cedana_shim.untrusted_json import MAX_DEPTH, loads, nested_too_deep
from hypothesis import given
from hypothesis import strategies as st

SCALARS = st.none() | st.booleans() | st.integers() | st.text(alphabet=st.characters(), max_size=8)
VALUES = st.recursive(
    SCALARS,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3)
    ),
    max_leaves=40,
)


def _depth(value: Any) -> int:
    if isinstance(value, list):
        return 1 + max(map(_depth, value), default=0)
    if isinstance(value, dict):
        return 1 + max(map(_depth, value.values()), default=0)
    return 0


def _nest(value: Any, levels: int, use_dict: bool) -> Any:
    for _ in range(levels):
        value = {"[{": value} if use_dict else [value, "]}"]
    return value


@given(VALUES, st.integers(0, MAX_DEPTH + 3), st.booleans(), st.booleans())
def test_the_bound_is_the_real_nesting_depth(
    value: Any, levels: int, use_dict: bool, as_bytes: bool
) -> None:
    document = _nest(value, levels, use_dict)
    text = json.dumps(document, ensure_ascii=False)
    data: str | bytes = text.encode() if as_bytes else text
    deep = _depth(document) > MAX_DEPTH
    assert nested_too_deep(data) is deep
    if deep:
        with pytest.raises(ValueError, match=f"nested more than {MAX_DEPTH} levels deep"):
            loads(data)
    else:
        assert loads(data) == document


@pytest.mark.parametrize(
    "data",
    [
        b"[" * 50_000,
        "[" * 50_000,
        b'{"a":' * 10_000,
        b"[" * (MAX_DEPTH + 1) + b"]" * (MAX_DEPTH + 1),
    ],
)
def test_a_deep_document_is_refused(data: str | bytes) -> None:
    with pytest.raises(ValueError, match="levels deep"):
        loads(data)


def test_brackets_in_strings_and_escapes_do_not_count() -> None:
    document = ['\\"' + "[" * 500, {"{" * 500: '"]'}]
    assert loads(json.dumps(document).encode()) == document


def test_deep_input_is_refused_without_recursing() -> None:
    """The reason for the module: the refusal must not take the parser near the
    recursion limit, where finalizers the garbage collector runs would fail."""
    headroom = MAX_DEPTH + 40
    outcome: list[object] = []

    def at_depth(frames: int) -> None:
        if frames > 0:
            at_depth(frames - 1)
            return
        with pytest.raises(RecursionError):
            json.loads(b"[" * 50_000)  # what the stdlib alone would do here
        with pytest.raises(ValueError, match="levels deep"):
            loads(b"[" * 50_000)
        outcome.append(loads(b"[" * MAX_DEPTH + b"]" * MAX_DEPTH))

    frame, used = sys._getframe(), 0
    while frame is not None:
        frame, used = frame.f_back, used + 1  # type: ignore[assignment]
    at_depth(sys.getrecursionlimit() - used - headroom)
    expected: list[Any] = []
    for _ in range(MAX_DEPTH - 1):
        expected = [expected]
    assert outcome == [expected]
