"""A node's part of a collective across nodes, compiled (lpsync/native/across.py) and run
by the native engine (net.c) over real sockets: every node an engine of its own, a
connected socket pair per pair of nodes, the nodes running at once on threads (the engine
releases the GIL). The result is checked bitwise against the general path's executor
(LocalGroup: the same schedule, the same summation order) and against numpy; and the
failures a run can meet (a peer that never comes, a lost channel, someone else's
message) end in their code, at once or by the deadline, never in a hang."""

from __future__ import annotations

import mmap
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager

import numpy as np
import pytest

from lpsync.algorithms import generate
from lpsync.algorithms.registry import algorithms_for
from lpsync.engine.group import LocalGroup, layout
from lpsync.native import FALLBACK, LOST, MISMATCH, OK, TIMEOUT, across, program
from lpsync.native import engine as native_engine
from lpsync.reduction import Reduction
from lpsync.types import Collective, ReduceOp
from lpsync_client.wire import blocks

ENGINE = native_engine()  # built by the install: a missing engine fails, never skips

REDUCING = (Collective.ALLREDUCE, Collective.REDUCE, Collective.REDUCE_SCATTER)
PLACEMENTS = {
    "2x1": (0, 1),
    "3x1": (0, 1, 2),
    "2x2": (0, 0, 1, 1),
    "interleaved": (0, 1, 0, 1),  # not node-major: chains cross nodes more often
    "5x1": (0, 1, 2, 3, 4),
}


class Node:
    """One node's engine over an anonymous doorbell page (no clients ring it here)."""

    def __init__(self) -> None:
        assert ENGINE is not None, "the native engine is not built"
        self.map = mmap.mmap(-1, 4096)
        self.page = np.frombuffer(self.map, np.uint8)
        self.engine = ENGINE.Engine(self.page, self.page.__array_interface__["data"][0], 4096, 1, (1.0,))
        self.generation = 0

    def arm(self, compiled: across.NodeProgram, pairs: list, key: int, timeout: float = 10.0) -> None:
        encoded = program.encode(compiled.program, program.flatten(pairs))
        assert encoded is not None
        data, bases, sizes = encoded
        self.generation = self.engine.arm(0, data, bases, sizes, timeout, key)

    def close(self) -> None:
        self.engine.close()
        del self.page
        self.map.close()


@contextmanager
def cluster(nodes: int) -> Iterator[list[Node]]:
    """``nodes`` engines, each pair connected by a socket pair: channel c of node a is
    node c. The engines hold the only descriptors (as the daemon hands them over): one
    that an engine closes is closed for its peer too."""
    engines = [Node() for _ in range(nodes)]
    try:
        for a in range(nodes):
            for b in range(a + 1, nodes):
                x, y = socket.socketpair()
                with x, y:
                    engines[a].engine.connect(b, x.fileno())
                    engines[b].engine.connect(a, y.fileno())
        yield engines
    finally:
        for e in engines:
            e.close()


