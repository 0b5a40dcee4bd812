"""Rooted and personalized data movement without reduction: gather, scatter, all-to-all.

Each block travels once, straight from its owner to its destination, so a schedule is
as cheap as the links allow: the root's link carries (P-1) blocks for gather and scatter,
(P-1) blocks leave and enter every participant's link for all-to-all. A chain (LP) or a
tree would only add hops — no block is combined with another on the way, so there is
nothing for pipelining to overlap with (docs/architecture.md, "Gather, scatter and
all-to-all").

  gather  (linear):   position v sends its block to the root; the root receives block v
                      into OUT at v*count, in the order of v (its own block is a copy);
  scatter (linear):   the mirror: the root sends block v of IN to position v's OUT;
  alltoall (pairwise): in step s (1..P-1) position v sends IN block v+s to v+s and
                      receives OUT block v-s from v-s (mod P): every link busy in both
                      directions, no step waits on a participant that waits elsewhere.
"""

from __future__ import annotations

import numpy as np

from lpsync.algorithms.schedule import Buf, Schedule, ScheduleBuilder
from lpsync.types import Collective


def gather_linear(participants: int, count: int, root: int = 0, chunks: int = 1) -> Schedule:
    p = participants
    b = ScheduleBuilder(Collective.GATHER, "linear", p, count, root)
    others = np.array([v for v in range(p) if v != root], np.int64)
    b.copy(0, root, Buf.OUT, root * count, (root + 1) * count, Buf.IN, 0)
    b.send(0, others, root, Buf.IN, 0, count)
    b.recv(0, root, others, Buf.OUT, others * count, (others + 1) * count)
    return b.build()


def scatter_linear(participants: int, count: int, root: int = 0, chunks: int = 1) -> Schedule:
    p = participants
    b = ScheduleBuilder(Collective.SCATTER, "linear", p, count, root)
    others = np.array([v for v in range(p) if v != root], np.int64)
    b.copy(0, root, Buf.OUT, 0, count, Buf.IN, root * count)
    b.send(0, root, others, Buf.IN, others * count, (others + 1) * count)
    b.recv(0, others, root, Buf.OUT, 0, count)
    return b.build()


def alltoall_pairwise(participants: int, count: int, root: int = 0, chunks: int = 1) -> Schedule:
    p = participants
    b = ScheduleBuilder(Collective.ALLTOALL, "pairwise", p, count)
    v = np.arange(p, dtype=np.int64)
    b.copy(0, v, Buf.OUT, v * count, (v + 1) * count, Buf.IN, v * count)
    for s in range(1, p):
        to, frm = (v + s) % p, (v - s) % p
        b.send(s, v, to, Buf.IN, to * count, (to + 1) * count)
        b.recv(s, v, frm, Buf.OUT, frm * count, (frm + 1) * count)
    return b.build()
