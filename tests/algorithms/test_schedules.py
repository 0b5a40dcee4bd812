"""Schedule invariants, checked without a transport (STYLE.md 13).

A symbolic interpreter runs every participant's program over bit masks: element e of
a buffer holds the set of participants whose contribution it contains (bit r for
rank r; P <= 17 fits in uint64). Sends are eager and snapshot the sender's masks; a
participant blocked on a receive waits. The interpreter asserts that nobody sends
what it does not have yet, that no reduction counts a contribution twice, that IN is
never written, that ``final`` marks exactly the reductions that complete a value, that
every OUT ends with the right masks and that every program runs to its end.
"""

from __future__ import annotations

from collections import defaultdict

import numpy as np
import pytest

from lpsync.algorithms import Buf, Kind, Schedule, generate
from lpsync.algorithms.schedule import ceil_log2, split
from lpsync.engine.group import layout
from tests.collective_cases import (
    OPS_ALGS,
    OPS_ALGS_IDS,
    PARTICIPANTS,
    REDUCING,
    C,
    chunk_options,
    in_elements,
    in_place_buffer,
    in_place_options,
    roots_for,
)

SEND, RECV, RECV_REDUCE, COPY = (int(k) for k in Kind)


def bit(r: int) -> np.uint64:
    return np.uint64(1) << np.uint64(r)


def initial_masks(op: C, rank: int, p: int, count: int, root: int) -> np.ndarray:
    """The masks of a rank's input: its own bit where it contributes, 0 where it has nothing."""
    n = in_elements(op, p, count, rank, root)
    if op is C.BROADCAST and rank != root:
        return np.zeros(n, np.uint64)
    return np.full(n, bit(rank), np.uint64)


def expected_out(op: C, rank: int, p: int, count: int, root: int, in_place: bool) -> np.ndarray | None:
    full = np.uint64((1 << p) - 1)
    if op is C.ALLREDUCE or op is C.REDUCE_SCATTER:
        return np.full(count, full, np.uint64)
    if op is C.BROADCAST:
        return np.full(count, bit(root), np.uint64)
    if op is C.ALLGATHER or op is C.ALLTOALL or (op is C.GATHER and rank == root):
        return np.repeat(np.array([bit(b) for b in range(p)], np.uint64), count)
    if op is C.GATHER:
        return np.zeros(0, np.uint64)  # a non-root has no output
    if op is C.SCATTER:
        return np.full(count, bit(root), np.uint64)
    if rank == root:
        return np.full(count, full, np.uint64)
    # A non-root's reduce buffer: in place it must be left as it was; out of place the
    # schedule has no business writing it.
    return np.full(count, bit(rank), np.uint64) if in_place else np.zeros(count, np.uint64)


