"""Ring collectives (what NCCL, Gloo and Horovod use): allreduce = reduce-scatter + allgather."""

from __future__ import annotations

import numpy as np

from lpsync.algorithms.patterns import ring_allgather, ring_reduce_scatter
from lpsync.algorithms.schedule import Buf, Schedule, ScheduleBuilder, split
from lpsync.types import Collective

# Ring allreduce cuts a large buffer into segments, each its own ring, each starting one
# step after the previous (as Gloo's chunked ring does): a block's reduction then overlaps
# the next segment's transfer instead of stalling every step of the ring. Segments carry
# messages of at least this many elements (1 MiB of float32), and there are at most
# RING_MAX_SEGMENTS. Measured on 8 emulated nodes, 64 MiB float32: docs/benchmarks.md.
RING_SEGMENT_ELEMENTS = 1 << 18
RING_MAX_SEGMENTS = 8


def ring_segments(participants: int, count: int) -> int:
    """How many segments allreduce_ring makes of ``count`` elements (same on every rank)."""
    return max(1, min(RING_MAX_SEGMENTS, count // (participants * RING_SEGMENT_ELEMENTS)))


def allreduce_ring(participants: int, count: int, root: int = 0, chunks: int = 1) -> Schedule:
    p = participants
    segments = ring_segments(p, count)
    b = ScheduleBuilder(Collective.ALLREDUCE, "ring", p, count, chunks=segments)
    ranks, edges = np.arange(p), split(count, segments)
    steps = 0
    for j in range(segments):
        bounds = edges[j] + split(int(edges[j + 1] - edges[j]), p)
        steps = ring_reduce_scatter(b, ranks, bounds, j, np.full(p, Buf.OUT),
                                    np.full(p, Buf.OUT), bounds[:-1])
        ring_allgather(b, ranks, bounds, j + steps, Buf.OUT)
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
