"""The flat program of the direct path, run by numpy (the reference path) and by the
native engine: both against an independent numpy reference, and bitwise against each
other, over every op, element type, reduction, participant count and placement, op by
op and by tiles on threads (tiny tiles, so that small buffers span many, none a multiple
of the tile or of the threads; and the defaults at a few MiB); and the engine's checks of
a program against its buffers. Unit tier: no daemon."""

from __future__ import annotations

import mmap
import os
import struct

import numpy as np
import pytest

import lpsync_client.doorbell as client_doorbell
from lpsync.engine.group import layout
from lpsync.native import FALLBACK, OK, program
from lpsync.native import engine as native_engine
from lpsync.reduction import Reduction
from lpsync.types import DTYPES, Collective, ReduceOp
from lpsync_client.wire import blocks

ENGINE = native_engine()
# The engine must be built where the tests run (the install builds it): a missing one fails
# these tests (_Engine asserts), never skips them, or CI would pass without running it.

OPS = [
    Collective.ALLREDUCE,
    Collective.REDUCE,
    Collective.BROADCAST,
    Collective.ALLGATHER,
    Collective.REDUCE_SCATTER,
    Collective.GATHER,
    Collective.SCATTER,
    Collective.ALLTOALL,
]
REDUCING = {Collective.ALLREDUCE, Collective.REDUCE, Collective.REDUCE_SCATTER}
COUNT = 37  # elements per block: odd, so no vector loop ends evenly
# How the engine runs them: its defaults (these programs are one tile, one thread); tiles
# of 192 bytes (3 lines) on 3 threads from 0 bytes on, over 1003-element blocks; and tiles
# of 1280 bytes, their copies out streamed (from 0 bytes on).
TUNINGS = {
    "defaults": (None, COUNT),
    "tiled_threaded": ((192, 0, 3), 1003),
    "streamed": ((1280, 0, 3, 0), 1003),
}


def _inputs(dtype: np.dtype, n: int, rank: int, rng: np.random.Generator) -> np.ndarray:
    if np.issubdtype(dtype, np.integer):
        info = np.iinfo(dtype)
        return rng.integers(max(info.min, -100), min(info.max, 100), n, endpoint=True).astype(dtype)
    values = (rng.standard_normal(n) * 10).astype(dtype)
    if n > 2:
        values[rank % n] = -0.0  # signed zeros through min/max, against +0.0 ties
        values[(rank + 1) % n] = 0.0
        # A quiet NaN of this rank's own payload, where other ranks hold numbers or theirs.
        bits = values.view(f"u{dtype.itemsize}")
        inf = int(np.array([np.inf], dtype).view(bits.dtype)[0])
        quiet = int(np.array([np.nan], dtype).view(bits.dtype)[0]) & ~inf
        bits[(3 * rank + 2) % n] = inf | quiet | (rank + 1)
    return values


def _buffers(op, p, dtype, in_place, root, rng, count=COUNT):
    """Each participant's buffers and their (input, output) views, as the daemon makes them."""
    pairs, keep, originals = [], [], []
    for r in range(p):
        blocks_in, blocks_out = blocks(op, p, r, root)  # as the daemon sizes them
        n_in = count * (max(blocks_in, blocks_out) if in_place else blocks_in)
        data = _inputs(dtype, n_in, r, rng)
        originals.append(data.copy())
        if in_place:
            pair = layout(op, r, p, count, data, in_place=True, root=root)
        else:
            out = np.full(count * blocks_out, 7, dtype)
            pair = (data, out)
        keep.append(data)
        pairs.append(pair)
    return pairs, originals


def _reference(op, p, root, reduce_op, inputs, dtype, count=COUNT):
    """What the participants' outputs must hold, from their inputs alone (numpy)."""
    if op in REDUCING:
        red = Reduction(reduce_op, dtype, p)
        acc = inputs[0].copy()
        for r in range(1, p):
            red.combine(acc, inputs[r], acc)
        red.finalize(acc)
        if op is Collective.REDUCE_SCATTER:
            return {r: acc[r * count : (r + 1) * count] for r in range(p)}
        return {r: acc for r in range(p)} if op is Collective.ALLREDUCE else {root: acc}
    if op is Collective.BROADCAST:
        return {r: inputs[root] for r in range(p)}
    if op in (Collective.ALLGATHER, Collective.GATHER):
        full = np.concatenate(inputs)
        return {r: full for r in range(p)} if op is Collective.ALLGATHER else {root: full}
    if op is Collective.SCATTER:
        return {r: inputs[root][r * count : (r + 1) * count] for r in range(p)}
    return {r: np.concatenate([inputs[q][r * count : (r + 1) * count] for q in range(p)]) for r in range(p)}


