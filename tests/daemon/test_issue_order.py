"""Issue order (DESIGN: collectives of one job whose buffers overlap execute in sequence
order): every rank issues allreduce -> broadcast -> allreduce on one buffer and only then
waits; every round must end in the in-order result (3x the sum, numpy's). On the client's
shared memory (the daemon's order) and on plain arrays and tensors (staged: the client's
and the torch backend's order), on one daemon and across three."""

from __future__ import annotations

import pytest

from tests.daemon.harness import PeeredDaemons, run_ranks
from tests.daemon.order_workers import COUNTS, three_in_flight, torch_three_in_flight
from tests.ports import free_ports


@pytest.fixture(scope="module")
def three_daemons(tmp_path_factory: pytest.TempPathFactory):
    cluster = PeeredDaemons(tmp_path_factory.mktemp("order"), 3, "--peer-transport", "tcp")
    try:
        yield cluster
    finally:
        unclean = cluster.stop()
    assert not unclean, "\n".join(unclean)


@pytest.mark.parametrize("shared", [True, False], ids=["shared-memory", "plain-arrays"])
def test_client_on_one_daemon(daemon, shared: bool) -> None:
    results = run_ranks(
        3, three_in_flight, 3, [daemon.socket] * 3, None, f"order-{shared}", 60, COUNTS, shared, timeout=150
    )
    assert results == [[], [], []], results


@pytest.mark.parametrize("shared", [True, False], ids=["shared-memory", "plain-arrays"])
def test_client_across_three_daemons(three_daemons: PeeredDaemons, shared: bool) -> None:
    results = run_ranks(
        3,
        three_in_flight,
        3,
        three_daemons.sockets,
        free_ports(1)[0],
        f"order-nodes-{shared}",
        24,
        COUNTS,
        shared,
        timeout=180,
    )
    assert results == [[], [], []], results


def test_torch_backend_on_one_daemon(daemon) -> None:
    results = run_ranks(3, torch_three_in_flight, 3, [daemon.socket] * 3, free_ports(1)[0], 60, timeout=150)
    assert results == [[], [], []], results


def test_torch_backend_across_three_daemons(three_daemons: PeeredDaemons) -> None:
    results = run_ranks(3, torch_three_in_flight, 3, three_daemons.sockets, free_ports(1)[0], 24, timeout=180)
    assert results == [[], [], []], results
