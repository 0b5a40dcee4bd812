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
