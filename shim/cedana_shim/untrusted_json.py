"""JSON from outside the shim (registries, users' files, peers on a socket), depth-bounded.

``json.loads`` recurses once per nesting level and gives up only at the
interpreter's recursion limit. Catching the ``RecursionError`` is not enough:
while the parser sits at that limit, any garbage collection it triggers runs
finalizers with no stack left, and those fail as "unraisable" errors in
whichever code they belonged to. So a document nested deeper than any real one
is refused before it is parsed. The bound is far above every format we read
(OCI manifests and indexes, docker auth files and hook configs nest 3-4 levels).

The check costs about what the parse does, and only for a document with more than
MAX_DEPTH brackets in all (an index of 50 checkpoints: ~80 us); below that, two
``count`` calls.
"""

from __future__ import annotations

import json
from collections.abc import Callable
from itertools import accumulate
from typing import Any

MAX_DEPTH = 64

_NOT_QUOTES_OR_BRACKETS = bytes(range(256)).translate(None, b'"[]{}')
_STEP = [0] * 256
_STEP[ord("[")] = _STEP[ord("{")] = 1
_STEP[ord("]")] = _STEP[ord("}")] = -1


def nested_too_deep(data: str | bytes) -> bool:
    """Whether ``data`` opens more than MAX_DEPTH arrays or objects inside each other."""
    if isinstance(data, str):
        data = data.encode("utf-8", "surrogatepass")
    elif (encoding := json.detect_encoding(data)) not in ("utf-8", "utf-8-sig"):
        data = data.decode(encoding, "replace").encode()  # json.loads reads UTF-16 and -32 too
    if data.count(b"[") + data.count(b"{") <= MAX_DEPTH:
        return False  # most documents, without a scan
    # Outside strings, quotes are the strings' ends once escapes are gone; this reads
    # them left to right as the parser does. UTF-8 continuation bytes are never ASCII.
    if b"\\" in data:
        data = data.replace(b"\\\\", b"").replace(b'\\"', b"")
    brackets = b"".join(data.translate(None, _NOT_QUOTES_OR_BRACKETS).split(b'"')[::2])
    return max(accumulate(map(_STEP.__getitem__, brackets)), default=0) > MAX_DEPTH


def loads(
    data: str | bytes,
    *,
    object_pairs_hook: Callable[[list[tuple[str, Any]]], Any] | None = None,
    parse_constant: Callable[[str], Any] | None = None,
) -> Any:
    """``json.loads``; a ValueError also for a document nested deeper than MAX_DEPTH."""
    if nested_too_deep(data):
        raise ValueError(f"nested more than {MAX_DEPTH} levels deep")
    try:
        return json.loads(data, object_pairs_hook=object_pairs_hook, parse_constant=parse_constant)
    except RecursionError:  # not expected past the check; a refusal all the same
        raise ValueError("nested too deep") from None
