"""lpsync.transport.tcp.congestion: the peer sockets' congestion control, checked against
the kernel with real sockets, and the warning for UCX's own sockets under BBR."""

from __future__ import annotations

import socket

import pytest

from lpsync.errors import InvalidArgumentError
from lpsync.transport.tcp import congestion


def test_apply_sets_what_the_kernel_reports() -> None:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        congestion.apply(sock, "reno")
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, 16).rstrip(b"\0") == b"reno"
        congestion.apply(sock, "")  # the host's default: left as it is
        assert sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, 16).rstrip(b"\0") == b"reno"


def test_check_names_what_the_host_offers() -> None:
    congestion.check("")
    congestion.check("cubic")
    with pytest.raises(InvalidArgumentError, match=r"available: .*cubic") as refused:
        congestion.check("no-such-algorithm")
    assert "host's default" in str(refused.value)


def test_choose_says_what_the_sockets_run_and_why() -> None:
    host = congestion.host_default()
    assert congestion.choose("") == (
        "",
        host,
        'the host\'s default (--peer-tcp-congestion "")',
    )
    assert congestion.choose("reno") == (
        "reno",
        "reno",
        f"--peer-tcp-congestion; the host's default is {host}",
    )
    with pytest.raises(InvalidArgumentError, match="no-such-algorithm"):
        congestion.choose("no-such-algorithm")
    auto = congestion.choose("auto")
    # Where this process may set cubic (root here), auto gives it; the fallback is
    # provoked for real in tests/daemon/test_peer_congestion.py (no CAP_NET_ADMIN).
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, b"cubic")
            allowed = True
        except PermissionError:
            allowed = False
    if allowed:
        assert auto == ("cubic", "cubic", f"auto: cubic whatever the host's default ({host})")
    else:
        assert auto.setting == "" and auto.name == host and "may not set cubic" in auto.reason


@pytest.mark.parametrize(
    ("transport", "tls", "default", "rdma", "warned"),
    [
        ("ucx", "tcp", "bbr", True, True),  # forced onto TCP, RDMA or not
        ("ucx", "", "bbr", False, True),  # UCX chooses, and TCP is all it has
        ("ucx", "", "bbr", True, False),  # UCX chooses its verbs transports
        ("ucx", "rc,sm", "bbr", True, False),
        ("ucx", "tcp", "cubic", False, False),
        ("tcp", "tcp", "bbr", False, False),  # the tcp backend sets its own
    ],
)
def test_ucx_over_bbr_is_warned_of(transport: str, tls: str, default: str, rdma: bool, warned: bool) -> None:
    why = congestion.ucx_over_bbr(transport, tls, default, rdma)
    assert (why is not None) == warned
    if why is not None:
        assert "bbr" in why and "--peer-transport tcp" in why
