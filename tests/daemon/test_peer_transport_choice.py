"""``--peer-transport auto`` (the default): UCX where the node has an RDMA device, the TCP
backend elsewhere; the daemon says which it chose and why, and a cluster on the default
forms its mesh and runs collectives."""

from __future__ import annotations

import json
from pathlib import Path

from lpsync.transport import backends
from tests.daemon.harness import PeeredDaemons, run_ranks
from tests.daemon.multinode_workers import one_allreduce


def _choice(log: str) -> dict:
    for line in log.splitlines():
        entry = json.loads(line) if line.startswith("{") else {}
        if entry.get("msg") == "peers":
            return entry
    raise AssertionError(f"no 'peers' line in the log:\n{log[-2000:]}")


def test_the_default_transport_is_chosen_by_the_node_and_said(tmp_path: Path) -> None:
    expected = "ucx" if backends.rdma_devices() else "tcp"
    cluster = PeeredDaemons(tmp_path, 2)
    try:
        for node in range(2):
            entry = _choice(cluster.log(node))
            assert entry["peer_transport"] == expected, entry
            assert entry["why"].startswith("auto: "), entry
        values = run_ranks(2, one_allreduce, cluster.sockets, 1, "auto-transport", 2, timeout=60)
        assert values == [1 + 2, 1 + 2]  # every element is the sum of rank + 1 over both ranks
    finally:
        cluster.stop_and_check()
