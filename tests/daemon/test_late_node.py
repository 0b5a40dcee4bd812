"""A node whose rank issues a collective only after the other nodes failed it (and the
mesh that their failure broke is rebuilt) fails it at once, with their error: each node
that failed it tells the next mesh (path._announce_later). Before, it waited out its own
timeout on the new mesh, and that timeout broke the new mesh too."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.daemon.harness import PeeredDaemons, run_ranks
from tests.daemon.multinode_workers import attempt, one_allreduce

TIMEOUT = 3.0  # each rank's collective timeout
LATE = 5.0  # node 1's rank issues its collective this long after attaching


@pytest.mark.parametrize("transport", ["tcp", "ucx"])
def test_a_node_that_comes_after_a_timeout_fails_at_once(tmp_path: Path, transport: str) -> None:
    cluster = PeeredDaemons(tmp_path, 2, "--peer-transport", transport)
    try:
        results = run_ranks(2, attempt, cluster.sockets, 1, "late", 2, 1, LATE, TIMEOUT, timeout=60)
        kind, seconds, message = results[0]
        assert kind == "CollectiveTimeoutError", results[0]  # node 0 waited for node 1
        assert TIMEOUT - 0.1 <= seconds < TIMEOUT + 3.0, results[0]
        kind, seconds, message = results[1]
        # Node 1's rank came after node 0's timeout broke the mesh and it was rebuilt: it
        # hears node 0's error there instead of waiting out its own 3 s.
        assert kind == "CollectiveTimeoutError", results[1]
        assert seconds < 1.5, results[1]
        assert "failed on another node: node 0" in message and "timed out" in message, message
        assert run_ranks(2, one_allreduce, cluster.sockets, 1, "after", 2, timeout=60) == [3, 3]
        # Node 0's timeout broke the first mesh; node 1 broke no other one.
        assert cluster.log(0).count("peer mesh up") == 2, cluster.log(0)[-3000:]
    finally:
        cluster.stop_and_check()
