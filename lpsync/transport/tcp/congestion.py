"""The TCP congestion control of the peer plane's sockets (TCP_CONGESTION, tcp(7)).

The daemons set it on their own sockets rather than leave it to the host's default: on a
host whose default is BBR (v1, as this kernel ships it) a pipelined ring keeps every link's
queue busy, so a flow never sees the empty queue that refreshes BBR's minimum RTT; every
10 s each flow then drops to 4 packets in flight for 200 ms (ProbeRTT), and the ring waits
for it. On 8 emulated nodes that made about half of the 64 MiB allreduces 15% slower
(1.14 s against 0.99 s), where gloo's unpipelined steps were not; with CUBIC, Linux's
default, every call took 0.99 s (docs/benchmarks.md).
"""

from __future__ import annotations

import socket
from pathlib import Path

from lpsync.errors import InvalidArgumentError

AVAILABLE = Path("/proc/sys/net/ipv4/tcp_available_congestion_control")
HOST_DEFAULT = Path("/proc/sys/net/ipv4/tcp_congestion_control")


def host_default() -> str:
    """The congestion control a socket gets unless told ("" where unreadable)."""
    try:
        return HOST_DEFAULT.read_text().strip()
    except OSError:
        return ""


def ucx_over_bbr(transport: str, ucx_tls: str, default: str, rdma: bool) -> str | None:
    """Why the UCX peer transport will stall on this host, or None: UCX over TCP makes its
    own sockets, which take the host's default, and BBR's ProbeRTT stalls a pipeline.
    ``rdma``: the node has an RDMA device (UCX's choice, ``ucx_tls`` "", takes it)."""
    if transport != "ucx" or not default.startswith("bbr"):
        return None
    if (ucx_tls and "tcp" not in ucx_tls.split(",")) or (not ucx_tls and rdma):
        return None  # RDMA or shared memory carry the data
    return (
        f"the host's TCP congestion control is {default}: UCX's TCP sockets take it, and its "
        "ProbeRTT stalls pipelined collectives (a 64 MiB allreduce on 8 nodes: up to 15% "
        "slower per call); use --peer-transport tcp (CUBIC on its own sockets) or CUBIC as "
        "the host's default (docs/multinode.md)"
    )


def apply(sock: socket.socket, name: str) -> None:
    """Use ``name`` on ``sock``; "" keeps the host's default."""
    if name:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, name.encode())


def check(name: str) -> None:
    """Refuse a congestion control this host cannot give a socket (not built or loaded,
    or not allowed to this process), before any peer connects."""
    if not name:
        return
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        try:
            apply(probe, name)
        except OSError as error:
            try:
                available = AVAILABLE.read_text().split()
            except OSError:
                available = []
            raise InvalidArgumentError(
                f"peer_tcp_congestion {name!r}: this host cannot use it ({error.strerror}); "
                f"available: {', '.join(available) or 'unknown'}. An empty value keeps the "
                "host's default (net.ipv4.tcp_congestion_control)"
            ) from None
