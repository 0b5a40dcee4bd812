"""Rank processes of the single-machine benchmarks: torchrun's environment for one node,
and ranks spawned, each reporting once on a queue."""

from __future__ import annotations

import multiprocessing as mp
import os
from collections.abc import Callable


def torchrun_env(rank: int, procs: int, port: int, socket: str | None = None, job: str | None = None) -> None:
    """This process's environment as torchrun would set it for ``rank`` of ``procs`` on
    one node, with its daemon's socket and the job's name where given."""
    os.environ.update(
        RANK=str(rank),
        WORLD_SIZE=str(procs),
        LOCAL_RANK=str(rank),
        LOCAL_WORLD_SIZE=str(procs),
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
    )
    if socket is not None:
        os.environ["LPSYNC_SOCKET"] = socket
    if job is not None:
        os.environ["LPSYNC_JOB"] = job


def spawn_ranks(target: Callable[..., None], args: list[tuple], timeout: float) -> list:
    """``target(*args[r], queue)`` in one spawned process per rank; what each put on the
    queue (once), sorted. A rank that puts nothing within ``timeout`` raises queue.Empty."""
    ctx = mp.get_context("spawn")
    out: mp.Queue = ctx.Queue()
    ranks = [ctx.Process(target=target, args=(*a, out)) for a in args]
    for process in ranks:
        process.start()
    try:
        return sorted(out.get(timeout=timeout) for _ in ranks)
    finally:
        for process in ranks:
            process.join(30)
            if process.is_alive():
                process.kill()