def run_all(engines: list[Node], seq: int, only: set[int] | None = None) -> list[int]:
    codes = [-1] * len(engines)

    def one(i: int) -> None:
        codes[i] = engines[i].engine.run(0, engines[i].generation, seq)

    threads = [
        threading.Thread(target=one, args=(i,)) for i in range(len(engines)) if only is None or i in only
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
        assert not t.is_alive(), "a node's run did not end"
    return codes


def inputs_for(op: Collective, p: int, count: int, dtype: np.dtype, in_place: bool, root: int, seed: int):
    """Each rank's data: its input, or in place its one buffer (lpsync.engine.group.layout)."""
    rng = np.random.default_rng(seed)
    datas = []
    for r in range(p):
        n_in, n_out = blocks(op, p, r, root)
        n = count * (max(n_in, n_out) if in_place else n_in)
        if np.issubdtype(dtype, np.integer):
            datas.append(rng.integers(-1000, 1000, n).astype(dtype))
        else:
            datas.append(rng.standard_normal(n).astype(dtype))
    return datas


class Bound:
    """Every rank's (input, output) views over arrays of its own; ``reset`` writes the
    original data into the same arrays (an armed plan stays bound to their addresses)."""

    def __init__(
        self, op: Collective, count: int, in_place: bool, root: int, datas: list[np.ndarray]
    ) -> None:
        self.datas, self.originals = [d.copy() for d in datas], datas
        p = len(datas)
        self.pairs = [layout(op, r, p, count, d, in_place, root) for r, d in enumerate(self.datas)]
        self.in_place = in_place
        self.reset()

    def reset(self) -> None:
        for d, original, (_, o) in zip(self.datas, self.originals, self.pairs, strict=True):
            d[...] = original
            if not self.in_place:
                o[...] = 0


def numpy_reference(
    op: Collective, pairs: list, reduce_op: ReduceOp, count: int, root: int
) -> list[np.ndarray | None]:
    """The result each rank's output holds, from the inputs alone (None: not defined)."""
    inputs = [i.copy() for i, _ in pairs]
    p = len(pairs)
    if op is Collective.BROADCAST:
        return [inputs[root]] * p
    if op is Collective.ALLGATHER:
        return [np.concatenate(inputs)] * p
    total = inputs[0].astype(np.float64 if inputs[0].dtype.kind == "f" else np.int64)
    for x in inputs[1:]:
        total = total + x
    if reduce_op is ReduceOp.AVG:
        total = total / p if inputs[0].dtype.kind == "f" else total // p
    total = total.astype(inputs[0].dtype)
    if op is Collective.ALLREDUCE:
        return [total] * p
    if op is Collective.REDUCE:
        return [total if r == root else None for r in range(p)]
    return [total[r * count : (r + 1) * count] for r in range(p)]  # reduce_scatter


CASES = [
    (op, algorithm)
    for op in (
        Collective.ALLREDUCE,
        Collective.BROADCAST,
        Collective.REDUCE,
        Collective.ALLGATHER,
        Collective.REDUCE_SCATTER,
    )
    for algorithm in algorithms_for(op)
]


@pytest.mark.parametrize(("op", "algorithm"), CASES, ids=[f"{op}-{a}" for op, a in CASES])
@pytest.mark.parametrize("placement", list(PLACEMENTS), ids=list(PLACEMENTS))
def test_a_node_program_gives_the_general_paths_bits(op: Collective, algorithm: str, placement: str) -> None:
    node_of = PLACEMENTS[placement]
    p, nodes = len(node_of), max(node_of) + 1
    for dtype, in_place, reduce_op, count, chunks, root in (
        (np.dtype(np.float32), True, ReduceOp.SUM, 1001, 4, p - 1),
        (np.dtype(np.int32), False, ReduceOp.AVG, 37, 3, 0),
        (np.dtype(np.float64), False, ReduceOp.SUM, 1, 1, 0),
    ):
        try:
            schedule = generate(op, algorithm, p, count, root, chunks)
        except Exception as error:  # an algorithm that does not take this shape
            if "participants" in str(error) or "power" in str(error):
                continue
            raise
        reduction = Reduction(reduce_op, dtype, p) if op in REDUCING else None
        datas = inputs_for(op, p, count, dtype, in_place, root, seed=len(CASES) * count + p)
        general, native = Bound(op, count, in_place, root, datas), Bound(op, count, in_place, root, datas)
        expected = numpy_reference(op, general.pairs, reduce_op, count, root)
        LocalGroup(schedule, general.pairs, reduction).run(30.0)
        with cluster(nodes) as engines:
            for node, engine in enumerate(engines):
                mine = [native.pairs[r] for r in range(p) if node_of[r] == node]
                compiled = across.compile_node(schedule, node_of, node, mine, reduction)
                assert compiled is not None
                engine.arm(compiled, mine, key=0xC0FFEE)
            for seq in (7, 8):  # armed once, run twice: the plan is reused as it is
                native.reset()
                assert run_all(engines, seq) == [OK] * nodes
        for r in range(p):
            what = f"{op} {algorithm} {placement} {dtype} {reduce_op} rank {r}"
            got = native.pairs[r][1]
            np.testing.assert_array_equal(
                got, general.pairs[r][1], err_msg=f"{what}: not the general path's bits"
            )
            if expected[r] is not None:
                np.testing.assert_allclose(got, expected[r], rtol=1e-5, atol=1e-4, err_msg=what)


def _allreduce_pair(count: int = 1 << 16):
    schedule = generate(Collective.ALLREDUCE, "ring", 2, count, 0, 4)
    reduction = Reduction(ReduceOp.SUM, np.dtype(np.float32), 2)
    pairs = [
        layout(Collective.ALLREDUCE, r, 2, count, np.full(count, r + 1, np.float32), True) for r in range(2)
    ]
    return schedule, reduction, pairs


def _arm_pair(engines: list[Node], keys: tuple[int, int] = (1, 1), timeout: float = 10.0):
    schedule, reduction, pairs = _allreduce_pair()
    for node in range(2):
        compiled = across.compile_node(schedule, (0, 1), node, [pairs[node]], reduction)
        assert compiled is not None
        engines[node].arm(compiled, [pairs[node]], keys[node], timeout)
    return pairs


def test_a_peer_that_never_runs_times_out_by_the_plans_deadline() -> None:
    with cluster(2) as engines:
        _arm_pair(engines, timeout=0.3)
        began = time.monotonic()
        codes = run_all(engines, 1, only={0})
        assert codes[0] == TIMEOUT
        assert 0.25 <= time.monotonic() - began < 5.0
        assert engines[0].engine.run(0, engines[0].generation, 2) != OK  # disarmed by the failure


def test_a_closed_channel_is_lost_at_once() -> None:
    with cluster(2) as engines:
        _arm_pair(engines, timeout=30.0)
        engines[1].engine.connect(0, -1)  # node 1 lets go of its end: the peer is gone
        began = time.monotonic()
        assert run_all(engines, 1, only={0})[0] == LOST
        assert time.monotonic() - began < 5.0
        assert engines[0].engine.failed_channel() == 1


def test_another_plan_on_a_peer_sends_both_to_the_general_path_writing_nothing() -> None:
    with cluster(2) as engines:
        pairs = _arm_pair(engines, keys=(1, 2))  # another plan's key on node 1
        before = [pairs[0][1].copy(), pairs[1][1].copy()]
        assert run_all(engines, 1) == [FALLBACK, FALLBACK]  # the GO round: nothing ran
        for node in range(2):
            np.testing.assert_array_equal(pairs[node][1], before[node])
        # Still armed, channels kept: the same plan on both, the next call, runs (the
        # round's unread leftovers are older and skipped).
        again = _arm_pair(engines, keys=(1, 1))  # held: the engine writes into them
        assert run_all(engines, 2) == [OK, OK]
        np.testing.assert_array_equal(again[0][1], np.full_like(before[0], 3.0))


def test_a_peer_on_the_general_path_sends_an_armed_node_back_at_once() -> None:
    with cluster(2) as engines:
        pairs = _arm_pair(engines, timeout=30.0)
        before = pairs[0][1].copy()
        engines[1].engine.notice(1)  # node 1's ranks took the general path for call 1
        began = time.monotonic()
        assert run_all(engines, 1, only={0})[0] == FALLBACK
        assert time.monotonic() - began < 5.0, "a notice ends the wait, not the deadline"
        np.testing.assert_array_equal(pairs[0][1], before)
        engines[1].engine.notice(1)  # an old notice again: skipped by the next call
        assert run_all(engines, 2) == [OK, OK]


def test_another_runs_sequence_number_fails_instead_of_mixing_calls() -> None:
    with cluster(2) as engines:
        _arm_pair(engines)
        codes = [-1, -1]

        def one(node: int, seq: int) -> None:
            codes[node] = engines[node].engine.run(0, engines[node].generation, seq)

        threads = [threading.Thread(target=one, args=(node, 5 + node)) for node in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        # Node 0 (call 5) reads node 1's GO for call 6: ahead of it, a failure, which
        # closes its channels; node 1 (call 6) skipped the older GO and then loses node 0.
        assert codes == [MISMATCH, LOST]


def test_sends_larger_than_the_socket_buffers_cross_both_ways_at_once() -> None:
    """Both nodes send 4 MiB to each other before either receives (LP's and the ring's
    shape at one chunk): the engine keeps reading while its sends wait for room."""
    count = 1 << 20
    schedule = generate(Collective.ALLREDUCE, "ring", 2, count, 0, 1)
    reduction = Reduction(ReduceOp.SUM, np.dtype(np.float32), 2)
    rng = np.random.default_rng(3)
    inputs = [rng.standard_normal(count).astype(np.float32) for _ in range(2)]
    pairs = [layout(Collective.ALLREDUCE, r, 2, count, inputs[r].copy(), True) for r in range(2)]
    with cluster(2) as engines:
        for node in range(2):
            compiled = across.compile_node(schedule, (0, 1), node, [pairs[node]], reduction)
            assert compiled is not None
            engines[node].arm(compiled, [pairs[node]], 9)
        assert run_all(engines, 1) == [OK, OK]
    np.testing.assert_array_equal(pairs[0][1], inputs[0] + inputs[1])
    np.testing.assert_array_equal(pairs[1][1], inputs[0] + inputs[1])


def test_the_engine_refuses_a_program_whose_messages_are_misnumbered() -> None:
    schedule, reduction, pairs = _allreduce_pair(64)
    compiled = across.compile_node(schedule, (0, 1), 0, [pairs[0]], reduction)
    assert compiled is not None
    steps = compiled.program.steps
    first_send = next(i for i, s in enumerate(steps) if s.kind == program.SEND)
    steps[first_send] = steps[first_send]._replace(arg=5)
    with cluster(2) as engines, pytest.raises(ValueError, match="not numbered in program order"):
        engines[0].arm(compiled, [pairs[0]], 1)


STAR_CASES = [
    Collective.ALLREDUCE,
    Collective.REDUCE,
    Collective.REDUCE_SCATTER,
    Collective.BROADCAST,
    Collective.ALLGATHER,
]


@pytest.mark.parametrize("op", STAR_CASES, ids=str)
@pytest.mark.parametrize("placement", list(PLACEMENTS), ids=list(PLACEMENTS))
def test_a_small_collectives_star_matches_numpy(op: Collective, placement: str) -> None:
    """The small collective's star (its data on the GO round): every node's outputs
    against numpy, in and out of place, twice on the same buffers."""
    node_of = PLACEMENTS[placement]
    p, nodes = len(node_of), max(node_of) + 1
    for dtype, in_place, reduce_op, count, root in (
        (np.dtype(np.float32), True, ReduceOp.SUM, 33, p - 1),
        (np.dtype(np.int64), False, ReduceOp.AVG, 5, 0),
    ):
        reduction = Reduction(reduce_op, dtype, p) if op in REDUCING else None
        datas = inputs_for(op, p, count, dtype, in_place, root, seed=p * 7 + count)
        native = Bound(op, count, in_place, root, datas)
        expected = numpy_reference(op, native.pairs, reduce_op, count, root)
        with cluster(nodes) as engines:
            for node, engine in enumerate(engines):
                mine = [native.pairs[r] for r in range(p) if node_of[r] == node]
                compiled = across.star(op, count, root, node_of, node, mine, reduction)
                assert compiled is not None
                engine.arm(compiled, mine, key=77)
            for seq in (3, 4):
                native.reset()
                assert run_all(engines, seq) == [OK] * nodes
        for r in range(p):
            if expected[r] is not None:
                np.testing.assert_allclose(
                    native.pairs[r][1], expected[r], rtol=1e-5, atol=1e-4, err_msg=f"rank {r}"
                )


def test_a_star_whose_leaf_took_the_general_path_falls_back_writing_nothing() -> None:
    node_of = (0, 1, 2)
    pairs = [layout(Collective.ALLREDUCE, r, 3, 8, np.full(8, r + 1, np.float32), True) for r in range(3)]
    reduction = Reduction(ReduceOp.SUM, np.dtype(np.float32), 3)
    with cluster(3) as engines:
        for node in range(3):
            compiled = across.star(Collective.ALLREDUCE, 8, 0, node_of, node, [pairs[node]], reduction)
            assert compiled is not None
            engines[node].arm(compiled, [pairs[node]], key=5, timeout=30.0)
        engines[2].engine.notice(9, 0)  # node 2's ranks went the general way for call 9
        began = time.monotonic()
        assert run_all(engines, 9, only={0, 1}) == [FALLBACK, FALLBACK, -1]
        assert time.monotonic() - began < 5.0
        for node in range(3):
            np.testing.assert_array_equal(pairs[node][1], np.full(8, node + 1, np.float32))
        assert run_all(engines, 10) == [OK, OK, OK]  # the leftovers skipped, all in
        for node in range(3):
            np.testing.assert_array_equal(pairs[node][1], np.full(8, 6, np.float32))
