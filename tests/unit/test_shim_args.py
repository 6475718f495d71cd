"""The shim's flags parse as Go's flag package parses them."""

import pytest
from cedana_shim.cli.args import ShimArgs, UsageError, parse_args


def test_containerd_16_start_line() -> None:
    args = parse_args(
        [
            "-namespace",
            "k8s.io",
            "-address",
            "/run/containerd/containerd.sock",
            "-publish-binary",
            "/usr/bin/containerd",
            "-id",
            "abc",
            "start",
        ]
    )
    assert args == ShimArgs(
        namespace="k8s.io",
        address="/run/containerd/containerd.sock",
        publish_binary="/usr/bin/containerd",
        id="abc",
        action="start",
    )


def test_delete_with_bundle_and_debug_in_any_spelling() -> None:
    args = parse_args(["--namespace=ns", "-id", "x", "-bundle", "/b", "-debug", "delete"])
    assert (args.namespace, args.id, args.bundle, args.debug, args.action) == (
        "ns",
        "x",
        "/b",
        True,
        "delete",
    )


def test_daemon_has_no_action_and_extra_args_after_action_are_kept() -> None:
    assert parse_args(["-namespace", "n", "-id", "i"]).action == ""
    assert parse_args(["-id", "i", "start", "extra"]).rest == ("extra",)


@pytest.mark.parametrize("value, expected", [("true", True), ("1", True), ("false", False)])
def test_boolean_with_value(value: str, expected: bool) -> None:
    assert parse_args([f"-debug={value}"]).debug is expected


@pytest.mark.parametrize(
    "argv, message",
    [(["-nope"], "not defined"), (["-id"], "needs an argument"), (["-debug=maybe"], "invalid")],
)
def test_bad_flags_are_refused(argv: list[str], message: str) -> None:
    with pytest.raises(UsageError, match=message):
        parse_args(argv)
