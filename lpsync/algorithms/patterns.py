"""Peer and block arithmetic shared by the algorithms: rings, binomial trees, halving/doubling.

Every helper works in *positions* 0..P-1 (``ranks[v]`` is the participant at
position v, so a rotation puts any root at position 0) and emits ops into a
ScheduleBuilder starting at time step ``step0``; each returns the number of steps
it used so that phases compose. ``bounds`` cut a buffer into P blocks: block v is
[bounds[v], bounds[v+1]) and belongs to position v. ``work`` holds partial sums,
one Buf per position. No I/O.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from lpsync.algorithms.schedule import Buf, ScheduleBuilder, ceil_log2, lowbit

if TYPE_CHECKING:
    from collections.abc import Sequence


def is_power_of_two(p: int) -> bool:
    return p > 0 and p & (p - 1) == 0


def ring_reduce_scatter(
    b: ScheduleBuilder,
    ranks: np.ndarray,
    bounds: np.ndarray,
    step0: int,
    work: np.ndarray,
    final_buf: np.ndarray,
    final_lo: np.ndarray,
) -> int:
    """Ring reduce-scatter: position v ends with block v fully reduced at (final_buf, final_lo).

    Each block is received exactly once per position, so the accumulator is always IN.
    """
    p = len(ranks)
    v = np.arange(p)
    for s in range(p - 1):
        sent, got = (v - s - 1) % p, (v - s - 2) % p
        b.send(
            step0 + s, ranks, ranks[(v + 1) % p], Buf.IN if s == 0 else work, bounds[sent], bounds[sent + 1]
        )
        last = s == p - 2
        dst_buf = final_buf if last else work
        dst_lo = final_lo if last else bounds[got]
        b.recv_reduce(
            step0 + s,
            ranks,
            ranks[(v - 1) % p],
            dst_buf,
            dst_lo,
            dst_lo + bounds[got + 1] - bounds[got],
            Buf.IN,
            bounds[got],
            final=last,
        )
    return max(p - 1, 0)


def ring_allgather(b: ScheduleBuilder, ranks: np.ndarray, bounds: np.ndarray, step0: int, buf: Buf) -> int:
    """Ring allgather in ``buf``: position v starts with block v and ends with all of them."""
    p = len(ranks)
    v = np.arange(p)
    for s in range(p - 1):
        sent, got = (v - s) % p, (v - s - 1) % p
        b.send(step0 + s, ranks, ranks[(v + 1) % p], buf, bounds[sent], bounds[sent + 1])
        b.recv(step0 + s, ranks, ranks[(v - 1) % p], buf, bounds[got], bounds[got + 1])
    return max(p - 1, 0)


def ring_allreduce(b: ScheduleBuilder, ranks: np.ndarray, bounds: np.ndarray, slices: int) -> None:
    """Ring allreduce in OUT (reduce-scatter, then allgather), each block cut into
    ``slices``. A position forwards a slice as soon as it has it (reduced, or received),
    so the reduction of one slice overlaps the transfer of the next and no step waits for
    a whole block; with one slice it is ring_reduce_scatter + ring_allgather. Phase t
    (0 .. 2P-3) moves, on every link, the block that ring_reduce_scatter (t < P-1) or
    ring_allgather (t >= P-1) moves in its step; slice j of it is step t * slices + j."""
    p = len(ranks)
    v = np.arange(p)
    right, left = ranks[(v + 1) % p], ranks[(v - 1) % p]
    phases = 2 * (p - 1)

    def piece(block: np.ndarray, j: int) -> tuple[np.ndarray, np.ndarray]:
        lo, size = bounds[block], bounds[block + 1] - bounds[block]
        return lo + size * j // slices, lo + size * (j + 1) // slices

    def send(t: int, j: int) -> None:
        s = t if t < p - 1 else t - (p - 1)
        block = (v - s - 1) % p if t < p - 1 else (v - s) % p
        lo, hi = piece(block, j)
        b.send(t * slices + j, ranks, right, Buf.IN if t == 0 else Buf.OUT, lo, hi)

    def receive(t: int, j: int) -> None:
        s = t if t < p - 1 else t - (p - 1)
        block = (v - s - 2) % p if t < p - 1 else (v - s - 1) % p
        lo, hi = piece(block, j)
        if t < p - 1:
            b.recv_reduce(t * slices + j, ranks, left, Buf.OUT, lo, hi, Buf.IN, lo, final=t == p - 2)
        else:
            b.recv(t * slices + j, ranks, left, Buf.OUT, lo, hi)

    for j in range(slices):
        send(0, j)
    for t in range(1, phases):
        for j in range(slices):  # what phase t-1 brought in goes out in phase t
            receive(t - 1, j)
            send(t, j)
    for j in range(slices):
        receive(phases - 1, j)


def halving_reduce_scatter(
    b: ScheduleBuilder,
    ranks: np.ndarray,
    bounds: np.ndarray,
    step0: int,
    work: np.ndarray,
    final_buf: np.ndarray,
    final_lo: np.ndarray,
) -> int:
    """Recursive halving (P a power of two): at distance d = P/2 .. 1 each position keeps
    the half of its range that holds its own block and sends the other half to v XOR d."""
    p = len(ranks)
    assert is_power_of_two(p)
    v = np.arange(p)
    d, j = p >> 1, 0
    while d >= 1:
        partner = v ^ d
        keep, give = v & ~(d - 1), partner & ~(d - 1)
        b.send(step0 + j, ranks, ranks[partner], Buf.IN if j == 0 else work, bounds[give], bounds[give + d])
        last = d == 1
        dst_buf = final_buf if last else work
        dst_lo = final_lo if last else bounds[keep]
        b.recv_reduce(
            step0 + j,
            ranks,
            ranks[partner],
            dst_buf,
            dst_lo,
            dst_lo + bounds[keep + d] - bounds[keep],
            Buf.IN if j == 0 else work,
            bounds[keep],
            final=last,
        )
        d, j = d >> 1, j + 1
    return j


def doubling_allgather(
    b: ScheduleBuilder, ranks: np.ndarray, bounds: np.ndarray, step0: int, buf: Buf
) -> int:
    """Recursive doubling (P a power of two): at distance d = 1 .. P/2 exchange the d blocks
    held so far with v XOR d."""
    p = len(ranks)
    assert is_power_of_two(p)
    v = np.arange(p)
    d, j = 1, 0
    while d < p:
        partner = v ^ d
        mine, theirs = v & ~(d - 1), partner & ~(d - 1)
        b.send(step0 + j, ranks, ranks[partner], buf, bounds[mine], bounds[mine + d])
        b.recv(step0 + j, ranks, ranks[partner], buf, bounds[theirs], bounds[theirs + d])
        d, j = d << 1, j + 1
    return j


def reduce_scatter_blocks(
    b: ScheduleBuilder,
    ranks: np.ndarray,
    bounds: np.ndarray,
    step0: int,
    work: np.ndarray,
    final_buf: np.ndarray,
    final_lo: np.ndarray,
) -> int:
    """Bidirectional exchange where it applies (P a power of two), the ring otherwise."""
    pattern = halving_reduce_scatter if is_power_of_two(len(ranks)) else ring_reduce_scatter
    return pattern(b, ranks, bounds, step0, work, final_buf, final_lo)


def allgather_blocks(b: ScheduleBuilder, ranks: np.ndarray, bounds: np.ndarray, step0: int, buf: Buf) -> int:
    pattern = doubling_allgather if is_power_of_two(len(ranks)) else ring_allgather
    return pattern(b, ranks, bounds, step0, buf)


# Binomial trees: position v's parent is v - lowbit(v); its children are v + m for
# m = lowbit(v)/2, lowbit(v)/4, .. 1 (the root's start at 2^(L-1)), v + m < P.
# Child v + m hangs off round L-1-log2(m) going down and round log2(m) going up.


def _child_masks(v: int, levels: int) -> list[int]:
    m = (lowbit(v) if v else 1 << levels) >> 1
    masks = []
    while m >= 1:
        masks.append(m)
        m >>= 1
    return masks


def _emit(b: ScheduleBuilder, method: str, rows: Sequence[tuple[object, ...]]) -> None:
    if rows:
        getattr(b, method)(*(np.array(col) for col in zip(*rows, strict=True)))


def binomial_down(
    b: ScheduleBuilder,
    ranks: np.ndarray,
    bounds: np.ndarray | None,
    step0: int,
    root_buf: Buf,
    buf: Buf,
    lo: int = 0,
    hi: int = 0,
) -> int:
    """Broadcast (bounds None: span lo:hi) or scatter (bounds: each subtree gets its blocks)
    from position 0, which reads root_buf; every other position receives into ``buf``."""
    p = len(ranks)
    levels = ceil_log2(p)

    def span(first: int, last: int) -> tuple[int, int]:
        return (lo, hi) if bounds is None else (int(bounds[first]), int(bounds[last]))

    sends, recvs = [], []
    for v in range(p):
        if v:
            m = lowbit(v)
            recvs.append(
                (
                    step0 + levels - 1 - m.bit_length() + 1,
                    ranks[v],
                    ranks[v - m],
                    buf,
                    *span(v, min(v + m, p)),
                )
            )
        for m in _child_masks(v, levels):
            if v + m < p:
                sends.append(
                    (
                        step0 + levels - m.bit_length(),
                        ranks[v],
                        ranks[v + m],
                        root_buf if v == 0 else buf,
                        *span(v + m, min(v + 2 * m, p)),
                    )
                )
    _emit(b, "send", sends)
    _emit(b, "recv", recvs)
    return levels


def binomial_up(
    b: ScheduleBuilder,
    ranks: np.ndarray,
    bounds: np.ndarray | None,
    step0: int,
    work: np.ndarray,
    lo: int = 0,
    hi: int = 0,
    reduce: bool = False,
) -> int:
    """Reduce (reduce=True, span lo:hi) or gather (bounds: blocks) toward position 0.

    Position v combines into work[v]. Reducing, its first child's message is added to
    IN and later ones to work; a leaf sends IN itself. Gathering, position v's own
    block must already be in work[v].
    """
    p = len(ranks)
    levels = ceil_log2(p)

    def span(first: int, last: int) -> tuple[int, int]:
        return (lo, hi) if bounds is None else (int(bounds[first]), int(bounds[last]))

    sends, recvs, reduces = [], [], []
    for v in range(p):
        children = [m for m in reversed(_child_masks(v, levels)) if v + m < p]
        for i, m in enumerate(children):
            s_lo, s_hi = span(v + m, min(v + 2 * m, p))
            step = step0 + m.bit_length() - 1
            if reduce:
                acc = Buf.IN if i == 0 else work[v]
                final = v == 0 and i == len(children) - 1
                reduces.append((step, ranks[v], ranks[v + m], work[v], s_lo, s_hi, acc, s_lo, final))
            else:
                recvs.append((step, ranks[v], ranks[v + m], work[v], s_lo, s_hi))
        if v:
            m = lowbit(v)
            src = work[v] if (children or not reduce) else Buf.IN
            sends.append((step0 + m.bit_length() - 1, ranks[v], ranks[v - m], src, *span(v, min(v + m, p))))
    _emit(b, "send", sends)
    _emit(b, "recv", recvs)
    _emit(b, "recv_reduce", reduces)
    return levels


def partials_at_root(p: int) -> np.ndarray:
    """Work buffers of a rooted reduction: the root sums into OUT, everyone else into TMP
    (so a non-root's buffers keep their contents)."""
    work = np.full(p, Buf.TMP)
    work[0] = Buf.OUT
    return work


def rotation(p: int, root: int) -> np.ndarray:
    """Participants in position order with ``root`` at position 0."""
    return (root + np.arange(p)) % p