class Interpreter:
    """Runs a schedule over mask buffers; ``in_place`` aliases IN and OUT as layout() does."""

    def __init__(self, s: Schedule, in_place: bool) -> None:
        self.s, self.in_place = s, in_place
        p, op, count = s.participants, s.op, s.count
        self.full = np.uint64((1 << p) - 1)
        self.bufs: list[tuple[np.ndarray, np.ndarray, np.ndarray]] = []
        for r in range(p):
            masks = initial_masks(op, r, p, count, s.root)
            if in_place:
                data = in_place_buffer(op, r, p, count, masks, s.root)
                inp, out = layout(op, r, p, count, data, True, s.root)
            else:
                inp = masks
                out = np.zeros(s.out_elements(r), np.uint64)
            self.bufs.append((inp, out, np.zeros(s.tmp_elements, np.uint64)))
        self.initial_in = [b[0].copy() for b in self.bufs]

    def span(self, rank: int, buf: int, lo: int, hi: int) -> np.ndarray:
        arr = self.bufs[rank][buf]
        assert 0 <= lo < hi <= arr.size, (
            f"rank {rank}: span {Buf(buf).name}[{lo}:{hi}] outside a buffer of {arr.size}"
        )
        return arr[lo:hi]

    def check_sendable(self, rank: int, buf: int, lo: int, masks: np.ndarray) -> None:
        s = self.s
        where = f"rank {rank} sends {Buf(buf).name}[{lo}:{lo + masks.size}]"
        assert np.all(masks != 0), f"{where}: it does not have elements {np.flatnonzero(masks == 0)[:5]}"
        if s.op in (C.BROADCAST, C.SCATTER):
            assert np.all(masks == bit(s.root)), f"{where}: not the root's data"
        elif s.op in (C.GATHER, C.ALLTOALL) and buf == Buf.IN:
            assert np.all(masks == bit(rank)), f"{where}: not its own data"
        elif s.op is C.ALLGATHER:
            if buf == Buf.IN:
                want = np.full(masks.size, bit(rank), np.uint64)
            else:
                blocks = np.arange(lo, lo + masks.size, dtype=np.uint64) // np.uint64(s.count)
                want = np.left_shift(np.uint64(1), blocks)
            assert np.array_equal(masks, want), f"{where}: not the final blocks"

    def write(self, rank: int, buf: int, lo: int, hi: int, masks: np.ndarray) -> None:
        s = self.s
        if not self.in_place:
            assert buf != Buf.IN, f"rank {rank} writes IN[{lo}:{hi}]"
            if s.op is C.REDUCE and rank != s.root:
                assert buf != Buf.OUT, f"non-root {rank} of reduce writes OUT[{lo}:{hi}]"
        self.span(rank, buf, lo, hi)[...] = masks

    def run(self) -> None:
        s, p = self.s, self.s.participants
        programs = [s.program(r) for r in range(p)]
        pcs = [0] * p
        mailbox: dict[tuple[int, int, int], np.ndarray] = {}
        progress = True
        while progress:
            progress = False
            for r in range(p):
                prog = programs[r]
                while pcs[r] < len(prog):
                    kind, peer, buf, lo, hi, src, src_lo, final, tag = prog[pcs[r]]
                    if kind == SEND:
                        masks = self.span(r, buf, lo, hi).copy()
                        self.check_sendable(r, buf, lo, masks)
                        assert (r, peer, tag) not in mailbox, "two messages with one tag"
                        mailbox[(r, peer, tag)] = masks
                    elif kind in (RECV, RECV_REDUCE):
                        message = mailbox.pop((peer, r, tag), None)
                        if message is None:
                            break  # blocked until the peer sends it
                        assert message.size == hi - lo
                        if kind == RECV:
                            self.write(r, buf, lo, hi, message)
                        else:
                            assert s.op in REDUCING, f"{s.op} reduces"
                            acc = self.span(r, src, src_lo, src_lo + hi - lo).copy()
                            assert np.all(acc != 0), f"rank {r} reduces into nothing"
                            twice = acc & message
                            assert not twice.any(), (
                                f"rank {r} counts contributions {twice[twice != 0][:3]} twice"
                            )
                            result = acc | message
                            complete = result == self.full
                            if final:
                                assert complete.all(), f"rank {r}: final on a partial result"
                            else:
                                assert not complete.any(), (
                                    f"rank {r}: a complete result at {lo}:{hi} not marked final"
                                )
                            self.write(r, buf, lo, hi, result)
                    else:
                        assert kind == COPY
                        self.write(r, buf, lo, hi, self.span(r, src, src_lo, src_lo + hi - lo).copy())
                    pcs[r] += 1
                    progress = True
        stuck = {r: programs[r][pcs[r]] for r in range(p) if pcs[r] < len(programs[r])}
        assert not stuck, f"deadlock: ranks blocked at {stuck}"
        assert not mailbox, f"messages never received: {list(mailbox)}"

    def check_result(self) -> None:
        s = self.s
        for r, (inp, out, _) in enumerate(self.bufs):
            if not self.in_place:
                assert np.array_equal(inp, self.initial_in[r]), f"rank {r}: IN changed"
            want = expected_out(s.op, r, s.participants, s.count, s.root, self.in_place)
            bad = np.flatnonzero(out != want)
            assert bad.size == 0, f"rank {r}: OUT[{bad[:5]}] = {out[bad[:5]]}, want {want[bad[:5]]}"


def counts_for(p: int) -> list[int]:
    return sorted({0, 1, max(p - 1, 0), 7, 100, 1003})


