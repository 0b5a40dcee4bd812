"""Ring collectives (what NCCL, Gloo and Horovod use): allreduce = reduce-scatter + allgather."""

from __future__ import annotations

import numpy as np

from lpsync.algorithms.patterns import ring_allgather, ring_allreduce, ring_reduce_scatter
from lpsync.algorithms.schedule import Buf, Schedule, ScheduleBuilder, split
from lpsync.types import Collective


def allreduce_ring(participants: int, count: int, root: int = 0, chunks: int = 1) -> Schedule:
    """``chunks`` slices per block (at most the smallest block's elements): each slice
    moves on as soon as it is reduced, overlapping reduction with transfer."""
    p = participants
    bounds = split(count, p)
    slices = max(1, min(chunks, int(np.diff(bounds).min())))
    b = ScheduleBuilder(Collective.ALLREDUCE, "ring", p, count, root, slices)
    ring_allreduce(b, np.arange(p), bounds, slices)
    return b.build()


def reduce_scatter_ring(participants: int, count: int, root: int = 0, chunks: int = 1) -> Schedule:
    p = participants
    b = ScheduleBuilder(Collective.REDUCE_SCATTER, "ring", p, count)
    ranks, bounds = np.arange(p), np.arange(p + 1, dtype=np.int64) * count
    ring_reduce_scatter(b, ranks, bounds, 0, np.full(p, Buf.TMP), np.full(p, Buf.OUT), np.zeros(p, np.int64))
    b.need_tmp(p * count)
    return b.build()


def allgather_ring(participants: int, count: int, root: int = 0, chunks: int = 1) -> Schedule:
    p = participants
    b = ScheduleBuilder(Collective.ALLGATHER, "ring", p, count)
    ranks, bounds = np.arange(p), np.arange(p + 1, dtype=np.int64) * count
    b.copy(0, ranks, Buf.OUT, bounds[:-1], bounds[1:], Buf.IN, 0)
    ring_allgather(b, ranks, bounds, 1, Buf.OUT)
    return b.build()
