"""The TCP congestion control of the peer plane's sockets (TCP_CONGESTION, tcp(7)).

The daemons set it on their own sockets rather than leave it to the host's default: on a
host whose default is BBR (v1, as this kernel ships it) a pipelined ring keeps every link's
queue busy, so a flow never sees the empty queue that refreshes BBR's minimum RTT; every
10 s each flow then drops to 4 packets in flight for 200 ms (ProbeRTT), and the ring waits
for it. On 8 emulated nodes that made about half of the 64 MiB allreduces 15% slower
(1.14 s against 0.99 s), where gloo's unpipelined steps were not; with CUBIC, Linux's
default, every call took 0.99 s (docs/benchmarks.md).

"auto", the daemon's default, asks for CUBIC and keeps the host's default where this
process may not set it: the kernel lets a process without CAP_NET_ADMIN set only the names
in net.ipv4.tcp_allowed_congestion_control, and a container usually lacks it. A daemon in
a container on a BBR host then still starts, and says why its sockets run BBR.
"""

from __future__ import annotations

import errno
import socket
from pathlib import Path
from typing import NamedTuple

from lpsync.errors import InvalidArgumentError

AUTO = "auto"
PREFERRED = "cubic"  # what auto asks for: Linux's default, no ProbeRTT
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


class Choice(NamedTuple):
    """What the tcp transport's peer sockets run."""

    setting: str  # set on each socket; "" leaves the host's default
    name: str  # what they run
    reason: str  # where it came from, for the startup log and `lpsync status`


def choose(asked: str) -> Choice:
    """Resolve --peer-tcp-congestion before any peer connects: "auto" (CUBIC where this
    process may set it, else the host's default), "" (the host's default), or a name,
    refused where this host cannot give it to a socket."""
    default = host_default() or "unknown"
    if not asked:
        return Choice("", default, 'the host\'s default (--peer-tcp-congestion "")')
    if asked != AUTO:
        check(asked)
        return Choice(asked, asked, f"--peer-tcp-congestion; the host's default is {default}")
    refused = _refusal(PREFERRED)
    if refused is None:
        return Choice(PREFERRED, PREFERRED, f"auto: {PREFERRED} whatever the host's default ({default})")
    return Choice(
        "",
        default,
        f"auto: the host's default, since this process may not set {PREFERRED} ({refused})",
    )


def check(name: str) -> None:
    """Refuse a congestion control this host cannot give a socket (not built or loaded,
    or not allowed to this process), before any peer connects."""
    refused = _refusal(name) if name else None
    if refused is None:
        return
    try:
        available = AVAILABLE.read_text().split()
    except OSError:
        available = []
    raise InvalidArgumentError(
        f"peer_tcp_congestion {name!r}: this host cannot use it ({refused}); "
        f"available: {', '.join(available) or 'unknown'}. An empty value keeps the "
        f"host's default (net.ipv4.tcp_congestion_control); {AUTO!r} asks for {PREFERRED} and "
        "keeps the host's default where that is not allowed"
    )


def _refusal(name: str) -> str | None:
    """Why a socket of this process cannot take ``name`` (the kernel's words), or None."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as probe:
        try:
            apply(probe, name)
        except OSError as error:
            if error.errno == errno.EPERM:
                # Without CAP_NET_ADMIN only the names the sysctl allows; a container's lot.
                return f"{error.strerror}: not in net.ipv4.tcp_allowed_congestion_control, no CAP_NET_ADMIN"
            return error.strerror or str(error)
    return None
