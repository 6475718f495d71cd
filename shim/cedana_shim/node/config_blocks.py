"""The marked blocks ``cedana node install`` writes into a containerd config file.

An appended block (``BLOCK_BEGIN`` ... ``BLOCK_END``) holds whole tables. An inline
block sits inside a table the node's file defines and may replace some of its lines,
which it keeps as ``#| `` comments; :func:`strip_block` removes both kinds and puts
the kept lines back, so a file comes back byte for byte.
"""

from __future__ import annotations

import re
import tomllib
from typing import Any, Final

from . import registration as reg

BLOCK_BEGIN: Final = (
    "# >>> cedana-shim: added by `cedana node install`; `cedana node uninstall` removes it"
)
BLOCK_END: Final = "# <<< cedana-shim"
_BLOCK_RE = re.compile(
    r"\n?" + re.escape(BLOCK_BEGIN) + r"\n.*?^" + re.escape(BLOCK_END) + r"\n?",
    re.DOTALL | re.MULTILINE,
)
INLINE_BEGIN: Final = (
    "# >>> cedana-shim: set by `cedana node install`; `cedana node uninstall` puts back "
    "the line(s) kept below as `#| ` comments"
)
_KEPT = "#| "
_INLINE_RE = re.compile(
    r"^" + re.escape(INLINE_BEGIN) + r"\n((?:" + re.escape(_KEPT) + r".*\n)*)"
    r"(?:(?!" + re.escape(BLOCK_END) + r"\n).*\n)*?" + re.escape(BLOCK_END) + r"\n",
    re.MULTILINE,
)


def strip_block(text: str) -> str:
    """``text`` without the blocks a previous install added, with the lines an inline
    block replaced put back."""
    text = _BLOCK_RE.sub("", text, count=1)
    return _INLINE_RE.sub(_kept_lines, text)


def _kept_lines(m: re.Match[str]) -> str:
    return "".join(line[len(_KEPT) :] for line in m[1].splitlines(keepends=True))


def has_block(text: str) -> bool:
    return _BLOCK_RE.search(text) is not None or _INLINE_RE.search(text) is not None


def append_block(text: str, tables: str) -> str:
    """``text`` (already stripped) with ``tables`` appended as a marked block."""
    base = text
    if base and not base.endswith("\n"):
        base += "\n"
    return f"{base}\n{BLOCK_BEGIN}\n{tables}{BLOCK_END}\n"


def _inline_block(kept: str, new: str) -> str:
    kept_lines = "".join(f"{_KEPT}{line}\n" for line in kept.splitlines())
    return f"{INLINE_BEGIN}\n{kept_lines}{new}{BLOCK_END}\n"


def _header_path(line: str) -> tuple[str, ...] | None:
    """The key path of a ``[table]`` header line (any quoting), else None."""
    stripped = line.strip()
    if not stripped.startswith("[") or stripped.startswith("[["):
        return None
    try:
        node: Any = tomllib.loads(stripped + "\n")
    except tomllib.TOMLDecodeError:
        return None
    path: list[str] = []
    while isinstance(node, dict) and len(node) == 1:
        key = next(iter(node))
        path.append(key)
        node = node[key]
    return tuple(path)


_DEFAULT_LINE_RE = re.compile(r"^(\s*)" + reg.DEFAULT_RUNTIME_KEY + r"\s*=")


def set_default_inline(text: str, version: int) -> str | None:
    """``text`` with ``default_runtime_name = "cedana"`` put into the CRI
    ``containerd`` table it defines, as a marked inline block (replacing the node's
    own line, which the block keeps); None when ``text`` has no such table header."""
    lines = text.splitlines(keepends=True)
    wanted = reg.containerd_path(version)
    header = None
    current: tuple[str, ...] | None = None
    for i, line in enumerate(lines):
        path = _header_path(line) if line.lstrip().startswith("[") else None
        if path is not None:
            current = path
            if path == wanted:
                header = i
            continue
        if current == wanted and (m := _DEFAULT_LINE_RE.match(line)):
            new = reg.render_default_runtime(m[1])
            lines[i] = _inline_block(line.rstrip("\n"), new)
            return "".join(lines)
    if header is None:
        return None
    indent = re.match(r"\s*", lines[header])[0] + "  "  # type: ignore[index]
    if not lines[header].endswith("\n"):
        lines[header] += "\n"
    lines.insert(header + 1, _inline_block("", reg.render_default_runtime(indent)))
    return "".join(lines)


def restore_edited(current: bytes) -> bytes:
    """For uninstall when the edited file changed since install: drop only our block."""
    return strip_block(current.decode()).encode()
