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
