"""Client processes for the point-to-point tests (spawned: importable by name)."""

from __future__ import annotations

import time

import numpy as np

import lpsync_client
from tests.daemon.layout_workers import _store


def ring_and_tags(rank: int, world: int, sockets: list[str], port: int, job: str) -> list[str]:
    """Each rank sends to the next (a ring, async both ways), then messages whose tags are
    received in the other order than they were sent, then a large message; the failures."""
    failures: list[str] = []
    with lpsync_client.connect(
        sockets[rank], job=job, rank=rank, world_size=world, store=_store(rank, world, port), timeout=30
    ) as c:
        right, left = (rank + 1) % world, (rank - 1) % world
        for step in range(3):
            out = c.zeros(5, "int64")
            out[:] = rank * 100 + step
            got = c.zeros(5, "int64")
            sent = c.send_async(out, right)
            c.recv(got, left)
            sent.result(30)
            if list(got) != [left * 100 + step] * 5:
                failures.append(f"ring step {step}: got {list(got)} from {left}")
        # Tag 7 sent before tag 3; the receiver takes tag 3 first: tags never wait on each other.
        if rank == 0:
            a, b = np.full(3, 7.0, np.float32), np.full(3, 3.0, np.float32)
            f7, f3 = c.send_async(a, 1, tag=7), c.send_async(b, 1, tag=3)
            f7.result(30)
            f3.result(30)
        elif rank == 1:
            x, y = np.zeros(3, np.float32), np.zeros(3, np.float32)
            c.recv(y, 0, tag=3)
            c.recv(x, 0, tag=7)
            if list(x) != [7.0] * 3 or list(y) != [3.0] * 3:
                failures.append(f"tags: tag 7 got {list(x)}, tag 3 got {list(y)}")
        # A large message (the pipeline, not the agreement, across nodes).
        big = np.arange(400_000, dtype=np.float64) + rank
        if rank == world - 1:
            c.send(big, 0, tag=1)
        elif rank == 0:
            into = np.zeros_like(big)
            c.recv(into, world - 1, tag=1)
            if not np.array_equal(into, np.arange(400_000, dtype=np.float64) + world - 1):
                failures.append("large message differs")
        c.barrier()
    return failures


def wrong_size(rank: int, socket: str, job: str) -> tuple[str, float]:
    """Rank 0 sends 8 elements, rank 1 posts a receive of 6: both fail at once, naming both."""
    with lpsync_client.connect(socket, job=job, rank=rank, world_size=2, timeout=20) as c:
        started = time.monotonic()
        try:
            if rank == 0:
                c.send(np.ones(8, np.float32), 1)
            else:
                c.recv(np.zeros(6, np.float32), 0)
            return "no error", 0.0
        except lpsync_client.LpsyncError as error:
            return f"{type(error).__name__}: {error}", time.monotonic() - started


def dies_before_sending(rank: int, socket: str, job: str) -> tuple[str, float]:
    """Rank 0 exits without sending; rank 1's pending receive fails within the bound."""
    import os

    with lpsync_client.connect(socket, job=job, rank=rank, world_size=2, timeout=60) as c:
        c.barrier()
        if rank == 0:
            c.ping()
            c.send(np.ones(1, np.float32), 1, tag=9)  # opens the pair job, delivered
            os._exit(0)
        c.recv(np.zeros(1, np.float32), 0, tag=9)
        started = time.monotonic()
        try:
            c.recv(np.zeros(1, np.float32), 0, tag=9)
            return "no error", 0.0
        except lpsync_client.LpsyncError as error:
            return f"{type(error).__name__}: {error}", time.monotonic() - started
