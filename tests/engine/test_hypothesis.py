"""Property tests: random collectives executed on the inproc transport against numpy."""

from __future__ import annotations

import numpy as np
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from lpsync.algorithms import generate
from lpsync.types import OUT_OF_PLACE_ONLY, ReduceOp
from tests.collective_cases import (
    OPS_ALGS,
    REDUCING,
    ROOTED,
    C,
    assert_matches,
    bits,
    make_inputs,
    reference,
    run_collective,
)


@st.composite
def collectives(draw: st.DrawFn) -> dict[str, object]:
    op, algorithm = draw(st.sampled_from(OPS_ALGS))
    p = draw(st.integers(1, 17))
    return {
        "op": op,
        "algorithm": algorithm,
        "p": p,
        "root": draw(st.integers(0, p - 1)) if op in ROOTED else 0,
        # reduce_scatter and allgather move P * count elements; keep those smaller.
        "count": draw(st.integers(0, 2000 if op in (*REDUCING, *ROOTED) else 300)),
        "chunks": draw(st.integers(1, 16)),
        "dtype": np.dtype(draw(st.sampled_from(["int32", "float64"]))),
        "reduce_op": draw(st.sampled_from(list(ReduceOp))),
        "in_place": draw(st.booleans()) and op not in OUT_OF_PLACE_ONLY,
        "seed": draw(st.integers(0, 2**32 - 1)),
    }


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(collectives())
def test_random_collective_matches_numpy(case: dict) -> None:
    op, p, root, count = case["op"], case["p"], case["root"], case["count"]
    s = generate(op, case["algorithm"], p, count, root, case["chunks"])
    rng = np.random.default_rng(case["seed"])
    inputs = make_inputs(op, p, count, case["dtype"], case["reduce_op"], rng, root)
    (outcome,) = run_collective(s, inputs, case["reduce_op"], in_place=case["in_place"])
    want = reference(op, case["reduce_op"], inputs, root, count)
    for r in range(p):
        assert_matches(outcome.results[r], want[r], f"rank {r}")
    if op not in (C.REDUCE_SCATTER, C.SCATTER, C.ALLTOALL):  # one result: the same bits everywhere
        holders = [r for r in range(p) if want[r].value is not None]
        assert len({bits(outcome.results[r]) for r in holders}) == 1
