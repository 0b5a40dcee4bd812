"""A forced algorithm on one node, armed: its schedule compiled into one program
(local.schedule_program: native/across.py with every participant on this node), run by
numpy's executor and by the engine, bitwise against the host pipeline (LocalGroup: what
``--native off`` runs) and close to an independent numpy reference; and why the direct
program may not stand in for it: a forced schedule reduces in its own order. Unit tier:
no daemon."""

from __future__ import annotations

import itertools

import numpy as np
import pytest

from lpsync.algorithms import generate
from lpsync.algorithms.registry import algorithms_for
from lpsync.daemon.collectives.local import schedule_program
from lpsync.engine.group import LocalGroup
from lpsync.native import OK, program
from lpsync.native import engine as native_engine
from lpsync.reduction import Reduction
from lpsync.types import DTYPES, ROOTED_OPS, Collective, ReduceOp
from tests.native.unit.test_program import REDUCING, _buffers, _Engine, _reference

OPS = [op for op in Collective if op is not Collective.BARRIER and algorithms_for(op)]
COUNT = 41  # elements per block: odd, cut unevenly into chunks
DTYPE_NAMES = ("float32", "bfloat16", "float16", "int32", "uint8")


def _cases():
    for op in OPS:
        for algorithm in algorithms_for(op):
            if algorithm == "direct":
                continue
            for p in (2, 3, 4):
                yield op, algorithm, p


def _run_three_ways(op, algorithm, p, dtype, reduce_op, in_place, chunks, engine):
    """The outputs (bytes per participant) of the host pipeline, the compiled program run
    by numpy, and the same program run by the engine; with the inputs."""
    results, inputs = [], None
    root = p - 1 if op in ROOTED_OPS else 0
    schedule = generate(op, algorithm, p, COUNT, root, chunks)
    for executor in ("host", "numpy", "engine"):
        rng = np.random.default_rng([p, chunks, int(in_place), dtype.num, len(algorithm)])
        pairs, _ = _buffers(op, p, dtype, in_place, root, rng, COUNT)
        inputs = [x.copy() for x, _ in pairs]
        reduction = Reduction(reduce_op, dtype, p) if op in REDUCING else None
        if executor == "host":
            group = LocalGroup(schedule, pairs, reduction)
            try:
                group.run(10.0)
            finally:
                group.close()
        else:
            compiled = schedule_program(schedule, pairs, reduction).program
            assert compiled is not None
            assert not any(s.kind in program.NET for s in compiled.steps), "one node: no messages"
            views = program.flatten(pairs)
            if executor == "numpy":
                compiled.run(views)
            else:
                encoded = program.encode(compiled, views)
                assert encoded is not None, f"{dtype} {reduce_op} served"
                data, bases, sizes = encoded
                generation = engine.engine.arm(0, data, bases, sizes, 5.0)
                assert engine.engine.run(0, generation) == OK
        results.append([out.tobytes() for _, out in pairs])
    return results, inputs, root


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # NaN inputs
@pytest.mark.parametrize(("op", "algorithm", "p"), list(_cases()), ids=str)
def test_compiled_schedule_gives_the_host_pipelines_bits(op: Collective, algorithm: str, p: int) -> None:
    engine = _Engine(p, (192, 0, 3))  # tiny tiles on 3 threads where the program allows it
    try:
        reduce_ops = list(ReduceOp) if op in REDUCING else [ReduceOp.SUM]
        places = (False,) if op is Collective.ALLTOALL else (True, False)
        for name, reduce_op, in_place, chunks in itertools.product(DTYPE_NAMES, reduce_ops, places, (1, 3)):
            dtype = DTYPES[name]
            (host, numpy_run, engine_run), inputs, root = _run_three_ways(
                op, algorithm, p, dtype, reduce_op, in_place, chunks, engine
            )
            what = f"{algorithm} {op} {name} {reduce_op} p={p} chunks={chunks} in_place={in_place}"
            assert numpy_run == host, f"numpy's run of the program and the pipeline differ: {what}"
            assert engine_run == host, f"the engine and the pipeline differ: {what}"
            exact = dtype.kind in "iu" or reduce_op in (ReduceOp.MIN, ReduceOp.MAX)
            for r, expected in _reference(op, p, root, reduce_op, inputs, dtype, COUNT).items():
                got = np.frombuffer(host[r], dtype)[: expected.size]  # the independent reference
                np.testing.assert_allclose(
                    got.astype(np.float64),
                    expected.astype(np.float64),
                    rtol=0 if exact else 0.05,
                    atol=0 if exact else 0.5,
                    err_msg=what,
                )
    finally:
        engine.close()


def test_direct_program_differs_from_a_forced_schedule() -> None:
    """Why a forced algorithm is compiled from its own schedule: ring's allreduce of 3
    reduces each block starting at another rank, and float sums in another order give
    other bits than the direct program's rank order."""
    p, dtype = 3, np.dtype(np.float32)
    reduction = Reduction(ReduceOp.SUM, dtype, p)
    outs = []
    for way in ("ring", "direct"):
        rng = np.random.default_rng(5)
        pairs, _ = _buffers(Collective.ALLREDUCE, p, dtype, False, 0, rng, 3000)
        if way == "ring":
            group = LocalGroup(generate(Collective.ALLREDUCE, "ring", p, 3000, 0, 1), pairs, reduction)
            try:
                group.run(10.0)
            finally:
                group.close()
        else:
            program.direct(Collective.ALLREDUCE, 0, pairs, reduction, 3000).run(program.flatten(pairs))
        outs.append(pairs[0][1].copy())
    ring_out, direct_out = outs
    np.testing.assert_allclose(ring_out, direct_out, rtol=1e-5, atol=1e-4)  # the same sum ...
    assert ring_out.tobytes() != direct_out.tobytes()  # ... in another order: other bits


def test_a_schedule_too_long_for_the_engine_is_not_compiled() -> None:
    """More rows than the engine takes ops (LPN_MAX_OPS): no program, the host pipeline
    keeps it."""
    module = native_engine()
    assert module is not None, "the native engine is not built"
    assert program.MAX_OPS == module.MAX_OPS
    schedule = generate(Collective.ALLREDUCE, "lp", 4, 1 << 16, 0, 1 << 14)
    assert schedule.num_ops > program.MAX_OPS
    assert schedule_program(schedule, [], Reduction(ReduceOp.SUM, np.dtype(np.float32), 4)).program is None
