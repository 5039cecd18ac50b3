"""The address a witness advertises: one that the nodes can reach.

A host's name is a poor guide: a login node's often resolves to loopback (its
``/etc/hosts``), and a witness advertised there holds ``replicas - 1`` votes no
replica can reach, which costs two of three replicas their majority. So the
witness takes the local source address of this host's route towards the nodes (a
UDP ``connect()`` asks the kernel for the route and sends nothing). Without one
that reaches every probed node it does not vote, and says why. ``choose_address``
is pure (routes in, a ``Reach`` out); ``probe`` finds the routes.
"""

from __future__ import annotations

import ipaddress
import socket
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

#: Nodes probed at most, spread over the allocation: routes differ by subnet, not
#: by node, and each probe may resolve a name (DNS) before its connect().
PROBED_NODES = 32
#: Any port: a UDP connect() only picks the route, nothing is sent there.
_PROBE_PORT = 9


@dataclass(frozen=True)
class Route:
    """How this host reaches one node: ``peer`` is the node's address (None: it
    did not resolve), ``source`` the local address of the route (None: no route)."""

    node: str
    peer: str | None
    source: str | None


@dataclass(frozen=True)
class Reach:
    """The address to advertise (None: none that every node can reach) and why."""

    address: str | None
    reason: str


def is_loopback(address: str) -> bool:
    try:
        ip = ipaddress.ip_address(address.split("%", 1)[0])
    except ValueError:
        return False
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    return ip.is_loopback


def choose_address(routes: Sequence[Route]) -> Reach:
    """The source address of the routes towards the nodes. A node whose address
    is loopback is this host and says nothing of the others; a node without a
    route, or reached only through loopback, makes the choice fail: no address."""
    if not routes:
        return Reach(None, "the allocation has no nodes to reach")
    unresolved = [r.node for r in routes if r.peer is None]
    if unresolved:
        return Reach(None, f"node {unresolved[0]}'s address does not resolve on this host"
                           + _others(unresolved))
    remote = [r for r in routes if not is_loopback(r.peer or "")]
    unrouted = [r.node for r in remote if r.source is None or is_loopback(r.source)]
    if unrouted:
        first = next(r for r in remote if r.node == unrouted[0])
        how = "no route" if first.source is None else f"only loopback ({first.source})"
        return Reach(None, f"{how} from this host to node {first.node} ({first.peer})"
                           + _others(unrouted))
    if not remote:
        local = next((r.source for r in routes if r.source), "127.0.0.1")
        return Reach(local, "every node is this host")
    address, reached = Counter(r.source for r in remote).most_common(1)[0]
    assert address is not None
    example = next(r for r in remote if r.source == address)
    note = "" if reached == len(remote) else \
        f" ({reached} of {len(remote)} probed nodes by this route, the others by others)"
    return Reach(address, f"the source of this host's route to node {example.node} "
                          f"({example.peer}){note}")


def _others(nodes: Sequence[str]) -> str:
    return f" (and {len(nodes) - 1} more)" if len(nodes) > 1 else ""


def spread(nodes: Sequence[tuple[str, str]], limit: int = PROBED_NODES
           ) -> list[tuple[str, str]]:
    """At most ``limit`` of ``nodes``, evenly spaced from the first to the last."""
    if len(nodes) <= limit:
        return list(nodes)
    step = (len(nodes) - 1) / (limit - 1)
    return [nodes[round(i * step)] for i in range(limit)]


# --------------------------------------------------------------------------- shell


def route_to(node: str, address: str) -> Route:
    """This host's route to ``node`` at ``address`` (a name or an IP)."""
    try:
        found = socket.getaddrinfo(address, _PROBE_PORT, type=socket.SOCK_DGRAM)
    except (OSError, UnicodeError):
        return Route(node, None, None)
    peer = None
    for family, kind, proto, _, sockaddr in found:
        peer = peer or str(sockaddr[0])
        try:
            with socket.socket(family, kind, proto) as probe:
                probe.connect(sockaddr)
                return Route(node, str(sockaddr[0]), str(probe.getsockname()[0]))
        except OSError:       # unreachable network, a blackhole or prohibit route
            continue
    return Route(node, peer, None)


def probe(nodes: Sequence[tuple[str, str]]) -> Reach:
    """The address to advertise to ``nodes`` (``(name, address)`` pairs)."""
    return choose_address([route_to(name, address) for name, address in spread(nodes)])
