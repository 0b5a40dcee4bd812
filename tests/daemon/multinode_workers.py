"""Client bodies of the multi-node tests: node-major ranks, each on its node's daemon."""

from __future__ import annotations

import os
import time

import numpy as np

import lpsync_client
from tests.daemon.workers import check_cases


def _node_env(rank: int, per_node: int) -> None:
    # As torchrun sets them: connect() reads LOCAL_RANK / LOCAL_WORLD_SIZE.
    os.environ["LOCAL_RANK"] = str(rank % per_node)
    os.environ["LOCAL_WORLD_SIZE"] = str(per_node)


def cases_on_nodes(
    rank: int, sockets: list[str], per_node: int, job: str, world: int, cases: list
) -> list[str]:
    _node_env(rank, per_node)
    return check_cases(rank, sockets[rank // per_node], job, world, cases)


def mismatch_on_nodes(rank: int, sockets: list[str], per_node: int, job: str, world: int) -> list[str]:
    """Every node agrees inside itself; the last node asks for another count."""
    _node_env(rank, per_node)
    node = rank // per_node
    last = world // per_node - 1
    with lpsync_client.connect(sockets[node], job=job, rank=rank, world_size=world, timeout=20) as c:
        x = c.zeros(8 if node != last else 6, "float32")
        try:
            c.allreduce(x)
            return ["no error"]
        except lpsync_client.InvalidArgumentError as error:
            got = [type(error).__name__, str(error)]
        y = c.zeros(4, "int32")
        y[:] = rank
        c.allreduce(y, algorithm="lp")  # the job still works afterwards
        got.append(str(int(y[0])))
        # Now a mismatch inside node 1: its daemon tells the others, nobody waits 20 s.
        z = c.zeros(5 if rank == per_node else 8, "float32")
        start = time.monotonic()
        try:
            c.allreduce(z)
            got.append("no error")
        except lpsync_client.LpsyncError as error:
            got += [type(error).__name__, f"{time.monotonic() - start:.2f}"]
        c.barrier()
        return got


def until_unavailable(
    rank: int, sockets: list[str], per_node: int, job: str, world: int, ready, timeout: float
) -> list:
    """Allreduce (forced LP, big enough to run a while) until one fails; report how."""
    _node_env(rank, per_node)
    with lpsync_client.connect(
        sockets[rank // per_node], job=job, rank=rank, world_size=world, timeout=timeout
    ) as c:
        x = c.zeros(4 << 20, "float32")
        done = 0
        while True:
            try:
                c.allreduce(x, algorithm="lp")
            except lpsync_client.LpsyncError as error:
                return [type(error).__name__, time.monotonic(), done, str(error)[:800]]
            done += 1
            if done == 2:
                ready.set()


def one_allreduce(rank: int, sockets: list[str], per_node: int, job: str, world: int) -> int:
    _node_env(rank, per_node)
    with lpsync_client.connect(
        sockets[rank // per_node], job=job, rank=rank, world_size=world, timeout=40
    ) as c:
        x = c.zeros(300_000, "int64")
        x[:] = rank + 1
        c.allreduce(x)
        assert np.all(x == x[0])
        return int(x[0])


def through_partition(
    rank: int, sockets: list[str], per_node: int, job: str, world: int, cut_node: int, ready, cut_done, healed
) -> list:
    """One allreduce; then the next one while the parent cuts ``cut_node`` off (its own
    ranks arrive only after the cut, so no node can finish it): report how it failed;
    once the parent says the link is back, three more allreduces on the same client,
    each checked against its expected sum."""
    _node_env(rank, per_node)
    node = rank // per_node
    with lpsync_client.connect(sockets[node], job=job, rank=rank, world_size=world, timeout=60) as c:
        x = c.zeros(1 << 16, "float32")
        x[:] = rank + 1
        c.allreduce(x)
        assert np.all(x == world * (world + 1) / 2), x[:4]
        if rank == 0:
            ready.set()
        if node == cut_node:
            assert cut_done.wait(60), "the parent never cut the link"
        try:
            c.allreduce(x)
            got: list = ["no error", time.monotonic(), ""]
        except lpsync_client.LpsyncError as error:
            got = [type(error).__name__, time.monotonic(), str(error)[:500]]
        assert healed.wait(150), "the parent never reported the mesh healed"
        after = []
        for i in range(3):
            y = c.zeros(1000 + i, "int64")
            y[:] = rank * 10 + i
            c.allreduce(y)
            after.append(bool(np.all(y == sum(r * 10 + i for r in range(world)))))
        return [*got, after]


def attempt(
    rank: int, sockets: list[str], per_node: int, job: str, world: int, late: int = -1, delay: float = 0.0
) -> list:
    """One allreduce with a 60 s timeout: [error kind or "ok", seconds, message]; rank
    ``late`` issues it ``delay`` seconds after attaching."""
    _node_env(rank, per_node)
    with lpsync_client.connect(
        sockets[rank // per_node], job=job, rank=rank, world_size=world, timeout=60
    ) as c:
        if rank == late:
            time.sleep(delay)
        return _timed_allreduce(c)


def _timed_allreduce(c) -> list:
    """One allreduce: [error kind or "ok", seconds, message]."""
    start = time.monotonic()
    try:
        c.allreduce(c.zeros(8, "float32"))
        return ["ok", time.monotonic() - start, ""]
    except lpsync_client.LpsyncError as error:
        return [type(error).__name__, time.monotonic() - start, str(error)[:500]]


def learning_allreduces(
    rank: int, sockets: list[str], per_node: int, job: str, world: int, calls: int
) -> list[str]:
    """``calls`` allreduces of 1.2 MB (past the agreement's riding size, so a schedule
    runs and node 0 learns which), each checked; then the algorithm this node's daemon
    ran for each call, in sequence order."""
    _node_env(rank, per_node)
    with lpsync_client.connect(
        sockets[rank // per_node], job=job, rank=rank, world_size=world, timeout=60
    ) as c:
        x = c.zeros(300_000, "float32")
        for call in range(calls):
            x[:] = rank + call
            c.allreduce(x)
            want = sum(range(world)) + world * call
            assert np.all(x == want), (call, x[:3], want)
        c.barrier()
        records = sorted(
            (r.sequence, r.algorithm) for r in c.status().recent if r.job == job and r.op == "allreduce"
        )
        return [algorithm for _, algorithm in records]


def unanswered(
    rank: int,
    sockets: list[str],
    per_node: int,
    job: str,
    world: int,
    timeout: float,
    idle: int = 0,
    timeouts: tuple[float, ...] = (),
    hold: float = 0.0,
) -> list:
    """Node ``idle``'s ranks attach and never call (["idle", 0, ""]), attached for
    ``hold`` seconds (default: until the others' timeouts have passed); every other rank
    runs one allreduce with ``timeout`` (or its node's in ``timeouts``): [error kind or
    "ok", seconds, message]."""
    _node_env(rank, per_node)
    node = rank // per_node
    mine = timeouts[node] if timeouts else timeout
    with lpsync_client.connect(sockets[node], job=job, rank=rank, world_size=world, timeout=mine) as c:
        if node == idle:
            time.sleep(hold or max(timeouts or (timeout,)) + 1.0)  # until the others have failed
            return ["idle", 0.0, ""]
        return _timed_allreduce(c)


def late_barrier(
    rank: int, sockets: list[str], per_node: int, job: str, world: int, late: int, delay: float
) -> list[float]:
    """A barrier that rank ``late`` enters ``delay`` s after the others (after one barrier
    of all, so every rank is attached): [entered, left], monotonic seconds."""
    _node_env(rank, per_node)
    with lpsync_client.connect(
        sockets[rank // per_node], job=job, rank=rank, world_size=world, timeout=30
    ) as c:
        c.barrier()
        if rank == late:
            time.sleep(delay)
        entered = time.monotonic()
        c.barrier()
        return [entered, time.monotonic()]


def allreduce_alone(socket: str, job: str, attached) -> None:
    """Rank 0 of a 2-rank job, one rank per node, whose rank 1 never comes: sets
    ``attached`` (an mp.Event) once attached, then blocks in an allreduce that runs across
    nodes until it is killed."""
    _node_env(0, 1)
    with lpsync_client.connect(socket, job=job, rank=0, world_size=2, timeout=120) as c:
        x = c.zeros(4, "float32")
        attached.set()
        c.allreduce(x)
