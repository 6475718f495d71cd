"""Parsers for the HTTP headers a registry answers with (pure, no I/O).

Every header here comes from the network and is untrusted: the parsers accept the
RFC grammar, raise ``ValueError`` on anything else and never loop or allocate beyond
the size of their input. The client turns a ``ValueError`` into DataLoss naming the
registry.
"""

from __future__ import annotations

import re
import string
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Final

__all__ = ["Challenge", "Link", "next_link", "parse_challenges", "parse_links", "upload_range_end"]

_TCHARS: Final = frozenset("!#$%&'*+-.^_`|~" + string.digits + string.ascii_letters)
_TOKEN68_CHARS: Final = frozenset("-._~+/" + string.digits + string.ascii_letters)
_OWS: Final = " \t"
_RANGE_RE: Final = re.compile(r"(?:bytes=)?0-(-1|[0-9]{1,19})")


@dataclass(frozen=True)
class Challenge:
    """One challenge of a ``WWW-Authenticate`` header (RFC 7235)."""

    scheme: str  # lowercased: "basic", "bearer"
    params: Mapping[str, str] = field(default_factory=dict)  # names lowercased
    token68: str | None = None


@dataclass(frozen=True)
class Link:
    """One link-value of a ``Link`` header (RFC 8288)."""

    target: str  # the URI reference between < and >, not resolved
    params: Mapping[str, str] = field(default_factory=dict)  # names lowercased

    @property
    def rels(self) -> frozenset[str]:
        return frozenset(self.params.get("rel", "").lower().split())


class _Scanner:
    """A cursor over a header value with the RFC 7230 lexical rules."""

    def __init__(self, text: str) -> None:
        self.text = text
        self.pos = 0

    def at_end(self) -> bool:
        return self.pos >= len(self.text)

    def peek(self) -> str:
        return self.text[self.pos] if self.pos < len(self.text) else ""

    def skip_ows(self) -> None:
        while self.pos < len(self.text) and self.text[self.pos] in _OWS:
            self.pos += 1

    def skip_list_separators(self) -> None:
        """Skip OWS and the empty list elements that ``#rule`` allows."""
        while self.pos < len(self.text) and self.text[self.pos] in " \t,":
            self.pos += 1

    def expect(self, char: str) -> None:
        if self.peek() != char:
            raise ValueError(f"expected {char!r} at offset {self.pos} of {self.text!r}")
        self.pos += 1

    def token(self) -> str:
        start = self.pos
        while self.pos < len(self.text) and self.text[self.pos] in _TCHARS:
            self.pos += 1
        if self.pos == start:
            raise ValueError(f"expected a token at offset {start} of {self.text!r}")
        return self.text[start : self.pos]

    def quoted_string(self) -> str:
        self.expect('"')
        out: list[str] = []
        while True:
            char = self.peek()
            if char == "":
                raise ValueError(f"unterminated quoted string in {self.text!r}")
            self.pos += 1
            if char == '"':
                return "".join(out)
            if char == "\\":
                char = self.peek()
                if char == "" or not _quotable(char):
                    raise ValueError(f"bad escape in quoted string of {self.text!r}")
                self.pos += 1
            elif not _quotable(char):
                raise ValueError(f"control character in quoted string of {self.text!r}")
            out.append(char)

    def token_or_quoted(self) -> str:
        return self.quoted_string() if self.peek() == '"' else self.token()

    def try_token68(self) -> str | None:
        """A token68 right after the scheme, if that is what follows (else no move)."""
        start = self.pos
        while self.pos < len(self.text) and self.text[self.pos] in _TOKEN68_CHARS:
            self.pos += 1
        if self.pos == start:
            return None
        while self.peek() == "=":
            self.pos += 1
        end = self.pos
        self.skip_ows()
        if self.at_end() or self.peek() == ",":
            return self.text[start:end]
        self.pos = start
        return None


def _quotable(char: str) -> bool:
    code = ord(char)
    return char == "\t" or 0x20 <= code <= 0x7E or 0x80 <= code <= 0xFF


def parse_challenges(header: str) -> list[Challenge]:
    """Parse a ``WWW-Authenticate`` value into its challenges, in order."""
    scan = _Scanner(header)
    challenges: list[Challenge] = []
    scan.skip_list_separators()
    while not scan.at_end():
        scheme = scan.token().lower()
        if scan.peek() not in ("", ",", " ", "\t"):
            raise ValueError(f"expected a space after the scheme {scheme!r} in {header!r}")
        scan.skip_ows()
        token68 = scan.try_token68()
        params: dict[str, str] = {}
        if token68 is None:
            _read_auth_params(scan, params)
        challenges.append(Challenge(scheme=scheme, params=params, token68=token68))
        scan.skip_list_separators()
    if not challenges:
        raise ValueError("empty WWW-Authenticate header")
    return challenges


def _read_auth_params(scan: _Scanner, params: dict[str, str]) -> None:
    """Read ``name=value`` pairs until the next challenge's scheme (or the end)."""
    while True:
        scan.skip_list_separators()
        if scan.at_end():
            return
        start = scan.pos
        name = scan.token().lower()
        scan.skip_ows()
        if scan.peek() != "=":
            scan.pos = start  # a scheme: the next challenge starts here
            return
        scan.pos += 1
        scan.skip_ows()
        if name in params:
            raise ValueError(f"parameter {name!r} given twice in {scan.text!r}")
        params[name] = scan.token_or_quoted()
        scan.skip_ows()
        if not scan.at_end() and scan.peek() != ",":
            raise ValueError(f"expected ',' at offset {scan.pos} of {scan.text!r}")


def parse_links(header: str) -> list[Link]:
    """Parse a ``Link`` value into its link-values, in order."""
    scan = _Scanner(header)
    links: list[Link] = []
    scan.skip_list_separators()
    while not scan.at_end():
        scan.expect("<")
        end = header.find(">", scan.pos)
        if end < 0:
            raise ValueError(f"unterminated '<' in {header!r}")
        target = header[scan.pos : end]
        if any(ord(c) <= 0x20 or c in '<"' for c in target):
            raise ValueError(f"bad character in link target {target!r}")
        scan.pos = end + 1
        params: dict[str, str] = {}
        scan.skip_ows()
        while scan.peek() == ";":
            scan.pos += 1
            scan.skip_ows()
            name = scan.token().lower()
            scan.skip_ows()
            value = ""
            if scan.peek() == "=":
                scan.pos += 1
                scan.skip_ows()
                value = scan.token_or_quoted()
                scan.skip_ows()
            params.setdefault(name, value)  # RFC 8288: later occurrences are ignored
        if not scan.at_end() and scan.peek() != ",":
            raise ValueError(f"expected ',' or ';' at offset {scan.pos} of {header!r}")
        links.append(Link(target=target, params=params))
        scan.skip_list_separators()
    return links


def next_link(header: str) -> str | None:
    """The target of the first ``rel="next"`` link, or None."""
    for link in parse_links(header):
        if "next" in link.rels:
            return link.target
    return None


def upload_range_end(range_header: str) -> int:
    """The last byte an upload session holds, from its ``Range: 0-<last>`` header.

    -1 (``0--1``) means nothing. Beware ``0-0``: distribution sends it both for an
    empty session and for one that holds one byte.
    """
    match = _RANGE_RE.fullmatch(range_header.strip())
    if match is None:
        raise ValueError(f"upload Range {range_header!r} is not 0-<last byte>")
    return int(match.group(1))
