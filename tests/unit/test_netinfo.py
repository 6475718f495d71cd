"""Network facts without a namespace of their own; reading them from a real pod
namespace needs root and is tested in tests/privileged/test_netinfo_namespace.py."""

import pytest
from cedana_shim.checkpoint.netinfo import network_facts, same_addresses


def test_missing_namespace_raises() -> None:
    with pytest.raises(FileNotFoundError):
        network_facts("/proc/999999999/ns/net")


def test_same_addresses_decides_whether_tcp_can_survive() -> None:
    a = {
        "addresses": [
            {"interface": "eth0", "address": "10.0.0.2"},
            {"interface": "lo", "address": "127.0.0.1"},
        ]
    }
    b = {"addresses": [{"interface": "eth0", "address": "10.0.0.3"}]}
    assert same_addresses(a, a)
    assert not same_addresses(a, b)
    assert not same_addresses({}, {})  # nothing recorded: do not pretend connections survive
    assert not same_addresses("garbage", a)
