"""Client bodies for test_overload.py, run in spawned processes (importable by name)."""

from __future__ import annotations

import os

import numpy as np

import lpsync_client


def steady(rank: int, socket: str, job: str, stop_path: str) -> tuple[int, int]:
    """A well-behaved 2-rank job: allreduces checked against numpy until ``stop_path``
    exists. Rank 0 puts the stop flag into the reduced data, so both ranks stop on the same
    iteration. Returns (iterations, wrong results)."""
    rng, partner = np.random.default_rng(rank), np.random.default_rng(1 - rank)
    done = wrong = 0
    with lpsync_client.connect(socket, job=job, rank=rank, world_size=2, timeout=60) as c:
        x = c.zeros(257, "int64")
        while True:
            mine = rng.integers(-1000, 1000, 256)
            theirs = partner.integers(-1000, 1000, 256)  # the other rank's draw (numpy)
            x[0] = int(rank == 0 and os.path.exists(stop_path))
            x[1:] = mine
            c.allreduce(x)
            wrong += int(not np.array_equal(x[1:], mine + theirs))
            done += 1
            if x[0]:
                return done, wrong


def churn(index: int, socket: str, rounds: int) -> int:
    """Attach, run one collective, detach — ``rounds`` times."""
    for i in range(rounds):
        with lpsync_client.connect(socket, job=f"churn-{index}-{i}", rank=0, world_size=1, timeout=30) as c:
            x = c.zeros(8)
            x[:] = i
            c.allreduce(x)
            assert x.tolist() == [i] * 8
    return rounds


def pending_partner(_: int, socket: str, job: str, n: int, go) -> list[str]:
    """Rank 1 of a job whose rank 0 already has ``n`` collectives pending: joins them when
    ``go`` is set; returns each one's outcome ("ok" or the error class)."""
    with lpsync_client.connect(socket, job=job, rank=1, world_size=2, timeout=60) as c:
        inp = c.zeros((n, 4), "int64")
        out = c.zeros((n, 4), "int64")
        inp[:] = 2 * np.arange(n)[:, None]
        assert go.wait(60)
        futures = [c.allreduce_async(inp[i], out=out[i]) for i in range(n)]
        outcomes = []
        for i, f in enumerate(futures):
            try:
                f.result(timeout=60)
                outcomes.append("ok" if out[i].tolist() == [3 * i] * 4 else f"wrong {out[i]}")
            except lpsync_client.LpsyncError as error:
                outcomes.append(type(error).__name__)
        c.allreduce(c.zeros(2))  # the job's numbering is still aligned
        return outcomes
