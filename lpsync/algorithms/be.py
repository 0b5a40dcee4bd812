"""BE (bidirectional exchange) collectives, as MPI implementations build them.

broadcast = binomial scatter + allgather; reduce = reduce-scatter + binomial gather;
allreduce = reduce-scatter + allgather (Rabenseifner). Reduce-scatter and allgather use
recursive halving/doubling when P is a power of two and the ring otherwise, so every
P works; docs/architecture.md discusses the cost of that fallback.
"""

from __future__ import annotations

import numpy as np

from lpsync.algorithms.patterns import (
    allgather_blocks,
    binomial_down,
    binomial_up,
    partials_at_root,
    reduce_scatter_blocks,
    rotation,
)
from lpsync.algorithms.schedule import Buf, Schedule, ScheduleBuilder, split
from lpsync.types import Collective


def broadcast_be(participants: int, count: int, root: int = 0, chunks: int = 1) -> Schedule:
    p = participants
    b = ScheduleBuilder(Collective.BROADCAST, "be", p, count, root)
    ranks, bounds = rotation(p, root), split(count, p)
    b.copy(0, root, Buf.OUT, 0, bounds[1], Buf.IN, 0)  # the root's own block, for the allgather
    steps = binomial_down(b, ranks, bounds, 0, Buf.IN, Buf.OUT)
    allgather_blocks(b, ranks, bounds, steps, Buf.OUT)  # the root receives the other blocks
    return b.build()


def reduce_be(participants: int, count: int, root: int = 0, chunks: int = 1) -> Schedule:
    p = participants
    b = ScheduleBuilder(Collective.REDUCE, "be", p, count, root)
    ranks, bounds = rotation(p, root), split(count, p)
    work = partials_at_root(p)
    steps = reduce_scatter_blocks(b, ranks, bounds, 0, work, work, bounds[:-1])
    binomial_up(b, ranks, bounds, steps, work)
    b.need_tmp(count)
    return b.build()


def allreduce_be(participants: int, count: int, root: int = 0, chunks: int = 1) -> Schedule:
    p = participants
    b = ScheduleBuilder(Collective.ALLREDUCE, "be", p, count)
    ranks, bounds = np.arange(p), split(count, p)
    out = np.full(p, Buf.OUT)
    steps = reduce_scatter_blocks(b, ranks, bounds, 0, out, out, bounds[:-1])
    allgather_blocks(b, ranks, bounds, steps, Buf.OUT)
    return b.build()


def allgather_be(participants: int, count: int, root: int = 0, chunks: int = 1) -> Schedule:
    p = participants
    b = ScheduleBuilder(Collective.ALLGATHER, "be", p, count)
    ranks, bounds = np.arange(p), np.arange(p + 1, dtype=np.int64) * count
    b.copy(0, ranks, Buf.OUT, bounds[:-1], bounds[1:], Buf.IN, 0)
    allgather_blocks(b, ranks, bounds, 1, Buf.OUT)
    return b.build()


def reduce_scatter_be(participants: int, count: int, root: int = 0, chunks: int = 1) -> Schedule:
    p = participants
    b = ScheduleBuilder(Collective.REDUCE_SCATTER, "be", p, count)
    ranks, bounds = np.arange(p), np.arange(p + 1, dtype=np.int64) * count
    reduce_scatter_blocks(
        b, ranks, bounds, 0, np.full(p, Buf.TMP), np.full(p, Buf.OUT), np.zeros(p, np.int64)
    )
    b.need_tmp(p * count)
    return b.build()
