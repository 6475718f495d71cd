"""Registry setting, repository, tag and digest validation."""

from __future__ import annotations

import pytest
from cedana_shim.errors import InvalidArgument
from cedana_shim.registry.reference import (
    RegistryLocation,
    check_digest,
    check_repository,
    check_tag,
    parse_registry,
    repository_for,
)
from hypothesis import given
from hypothesis import strategies as st

namespaces = st.from_regex(r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?", fullmatch=True)
prefixes = st.sampled_from(["", "cedana", "team/cedana", "a.b/c__d/e-f"])


@given(prefixes, namespaces, namespaces)
def test_each_namespace_gets_its_own_repository(prefix: str, a: str, b: str) -> None:
    repo_a, repo_b = repository_for(prefix, a), repository_for(prefix, b)
    assert check_repository(repo_a) == repo_a
    assert repo_a.rsplit("/", 1)[-1] == a
    assert (repo_a == repo_b) == (a == b)


@pytest.mark.parametrize(
    "namespace",
    ["", "A", "a/b", "..", "a..b/..", "-a", "a-", "a_b", "a.b", "x" * 64, "a b", "a%2fb"],
)
def test_a_namespace_that_is_not_a_dns_label_is_refused(namespace: str) -> None:
    with pytest.raises(InvalidArgument, match="DNS-1123"):
        repository_for("cedana", namespace)


@given(st.text(max_size=80))
def test_a_namespace_never_escapes_its_prefix(namespace: str) -> None:
    try:
        repo = repository_for("cedana", namespace)
    except InvalidArgument:
        return
    assert repo == f"cedana/{namespace}" and "/" not in namespace and ".." not in namespace


@pytest.mark.parametrize("name", ["a", "a/b", "a.b_c__d---e/f9", "0/1"])
def test_valid_repositories(name: str) -> None:
    assert check_repository(name) == name


@pytest.mark.parametrize("name", ["", "A", "a//b", "/a", "a/", "a..b", "a___b", "a.", "a" * 256])
def test_invalid_repositories(name: str) -> None:
    with pytest.raises(InvalidArgument, match="not a valid repository name"):
        check_repository(name)


@given(st.from_regex(r"[A-Za-z0-9_][A-Za-z0-9._-]{0,127}", fullmatch=True))
def test_tags_of_the_grammar_are_accepted(tag: str) -> None:
    assert check_tag(tag) == tag


@pytest.mark.parametrize("tag", ["", ".a", "-a", "a" * 129, "a/b", "a:b", "a@b", "é", "a\n"])
def test_tags_outside_the_grammar_are_refused(tag: str) -> None:
    with pytest.raises(InvalidArgument):
        check_tag(tag)


def test_digests() -> None:
    good = "sha256:" + "ab" * 32
    assert check_digest(good) == good
    for bad in ("sha256:" + "AB" * 32, "sha512:" + "ab" * 64, "sha256:abc", "ab" * 32):
        with pytest.raises(InvalidArgument):
            check_digest(bad)


@pytest.mark.parametrize(
    ("value", "host", "prefix"),
    [
        ("registry.example.com/cedana/ckpt", "registry.example.com", "cedana/ckpt"),
        ("127.0.0.1:5000", "127.0.0.1:5000", ""),
        ("[::1]:5000/x", "[::1]:5000", "x"),
        ("localhost:443/a", "localhost:443", "a"),
    ],
)
def test_parse_registry(value: str, host: str, prefix: str) -> None:
    assert parse_registry(value) == RegistryLocation(host=host, prefix=prefix)


@pytest.mark.parametrize(
    "value",
    [
        "https://registry.example.com/x",
        "",
        "host:0/x",
        "host:99999/x",
        "host:port/x",
        "[::1/x",
        "[zz::1]:5000/x",
        "-host/x",
        "host/UPPER",
        "host/a//b",
        "user@host/x",
    ],
)
def test_bad_registry_settings_are_refused(value: str) -> None:
    with pytest.raises(InvalidArgument, match="registry setting"):
        parse_registry(value)
