"""Where the other nodes reach this one: the address and interface that route to the master address.

A host's name often resolves to a loopback address (``/etc/hosts`` maps it to 127.0.x.1 on many
images). Gloo and NCCL then advertise that address to the other nodes, whose connects are refused,
and a controller listening on it is out of every other node's reach. The kernel's own route to the
master address names the source address the other nodes can answer, and its interface.
"""
from __future__ import annotations

import socket

IFNAME_VARS = ("GLOO_SOCKET_IFNAME", "NCCL_SOCKET_IFNAME")


def is_loopback(addr: str) -> bool:
    return addr.startswith("127.") or addr in ("localhost", "::1")


def route_to(addr: str) -> str:
    """This host's address on the route to ``addr`` (a UDP socket's connect sends nothing)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((socket.gethostbyname(addr), 9))
        return s.getsockname()[0]


def interface_of(ip: str) -> str | None:
    import psutil
    for name, addrs in psutil.net_if_addrs().items():
        if any(a.family == socket.AF_INET and a.address == ip for a in addrs):
            return name
    return None


def name_resolves_to_loopback() -> bool:
    try:
        return is_loopback(socket.gethostbyname(socket.gethostname()))
    except OSError:
        return True  # unresolvable: gloo cannot use it either


def node_network(master_addr: str, env) -> tuple[str, dict, str]:
    """(this node's routable address, the variables to add to its workers' environment, what was
    chosen and why, for the log). A job on loopback stays there. Where the host name resolves to a
    loopback address and the variables are unset, gloo and NCCL are pointed at the interface that
    routes to the master address."""
    if is_loopback(master_addr):
        return "127.0.0.1", {}, ""
    try:
        host = route_to(master_addr)
    except OSError as e:  # (unresolvable here, or IPv6 only): what the host name says, as before
        host = socket.gethostbyname(socket.gethostname())
        return host, {}, (f"no IPv4 route to the master address {master_addr} ({e.strerror or e}): this node "
                          f"announces {host}, its host name's address; --local-addr names another")
    unset = [v for v in IFNAME_VARS if not env.get(v)]
    if not unset or not name_resolves_to_loopback():
        return host, {}, f"this node is reached at {host} (the route to the master address {master_addr})"
    name = socket.gethostname()
    ifname = interface_of(host)
    if ifname is None:
        return host, {}, (f"host name {name} resolves to a loopback address and no interface holds {host} (the "
                          f"route to {master_addr}): set GLOO_SOCKET_IFNAME and NCCL_SOCKET_IFNAME")
    return host, {v: ifname for v in unset}, (
        f"host name {name} resolves to a loopback address: this node is reached at {host} on interface {ifname} "
        f"(the route to the master address {master_addr}), and its workers' {' and '.join(unset)} name it")