@pytest.mark.parametrize(("op", "algorithm"), OPS_ALGS, ids=OPS_ALGS_IDS)
@pytest.mark.parametrize("p", PARTICIPANTS)
def test_schedule_invariants(op: C, algorithm: str, p: int) -> None:
    for root in roots_for(op, p):
        for count in counts_for(p):
            for chunks in chunk_options(algorithm):
                s = generate(op, algorithm, p, count, root, chunks)
                assert (s.op, s.participants, s.count) == (op, p, count)
                for in_place in in_place_options(op):
                    interp = Interpreter(s, in_place)
                    try:
                        interp.run()
                        interp.check_result()
                    except AssertionError as error:
                        raise AssertionError(
                            f"{op} {algorithm} P={p} root={root} count={count} "
                            f"chunks={chunks} in_place={in_place}: {error}"
                        ) from error


def test_interpreter_catches_a_broken_schedule() -> None:
    """The checker itself: a schedule whose sender reads a span it never received fails."""
    from lpsync.algorithms.schedule import ScheduleBuilder

    b = ScheduleBuilder(C.BROADCAST, "broken", 3, 4, 0)
    b.send(0, 0, 1, Buf.IN, 0, 4)
    b.recv(0, 1, 0, Buf.OUT, 0, 4)
    b.send(0, 1, 2, Buf.OUT, 0, 4)  # same step: before its receive, so not had yet
    b.recv(1, 2, 1, Buf.OUT, 0, 4)
    b.copy(2, 0, Buf.OUT, 0, 4, Buf.IN, 0)
    with pytest.raises(AssertionError, match="does not have"):
        Interpreter(b.build(), False).run()


# ---------------------------------------------------------------------------------------
# Bytes per directed link, against what each algorithm's model says it moves.


def link_elements(s: Schedule) -> dict[tuple[int, int], int]:
    """Elements carried by each directed link (sender, receiver)."""
    links: dict[tuple[int, int], int] = defaultdict(int)
    for m in range(s.num_messages):
        row = int(s.send_op[m])
        src, dst = int(s.ops["rank"][row]), int(s.ops["rank"][s.recv_op[m]])
        links[(src, dst)] += int(s.ops["hi"][row] - s.ops["lo"][row])
    return dict(links)


def sent_received(s: Schedule) -> tuple[np.ndarray, np.ndarray]:
    p = s.participants
    sent, received = np.zeros(p, np.int64), np.zeros(p, np.int64)
    for (a, b), n in link_elements(s).items():
        sent[a] += n
        received[b] += n
    return sent, received


LINK_COUNTS = [100, 1003]


@pytest.mark.parametrize("count", LINK_COUNTS)
@pytest.mark.parametrize("op", [C.BROADCAST, C.REDUCE])
@pytest.mark.parametrize("p", PARTICIPANTS)
def test_lp_chain_links_carry_the_message_once(op: C, p: int, count: int) -> None:
    for root in roots_for(op, p):
        for chunks in (1, 3, 8):
            s = generate(op, "lp", p, count, root, chunks)
            # Broadcast: the chain starts at the root; reduce: it ends there.
            first = root if op is C.BROADCAST else root + 1
            chain = [(first + i) % p for i in range(p)]
            want = {(chain[i], chain[i + 1]): count for i in range(p - 1)}
            assert link_elements(s) == want
            sent, received = sent_received(s)
            assert sent.max(initial=0) <= count and received.max(initial=0) <= count
            assert s.num_messages == (p - 1) * chunks


@pytest.mark.parametrize("count", LINK_COUNTS)
@pytest.mark.parametrize("p", PARTICIPANTS)
def test_lp_allreduce_links(p: int, count: int) -> None:
    for chunks in (1, 3, 8):
        s = generate(C.ALLREDUCE, "lp", p, count, 0, chunks)
        want = {}
        for i in range(p - 1):
            want[(i, i + 1)] = count  # partials toward the end of the chain
            want[(i + 1, i)] = count  # finished chunks back
        assert link_elements(s) == want
        sent, received = sent_received(s)
        ends = [0, p - 1] if p > 1 else []
        for r in range(p):
            expected = 0 if p == 1 else (count if r in ends else 2 * count)
            assert sent[r] == expected and received[r] == expected, r