def _bits(values: np.ndarray) -> np.ndarray:
    """The elements' bits (NaN payloads and zero signs compare too)."""
    return np.ascontiguousarray(values).view(f"u{values.dtype.itemsize}")


class _Engine:
    """An engine over an anonymous page, for arming and running programs directly."""

    def __init__(self, slots: int, tuning: tuple[int, ...] | None = None) -> None:
        assert ENGINE is not None, "the native engine is not built"
        self.map = mmap.mmap(-1, 4096)
        self.page = np.frombuffer(self.map, np.uint8)
        address = self.page.__array_interface__["data"][0]
        self.engine = ENGINE.Engine(self.page, address, 4096, slots, (1e-3, 1.0))
        if tuning is not None:
            self.engine.tune(*tuning)

    def close(self) -> None:
        self.engine.close()
        del self.page
        self.map.close()


def _dtypes():
    return [DTYPES[name] for name in program.DTYPE_CODES]


@pytest.mark.filterwarnings("ignore:overflow encountered:RuntimeWarning")  # float16 products
@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")  # NaN inputs
@pytest.mark.parametrize("op", OPS, ids=str)
@pytest.mark.parametrize("p", [1, 2, 3, 5])
@pytest.mark.parametrize("in_place", [True, False], ids=["in_place", "out_of_place"])
@pytest.mark.parametrize("tuning", TUNINGS)
def test_numpy_and_engine_agree_with_the_reference(op, p: int, in_place: bool, tuning: str) -> None:
    if in_place and op is Collective.ALLTOALL:
        pytest.skip("alltoall runs out of place only")
    tune, count = TUNINGS[tuning]
    rng = np.random.default_rng([p, OPS.index(op), in_place])
    reduce_ops = list(ReduceOp) if op in REDUCING else [ReduceOp.SUM]
    engine = _Engine(p, tune)
    try:
        for dtype in _dtypes():
            for reduce_op in reduce_ops:
                root = p - 1
                results = []
                for executor in ("numpy", "engine"):
                    state = np.random.default_rng([p, OPS.index(op), in_place, dtype.num]).bit_generator.state
                    rng.bit_generator.state = state
                    pairs, originals = _buffers(op, p, dtype, in_place, root, rng, count)
                    inputs = [inp.copy() for inp, _ in pairs]
                    reduction = Reduction(reduce_op, dtype, p) if op in REDUCING else None
                    compiled = program.direct(op, root, pairs, reduction, count)
                    views = program.flatten(pairs)
                    encoded = program.encode(compiled, views)
                    assert encoded is not None, f"{dtype} {reduce_op}: every type and reduction is served"
                    if executor == "numpy" or encoded is None:
                        compiled.run(views)
                    else:
                        data, bases, sizes = encoded
                        generation = engine.engine.arm(0, data, bases, sizes, 5.0)
                        if tune is not None and compiled.steps:  # every direct program runs by tiles
                            tile, threads, _, stream = engine.engine.shape(0)
                            span = max(
                                s.n * (1 if s.kind == program.COPY else dtype.itemsize)
                                for s in compiled.steps
                            )
                            assert (tile, threads) == (tune[0], min(3, -(-span // tune[0]))), (op, dtype)
                            assert stream == (len(tune) > 3), (op, dtype, reduce_op)
                        assert engine.engine.run(0, generation) == OK
                        assert (
                            engine.engine.run(0, generation + 1) == FALLBACK
                        )  # a stale generation never runs
                    results.append([out.copy() for _, out in pairs])
                    want = _reference(op, p, root, reduce_op, inputs, dtype, count)
                    for r, expected in want.items():
                        got = pairs[r][1]
                        np.testing.assert_array_equal(  # bitwise: NaN payloads and zero signs too
                            _bits(got),
                            _bits(expected),
                            err_msg=f"{executor} {op} {dtype} {reduce_op} rank {r}",
                        )
                    if not in_place:  # out of place the inputs are only read
                        for r, (inp, _) in enumerate(pairs):
                            assert inp.tobytes() == originals[r].tobytes()
                numpy_out, engine_out = results
                for a, b in zip(numpy_out, engine_out, strict=True):
                    assert a.tobytes() == b.tobytes(), f"{op} {dtype} {reduce_op}: engine and numpy differ"
    finally:
        engine.close()


@pytest.mark.parametrize(
    ("op", "dtype", "reduce_op"),
    [
        (Collective.ALLREDUCE, "float32", ReduceOp.SUM),
        (Collective.REDUCE, "bfloat16", ReduceOp.AVG),
        (Collective.REDUCE_SCATTER, "int32", ReduceOp.PROD),
        (Collective.BROADCAST, "float64", ReduceOp.SUM),
    ],
    ids=str,
)
def test_engine_defaults_at_a_few_mib(op: Collective, dtype: str, reduce_op: ReduceOp) -> None:
    """The engine's own tile and threads (min(CPUs, participants)) on programs past the
    threshold, in place, blocks no multiple of the tile: numpy's bits."""
    assert ENGINE is not None, "the native engine is not built"
    p, dt = 4, DTYPES[dtype]
    count = (3 << 20) // dt.itemsize + 5  # 3 MiB and a few elements per block
    outs = []
    for executor in ("numpy", "engine"):
        rng = np.random.default_rng(7)
        pairs, originals = _buffers(op, p, dt, True, 1, rng, count)
        inputs = [x.copy() for x in originals]
        reduction = Reduction(reduce_op, dt, p) if op in REDUCING else None
        compiled = program.direct(op, 1, pairs, reduction, count)
        views = program.flatten(pairs)
        if executor == "numpy":
            compiled.run(views)
        else:
            engine = _Engine(p)
            try:
                data, bases, sizes = program.encode(compiled, views)  # type: ignore[misc]
                generation = engine.engine.arm(0, data, bases, sizes, 5.0)
                threads = min(len(os.sched_getaffinity(0)), p)
                tile, used, scratch, stream = engine.engine.shape(0)
                assert (tile, used, stream) == (ENGINE.TILE, threads, False)  # 3 MiB: below STREAM
                # Each thread keeps its tiles of the scratch (one per block reduced).
                slots = p if op is Collective.REDUCE_SCATTER else 1
                assert scratch == (threads * slots * tile if op in REDUCING else 0), scratch
                assert engine.engine.run(0, generation) == OK
            finally:
                engine.close()
        want = _reference(op, p, 1, reduce_op, inputs, dt, count)
        for r, expected in want.items():
            np.testing.assert_array_equal(_bits(pairs[r][1]), _bits(expected), err_msg=f"{executor} rank {r}")
        outs.append(b"".join(out.tobytes() for _, out in pairs))
    assert outs[0] == outs[1], "engine and numpy differ"


def test_scratch_is_bounded_at_256_mib() -> None:
    """A 256 MiB allreduce (and reduce_scatter) of 4 armed: the engine's scratch is its
    threads' tiles, not the message (buffers never touched: only their addresses count)."""
    assert ENGINE is not None, "the native engine is not built"
    p, count = 4, (256 << 20) // 4
    pairs = [(np.empty(count, np.float32), np.empty(count, np.float32)) for _ in range(p)]
    threads = min(len(os.sched_getaffinity(0)), p)
    for op, slots in ((Collective.ALLREDUCE, 1), (Collective.REDUCE_SCATTER, p)):
        block = count if op is Collective.ALLREDUCE else count // p
        compiled = program.direct(op, 0, pairs, Reduction(ReduceOp.SUM, np.dtype(np.float32), p), block)
        assert compiled.scratch == 256 << 20  # what numpy's run allocates
        engine = _Engine(p)
        try:
            data, bases, sizes = program.encode(compiled, program.flatten(pairs))  # type: ignore[misc]
            engine.engine.arm(0, data, bases, sizes, 5.0)
            assert engine.engine.shape(0) == (ENGINE.TILE, threads, threads * slots * ENGINE.TILE, True)
        finally:
            engine.close()


def test_nan_and_signed_zero_bits_agree() -> None:
    """NaN, infinities, signed zeros and overflow: the engine's sums, products and averages
    give numpy's bits (float16 and bfloat16 rounded to nearest even as numpy and
    ml_dtypes do); float min and max too (test_float_min_max_bits_are_numpys)."""
    engine = _Engine(2)
    try:
        for dtype in _dtypes():
            if np.issubdtype(dtype, np.integer):
                continue
            a = np.array([np.nan, 1.0, -0.0, 0.0, np.inf, -np.inf, 65504.0, 1e-4, 3.0, np.nan], dtype)
            b = np.array([2.0, np.nan, 0.0, -0.0, -np.inf, np.inf, 65504.0, 3e-8, 1e-3, np.nan], dtype)
            for reduce_op in (ReduceOp.SUM, ReduceOp.PROD, ReduceOp.AVG):
                outs = []
                for executor in ("numpy", "engine"):
                    pairs = [(a.copy(), np.zeros_like(a)), (b.copy(), np.zeros_like(b))]
                    compiled = program.direct(
                        Collective.ALLREDUCE, 0, pairs, Reduction(reduce_op, dtype, 2), a.size
                    )
                    views = program.flatten(pairs)
                    if executor == "numpy":
                        compiled.run(views)
                    else:
                        data, bases, sizes = program.encode(compiled, views)  # type: ignore[misc]
                        assert engine.engine.run(0, engine.engine.arm(0, data, bases, sizes, 5.0)) == OK
                    outs.append(pairs[0][1].tobytes())
                assert outs[0] == outs[1], f"{dtype} {reduce_op}"
    finally:
        engine.close()


# Bit patterns per float type (an independent table, not program.py's probe): quiet NaNs
# of both signs, with payloads, signalling NaNs of both signs, +-0, +-inf, the smallest
# subnormals of both signs, and numbers (1, -1, 2, the largest finite).
SPECIAL_BITS = {
    "float16": [0x7E00, 0xFE00, 0x7E2B, 0x7C01, 0xFD55, 0x0000, 0x8000, 0x7C00, 0xFC00, 0x0001, 0x8001,
                0x3C00, 0xBC00, 0x4000, 0x7BFF],
    "bfloat16": [0x7FC0, 0xFFC0, 0x7FD3, 0x7F81, 0xFFA5, 0x0000, 0x8000, 0x7F80, 0xFF80, 0x0001, 0x8001,
                 0x3F80, 0xBF80, 0x4000, 0x7F7F],
    "float32": [0x7FC00000, 0xFFC00000, 0x7FC0ABCD, 0x7F800001, 0xFFA5A5A5, 0, 0x80000000, 0x7F800000,
                0xFF800000, 1, 0x80000001, 0x3F800000, 0xBF800000, 0x40000000, 0x7F7FFFFF],
    "float64": [0x7FF8000000000000, 0xFFF8000000000000, 0x7FF80000DEADBEEF, 0x7FF0000000000001,
                0xFFF5A5A5A5A5A5A5, 0, 0x8000000000000000, 0x7FF0000000000000, 0xFFF0000000000000, 1,
                0x8000000000000001, 0x3FF0000000000000, 0xBFF0000000000000, 0x4000000000000000,
                0x7FEFFFFFFFFFFFFF],
}  # fmt: skip


@pytest.mark.filterwarnings("ignore:invalid value encountered:RuntimeWarning")
@pytest.mark.parametrize("dtype", list(SPECIAL_BITS))
@pytest.mark.parametrize("tuning", TUNINGS)
def test_float_min_max_bits_are_numpys(dtype: str, tuning: str) -> None:
    """min and max over 3 participants of every triple of SPECIAL_BITS (NaN payloads and
    signs, signalling NaNs, signed zeros, infinities): numpy's bits (np.minimum and
    np.maximum in rank order), by the engine op by op and by tiles on threads, in place
    and out of place; and the engine serves them."""
    dt = DTYPES[dtype]
    table = np.array(SPECIAL_BITS[dtype], f"u{dt.itemsize}").view(dt)
    k, p = table.size, 3
    index = np.indices((k, k, k)).reshape(3, -1)  # participant r's values: table[index[r]]
    for reduce_op, ufunc in ((ReduceOp.MIN, np.minimum), (ReduceOp.MAX, np.maximum)):
        assert program.served(dtype, reduce_op), f"{dtype} {reduce_op} left to numpy"
        want = table[index[0]]
        with np.errstate(invalid="ignore"):
            for r in range(1, p):
                want = ufunc(want, table[index[r]])
        for in_place in (False, True):
            engine = _Engine(p, TUNINGS[tuning][0])
            try:
                inputs = [table[index[r]].copy() for r in range(p)]
                pairs = [(x, x if in_place else np.zeros_like(x)) for x in inputs]
                compiled = program.direct(Collective.ALLREDUCE, 0, pairs, Reduction(reduce_op, dt, p), k**3)
                views = program.flatten(pairs)
                data, bases, sizes = program.encode(compiled, views)  # type: ignore[misc]
                assert engine.engine.run(0, engine.engine.arm(0, data, bases, sizes, 5.0)) == OK
            finally:
                engine.close()
            for r, (_, out) in enumerate(pairs):
                np.testing.assert_array_equal(
                    _bits(out), _bits(want), err_msg=f"{dtype} {reduce_op} in_place={in_place} rank {r}"
                )


def test_engine_refuses_programs_that_reach_outside_their_buffers() -> None:
    engine = _Engine(2)
    try:
        pairs = [(np.ones(8, np.float32), np.zeros(8, np.float32)) for _ in range(2)]
        compiled = program.direct(
            Collective.ALLREDUCE, 0, pairs, Reduction(ReduceOp.SUM, np.dtype(np.float32), 2), 8
        )
        views = program.flatten(pairs)
        data, bases, sizes = program.encode(compiled, views)  # type: ignore[misc]
        engine.engine.arm(0, data, bases, sizes, 5.0)  # the real buffers: accepted
        cases = {
            "a buffer smaller than the program says": (data, bases, [sizes[0] - 4, *sizes[1:]]),
            "one address too few": (data, bases[:-1], sizes[:-1]),
            "truncated": (data[:-1], bases, sizes),
            "an unaligned input to reduce": (data, [*bases[:2], bases[2] + 1, bases[3]], sizes),
        }
        # An op whose length reaches past its buffer: the last op's n field.
        header = struct.calcsize("<4I") + 8 * (1 + len(sizes))
        last = header + (len(compiled.steps) - 1) * 64
        bad = bytearray(data)
        struct.pack_into("<Q", bad, last + 24 + 24, 8 * 4 + 4)
        cases["past the end"] = (bytes(bad), bases, sizes)
        for why, (d, b, s) in cases.items():
            with pytest.raises(ValueError):
                engine.engine.arm(1, d, b, s, 5.0)
                pytest.fail(f"armed a program with {why}")
        with pytest.raises(ValueError):
            engine.engine.arm(native_engine().MAX_PLANS, data, bases, sizes, 5.0)  # no such plan
        with pytest.raises(ValueError):
            engine.engine.arm(1, data, bases, sizes, -1.0)  # a timeout that never ends nothing
    finally:
        engine.close()


def test_client_and_engine_share_the_page_layout() -> None:
    """The doorbell page is a wire contract (lpsync_client/doorbell.py and engine.h)."""
    assert ENGINE is not None, "the native engine is not built"
    d = client_doorbell
    assert (d.HEADER_BYTES, d.BELL_OFFSET, d.SLOT_BYTES) == (
        ENGINE.HEADER_BYTES,
        ENGINE.BELL_OFFSET,
        ENGINE.SLOT_BYTES,
    )
    assert (d.OK, d.FALLBACK, d.MAGIC, d.VERSION) == (
        ENGINE.OK,
        ENGINE.FALLBACK,
        ENGINE.MAGIC,
        ENGINE.VERSION,
    )
    assert (program.PROGRAM_MAGIC, program.VERSION) == (ENGINE.PROGRAM_MAGIC, ENGINE.VERSION)
    assert struct.calcsize("<6I5Q") == ENGINE.OP_BYTES
