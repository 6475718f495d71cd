"""JSON from outside the shim (registries, users' files, peers on a socket), depth-bounded.

``json.loads`` recurses once per nesting level and gives up only at the
interpreter's recursion limit. Catching the ``RecursionError`` is not enough:
while the parser sits at that limit, any garbage collection it triggers runs
finalizers with no stack left, and those fail as "unraisable" errors in
whichever code they belonged to. So a document nested deeper than any real one
is refused before it is parsed. The bound is far above every format we read
(an OCI manifest nests 4 levels, a hook config 5).
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Iterator
from typing import Any

MAX_DEPTH = 64

# One bracket, or a whole string (whose brackets do not count).
_TOKEN = r'(?P<open>[\[{])|(?P<close>[\]}])|"[^"\\]*(?:\\.[^"\\]*)*"'
_TOKEN_TEXT = re.compile(_TOKEN, re.S)
_TOKEN_BYTES = re.compile(_TOKEN.encode(), re.S)


def nested_too_deep(data: str | bytes) -> bool:
    """Whether ``data`` opens more than MAX_DEPTH arrays or objects inside each other."""
    tokens: Iterator[re.Match[str]] | Iterator[re.Match[bytes]]
    if isinstance(data, str):
        opened = data.count("[") + data.count("{")
        tokens = _TOKEN_TEXT.finditer(data)
    else:
        opened = data.count(b"[") + data.count(b"{")
        tokens = _TOKEN_BYTES.finditer(data)
    if opened <= MAX_DEPTH:
        return False  # every real document, without a scan
    depth = 0
    for token in tokens:
        if token.lastgroup == "open":
            depth += 1
            if depth > MAX_DEPTH:
                return True
        elif token.lastgroup == "close":
            depth -= 1
    return False


def loads(
    data: str | bytes,
    *,
    object_pairs_hook: Callable[[list[tuple[str, Any]]], Any] | None = None,
    parse_constant: Callable[[str], Any] | None = None,
) -> Any:
    """``json.loads``; a ValueError also for a document nested deeper than MAX_DEPTH."""
    if nested_too_deep(data):
        raise ValueError(f"nested more than {MAX_DEPTH} levels deep")
    return json.loads(data, object_pairs_hook=object_pairs_hook, parse_constant=parse_constant)
