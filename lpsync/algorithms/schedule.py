"""Schedules as plain data: what every participant sends, receives, reduces and copies.

A schedule is one table of operations (numpy columns, one row per op), grouped by
participant and, inside a participant, in program order. The executor runs a
participant's rows one after another (sends are asynchronous, receives block);
the simulator times the same rows. Nothing here does I/O.

Spans are element ranges of three per-participant buffers:
  IN   the participant's input (read only: no op ever writes it)
  OUT  the participant's result
  TMP  scratch the schedule asks for (``tmp_elements``)
In-place collectives alias IN and OUT; the executor handles the aliasing.

Messages are matched by (sender, receiver, tag); tags count the messages of each
ordered pair in program order, so both sides agree without coordination.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import IntEnum

import numpy as np

from lpsync.errors import ScheduleError
from lpsync.types import Collective, blocks


class Kind(IntEnum):
    SEND = 0  # send span (buf, lo, hi) to peer
    RECV = 1  # receive from peer into span (buf, lo, hi)
    RECV_REDUCE = 2  # span(buf, lo, hi) = span(src, src_lo, ..) (op) message from peer
    COPY = 3  # span(buf, lo, hi) = span(src, src_lo, ..)


class Buf(IntEnum):
    IN = 0
    OUT = 1
    TMP = 2


# Sends go before receives issued at the same step: they do not block.
_PHASE = np.array([0, 1, 1, 2], dtype=np.int64)

_COLUMNS: dict[str, type] = {
    "rank": np.int32,
    "kind": np.int8,
    "peer": np.int32,
    "buf": np.int8,
    "lo": np.int64,
    "hi": np.int64,
    "src": np.int8,
    "src_lo": np.int64,
    "final": np.bool_,
}


@dataclass(frozen=True, eq=False)
class Schedule:
    """The ops of every participant of one collective, plus the message matching.

    ``count`` is the element count of one participant's contribution: the whole
    buffer for allreduce/broadcast/reduce, one rank's block for allgather and
    reduce_scatter (as in NCCL's recvcount/sendcount).
    """

    op: Collective
    algorithm: str
    participants: int
    count: int
    root: int
    chunks: int
    ops: dict[str, np.ndarray]  # column name -> one value per op
    offsets: np.ndarray  # ops of rank r are rows offsets[r]:offsets[r+1]
    tags: np.ndarray  # per op: message number within its (sender, receiver) pair, -1 if none
    send_op: np.ndarray  # per message: row of its SEND
    recv_op: np.ndarray  # per message: row of its RECV/RECV_REDUCE
    tmp_elements: int
    notes: dict[str, object] = field(default_factory=dict)

    @property
    def num_ops(self) -> int:
        return int(self.offsets[-1])

    @property
    def num_messages(self) -> int:
        return len(self.send_op)

    def in_elements(self, rank: int) -> int:
        return self.count * blocks(self.op, self.participants, rank, self.root)[0]

    def out_elements(self, rank: int) -> int:
        return self.count * blocks(self.op, self.participants, rank, self.root)[1]

    def program(self, rank: int) -> list[tuple[int, int, int, int, int, int, int, bool, int]]:
        """Rank's ops in program order as tuples (kind, peer, buf, lo, hi, src, src_lo, final, tag)."""
        a, b = int(self.offsets[rank]), int(self.offsets[rank + 1])
        cols = [
            self.ops[name][a:b].tolist()
            for name in ("kind", "peer", "buf", "lo", "hi", "src", "src_lo", "final")
        ]
        return list(zip(*cols, self.tags[a:b].tolist(), strict=True))


class ScheduleBuilder:
    """Collects ops (scalars or numpy arrays, broadcast together) and builds a Schedule.

    Each op carries an integer ``step``: the time step of the ideal schedule in
    which it happens. A participant's program order is (step, sends first, emission
    order), so generators can emit ops in whatever order is convenient.
    """

    def __init__(
        self, op: Collective, algorithm: str, participants: int, count: int, root: int = 0, chunks: int = 1
    ) -> None:
        self.op, self.algorithm = op, algorithm
        self.participants, self.count, self.root, self.chunks = participants, count, root, chunks
        self.tmp_elements = 0
        self._batches: list[tuple[tuple[int, ...], dict[str, np.ndarray]]] = []

    def _add(self, **columns: object) -> None:
        # Kept unexpanded: build() writes every batch straight into the final columns.
        arrays = {name: np.asarray(value) for name, value in columns.items()}
        shape = np.broadcast_shapes(*(a.shape for a in arrays.values()))
        self._batches.append((shape, arrays))

    def send(self, step: object, rank: object, peer: object, buf: object, lo: object, hi: object) -> None:
        self._add(
            step=step,
            rank=rank,
            kind=Kind.SEND,
            peer=peer,
            buf=buf,
            lo=lo,
            hi=hi,
            src=0,
            src_lo=0,
            final=False,
        )

    def recv(self, step: object, rank: object, peer: object, buf: object, lo: object, hi: object) -> None:
        self._add(
            step=step,
            rank=rank,
            kind=Kind.RECV,
            peer=peer,
            buf=buf,
            lo=lo,
            hi=hi,
            src=0,
            src_lo=0,
            final=False,
        )

    def recv_reduce(
        self,
        step: object,
        rank: object,
        peer: object,
        buf: object,
        lo: object,
        hi: object,
        src: object,
        src_lo: object,
        final: object = False,
    ) -> None:
        """span(buf, lo:hi) = span(src, src_lo:) op received; ``final`` marks a fully reduced result."""
        self._add(
            step=step,
            rank=rank,
            kind=Kind.RECV_REDUCE,
            peer=peer,
            buf=buf,
            lo=lo,
            hi=hi,
            src=src,
            src_lo=src_lo,
            final=final,
        )

    def copy(
        self, step: object, rank: object, buf: object, lo: object, hi: object, src: object, src_lo: object
    ) -> None:
        self._add(
            step=step,
            rank=rank,
            kind=Kind.COPY,
            peer=-1,
            buf=buf,
            lo=lo,
            hi=hi,
            src=src,
            src_lo=src_lo,
            final=False,
        )

    def need_tmp(self, elements: int) -> None:
        self.tmp_elements = max(self.tmp_elements, int(elements))

    def build(self) -> Schedule:
        sizes = [int(np.prod(shape)) for shape, _ in self._batches]
        starts = np.r_[0, np.cumsum(sizes)].astype(np.int64)
        cols: dict[str, np.ndarray] = {
            name: np.empty(int(starts[-1]), dtype) for name, dtype in _COLUMNS.items()
        }
        step = np.empty(int(starts[-1]), np.int64)
        for (shape, arrays), a, b in zip(self._batches, starts[:-1], starts[1:], strict=True):
            for name, column in (*cols.items(), ("step", step)):
                column[a:b].reshape(shape)[...] = arrays[name]
        keep = cols["hi"] > cols["lo"]  # empty spans move nothing: both sides drop them
        if not keep.all():
            cols = {k: v[keep] for k, v in cols.items()}
            step = step[keep]
        if step.size:
            step = step - step.min()
        p = self.participants
        if cols["rank"].size and (cols["rank"].min() < 0 or cols["rank"].max() >= p):
            raise ScheduleError(f"{self.algorithm}: op on a rank outside 0..{p - 1}")
        # One int64 sort key: rank, step, phase; a stable sort keeps emission order on ties.
        key = (cols["rank"].astype(np.int64) * (int(step.max(initial=0)) + 1) + step) * 4
        key += _PHASE[cols["kind"]]
        if np.any(key[1:] < key[:-1]):
            order = np.argsort(key, kind="stable")
            cols = {k: v[order] for k, v in cols.items()}
        offsets = np.searchsorted(cols["rank"], np.arange(p + 1), side="left").astype(np.int64)
        tags, send_op, recv_op = _match_messages(cols, p, self.algorithm)
        return Schedule(
            op=self.op,
            algorithm=self.algorithm,
            participants=p,
            count=self.count,
            root=self.root,
            chunks=self.chunks,
            ops=cols,
            offsets=offsets,
            tags=tags,
            send_op=send_op,
            recv_op=recv_op,
            tmp_elements=self.tmp_elements,
        )


def _pair_order(src: np.ndarray, dst: np.ndarray, p: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """For messages listed in program order: the (src, dst) pair key, the order that sorts
    them by pair (program order kept inside a pair) and each one's number within its pair."""
    pair = src.astype(np.int64) * p + dst
    order = np.argsort(pair, kind="stable")
    sorted_pair = pair[order]
    start = np.r_[0, np.flatnonzero(np.diff(sorted_pair)) + 1]
    first = np.repeat(start, np.diff(np.r_[start, len(order)]))
    seq = np.empty(len(order), np.int64)
    seq[order] = np.arange(len(order)) - first
    return pair, order, seq


def _match_messages(
    cols: dict[str, np.ndarray], p: int, name: str
) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    kind = cols["kind"]
    tags = np.full(len(kind), -1, np.int64)
    sends = np.flatnonzero(kind == Kind.SEND)
    recvs = np.flatnonzero((kind == Kind.RECV) | (kind == Kind.RECV_REDUCE))
    s_pair, s_order, s_seq = _pair_order(cols["rank"][sends], cols["peer"][sends], p)
    r_pair, r_order, r_seq = _pair_order(cols["peer"][recvs], cols["rank"][recvs], p)
    tags[sends], tags[recvs] = s_seq, r_seq
    # Sorted by pair and then by number within the pair, message i pairs send i with recv i.
    if len(sends) != len(recvs) or not np.array_equal(s_pair[s_order], r_pair[r_order]):
        raise ScheduleError(f"{name}: sends and receives do not pair up")
    send_op, recv_op = sends[s_order], recvs[r_order]
    sizes = cols["hi"] - cols["lo"]
    if not np.array_equal(sizes[send_op], sizes[recv_op]):
        raise ScheduleError(f"{name}: a message's send and receive sizes differ")
    if np.any(cols["peer"][sends] == cols["rank"][sends]):
        raise ScheduleError(f"{name}: a participant sends to itself")
    return tags, send_op, recv_op


def split(count: int, parts: int) -> np.ndarray:
    """Bounds of ``parts`` near-equal pieces of ``count`` elements: piece i is [b[i], b[i+1])."""
    return (np.arange(parts + 1, dtype=np.int64) * count) // parts


def ceil_log2(p: int) -> int:
    return max(0, (p - 1).bit_length())


def lowbit(v: int) -> int:
    return v & -v
