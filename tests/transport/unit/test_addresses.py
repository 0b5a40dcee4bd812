"""Peer address lists as --peers gives them."""

from __future__ import annotations

import pytest

from lpsync.errors import ConfigError
from lpsync.transport.addresses import PeerAddress, parse_address, parse_peers


def test_parse_peers_in_rank_order() -> None:
    assert parse_peers("a:1, 10.0.0.2:13337,[fe80::1]:9") == [
        PeerAddress("a", 1),
        PeerAddress("10.0.0.2", 13337),
        PeerAddress("fe80::1", 9),
    ]
    assert str(PeerAddress("fe80::1", 9)) == "[fe80::1]:9"


@pytest.mark.parametrize("bad", ["host", "host:", ":80", "host:0", "host:70000", "host:http"])
def test_bad_addresses_are_refused(bad: str) -> None:
    with pytest.raises(ConfigError):
        parse_address(bad)


def test_duplicates_and_empty_lists_are_refused() -> None:
    with pytest.raises(ConfigError, match="twice"):
        parse_peers("a:1,b:2,a:1")
    with pytest.raises(ConfigError, match="empty"):
        parse_peers(" , ")


def test_auto_transport_takes_ucx_only_where_an_rdma_device_exists(tmp_path) -> None:
    from lpsync.transport import backends

    empty = tmp_path / "infiniband"
    assert backends.resolve("auto", backends.Rdma.scan(empty))[0] == "tcp"  # no RDMA stack at all
    empty.mkdir()
    chosen, why = backends.resolve("auto", backends.Rdma.scan(empty))
    assert chosen == "tcp" and "no RDMA device" in why
    (empty / "mlx5_0").mkdir()
    (empty / "mlx5_1").mkdir()
    chosen, why = backends.resolve("auto", backends.Rdma.scan(empty))
    assert chosen == "ucx" and "mlx5_0, mlx5_1" in why
    assert backends.resolve("tcp", backends.Rdma.scan(empty)) == ("tcp", "asked for (--peer-transport)")
    assert backends.resolve("ucx", backends.Rdma.scan(tmp_path / "none"))[0] == "ucx"


def test_auto_ucx_tls_lets_ucx_choose_only_where_an_rdma_device_exists(tmp_path) -> None:
    from lpsync.transport import backends

    where = tmp_path / "infiniband"
    tls, why = backends.resolve_tls("auto", backends.Rdma.scan(where))
    assert tls == "tcp" and "no RDMA device" in why  # co-located daemons stay off shared memory
    where.mkdir()
    (where / "mlx5_0").mkdir()
    tls, why = backends.resolve_tls("auto", backends.Rdma.scan(where))
    assert tls == "" and "mlx5_0" in why and "UCX chooses" in why  # its verbs transports, not TCP
    assert backends.resolve_tls("tcp", backends.Rdma.scan(where)) == ("tcp", "asked for (--ucx-tls)")
    assert backends.resolve_tls("", backends.Rdma.scan(where)) == ("", "asked for (--ucx-tls)")
    assert backends.resolve_tls("rc,sm", backends.Rdma.scan(tmp_path / "none"))[0] == "rc,sm"
