"""send/recv through real daemons: a ring of async sends, tags received out of their
sending order, a large message, on one daemon and across daemons 1 and 2 of three (a job
that skips daemon 0); a receive of the wrong size and a sender that dies fail at once."""

from __future__ import annotations

import re
import time
from pathlib import Path

import numpy as np
import pytest

import lpsync_client
from lpsync.daemon import launch
from tests.daemon.harness import PeeredDaemons, run_ranks
from tests.daemon.p2p_workers import any_source, dies_before_sending, ring_and_tags, wrong_size
from tests.ports import free_ports


def test_send_recv_on_one_daemon(daemon) -> None:
    results = run_ranks(3, ring_and_tags, 3, [daemon.socket] * 3, free_ports(1)[0], "p2p-one", timeout=120)
    assert results == [[], [], []], results


def test_receive_from_any_source_on_one_daemon(daemon) -> None:
    results = run_ranks(3, any_source, 3, [daemon.socket] * 3, free_ports(1)[0], "p2p-any", timeout=120)
    assert results == [[], [], []], results


def test_send_recv_across_daemons_1_and_2(tmp_path: Path) -> None:
    cluster = PeeredDaemons(tmp_path, 3, "--peer-transport", "tcp")
    try:
        sockets = [cluster.sockets[n] for n in (1, 2, 2)]
        results = run_ranks(3, ring_and_tags, 3, sockets, free_ports(1)[0], "p2p-nodes", timeout=180)
        assert results == [[], [], []], results
        # From any source: rank 0 on daemon 1, its senders on daemon 2 (announced by note).
        results = run_ranks(3, any_source, 3, sockets, free_ports(1)[0], "p2p-any-nodes", timeout=180)
        assert results == [[], [], []], results
    finally:
        unclean = cluster.stop()
    assert not unclean, "\n".join(unclean)


def test_a_receive_of_another_size_fails_both_sides(daemon) -> None:
    for rank, (message, seconds) in enumerate(run_ranks(2, wrong_size, daemon.socket, "p2p-size")):
        assert message.startswith("MismatchError"), (rank, message)
        assert "count" in message and "8" in message and "6" in message, message
        assert seconds < 5.0, seconds


def test_a_sender_that_dies_fails_the_receive(daemon) -> None:
    (result,) = [r for r in run_ranks(2, dies_before_sending, daemon.socket, "p2p-dies", dies=(0,)) if r]
    message, seconds = result
    # Named either way the daemon words it: "rank 0 ... left" when the receive was waiting,
    # "lost rank(s) 0 (...)" when the loss was seen before the receive arrived.
    assert message.startswith("AbortedError") and re.search(r"rank(\(s\))? 0\b", message), message
    assert seconds < 5.0, seconds


def test_status_shows_a_receive_from_any_source_that_waits(daemon) -> None:
    with lpsync_client.connect(daemon.socket, job="any-wait", rank=0, world_size=2, timeout=30) as c:
        pending = c.recv_any_async(np.zeros(1, np.int32), tag=4, timeout=3.0)
        deadline, waits = time.monotonic() + 10, []
        while not waits and time.monotonic() < deadline:
            jobs = {j.job: j for j in launch.status(daemon.socket).jobs}
            waits = [(w.rank, w.tag) for w in jobs["any-wait"].receiving_any] if "any-wait" in jobs else []
            time.sleep(0.05)
        assert waits == [(0, 4)]
        with pytest.raises(lpsync_client.CollectiveTimeoutError, match="from any source"):
            pending.result(30)
        jobs = {j.job: j for j in launch.status(daemon.socket).jobs}
        assert not jobs["any-wait"].receiving_any  # gone with its timeout
