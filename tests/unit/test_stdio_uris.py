"""Stdio URIs are read as containerd's createIO reads them."""

import pytest
from cedana_shim.errors import InvalidArgument
from cedana_shim.task.stdio import StdioConfig, StdioTarget, parse_target


@pytest.mark.parametrize(
    "config, expected",
    [
        (StdioConfig(), StdioTarget("null")),
        (StdioConfig(stdin="/f/in"), StdioTarget("fifo")),
        (StdioConfig(stdout="/f/out", stderr="/f/err"), StdioTarget("fifo", "/f/out")),
        (StdioConfig(stdout="fifo:///f/out"), StdioTarget("fifo", "/f/out")),
        (StdioConfig(stdout="file:///var/log/a%20b.log"), StdioTarget("file", "/var/log/a b.log")),
        (
            StdioConfig(stdout="binary:///usr/bin/logger?id=7&debug"),
            StdioTarget("binary", "/usr/bin/logger", ("id", "7", "debug")),
        ),
    ],
)
def test_targets(config: StdioConfig, expected: StdioTarget) -> None:
    assert parse_target(config) == expected


@pytest.mark.parametrize("uri", ["http://x/y", "binary://relative/path", "file://relative"])
def test_bad_uris_are_refused(uri: str) -> None:
    with pytest.raises(InvalidArgument):
        parse_target(StdioConfig(stdout=uri))
