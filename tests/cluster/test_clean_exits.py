"""Every daemon exits within 5 s of SIGTERM, idle and mid-collective, with either peer
transport, leaving no shared memory, sockets, processes or namespaces (root: an emulated
cluster; 8 and 16 nodes are measured by `python -m lab.exits`, docs/reliability.md)."""

from __future__ import annotations

import os

import pytest

from lab.exits import BOUND, measure
from tests.cluster.test_cluster import needs_netns

pytest.importorskip("ucxx")


@needs_netns
@pytest.mark.parametrize("busy", [False, True], ids=["idle", "mid-collective"])
@pytest.mark.parametrize("transport", ["tcp", "ucx"])
@pytest.mark.parametrize("nodes", [2, 5])
def test_every_daemon_exits_cleanly_within_the_bound(nodes: int, transport: str, busy: bool) -> None:
    point = measure(nodes, transport, busy, prefix=f"tx{os.getpid() % 100000}")
    assert len(point.exits) == nodes
    assert not point.leftover, point.leftover
    for e in point.exits:
        assert e.code == 0, (e, point.row())
        assert not e.shm and not e.sockets, e
        assert e.seconds <= BOUND, point.row()
    print(point.row())
