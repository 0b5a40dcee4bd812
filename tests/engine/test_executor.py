"""Real schedules on real buffers: LocalGroup over the inproc transport against numpy
(STYLE.md 14: one generic harness, every rank with its own inputs)."""

from __future__ import annotations

import time
import zlib

import numpy as np
import pytest

from lpsync.algorithms import generate
from lpsync.types import DTYPES, ReduceOp
from tests.collective_cases import (
    IN_PLACE_OPS_ALGS,
    IN_PLACE_OPS_ALGS_IDS,
    OPS_ALGS,
    OPS_ALGS_IDS,
    PARTICIPANTS,
    REDUCING,
    ROOTED,
    C,
    Outcome,
    assert_matches,
    bits,
    chunk_options,
    in_place_options,
    make_inputs,
    reference,
    roots_for,
    run_collective,
)


def check_outcomes(
    op: C,
    root: int,
    count: int,
    inputs: list[np.ndarray],
    reduce_op: ReduceOp,
    in_place: bool,
    outcomes: list[Outcome],
    what: str,
) -> None:
    p = len(inputs)
    want = reference(op, reduce_op, inputs, root, count)
    first = outcomes[0]
    for r in range(p):
        assert_matches(first.results[r], want[r], f"{what} rank {r}")
    # Every participant holds the same bits (reduce_scatter: each its own block).
    holders = (
        [root]
        if op in (C.REDUCE, C.GATHER)
        else ([] if op in (C.REDUCE_SCATTER, C.SCATTER, C.ALLTOALL) else range(p))
    )
    for r in holders:
        assert bits(first.results[r]) == bits(first.results[holders[0]]), f"{what} rank {r}"
    # The same bits on every run.
    for again in outcomes[1:]:
        for r in range(p):
            if want[r].value is not None:
                assert bits(again.results[r]) == bits(first.results[r]), f"{what} rerun r{r}"
    for outcome in outcomes:
        for r in range(p):
            if not in_place:
                assert bits(outcome.inputs_after[r]) == bits(inputs[r]), (
                    f"{what}: rank {r}'s out-of-place input changed"
                )
            elif op is C.REDUCE and r != root:
                assert bits(outcome.buffers[r]) == bits(inputs[r]), (
                    f"{what}: in-place reduce changed non-root {r}'s buffer"
                )


def ragged_counts(p: int) -> list[int]:
    return sorted({0, 1, p + 1, 1001})


@pytest.mark.parametrize(("op", "algorithm"), OPS_ALGS, ids=OPS_ALGS_IDS)
def test_every_size_root_and_count_int64_sum(op: C, algorithm: str) -> None:
    """Exact int64 sums over every P, root and ragged count (not divisible by P or k)."""
    rng = np.random.default_rng(zlib.crc32(f"{op}-{algorithm}".encode()))
    for p in PARTICIPANTS:
        for root in roots_for(op, p):
            for count in ragged_counts(p):
                for chunks in chunk_options(algorithm, (1, 4)):
                    s = generate(op, algorithm, p, count, root, chunks)
                    inputs = make_inputs(op, p, count, np.dtype(np.int64), ReduceOp.SUM, rng, root)
                    outcomes = run_collective(s, inputs, ReduceOp.SUM, in_place=False)
                    check_outcomes(
                        op,
                        root,
                        count,
                        inputs,
                        ReduceOp.SUM,
                        False,
                        outcomes,
                        f"P={p} root={root} count={count} chunks={chunks}",
                    )


