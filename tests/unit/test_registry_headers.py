"""WWW-Authenticate, Link and upload Range parsing: round trips and hostile input."""

from __future__ import annotations

import string

import pytest
from cedana_shim.registry.headers import (
    Challenge,
    next_link,
    parse_challenges,
    parse_links,
    upload_range_end,
)
from hypothesis import given
from hypothesis import strategies as st

_TCHAR = "!#$%&'*+-.^_`|~" + string.digits + string.ascii_letters
tokens = st.text(alphabet=_TCHAR, min_size=1, max_size=12)
# Printable ASCII and Latin-1 (obs-text), what a quoted-string may carry.
quoted_values = st.text(
    alphabet=st.characters(min_codepoint=0x20, max_codepoint=0xFF).filter(lambda c: c != "\x7f"),
    max_size=30,
)


def _quote(value: str) -> str:
    return '"' + value.replace("\\", "\\\\").replace('"', '\\"') + '"'


challenge_specs = st.tuples(
    tokens, st.dictionaries(tokens.map(str.lower), quoted_values, min_size=1, max_size=4)
)


@given(st.lists(challenge_specs, min_size=1, max_size=3))
def test_challenges_round_trip(specs: list[tuple[str, dict[str, str]]]) -> None:
    header = ", ".join(
        f"{scheme} " + ", ".join(f"{name}={_quote(value)}" for name, value in params.items())
        for scheme, params in specs
    )
    parsed = parse_challenges(header)
    assert [(c.scheme, dict(c.params)) for c in parsed] == [
        (scheme.lower(), params) for scheme, params in specs
    ]


@given(st.text(max_size=200))
def test_any_text_parses_or_raises_value_error(header: str) -> None:
    try:
        challenges = parse_challenges(header)
    except ValueError:
        return
    assert all(isinstance(c, Challenge) and c.scheme for c in challenges)


def test_a_docker_token_challenge() -> None:
    header = (
        'Bearer realm="https://auth.docker.io/token",service="registry.docker.io",'
        'scope="repository:library/busybox:pull",error="insufficient_scope"'
    )
    (challenge,) = parse_challenges(header)
    assert challenge.scheme == "bearer"
    assert challenge.params == {
        "realm": "https://auth.docker.io/token",
        "service": "registry.docker.io",
        "scope": "repository:library/busybox:pull",
        "error": "insufficient_scope",
    }


def test_basic_and_token68_challenges_side_by_side() -> None:
    parsed = parse_challenges('Negotiate YWJj==, Basic realm=registry, charset="UTF-8"')
    assert parsed == [
        Challenge(scheme="negotiate", params={}, token68="YWJj=="),
        Challenge(scheme="basic", params={"realm": "registry", "charset": "UTF-8"}),
    ]


@pytest.mark.parametrize(
    "header",
    [
        "",
        "Basic a=b=c",
        'Basic realm="unterminated',
        'Basic realm="a" realm2="b"',
        'Bearer realm="a", realm="b"',
        '=x, Basic realm="a"',
        'Basic realm="a\x01"',
    ],
)
def test_malformed_challenges_are_refused(header: str) -> None:
    with pytest.raises(ValueError):
        parse_challenges(header)


targets = st.text(
    alphabet=st.characters(min_codepoint=0x21, max_codepoint=0x7E).filter(lambda c: c not in '<>"'),
    min_size=1,
    max_size=40,
)
link_specs = st.tuples(targets, st.lists(st.sampled_from(["next", "prev", "last"]), max_size=2))


@given(st.lists(link_specs, max_size=4))
def test_links_round_trip(specs: list[tuple[str, list[str]]]) -> None:
    header = ", ".join(f'<{target}>; rel="{" ".join(rels)}"; type=x' for target, rels in specs)
    links = parse_links(header)
    assert [(link.target, sorted(link.rels)) for link in links] == [
        (target, sorted(set(rels))) for target, rels in specs
    ]
    expected = next((target for target, rels in specs if "next" in rels), None)
    assert next_link(header) == expected


@given(st.text(max_size=200))
def test_any_link_text_parses_or_raises_value_error(header: str) -> None:
    try:
        target = next_link(header)
    except ValueError:
        return
    assert target is None or f"<{target}>" in header


def test_the_link_distribution_sends() -> None:
    header = '</v2/cedana/a/tags/list?last=t49&n=50>; rel="next"'
    assert next_link(header) == "/v2/cedana/a/tags/list?last=t49&n=50"
    assert next_link('<https://x/a>; rel="prev"') is None


@pytest.mark.parametrize("header", ["<a", "<a> rel=next", "<a>; =x", "<a b>; rel=next"])
def test_malformed_links_are_refused(header: str) -> None:
    with pytest.raises(ValueError):
        parse_links(header)


@pytest.mark.parametrize(
    ("header", "end"), [("0-0", 0), ("0-9", 9), ("bytes=0-41", 41), ("0--1", -1), (" 0-5 ", 5)]
)
def test_upload_range_end(header: str, end: int) -> None:
    assert upload_range_end(header) == end


@pytest.mark.parametrize("header", ["", "1-5", "0-", "0-x", "0-" + "9" * 20, "0-1,3-4"])
def test_bad_upload_ranges_are_refused(header: str) -> None:
    with pytest.raises(ValueError):
        upload_range_end(header)
