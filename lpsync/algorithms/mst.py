"""MST (binomial tree) collectives: ceil(log2 P) rounds of whole-message transfers."""

from __future__ import annotations

import numpy as np

from lpsync.algorithms.patterns import binomial_down, binomial_up, partials_at_root, rotation
from lpsync.algorithms.schedule import Buf, Schedule, ScheduleBuilder
from lpsync.types import Collective


def broadcast_mst(participants: int, count: int, root: int = 0, chunks: int = 1) -> Schedule:
    p = participants
    b = ScheduleBuilder(Collective.BROADCAST, "mst", p, count, root)
    steps = binomial_down(b, rotation(p, root), None, 0, Buf.IN, Buf.OUT, 0, count)
    b.copy(steps, root, Buf.OUT, 0, count, Buf.IN, 0)
    return b.build()


def reduce_mst(participants: int, count: int, root: int = 0, chunks: int = 1) -> Schedule:
    p = participants
    b = ScheduleBuilder(Collective.REDUCE, "mst", p, count, root)
    work = partials_at_root(p)
    binomial_up(b, rotation(p, root), None, 0, work, 0, count, reduce=True)
    b.need_tmp(count)
    return b.build()


def allreduce_mst(participants: int, count: int, root: int = 0, chunks: int = 1) -> Schedule:
    """Binomial reduce to participant 0, then binomial broadcast from it."""
    p = participants
    b = ScheduleBuilder(Collective.ALLREDUCE, "mst", p, count)
    ranks = np.arange(p)
    steps = binomial_up(b, ranks, None, 0, np.full(p, Buf.OUT), 0, count, reduce=True)
    binomial_down(b, ranks, None, steps, Buf.OUT, Buf.OUT, 0, count)
    return b.build()
