"""Shared helpers for the collective tests: the case lists, inputs, the numpy reference
and one generic multi-rank harness (every rank a thread on the inproc transport)."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

import ml_dtypes
import numpy as np

from lpsync.algorithms import ALGORITHMS, Schedule, generate
from lpsync.algorithms.schedule import Buf, ScheduleBuilder
from lpsync.engine.executor import Plan
from lpsync.engine.group import LocalGroup, layout
from lpsync.reduction import Reduction
from lpsync.types import DATA_COLLECTIVES, DTYPES, OUT_OF_PLACE_ONLY, ROOTED_OPS, Collective, ReduceOp, blocks

C = Collective

# Every (op, algorithm) the registry offers, as pytest ids "op-algorithm".
OPS_ALGS: list[tuple[Collective, str]] = [
    (op, name) for name, algo in ALGORITHMS.items() for op in algo.generators
]
OPS_ALGS_IDS = [f"{op}-{name}" for op, name in OPS_ALGS]
# The ones that also run in place (all-to-all runs out of place only).
IN_PLACE_OPS_ALGS = [(op, name) for op, name in OPS_ALGS if op not in OUT_OF_PLACE_ONLY]
IN_PLACE_OPS_ALGS_IDS = [f"{op}-{name}" for op, name in IN_PLACE_OPS_ALGS]

# World sizes: 1, every small size (primes and non-powers of two included), 16 and 17.
PARTICIPANTS = [*range(1, 10), 16, 17]

ROOTED = frozenset(C(op) for op in ROOTED_OPS)
REDUCING = frozenset({C.ALLREDUCE, C.REDUCE, C.REDUCE_SCATTER})


def roots_for(op: Collective, p: int) -> list[int]:
    """The roots worth testing: the first, the last and a middle participant."""
    return sorted({0, p - 1, p // 2}) if op in ROOTED else [0]


def chunk_options(algorithm: str, options: Sequence[int] = (1, 3, 8)) -> list[int]:
    return list(options) if ALGORITHMS[algorithm].pipelined else [1]


def in_elements(op: Collective, p: int, count: int, rank: int = 0, root: int = 0) -> int:
    return count * blocks(op, p, rank, root)[0]


def out_elements(op: Collective, p: int, count: int, rank: int = 0, root: int = 0) -> int:
    return count * blocks(op, p, rank, root)[1]


def in_place_options(op: Collective) -> tuple[bool, ...]:
    return (False,) if op in OUT_OF_PLACE_ONLY else (False, True)


FLOAT_DTYPES = frozenset(
    n for n, d in DTYPES.items() if d == np.dtype(ml_dtypes.bfloat16) or np.issubdtype(d, np.floating)
)


def make_inputs(
    op: Collective,
    p: int,
    count: int,
    dtype: np.dtype,
    reduce_op: ReduceOp,
    rng: np.random.Generator,
    root: int = 0,
) -> list[np.ndarray]:
    """Every rank's own input (IN-sized: a scatter's non-roots have none), distinct per rank.

    Integers span the whole range of the type (sums and products wrap); floats lie in
    [-1, 1], or near 1 for prod so that products neither overflow nor vanish.
    """
    dtype = np.dtype(dtype)
    inputs = []
    for rank in range(p):
        n = in_elements(op, p, count, rank, root)
        if np.issubdtype(dtype, np.integer):
            info = np.iinfo(dtype)
            x = rng.integers(info.min, info.max, size=n, endpoint=True, dtype=dtype)
        elif reduce_op is ReduceOp.PROD:
            x = (1.0 + rng.uniform(-0.1, 0.1, size=n)).astype(dtype)
        else:
            x = rng.uniform(-1.0, 1.0, size=n).astype(dtype)
        inputs.append(x)
    return inputs


def every_case(world: int, count: int, root: int, seed: int) -> list[tuple]:
    """Every op x dtype (x reduce op) x in/out of place as picklable tuples for rank
    processes: (op, dtype, reduce_op, in_place, root, count, every rank's input bytes)."""
    rng = np.random.default_rng(seed)
    cases = []
    for op in DATA_COLLECTIVES:
        reduce_ops = list(ReduceOp) if op in REDUCING else [ReduceOp.SUM]
        op_root = root if op in ROOTED else 0
        for dtype in DTYPES:
            for reduce_op in reduce_ops:
                for in_place in in_place_options(op):
                    inputs = make_inputs(op, world, count, DTYPES[dtype], reduce_op, rng, op_root)
                    cases.append(
                        (
                            op.value,
                            dtype,
                            reduce_op.value,
                            in_place,
                            op_root,
                            count,
                            [x.tobytes() for x in inputs],
                        )
                    )
    return cases


def rotating_cases(world: int, count: int, kinds: list[tuple[str, str]], root: int, seed: int) -> list[tuple]:
    """Every op in and out of place, each on the next (dtype, reduce op) of ``kinds`` in
    turn (reduce ops only where the op reduces): every_case's tuples, fewer of them."""
    rng = np.random.default_rng(seed)
    cases: list[tuple] = []
    for op in DATA_COLLECTIVES:
        for in_place in in_place_options(op):
            dtype, reduce_op = kinds[len(cases) % len(kinds)]
            if op not in REDUCING:
                reduce_op = "sum"
            op_root = root if op in ROOTED else 0
            inputs = make_inputs(op, world, count, DTYPES[dtype], ReduceOp(reduce_op), rng, op_root)
            cases.append(
                (op.value, dtype, reduce_op, in_place, op_root, count, [x.tobytes() for x in inputs])
            )
    return cases


def check_case_results(cases: list[tuple], results: list, world: int, inputs_kept: bool = False) -> None:
    """Every rank's (output bytes, input bytes after) for each case against numpy: a
    non-root's in-place reduce buffer is untouched, and with ``inputs_kept`` so is every
    out-of-place input."""
    for index, (op, dtype, reduce_op, in_place, root, count, raw) in enumerate(cases):
        dt = DTYPES[dtype]
        inputs = [np.frombuffer(b, dt) for b in raw]
        want = reference(C(op), ReduceOp(reduce_op), inputs, root, count)
        for rank in range(world):
            got, after = results[rank][index]
            if op == "reduce" and in_place and rank != root:
                assert after == raw[rank], "a non-root's reduce buffer was written"
                continue
            assert_matches(
                np.frombuffer(got, dt),
                want[rank],
                f"{op} {dtype} {reduce_op} in_place={in_place} rank {rank}",
            )
            if inputs_kept and not in_place:
                assert after == raw[rank], f"{op}: an out-of-place input was modified"


def _reduce_exact(stack: np.ndarray, reduce_op: ReduceOp, p: int) -> np.ndarray:
    """The reduction of the rows of ``stack`` in its own dtype (integers wrap)."""
    dtype = stack.dtype
    if reduce_op in (ReduceOp.SUM, ReduceOp.AVG):
        out = np.add.reduce(stack, axis=0, dtype=dtype)
        if reduce_op is ReduceOp.AVG:
            out = np.floor_divide(out, dtype.type(p)).astype(dtype)
        return out
    ufunc = {ReduceOp.PROD: np.multiply, ReduceOp.MIN: np.minimum, ReduceOp.MAX: np.maximum}
    return ufunc[reduce_op].reduce(stack, axis=0, dtype=dtype)


@dataclass
class Expected:
    """What a rank's OUT must hold: ``value`` (None: unspecified) compared exactly, or,
    when ``tol`` is set, within ``tol`` (per element) of ``value`` in float64."""

    value: np.ndarray | None
    tol: np.ndarray | None = None


def reference(
    op: Collective, reduce_op: ReduceOp, inputs: Sequence[np.ndarray], root: int, count: int
) -> list[Expected]:
    """The numpy reference for every rank's OUT.

    Integer reductions and data movement are exact; float sums, products and averages
    get a float64 reference and a tolerance of a few ulps per participant.
    """
    p = len(inputs)
    dtype = inputs[0].dtype
    if op is C.BROADCAST:
        return [Expected(inputs[root].copy()) for _ in range(p)]
    if op is C.ALLGATHER:
        return [Expected(np.concatenate(inputs)) for _ in range(p)]
    if op is C.GATHER:
        return [Expected(np.concatenate(inputs) if r == root else None) for r in range(p)]
    if op is C.SCATTER:
        return [Expected(inputs[root][r * count : (r + 1) * count].copy()) for r in range(p)]
    if op is C.ALLTOALL:
        return [Expected(np.concatenate([x[r * count : (r + 1) * count] for x in inputs])) for r in range(p)]
    stack = np.stack(inputs)
    if op is C.REDUCE_SCATTER:
        stack = stack.reshape(p, p, count)  # [rank, block, element]
    is_float = not np.issubdtype(dtype, np.integer)
    if not is_float or reduce_op in (ReduceOp.MIN, ReduceOp.MAX):
        total = _reduce_exact(stack, reduce_op, p)
        tol = None
    else:
        wide = stack.astype(np.float64)
        eps = float(ml_dtypes.finfo(dtype).eps)  # numpy's finfo refuses bfloat16 (numpy 2.5)
        if reduce_op is ReduceOp.PROD:
            total = np.prod(wide, axis=0)
            tol = 4 * (p + 1) * eps * np.abs(total)
        else:
            total = np.sum(wide, axis=0)
            tol = 4 * (p + 1) * eps * np.sum(np.abs(wide), axis=0)
            if reduce_op is ReduceOp.AVG:
                total, tol = total / p, tol / p
        tol = tol + float(ml_dtypes.finfo(dtype).tiny)
    if op is C.REDUCE_SCATTER:
        return [Expected(total[r], None if tol is None else tol[r]) for r in range(p)]
    if op is C.REDUCE:
        return [Expected(total if r == root else None, tol if r == root else None) for r in range(p)]
    return [Expected(total, tol) for _ in range(p)]


def assert_matches(got: np.ndarray, want: Expected, what: str) -> None:
    if want.value is None:
        return
    assert got.shape == want.value.shape, f"{what}: shape {got.shape} != {want.value.shape}"
    if want.tol is None:
        assert got.dtype == want.value.dtype
        width = got.dtype.itemsize
        differ = (got.view(np.uint8).reshape(-1, width) != want.value.view(np.uint8).reshape(-1, width)).any(
            axis=1
        )
        bad = np.flatnonzero(differ)
        assert bad.size == 0, (
            f"{what}: {bad.size} wrong elements, first {bad[0]}: {got[bad[0]]} vs {want.value[bad[0]]}"
        )
    else:
        err = np.abs(got.astype(np.float64) - want.value)
        bad = np.flatnonzero(~(err <= want.tol))
        assert bad.size == 0, (
            f"{what}: {bad.size} elements off, first {bad[0]}: "
            f"{got[bad[0]]} vs {want.value[bad[0]]} (tol {want.tol[bad[0]]})"
        )


def bits(a: np.ndarray) -> bytes:
    return np.ascontiguousarray(a).view(np.uint8).tobytes()


@dataclass
class Outcome:
    results: list[np.ndarray]  # every rank's OUT after the run (copies)
    inputs_after: list[np.ndarray]  # every rank's input buffer after the run (copies)
    buffers: list[np.ndarray]  # in place: the one buffer of each rank, after


def in_place_buffer(
    op: Collective, rank: int, p: int, count: int, data: np.ndarray, root: int = 0
) -> np.ndarray:
    """The one buffer a rank passes in place, holding its input where layout() wants it."""
    n_in, n_out = blocks(op, p, rank, root)
    if n_in < n_out:  # the input is the rank's block of the output (or nothing)
        buf = np.zeros(n_out * count, data.dtype)
        if n_in:
            buf[rank * count : (rank + 1) * count] = data
        return buf
    return data.copy()


def swap_schedule(n: int) -> Schedule:
    """Rank 0 sends its OUT, then receives into it; rank 1 sends its IN at once, then
    receives rank 0's OUT. A receive posted on rank 0 before its send has gone would land
    rank 1's data in the span being sent, and rank 1 would get its own data back."""
    b = ScheduleBuilder(Collective.BROADCAST, "swap", 2, n)
    b.send(0, 0, 1, Buf.OUT, 0, n)
    b.recv(1, 0, 1, Buf.OUT, 0, n)
    b.send(0, 1, 0, Buf.IN, 0, n)
    b.recv(1, 1, 0, Buf.OUT, 0, n)
    return b.build()


def planned_cases(op: Collective, algorithm: str, p: int, rng: np.random.Generator) -> Iterator[PlannedCase]:
    """The plans of ``op`` by ``algorithm`` on ``p`` ranks over a grid of roots, counts
    (empty included), chunk counts and in place or not."""
    for root in roots_for(op, p)[:2]:
        for count in (0, 7, 1001):
            for chunks in chunk_options(algorithm, (1, 4, 9)):
                for in_place in in_place_options(op):
                    yield PlannedCase.of(op, algorithm, p, root, count, chunks, in_place, rng)


@dataclass
class PlannedCase:
    """One case's plans over int64 sum inputs (a Plan per rank, its (IN, OUT)), and the
    check of every rank's output against numpy once they have run."""

    plans: list[Plan]
    pairs: list[tuple[np.ndarray, np.ndarray]]
    want: list
    what: str

    @classmethod
    def of(
        cls, op: Collective, algorithm: str, p: int, root: int, count: int, chunks: int, in_place: bool, rng
    ) -> PlannedCase:
        schedule = generate(op, algorithm, p, count, root, chunks)
        inputs = make_inputs(op, p, count, np.dtype(np.int64), ReduceOp.SUM, rng, root)
        datas = [
            in_place_buffer(op, r, p, count, x, root) if in_place else x.copy() for r, x in enumerate(inputs)
        ]
        pairs = [layout(op, r, p, count, d, in_place, root) for r, d in enumerate(datas)]
        reduction = Reduction(ReduceOp.SUM, np.dtype(np.int64), p)
        return cls(
            [Plan(schedule, r, pair, reduction) for r, pair in enumerate(pairs)],
            pairs,
            reference(op, ReduceOp.SUM, inputs, root, count),
            f"{op}-{algorithm} P={p} root={root} count={count} chunks={chunks} in_place={in_place}",
        )

    def check(self) -> None:
        for r, (_, out) in enumerate(self.pairs):
            assert_matches(out, self.want[r], f"{self.what} rank {r}")


def run_collective(
    schedule: Schedule,
    inputs: Sequence[np.ndarray],
    reduce_op: ReduceOp,
    in_place: bool = False,
    runs: int = 1,
    timeout: float = 30.0,
) -> list[Outcome]:
    """Run ``schedule`` over the ranks' ``inputs`` with LocalGroup, ``runs`` times on the
    same plans (in place, the buffers are refilled with the inputs before each run)."""
    op, p, count, root = schedule.op, schedule.participants, schedule.count, schedule.root
    dtype = inputs[0].dtype
    if in_place:
        datas = [in_place_buffer(op, r, p, count, x, root) for r, x in enumerate(inputs)]
        pristine = [d.copy() for d in datas]
    else:
        datas = [x.copy() for x in inputs]
    pairs = [layout(op, r, p, count, d, in_place, root) for r, d in enumerate(datas)]
    outcomes = []
    with LocalGroup(schedule, pairs, Reduction(reduce_op, dtype, p)) as group:
        for _ in range(runs):
            if in_place:
                for d, orig in zip(datas, pristine, strict=True):
                    d[...] = orig
            for _, out in [] if in_place else pairs:
                out.fill(0)
            group.run(timeout)
            outcomes.append(
                Outcome(
                    [out.copy() for _, out in pairs],
                    [inp.copy() for inp, _ in pairs],
                    [d.copy() for d in datas],
                )
            )
    return outcomes
