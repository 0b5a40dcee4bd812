"""Ring collectives (what NCCL, Gloo and Horovod use): allreduce = reduce-scatter + allgather."""

from __future__ import annotations

import numpy as np

from lpsync.algorithms.patterns import ring_allgather, ring_reduce_scatter
from lpsync.algorithms.schedule import Buf, Schedule, ScheduleBuilder, split
from lpsync.types import Collective


def allreduce_ring(participants: int, count: int, root: int = 0, chunks: int = 1) -> Schedule:
    p = participants
    b = ScheduleBuilder(Collective.ALLREDUCE, "ring", p, count)
    ranks, bounds = np.arange(p), split(count, p)
    steps = ring_reduce_scatter(b, ranks, bounds, 0, np.full(p, Buf.OUT), np.full(p, Buf.OUT),
                                bounds[:-1])
    ring_allgather(b, ranks, bounds, steps, Buf.OUT)
    return b.build()


def reduce_scatter_ring(participants: int, count: int, root: int = 0,
                        chunks: int = 1) -> Schedule:
    p = participants
    b = ScheduleBuilder(Collective.REDUCE_SCATTER, "ring", p, count)
    ranks, bounds = np.arange(p), np.arange(p + 1, dtype=np.int64) * count
    ring_reduce_scatter(b, ranks, bounds, 0, np.full(p, Buf.TMP), np.full(p, Buf.OUT),
                        np.zeros(p, np.int64))
    b.need_tmp(p * count)
    return b.build()


def allgather_ring(participants: int, count: int, root: int = 0, chunks: int = 1) -> Schedule:
    p = participants
    b = ScheduleBuilder(Collective.ALLGATHER, "ring", p, count)
    ranks, bounds = np.arange(p), np.arange(p + 1, dtype=np.int64) * count
    b.copy(0, ranks, Buf.OUT, bounds[:-1], bounds[1:], Buf.IN, 0)
    ring_allgather(b, ranks, bounds, 1, Buf.OUT)
    return b.build()
