"""A node of the agreement tree whose messages never come fails at its own timeout: a
leaf waiting for the verdict (ucx and tcp), node 0 waiting for a summary (tcp); three
real daemons on loopback. With tcp no thread waits for a leaf's verdict (it finishes on
the reader, collectives/agreement.agree_later): the heartbeat watchdog expires the wait
(peers/plane.Link.watch). Its own file, so that it runs beside the long multinode file
rather than after it."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.daemon.harness import PeeredDaemons, run_ranks
from tests.daemon.multinode_workers import unanswered

pytest.importorskip("ucxx")

NODES, PER_NODE = 3, 2
WORLD = NODES * PER_NODE


@pytest.mark.parametrize("transport", ["ucx", "tcp"])
def test_a_verdict_that_never_comes_fails_the_leaves_at_their_timeout(tmp_path: Path, transport: str) -> None:
    """Node 0's ranks attach and never call, so node 0 never answers the other nodes'
    summaries. The leaves fail at their own timeout: the first one with
    CollectiveTimeoutError; its timeout breaks the mesh, so a leaf behind it may hear of a
    lost peer first."""
    cluster = PeeredDaemons(tmp_path, NODES, "--heartbeat-timeout", "3", "--peer-transport", transport)
    timeout = 2.0
    try:
        results = run_ranks(WORLD, unanswered, cluster.sockets, PER_NODE, "unanswered", WORLD, timeout)
    finally:
        unclean = cluster.stop()  # and no shared memory left (the harness checks)
    assert not unclean, unclean
    assert [kind for kind, _, _ in results[:PER_NODE]] == ["idle"] * PER_NODE, results
    leaves = results[PER_NODE:]
    for kind, seconds, message in leaves:
        assert kind in ("CollectiveTimeoutError", "UnavailableError"), (kind, message)
        # Within a watchdog tick (0.75 s here) and slack for a loaded machine: the
        # client gives up after 14 s.
        assert seconds < timeout + 4.0, (seconds, message)
        # A timeout no sooner than its own; a lost peer may come sooner (a leaf whose
        # ranks called first timed out first, and broke the mesh).
        assert kind != "CollectiveTimeoutError" or seconds >= timeout - 0.1, (seconds, message)
    timed_out = [message for kind, _, message in leaves if kind == "CollectiveTimeoutError"]
    assert timed_out and all("timed out across nodes" in m for m in timed_out), leaves


def test_a_summary_that_never_comes_fails_node_0_at_its_timeout(tmp_path: Path) -> None:
    """Node 2's ranks attach and never call, so node 0 never has every summary. Node 0's
    ranks have the shortest timeout: node 0 fails at it with CollectiveTimeoutError
    (nothing else would wake it before node 1's longer timeout), and its timeout breaks
    the mesh, so node 1 fails then too, before its own."""
    cluster = PeeredDaemons(tmp_path, NODES, "--heartbeat-timeout", "3", "--peer-transport", "tcp")
    timeouts = (2.0, 8.0, 8.0)
    try:
        results = run_ranks(
            WORLD, unanswered, cluster.sockets, PER_NODE, "no-summary", WORLD, 0.0, NODES - 1, timeouts, 5.0
        )
    finally:
        unclean = cluster.stop()  # and no shared memory left (the harness checks)
    assert not unclean, unclean
    root, leaf, idle = results[:PER_NODE], results[PER_NODE : 2 * PER_NODE], results[2 * PER_NODE :]
    assert [kind for kind, _, _ in idle] == ["idle"] * PER_NODE, results
    for kind, seconds, message in root:
        assert kind == "CollectiveTimeoutError", (kind, message)
        assert "timed out across nodes" in message, message
        # No sooner than its own timeout, within a watchdog tick and slack.
        assert timeouts[0] - 0.1 <= seconds < timeouts[0] + 4.0, (seconds, message)
    for kind, seconds, message in leaf:
        assert kind in ("UnavailableError", "CollectiveTimeoutError"), (kind, message)
        assert seconds < timeouts[1] - 1.0, (seconds, message)  # the broken mesh, not its own
