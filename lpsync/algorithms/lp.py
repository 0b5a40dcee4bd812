"""Linear Pipelining (Wang et al. 2016): a chain of P participants, the message cut in k chunks.

Broadcast: the root heads the chain; in step s the link r_i -> r_(i+1) carries chunk s-i.
Reduce: the root ends the chain; r_i adds its chunk to the partial it received, forwards it.
Allreduce: LP reduce toward r_(P-1), pipelined chunk by chunk with the LP broadcast of the
finished chunks back toward r_0 over the reverse direction of the same links.
Ops are generated for all (position, chunk) pairs at once with numpy broadcasting.
"""

from __future__ import annotations

import numpy as np

from lpsync.algorithms.patterns import rotation
from lpsync.algorithms.schedule import Buf, Schedule, ScheduleBuilder, split
from lpsync.types import Collective


def _chunks(count: int, chunks: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    bounds = split(count, chunks)
    return np.arange(chunks), bounds[:-1], bounds[1:]


def broadcast_lp(participants: int, count: int, root: int = 0, chunks: int = 1) -> Schedule:
    p = participants
    b = ScheduleBuilder(Collective.BROADCAST, "lp", p, count, root, chunks)
    c, lo, hi = _chunks(count, chunks)
    chain = rotation(p, root)
    if p > 1:
        b.send(c, chain[0], chain[1], Buf.IN, lo, hi)
        pos = np.arange(1, p)[:, None]
        b.recv(c + pos - 1, chain[pos], chain[pos - 1], Buf.OUT, lo, hi)
        mid = np.arange(1, p - 1)[:, None]
        b.send(c + mid, chain[mid], chain[mid + 1], Buf.OUT, lo, hi)
    b.copy(chunks + p, root, Buf.OUT, 0, count, Buf.IN, 0)  # the root's own result, off the pipeline
    return b.build()


def reduce_lp(participants: int, count: int, root: int = 0, chunks: int = 1) -> Schedule:
    p = participants
    b = ScheduleBuilder(Collective.REDUCE, "lp", p, count, root, chunks)
    c, lo, hi = _chunks(count, chunks)
    chain = rotation(p, root + 1)  # chain[p-1] is the root
    b.send(c, chain[0], chain[1], Buf.IN, lo, hi)
    mid = np.arange(1, p - 1)[:, None]
    # Partials live in TMP so that a non-root's buffers keep their contents.
    b.recv_reduce(c + mid - 1, chain[mid], chain[mid - 1], Buf.TMP, lo, hi, Buf.IN, lo)
    b.send(c + mid, chain[mid], chain[mid + 1], Buf.TMP, lo, hi)
    b.recv_reduce(c + p - 2, root, chain[p - 2], Buf.OUT, lo, hi, Buf.IN, lo, final=True)
    if p > 2:
        b.need_tmp(count)
    return b.build()


def allreduce_lp(participants: int, count: int, root: int = 0, chunks: int = 1) -> Schedule:
    p = participants
    b = ScheduleBuilder(Collective.ALLREDUCE, "lp", p, count, 0, chunks)
    c, lo, hi = _chunks(count, chunks)
    # Reduce toward p-1: chunk c crosses link i -> i+1 in step c+i. The head's sends read
    # IN only, so all are issued up front: none waits behind a receive of a returning chunk.
    b.send(0 * c, 0, 1, Buf.IN, lo, hi)
    mid = np.arange(1, p - 1)[:, None]
    b.recv_reduce(c + mid - 1, mid, mid - 1, Buf.OUT, lo, hi, Buf.IN, lo)
    b.send(c + mid, mid, mid + 1, Buf.OUT, lo, hi)
    b.recv_reduce(c + p - 2, p - 1, p - 2, Buf.OUT, lo, hi, Buf.IN, lo, final=True)
    # Broadcast back: finished chunk c crosses link i+1 -> i in step c + 2p-3 - i.
    b.send(c + p - 1, p - 1, p - 2, Buf.OUT, lo, hi)
    back = np.arange(0, p - 1)[:, None]
    b.recv(c + 2 * p - 3 - back, back, back + 1, Buf.OUT, lo, hi)
    b.send(c + 2 * p - 2 - mid, mid, mid - 1, Buf.OUT, lo, hi)
    return b.build()
