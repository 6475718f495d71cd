"""Network facts are read inside the pod's namespace without disturbing the caller."""

import os
import subprocess
import threading
import uuid
from collections.abc import Iterator

import pytest
from cedana_shim.checkpoint.netinfo import network_facts, pod_addresses


@pytest.fixture
def netns() -> Iterator[str]:
    assert os.geteuid() == 0, "creating network namespaces needs root"
    name = f"cdn-test-{uuid.uuid4().hex[:8]}"
    subprocess.run(["ip", "netns", "add", name], check=True)
    try:
        subprocess.run(["ip", "-n", name, "link", "set", "lo", "up"], check=True)
        subprocess.run(
            ["ip", "-n", name, "link", "add", "d0", "type", "veth", "peer", "name", "d1"],
            check=True,
        )
        subprocess.run(["ip", "-n", name, "addr", "add", "10.77.0.5/24", "dev", "d0"], check=True)
        subprocess.run(["ip", "-n", name, "link", "set", "d0", "up"], check=True)
        yield f"/var/run/netns/{name}"
    finally:
        subprocess.run(["ip", "netns", "del", name], check=False)


def test_facts_come_from_the_namespace_and_leave_the_caller_where_it_was(netns: str) -> None:
    before = os.readlink("/proc/thread-self/ns/net")
    threads = threading.active_count()
    facts = network_facts(netns)
    assert os.readlink("/proc/thread-self/ns/net") == before
    assert threading.active_count() == threads
    assert {"interface": "d0", "family": "ipv4", "address": "10.77.0.5", "prefixlen": 24} in facts[
        "addresses"
    ]
    assert any(
        r["destination"] == "10.77.0.0/24" and r["interface"] == "d0" for r in facts["routes"]
    )
    assert pod_addresses(facts) == {"10.77.0.5"}
