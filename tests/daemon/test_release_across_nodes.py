"""A buffer released after collectives across nodes is unmapped by its daemon at once.

Two daemons on loopback (TCP peers), a rank on each. Before, the daemons kept every
released buffer mapped until Python's cyclic collector next ran, which it need not do for
long: a finished run and its transport requests formed a cycle that held the run's views,
and the TCP writer thread held the last message it sent while it waited for the next one.
At 64 MiB a buffer, three release rounds left 192 MiB mapped in each daemon."""

from __future__ import annotations

import time
from pathlib import Path

import numpy as np
import pytest

import lpsync_client
from tests.daemon.harness import PeeredDaemons, run_ranks

ROUNDS = 3
CALLS = 16  # past the tuner's trials (13 calls), and the armed runs after them where native
SIZE = 4 << 20  # 16 MiB: messages that outrun a socket buffer, runs long enough to age


def mapped_segments(pid: int) -> set[str]:
    """The /dev/shm segments mapped into process ``pid`` now (by name: an unlinked one's
    line ends in " (deleted)", and stays while it is mapped)."""
    lines = Path(f"/proc/{pid}/maps").read_text().splitlines()
    return {line.split("/dev/shm/", 1)[1].split()[0] for line in lines if "/dev/shm/lpsync-" in line}


def release_rounds(rank: int, sockets: list[str], daemon_pids: list[int], job: str) -> list[list[str]]:
    """Each round: a buffer, allreduces on it, its release; what of it the daemon still
    maps 5 s later (nothing, when it is right)."""
    stayed = []
    daemon = daemon_pids[rank]
    with lpsync_client.connect(sockets[rank], job=job, rank=rank, world_size=2, timeout=60) as c:
        c.barrier()
        for _ in range(ROUNDS):
            before = mapped_segments(daemon)
            x = c.zeros(SIZE, "float32")
            mine = mapped_segments(daemon) - before  # the daemon made it: mapped at once
            assert len(mine) == 1, mine
            for call in range(CALLS):
                x[:] = rank + 1 + call
                c.allreduce(x)
                assert np.all(x == 2 * call + 3), (call, x[:4])
            c.release(x)
            del x
            c.barrier()
            deadline = time.monotonic() + 5.0
            while (left := mine & mapped_segments(daemon)) and time.monotonic() < deadline:
                time.sleep(0.05)
            stayed.append(sorted(left))
            c.barrier()
    return stayed


@pytest.mark.parametrize("native", ["on", "off"])
def test_a_released_buffer_is_unmapped_after_collectives_across_nodes(tmp_path: Path, native: str) -> None:
    cluster = PeeredDaemons(tmp_path, 2, "--peer-transport", "tcp", "--native", native)
    try:
        pids = [d.pid for d in cluster.daemons if d is not None]
        results = run_ranks(2, release_rounds, cluster.sockets, pids, f"release-{native}", timeout=120)
    finally:
        assert not (unclean := cluster.stop()), "\n".join(unclean)
    assert results == [[[]] * ROUNDS] * 2, results