@pytest.mark.parametrize("count", LINK_COUNTS)
@pytest.mark.parametrize("p", PARTICIPANTS)
def test_ring_links(p: int, count: int) -> None:
    size = np.diff(split(count, p))
    s = generate(C.ALLREDUCE, "ring", p, count)
    links = link_elements(s)
    assert set(links) == ({(r, (r + 1) % p) for r in range(p)} if p > 1 else set())
    for r in range(p):
        if p > 1:
            # reduce-scatter sends every block but its own, allgather every block but the
            # next rank's: 2(P-1)/P * count up to the rounding of the blocks.
            assert links[(r, (r + 1) % p)] == 2 * count - size[r] - size[(r + 1) % p]
            assert abs(links[(r, (r + 1) % p)] - 2 * (p - 1) / p * count) <= 2
    for op in (C.ALLGATHER, C.REDUCE_SCATTER):
        links = link_elements(generate(op, "ring", p, count))
        want = {(r, (r + 1) % p): (p - 1) * count for r in range(p)} if p > 1 else {}
        assert links == want


@pytest.mark.parametrize("count", LINK_COUNTS)
@pytest.mark.parametrize("p", PARTICIPANTS)
def test_mst_links(p: int, count: int) -> None:
    levels = ceil_log2(p)
    for root in roots_for(C.BROADCAST, p):
        bcast = generate(C.BROADCAST, "mst", p, count, root)
        sent, received = sent_received(bcast)
        assert sent[root] == levels * count
        assert received[root] == 0
        assert all(received[r] == count for r in range(p) if r != root)
        assert bcast.num_messages == p - 1
        # Reduce is the broadcast's mirror image: every link reversed, same load.
        red = generate(C.REDUCE, "mst", p, count, root)
        assert link_elements(red) == {(b, a): n for (a, b), n in link_elements(bcast).items()}
    # Allreduce: a binomial reduce to 0 then a binomial broadcast from 0.
    sent, received = sent_received(generate(C.ALLREDUCE, "mst", p, count))
    assert sent[0] == levels * count and received[0] == levels * count
    assert all(sent[r] + received[r] >= 2 * count for r in range(1, p))


@pytest.mark.parametrize("count", LINK_COUNTS)
@pytest.mark.parametrize("p", PARTICIPANTS)
def test_be_links(p: int, count: int) -> None:
    bounds = split(count, p)
    size = np.diff(bounds)
    for root in roots_for(C.BROADCAST, p):
        s = generate(C.BROADCAST, "be", p, count, root)
        sent, received = sent_received(s)
        for v in range(p):
            r = (root + v) % p
            low = v & -v
            scatter_in = bounds[min(v + low, p)] - bounds[v] if v else 0
            # The scatter brings a position its subtree's blocks; the allgather every
            # block but its own, once.
            assert received[r] == scatter_in + count - size[v], (root, v)
        # The root's scatter: its first sends carry every block but its own.
        rows = range(int(s.offsets[root]), int(s.offsets[root + 1]))
        root_sends = [int(s.ops["hi"][i] - s.ops["lo"][i]) for i in rows if s.ops["kind"][i] == Kind.SEND]
        assert sum(root_sends[: ceil_log2(p)]) == count - size[0]
        if p & (p - 1) == 0:
            # Reduce = reduce-scatter + gather, the exact mirror of broadcast for P = 2^L.
            red = generate(C.REDUCE, "be", p, count, root)
            assert link_elements(red) == {(b, a): n for (a, b), n in link_elements(s).items()}
    if p & (p - 1) == 0:
        # Rabenseifner: every rank sends and receives 2(P-1)/P * count.
        sent, received = sent_received(generate(C.ALLREDUCE, "be", p, count))
        assert np.all(np.abs(sent - 2 * (p - 1) / p * count) <= 2 * ceil_log2(p))
        assert np.all(np.abs(received - 2 * (p - 1) / p * count) <= 2 * ceil_log2(p))
    for op in (C.ALLGATHER, C.REDUCE_SCATTER):
        sent, received = sent_received(generate(op, "be", p, count))
        assert np.all(sent == (p - 1) * count) and np.all(received == (p - 1) * count)


def test_interpreter_catches_a_wrong_final_flag() -> None:
    """The checker itself: dropping the root's ``final`` marks of an LP reduce fails."""
    import dataclasses

    s = generate(C.REDUCE, "lp", 4, 12, 1, 3)
    ops = {k: v.copy() for k, v in s.ops.items()}
    ops["final"][:] = False
    with pytest.raises(AssertionError, match="not marked final"):
        Interpreter(dataclasses.replace(s, ops=ops), False).run()
