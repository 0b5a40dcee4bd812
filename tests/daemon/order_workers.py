"""Client bodies of the issue-order tests (test_issue_order.py): every rank issues
allreduce -> broadcast -> allreduce on one buffer without waiting in between, then waits
on all three. In issue order every rank ends with 3x the sum of the inputs."""

from __future__ import annotations

import numpy as np

import lpsync_client
from tests.daemon.layout_workers import _store

# Small counts take the direct path (the event loop runs them inline), large ones a worker
# thread: the mix is what used to let a later collective overtake an earlier one.
COUNTS = (3, 50_000, 7, 200_000)


def three_in_flight(
    rank: int,
    world: int,
    sockets: list[str],
    port: int | None,
    job: str,
    rounds: int,
    counts: tuple[int, ...] = COUNTS,
    shared: bool = True,
) -> list[str]:
    """``rounds`` rounds of the three; the rounds whose result was not 3x the sum. On the
    client's shared-memory arrays (``shared``) or on plain numpy arrays (staged)."""
    store = _store(rank, world, port) if port is not None else None
    wrong: list[str] = []
    with lpsync_client.connect(
        sockets[rank], job=job, rank=rank, world_size=world, store=store, timeout=60
    ) as c:
        buffers = {count: c.zeros(count, "float64") if shared else np.zeros(count) for count in counts}
        for i in range(rounds):
            count = counts[i % len(counts)]
            x = buffers[count]
            x[:] = np.arange(count) + 10.0 * (rank + 1) + i
            expected = 3 * (np.arange(count) * world + 5.0 * world * (world + 1) + i * world)
            futures = [c.allreduce_async(x), c.broadcast_async(x, root=1 % world), c.allreduce_async(x)]
            for f in futures:
                f.result(60)
            if not np.array_equal(x, expected):
                wrong.append(f"round {i} ({count} elements): {x[:3]}... expected {expected[:3]}...")
    return wrong


def torch_three_in_flight(rank: int, world: int, sockets: list[str], port: int, rounds: int) -> list[str]:
    """The same through the torch backend on plain tensors (staged by the backend); the
    ranks find their nodes through the store (no LOCAL_* hints)."""
    import torch
    import torch.distributed as dist

    from tests.client.torch_backend.layout_workers import init

    init(rank, world, sockets, port)
    wrong: list[str] = []
    try:
        for i in range(rounds):
            count = COUNTS[i % len(COUNTS)]
            t = torch.arange(count, dtype=torch.float64) + 10.0 * (rank + 1) + i
            expected = 3 * (
                torch.arange(count, dtype=torch.float64) * world + 5.0 * world * (world + 1) + i * world
            )
            works = [
                dist.all_reduce(t, async_op=True),
                dist.broadcast(t, src=1 % world, async_op=True),
                dist.all_reduce(t, async_op=True),
            ]
            for w in works:
                w.wait()
            if not torch.equal(t, expected):
                wrong.append(
                    f"round {i} ({count} elements): {t[:3].tolist()}... expected {expected[:3].tolist()}..."
                )
    finally:
        dist.destroy_process_group()
    return wrong
