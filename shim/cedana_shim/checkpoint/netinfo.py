"""The network facts of a pod, recorded with each checkpoint.

Pod containers share their sandbox's network namespace; CRIU dumps
established TCP connections only when told to, and can restore them only if
the pod keeps its IP address. The addresses and routes of the namespace go
into the checkpoint metadata, and a restore compares them with the new pod's
to decide between keeping connections (same IP) and closing them cleanly.

pyroute2 costs ~140 ms to import, so it is imported inside the function, off
the shim's start path.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping
from typing import Any, TypedDict


class Address(TypedDict):
    interface: str
    family: str
    address: str
    prefixlen: int


class Route(TypedDict):
    destination: str
    gateway: str
    interface: str


class NetworkFacts(TypedDict):
    addresses: list[Address]
    routes: list[Route]


CLONE_NEWNET = 0x40000000


def network_facts(netns_path: str) -> NetworkFacts:
    """Addresses and routes of the namespace at ``netns_path`` (e.g. /proc/PID/ns/net).

    Read from a thread of its own that joins the namespace with setns(2): the
    namespace is per thread, and pyroute2's own ``netns=`` support forks the
    shim and signals the child, which an asyncio daemon must never have done
    to it (the child shares the loop's signal wake-up fd).
    """
    outcome: list[NetworkFacts | BaseException] = []

    def in_namespace() -> None:
        try:
            fd = os.open(netns_path, os.O_RDONLY | os.O_CLOEXEC)
            try:
                _setns(fd, CLONE_NEWNET)
            finally:
                os.close(fd)
            outcome.append(_read_facts())
        except BaseException as err:  # handed to the caller's thread
            outcome.append(err)

    # A fresh thread, never a pooled one: it stays in that namespace until it ends.
    worker = threading.Thread(target=in_namespace, name="netns-facts", daemon=True)
    worker.start()
    worker.join()
    result = outcome[0]
    if isinstance(result, BaseException):
        raise result
    return result


def _setns(fd: int, nstype: int) -> None:
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.setns(fd, nstype) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"setns: {os.strerror(err)}")


def preload_network_facts() -> None:
    """Import what :func:`network_facts` needs, so that its first call is cheap."""
    import pyroute2  # type: ignore[import-untyped]  # noqa: F401


def _read_facts() -> NetworkFacts:
    from socket import AF_INET

    from pyroute2 import IPRoute

    with IPRoute() as ip:
        names = {link["index"]: link.get_attr("IFLA_IFNAME") for link in ip.get_links()}
        addresses: list[Address] = [
            {
                "interface": names.get(a["index"], ""),
                "family": "ipv4" if a["family"] == AF_INET else "ipv6",
                "address": a.get_attr("IFA_ADDRESS"),
                "prefixlen": a["prefixlen"],
            }
            for a in ip.get_addr()
        ]
        routes: list[Route] = []
        for r in ip.get_routes(table=254):  # main table
            dst = r.get_attr("RTA_DST")
            routes.append(
                {
                    "destination": f"{dst}/{r['dst_len']}" if dst else "default",
                    "gateway": r.get_attr("RTA_GATEWAY") or "",
                    "interface": names.get(r.get_attr("RTA_OIF"), ""),
                }
            )
    return {"addresses": addresses, "routes": routes}


def pod_addresses(facts: Any) -> set[str]:
    """The non-loopback addresses in recorded facts (tolerates old or missing data)."""
    out: set[str] = set()
    if not isinstance(facts, dict):
        return out
    for entry in facts.get("addresses") or []:
        if isinstance(entry, dict) and entry.get("interface") != "lo":
            address = entry.get("address")
            if isinstance(address, str) and not address.startswith(("127.", "::1", "fe80:")):
                out.add(address)
    return out


def same_addresses(before: Any, after: Any) -> bool:
    """True when a restore keeps the pod's addresses, so its TCP connections can live."""
    old = pod_addresses(before)
    return bool(old) and old == pod_addresses(after)


def tcp_can_live(before: Any, after: Any) -> bool:
    """Whether the checkpoint's TCP connections can be restored as they were: the pod
    kept its addresses, or none of them leaves the container (connections over
    loopback between its own processes live wherever it lands)."""
    if same_addresses(before, after):
        return True
    tcp = before.get("tcp") if isinstance(before, dict) else None
    return isinstance(tcp, dict) and tcp.get("external") == 0


def joined_network_facts(spec: Mapping[str, Any]) -> NetworkFacts | dict[str, Any]:
    """The facts of the network namespace a new container joins: the one its spec
    names (a pod's), or the host's (this process's) when the spec has no network
    namespace at all (host network); empty when it makes its own. Blocking."""
    for ns in (spec.get("linux") or {}).get("namespaces") or []:
        if isinstance(ns, Mapping) and ns.get("type") == "network":
            return network_facts(str(ns["path"])) if ns.get("path") else {}
    return network_facts("/proc/self/ns/net")
