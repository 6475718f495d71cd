"""untrusted_json: the depth bound, and that it changes nothing else."""

from __future__ import annotations

import contextlib
import gc
import json
import sys
from collections.abc import Callable
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
        json.dumps(["]" * 500 + "\\", _nest([], MAX_DEPTH - 1, use_dict=True)]),
        b"[" * (MAX_DEPTH + 1) + b"]" * (MAX_DEPTH + 1),
    ],
)
def test_a_deep_document_is_refused(data: str | bytes) -> None:
    with pytest.raises(ValueError, match="levels deep"):
        loads(data)


@pytest.mark.parametrize(
    "document",
    [
        ['\\"' + "[" * 500, {"{" * 500: '"]'}],
        ["\\", "[" * 500, "\\\\", "{" * 500],
        ["]" * 500 + "\\", _nest([], MAX_DEPTH - 2, use_dict=True)],
    ],
)
def test_brackets_in_strings_and_escapes_do_not_count(document: Any) -> None:
    assert loads(json.dumps(document).encode()) == document
    assert loads(json.dumps(document, ensure_ascii=False)) == document


def test_utf16_and_utf32_are_checked_too() -> None:
    for encoding in ("utf-16-le", "utf-16-be", "utf-32-le", "utf-32-be"):
        with pytest.raises(ValueError, match="levels deep"):
            loads(("[" * 50_000).encode(encoding))
        assert loads(("[" * MAX_DEPTH + "]" * MAX_DEPTH).encode(encoding))


class _Finalized:
    me: _Finalized | None = None

    def __del__(self) -> None:
        def call(frames: int) -> int:
            return call(frames - 1) if frames else 0

        call(30)


def _unraisable_during_deep_parses(parse: Callable[[bytes], Any]) -> list[str]:
    """Finalizers a garbage collection ran while ``parse`` refused deep documents,
    and failed. The parser allocates a list per level, so a collection is timed
    to start in the last 40 levels the stack has room for."""
    frame, frames = sys._getframe(), 0
    while frame is not None:
        frame, frames = frame.f_back, frames + 1  # type: ignore[assignment]
    room = sys.getrecursionlimit() - frames
    failed: list[str] = []
    previous = gc.get_threshold()
    hook, sys.unraisablehook = sys.unraisablehook, lambda u: failed.append(repr(u.exc_value))
    try:
        for threshold in range(room - 40, room + 1, 5):
            gc.collect()
            gc.set_threshold(threshold)
            cycle = _Finalized()
            cycle.me = cycle
            del cycle
            with contextlib.suppress(RecursionError, ValueError):
                parse(b"[" * 50_000)
    finally:
        gc.set_threshold(*previous)
        gc.collect()
        sys.unraisablehook = hook
    return failed


def test_a_collection_during_the_refusal_has_stack_to_run_finalizers() -> None:
    """Why the module exists (CI saw it as unraisable RecursionErrors in a registry
    test): the stdlib parser recurses to the limit, and a collection there fails."""
    assert _unraisable_during_deep_parses(json.loads), "the stdlib no longer recurses?"
    assert _unraisable_during_deep_parses(loads) == []
