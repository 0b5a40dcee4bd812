"""Daemons on the emulated device made as strict as CUDA (issue 25, points 6 and 7), with
real client processes."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

import lpsync_client
from lpsync_client import emulated
from tests.daemon.harness import PeeredDaemons, run_ranks

COUNT = 8192  # 32 KiB of float32: at most 64 KiB, so the data rides the cross-node agreement


def _small_across_nodes(rank: int, sockets: list[str]) -> list[float]:
    os.environ["LOCAL_RANK"], os.environ["LOCAL_WORLD_SIZE"] = "0", "1"
    with lpsync_client.connect(
        sockets[rank], job="small-landed", rank=rank, world_size=2, timeout=60
    ) as client:
        x = emulated.asarray(np.full(COUNT, rank + 1.0, np.float32))
        client.allreduce(x)
        seen = x.host.copy()  # the memory itself, the moment the daemon answered
        return [float(seen.min()), float(seen.max())]


def test_cuda_contract_a_small_cross_node_result_has_landed_when_answered(tmp_path: Path):
    """A collective small enough to ride the agreement is answered only once its result is
    in the clients' device memory (point 6). The emulated devices copy at 200 kB/s, and a
    pageable host-to-device write (kind.write, cudaMemcpy) lands after it returned, as on
    CUDA: answering after one, the client read its own input."""
    daemons = PeeredDaemons(tmp_path, 2, "--devices", "emulated:1,bw=200000")
    try:
        for seen in run_ranks(2, _small_across_nodes, daemons.sockets, timeout=120):
            assert seen == [3.0, 3.0], f"the answer came before the result landed: min, max {seen}"
    finally:
        daemons.stop_and_check()