@pytest.mark.parametrize("dtype_name", list(DTYPES))
@pytest.mark.parametrize(("op", "algorithm"), OPS_ALGS, ids=OPS_ALGS_IDS)
def test_every_dtype_and_reduce_op(op: C, algorithm: str, dtype_name: str) -> None:
    """Every dtype x reduce op, in place and out of place, run twice on one plan."""
    dtype = DTYPES[dtype_name]
    rng = np.random.default_rng(zlib.crc32(f"{op}-{algorithm}-{dtype_name}".encode()))
    reduce_ops = list(ReduceOp) if op in REDUCING else [ReduceOp.SUM]
    for reduce_op in reduce_ops:
        for p in (3, 4):
            root = p - 1 if op in ROOTED else 0
            count = 37
            chunks = 5 if algorithm == "lp" else 1
            s = generate(op, algorithm, p, count, root, chunks)
            inputs = make_inputs(op, p, count, dtype, reduce_op, rng, root)
            for in_place in in_place_options(op):
                outcomes = run_collective(s, inputs, reduce_op, in_place=in_place, runs=2)
                check_outcomes(
                    op,
                    root,
                    count,
                    inputs,
                    reduce_op,
                    in_place,
                    outcomes,
                    f"{reduce_op} P={p} in_place={in_place}",
                )


@pytest.mark.parametrize(("op", "algorithm"), IN_PLACE_OPS_ALGS, ids=IN_PLACE_OPS_ALGS_IDS)
def test_in_place_every_size(op: C, algorithm: str) -> None:
    """In place over every P and root: the aliasing of IN and OUT must not corrupt data."""
    rng = np.random.default_rng(7)
    for p in PARTICIPANTS:
        for root in roots_for(op, p):
            count = 2 * p + 3
            for chunks in chunk_options(algorithm, (1, 4)):
                s = generate(op, algorithm, p, count, root, chunks)
                inputs = make_inputs(op, p, count, np.dtype(np.int32), ReduceOp.SUM, rng, root)
                outcomes = run_collective(s, inputs, ReduceOp.SUM, in_place=True)
                check_outcomes(
                    op,
                    root,
                    count,
                    inputs,
                    ReduceOp.SUM,
                    True,
                    outcomes,
                    f"in place P={p} root={root} chunks={chunks}",
                )


def test_float_avg_is_identical_on_every_participant() -> None:
    """avg divides once per fully reduced chunk: every rank gets the divided bits."""
    rng = np.random.default_rng(3)
    for algorithm in ("lp", "ring", "mst", "be"):
        for p in (3, 5, 8):
            s = generate(C.ALLREDUCE, algorithm, p, 1000, 0, 7)
            inputs = make_inputs(C.ALLREDUCE, p, 1000, np.dtype(np.float32), ReduceOp.AVG, rng)
            (outcome,) = run_collective(s, inputs, ReduceOp.AVG)
            assert len({bits(x) for x in outcome.results}) == 1, (algorithm, p)
            want = np.mean(np.stack(inputs).astype(np.float64), axis=0)
            np.testing.assert_allclose(outcome.results[0], want, rtol=0, atol=1e-5)


def test_integer_avg_floors() -> None:
    """Integer avg rounds toward minus infinity, after a wrapping sum."""
    p = 4
    inputs = [
        np.array([-1, 1, 3, -7, 127], np.int8),
        np.array([0, 0, 0, 0, 127], np.int8),
        np.array([0, 0, 0, 0, 127], np.int8),
        np.array([0, 0, 0, 0, 127], np.int8),
    ]
    s = generate(C.ALLREDUCE, "ring", p, 5)
    (outcome,) = run_collective(s, inputs, ReduceOp.AVG)
    # 4 * 127 = 508 wraps to -4 in int8; -4 // 4 = -1.
    assert outcome.results[0].tolist() == [-1, 0, 0, -2, -1]


def test_inproc_transport_is_zero_copy() -> None:
    """A message is a read-only view of the sender's span until the receiver releases it."""
    from lpsync.transport.inproc import InprocFabric

    fabric = InprocFabric(2)
    data = np.arange(10, dtype=np.float32)
    request = fabric.endpoint(0).send(1, 7, data[2:6])
    assert not request.done()
    with fabric.endpoint(1).recv_borrow(0, 7, 16, deadline=time.monotonic() + 5) as raw:
        assert np.shares_memory(raw, data)
        assert not raw.flags.writeable
        assert raw.view(np.float32).tolist() == [2, 3, 4, 5]
        assert not request.done()  # the sender may not touch the span yet
    assert request.done()
    assert data.flags.writeable  # the sender's own array is untouched
